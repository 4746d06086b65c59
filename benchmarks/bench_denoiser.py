"""Full-depth H3 denoiser on one GPU: core against the pack, forward + whole Turbo 4-step runs (issue 20).

One process, in this order (each step saves ``$OUT/$TAG.json``, so a killed run still returns what ran):

1. A full-depth, full-width random H3 (50 DiT + 2 refiner blocks, hidden 5376; ``tools/fixtures.py``'s key
   layout and weight scales) is drawn ON THE GPU, its 208 block projections quantized there by
   ``formats.nvfp4.quantize`` as they are drawn, and written in one streaming pass
   (``formats.convert.write_safetensors_stream``) as a ComfyUI-native NVFP4 file (unpruned: bf16 AdaLN
   kept), plus a Turbo 4-step LoRA with the official shapes (qkv rank 384, others 128, alpha = rank;
   ``tools.fixtures.make_turbo_lora``, contract shifts 6/3). The file is reused when it already exists
   (same machine, same sizes).
2. Families, each loaded once and dropped before the next:
   - ``core_bf16``: the same weights dequantized (``formats.nvfp4.dequantize``, bit-identical to
     comfy-kitchen) to a bf16 state dict on the GPU, loaded by core's ``comfy.sd.load_diffusion_model_state_dict``
     (what ``UNETLoader`` calls for a BF16 file; a BF16 file itself does not fit the disk beside the NVFP4
     one). Turbo: core's ``LoraLoaderModelOnly``.
   - ``core_nvfp4``: core's ``UNETLoader`` on the NVFP4 file (core's NVFP4 path and core's attention);
     Turbo: core's ``LoraLoaderModelOnly`` (core merges the LoRA into the weights and re-quantizes them).
   - ``ours_exact`` / ``ours_fp8``: ``runtime.loading.load_h3_model`` (the pack's loader node code) with
     compute exact / fp8, then ``H3TurboAttention`` (exact, int8_sage), Turbo by ``H3TurboLoRA`` (the branch).
   Every configuration gets core's ``MiniMaxH3SigmaShift`` (ModelSamplingMiniMaxH3) at the Turbo contract's
   shifts 6/3, so every sampler runs on the same video and audio grids.
3. Per configuration and shape: one direct denoiser forward (first call: compile, autotune, attention
   choice, fp8/exact preparation), ``FWD_REPS`` timed forwards, then one whole 4-step sampling run through
   core's ``SamplerCustomAdvanced`` (ours: ``H3TurboSampler`` fp32 state; core: ``KSamplerSelect`` euler) on
   the contract's 4-step sigmas, noise seed 42, ``H3TurboTestConditioning`` seed 0 with 300 text tokens;
   its 4 model calls are timed too (CUDA events around the diffusion model). ``forward_s`` is the median
   of the timed forwards and the 4 sampling forwards. The direct forwards get the context a sampling step gets:
   the text states refined once per model (core's ``preprocess_text_embeds``, what ``extra_conds`` runs once per
   sampling run); RAW_CTX=1 gives the raw states instead (every direct forward then runs the 2 refiner blocks, the
   form of the earlier result files). Peak and resident VRAM, relative L2 errors of the
   forward output and the final latent against the references (see ``summarize``), ratios to core NVFP4.
4. ``PROFILE``: a torch-profiler pass over one forward of the configurations named there; kernel time
   by category and the GPU idle time inside the forward.

Env: OUT, TAG (json name, default denoiser_h200), DRY=1 (CPU, tiny widths: checks the script), NB (DiT
blocks; default 50, DRY 3), SHAPES (comma list WxHxF, default 960x544x124), FAMILIES (comma list, default
core_bf16,core_nvfp4,ours_exact,ours_fp8; ``ours_fp8t``: ours_fp8 loaded with ``adaln=table``, the AdaLN rows
looked up per timestep group instead of computed from resident weights), CONFIGS (comma list of configuration names to run, default all),
FWD_REPS (default 1), TURBO4_AGAIN=1 (the 4-step run twice: ``turbo4_again_s``, the steady run with every
timestep group cached, and ``turbo4_first_over_again``), FUSED=1 (ours_fp8 also with the fused DiT blocks: ``<name>_fused``; with ATTN=int8_sage they
run its producer route), SETTINGS_B (a JSON dict of ``kernels.fused.SETTINGS``, of ``runtime.prologue.SETTINGS`` as
``"prologue.<key>"`` and of the int8_sage launch configuration's defaults as ``"attn.<KEY>"``, e.g.
``{"attn.ROTATE": false, "attn.BALANCE": false}``: every ``_fused`` row runs
again, the same MODEL, with these settings as ``<name>_fused_b``, its errors also against ``<name>_fused``; an A/B in
one process; unknown keys are refused), AB_ROUNDS (N) and AB_SETTINGS (a JSON list of such dicts, default
[SETTINGS_B]): then N rounds of one forward with the defaults and one per setting, interleaved (:func:`ab_rounds`), PROFILE (comma list of
configuration names), HOST_PHASES (comma list of configuration names: host and GPU time at the prologue's marks,
unprofiled, and a cProfile of the prologue's host functions, :func:`host_phases`), GAP_OPS (N: each profile also lists, for its N largest GPU idle gaps, the top-level host ops that
started inside the gap: what the GPU waited for), DEADLINE (s since start after which no
new configuration starts), CKPT_DIR (where the checkpoint is written), CKPT_RAM=1 (write it to /dev/shm when that has the
room), COMFY_ARGS (default --highvram on the
GPU: offload device = GPU, so unloading a family moves nothing), PLOT=1 (write the PNG at the end),
PLOT_ONLY=a.json,b.json (plot these result files, nothing else), MERGE=a.json,b.json (write the merged result
file ``$OUT/$TAG.json`` from raw run files, see :func:`merge`; the plot too with PLOT=1). CONFIGS entries may name a shape:
``name@960x544x124``.

Run (GPU, ComfyUI and comfy-kitchen importable; benchmarks/README.md has the preparation):
``TAG=denoiser_h200_runN FWD_REPS=3 SHAPES=960x544x124 FAMILIES=core_nvfp4,ours_fp8t ATTN=int8_sage FUSED=1
CONFIGS=core_nvfp4,ours_fp8t_int8_sage_fused DEADLINE=255 timeout 285 python3 benchmarks/bench_denoiser.py``;
CPU check: ``DRY=1 OUT=/tmp/dry COMFYUI_PATH=$HOME/ComfyUI python benchmarks/bench_denoiser.py``.
"""
from __future__ import annotations

import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback

T0 = time.perf_counter()
DRY = bool(os.environ.get("DRY"))
OUT = os.environ.get("OUT", ".")
TAG = os.environ.get("TAG", "denoiser_h200")
DEADLINE = float(os.environ.get("DEADLINE", 1e9))
os.makedirs(OUT, exist_ok=True)
if not (os.environ.get("PLOT_ONLY") or os.environ.get("MERGE")):
    sys.argv = ["main.py"] + os.environ.get("COMFY_ARGS", "" if DRY else "--highvram").split()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RES: dict = {"dry": DRY, "errors": {}, "log": [], "timeline": [], "shapes": {}, "profiles": {}, "summary": {}}
FWD: dict = {}   # shape -> config -> (video, audio) forward outputs (CPU fp32)
LAT: dict = {}   # shape -> config -> (video, audio) final latents of the 4-step run


def now():
    return time.perf_counter() - T0


def mark(what):
    RES["timeline"].append([round(now(), 2), what])
    print(f"[{now():7.1f}s] {what}", flush=True)


from _common import collect_logs, lora_routes  # noqa: E402

collect_logs(RES["log"], 300)

import torch  # noqa: E402

CUDA = torch.cuda.is_available() and not DRY


def sync():
    if CUDA:
        torch.cuda.synchronize()


def gb(x):
    return round(x / 1e9, 3)


def rel_l2(a, b):
    """Relative L2 of a against b over every stream together: |a-b| / |b| (float64)."""
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


# ----------------------------------------------------------------------------------------- results

def summarize():
    """References and ratios, per shape (recomputed at every save).

    rel_err_forward: against core_bf16 (same Turbo setting) when it ran, else ours_exact_exact.
    rel_err_turbo4: ours against ours_exact_exact (same sampler, same Turbo setting: the target's reference);
    core against core_bf16 when it ran, else ours_exact_exact. ``errors`` keeps every comparison, with the
    video and audio streams apart; a fused row also against its unfused twin and its A/B twin, an ``ours_fp8t``
    row (adaln=table) against the same ``ours_fp8`` row (resident AdaLN: 0.0 when bit-identical). Ratios: to
    core_nvfp4 with the same Turbo setting.
    """
    for sk, rows in RES["shapes"].items():
        fw, lt = FWD.get(sk, {}), LAT.get(sk, {})
        for name, r in rows.items():
            turbo = name.endswith("_turbo4")
            sfx = "_turbo4" if turbo else ""
            core_ref = "core_nvfp4" + sfx
            if core_ref in rows and r.get("forward_s") and rows[core_ref].get("forward_s"):
                r["ratio_forward_to_core_nvfp4"] = round(r["forward_s"] / rows[core_ref]["forward_s"], 4)
            if core_ref in rows and r.get("turbo4_s") and rows[core_ref].get("turbo4_s"):
                r["ratio_turbo4_to_core_nvfp4"] = round(r["turbo4_s"] / rows[core_ref]["turbo4_s"], 4)
            errs = {}
            for ref in ("core_bf16", "ours_exact_exact", "core_nvfp4"):
                rk = ref + sfx
                if rk == name:
                    continue
                if name in fw and rk in fw:
                    errs[f"forward_vs_{rk}"] = {"all": rel_l2(fw[name], fw[rk]), "video": rel_l2(fw[name][:1], fw[rk][:1]),
                                                "audio": rel_l2(fw[name][1:], fw[rk][1:])}
                if name in lt and rk in lt:
                    errs[f"turbo4_vs_{rk}"] = {"all": rel_l2(lt[name], lt[rk]), "video": rel_l2(lt[name][:1], lt[rk][:1]),
                                               "audio": rel_l2(lt[name][1:], lt[rk][1:])}
            unf = re.sub(r"_fused(_sage|_b)?", "", name)
            alt = re.sub(r"_fused(_sage|_b)", "_fused", name)       # an A/B row against its default-settings twin
            res = name.replace("ours_fp8t_", "ours_fp8_", 1)          # adaln=table against resident AdaLN
            for other in {unf, alt, res} - {name}:   # the fused blocks against the same configuration unfused / A
                if name in fw and other in fw:
                    errs[f"forward_vs_{other}"] = {"all": rel_l2(fw[name], fw[other])}
                if name in lt and other in lt:
                    errs[f"turbo4_vs_{other}"] = {"all": rel_l2(lt[name], lt[other])}
            if turbo and name in fw and name[:-7] in fw:
                errs["forward_vs_turbo_off(branch effect)"] = {"all": rel_l2(fw[name], fw[name[:-7]])}
            r["errors"] = errs
            fref = ("core_bf16" if "core_bf16" + sfx in fw else "ours_exact_exact") + sfx
            lref = (("core_bf16" if "core_bf16" + sfx in lt else "ours_exact_exact") if name.startswith("core")
                    else "ours_exact_exact") + sfx
            r["reference_forward"], r["reference_turbo4"] = fref, lref
            r["rel_err_forward"] = 0.0 if name == fref and name in fw else errs.get(f"forward_vs_{fref}", {}).get("all")
            r["rel_err_turbo4"] = 0.0 if name == lref and name in lt else errs.get(f"turbo4_vs_{lref}", {}).get("all")
        # targets (recorded, not asserted)
        ours_t = {n: r for n, r in rows.items() if n.startswith("ours_") and n.endswith("_turbo4") and r.get("turbo4_s")}
        core_t = rows.get("core_nvfp4_turbo4", {}).get("turbo4_s")
        summ = RES["summary"].setdefault(sk, {})
        if ours_t:
            best = min(ours_t, key=lambda n: ours_t[n]["turbo4_s"])
            summ["fastest_ours_turbo4"] = best
            summ["fastest_turbo4_s"] = ours_t[best]["turbo4_s"]
            if core_t:
                summ["target_turbo4_ratio"] = round(ours_t[best]["turbo4_s"] / core_t, 4)
                summ["target_turbo4_ratio_met(<=0.50)"] = ours_t[best]["turbo4_s"] / core_t <= 0.50
            e = ours_t[best].get("errors", {}).get("turbo4_vs_ours_exact_exact_turbo4", {}).get("all")
            if best == "ours_exact_exact_turbo4":
                e = 0.0
            summ["fastest_turbo4_rel_err_vs_ours_exact"] = e
            if e is not None:
                summ["target_latent_within_2pct_met"] = e <= 0.02
        branch = {}
        for n, r in rows.items():
            if n.startswith("ours_") and n.endswith("_turbo4") and n[:-7] in rows:
                a, b = r.get("forward_s"), rows[n[:-7]].get("forward_s")
                if a and b:
                    branch[n[:-7]] = round(a / b - 1.0, 4)
        if branch:
            summ["turbo_branch_forward_overhead"] = branch
            summ["target_branch_overhead_met(<=5%)"] = {k: v <= 0.05 for k, v in branch.items()}


def save():
    try:
        summarize()
    except Exception:  # noqa: BLE001
        RES["errors"]["summarize"] = traceback.format_exc()[-1500:]
    RES["elapsed_s"] = round(now(), 1)
    with open(os.path.join(OUT, f"{TAG}.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


# ----------------------------------------------------------------------------------------- model + files

def full_cfg(nb):
    from _common import h3_config

    return h3_config(nb, DRY)


def make_files(cfg, models, dev):
    """Draw the random H3 on ``dev`` (projections quantized there), stream it to disk once; the Turbo LoRA.
    Returns (nvfp4 path, lora file name, the GPU state dict or None when the file was reused)."""
    from safetensors.torch import save_file

    from h3_turbo.formats import nvfp4
    from h3_turbo.formats.convert import _ST_DTYPES, write_safetensors_stream
    from h3_turbo.tools.fixtures import make_tiny_h3_state_dict, make_turbo_lora

    path = os.path.join(models, "diffusion_models", "h3_full_nvfp4.safetensors")
    lname = "h3_full_turbo_4step.safetensors"
    lpath = os.path.join(models, "loras", lname)
    stamp = os.path.join(models, "stamp.json")
    want = json.dumps({"cfg": cfg.__dict__, "v": 1}, sort_keys=True)
    info = RES.setdefault("checkpoint", {})
    sd = None
    if os.path.exists(stamp) and open(stamp).read() == want and os.path.exists(path) and os.path.exists(lpath):
        info["reused"] = True
        mark("checkpoint reused")
    else:
        for p in (stamp, path, lpath):
            if os.path.exists(p):
                os.remove(p)
        marker = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)

        def native_nvfp4(w):
            q, bs, s = nvfp4.quantize(w.to(torch.bfloat16))
            return {"weight": q, "weight_scale": bs, "weight_scale_2": s.float().reshape(()),
                    "comfy_quant": marker.clone().to(w.device)}

        t0 = time.perf_counter()
        sd = make_tiny_h3_state_dict(cfg, seed=0, device=dev, projection=native_nvfp4)
        sync()
        info["draw_s"] = round(time.perf_counter() - t0, 2)
        info["tensors"] = len(sd)
        info["bytes"] = sum(t.nbytes for t in sd.values())
        info["bytes_bf16_adaln"] = sum(t.nbytes for k, t in sd.items() if "adaln_proj" in k)
        info["bytes_nvfp4_projections"] = sum(t.nbytes for k, t in sd.items() if any(p in k for p in
                                              ("qkv_proj", "out_proj", "fc1", "fc2")))
        mark(f"drew {len(sd)} tensors, {gb(info['bytes'])} GB on {dev} in {info['draw_s']} s")
        t0 = time.perf_counter()
        plan = [(k, _ST_DTYPES[t.dtype], tuple(t.shape)) for k, t in sd.items()]
        info["file_bytes"] = write_safetensors_stream(path, iter(sd.items()), plan, {})
        info["write_s"] = round(time.perf_counter() - t0, 2)
        mark(f"wrote {path} ({gb(info['file_bytes'])} GB) in {info['write_s']} s")
        t0 = time.perf_counter()
        lt, lm = make_turbo_lora(None, cfg, alpha_over_rank=1.0, seed=1, nfe=4, shifts=(6.0, 3.0))
        info["lora_bytes"] = sum(t.nbytes for t in lt.values())
        save_file(lt, lpath, metadata=lm)
        del lt
        info["lora_s"] = round(time.perf_counter() - t0, 2)
        with open(stamp, "w") as f:
            f.write(want)
        mark(f"wrote Turbo LoRA ({gb(info['lora_bytes'])} GB) in {info['lora_s']} s")
    info["path"] = path
    return path, lname, sd


def pick_disk(need=39e9):
    """The first of /tmp, /root, /var/tmp, the cwd on a disk file system (not tmpfs) with ``need`` bytes free
    (the file is ~36 GB + the 1.7 GB LoRA); else /dev/shm (RAM) if it has the room; else /tmp. CKPT_RAM=1: /dev/shm
    first when it has the room (writing to RAM instead of a slow disk)."""
    disks = RES.setdefault("disks", {})

    def shm_fits() -> bool:
        if not os.path.isdir("/dev/shm"):
            return False
        st = os.statvfs("/dev/shm")
        disks["/dev/shm"] = {"free_gb": gb(st.f_bavail * st.f_frsize)}
        return st.f_bavail * st.f_frsize >= need

    if os.environ.get("CKPT_RAM") == "1" and shm_fits():
        disks["chosen"] = "/dev/shm (CKPT_RAM=1)"
        return "/dev/shm"
    mounts = []
    try:
        for ln in open("/proc/mounts"):
            f = ln.split()
            mounts.append((f[1], f[2]))
    except OSError:
        pass
    for d in ("/tmp", "/root", "/var/tmp", os.getcwd()):
        if not os.path.isdir(d):
            continue
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize
        fs = max((m for m in mounts if d == m[0] or d.startswith(m[0].rstrip("/") + "/")), key=lambda m: len(m[0]),
                 default=("?", "?"))
        disks[d] = {"free_gb": gb(free), "mount": fs[0], "fstype": fs[1]}
        if free >= need and fs[1] not in ("tmpfs", "ramfs"):
            disks["chosen"] = d
            return d
    if shm_fits():
        disks["chosen"] = "/dev/shm (RAM: no disk with enough room)"
        return "/dev/shm"
    disks["chosen"] = "/tmp (no disk with enough room found)"
    return "/tmp"


def bf16_state_dict(sd_or_path, dev):
    """The NVFP4 state dict with its 208 projections dequantized to bf16 (comfy-kitchen's function), on dev.
    Consumes ``sd`` (quantized tensors are dropped as they are converted)."""
    from h3_turbo.formats import nvfp4
    from h3_turbo.formats.safetensors_io import open_tensors

    if isinstance(sd_or_path, str):
        with open_tensors(sd_or_path) as f:
            sd = {k: f.get_tensor(k).to(dev) for k in f.keys()}
    else:
        sd = sd_or_path
    stems = [k[:-len(".comfy_quant")] for k in list(sd) if k.endswith(".comfy_quant")]
    for s in stems:
        q, bs, s2 = sd.pop(f"{s}.weight"), sd.pop(f"{s}.weight_scale"), sd.pop(f"{s}.weight_scale_2")
        sd.pop(f"{s}.comfy_quant")
        n, kp2 = q.shape
        sd[f"{s}.weight"] = nvfp4.dequantize(q, s2, bs, torch.bfloat16)
        del q, bs, s2
    return sd


def drop_all():
    """Unload every model (with --highvram the offload device is the GPU: nothing moves), forget them, free."""
    import comfy.model_management as mm

    from h3_turbo.adapters import residency
    from h3_turbo.kernels.paths import base as pbase

    try:
        mm.unload_all_models()
    except Exception:  # noqa: BLE001
        RES["errors"].setdefault("unload", traceback.format_exc()[-800:])
    residency.clear()
    pbase.release_work_buffers()
    gc.collect()
    mm.cleanup_models()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        mark(f"dropped: {gb(torch.cuda.memory_allocated())} GB still allocated")


# ----------------------------------------------------------------------------------------- running

class Inputs:
    def __init__(self, w, h, length, text_dim, dev):
        from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

        self.key = f"{w}x{h}x{length}"
        self.latent = EmptyMiniMaxH3LatentAV.execute(w, h, length).args[0]
        v, a = self.latent["samples"].unbind()
        g = torch.Generator(device=dev).manual_seed(1)
        self.xv = torch.randn(v.shape, device=dev, generator=g)
        self.xa = torch.randn(a.shape, device=dev, generator=g)
        gc_ = torch.Generator().manual_seed(0)     # = H3TurboTestConditioning(seed 0, TEXT tokens)
        self.ctx_cpu = torch.randn(1, TEXT, text_dim, generator=gc_)
        self.ctx = self.ctx_cpu.to(dev, torch.bfloat16)
        self.t = torch.tensor([800.0], device=dev)
        self.shapes = {"video": list(v.shape), "audio": list(a.shape), "text": [1, TEXT, text_dim],
                       "video_tokens": int(v.shape[2] * (v.shape[3] // 2) * (v.shape[4] // 2)), "audio_tokens": int(a.shape[-1])}


def transformer_options(m):
    import comfy.patcher_extension as pe

    to = pe.copy_nested_dicts(m.model_options.get("transformer_options", {}))
    to["wrappers"] = pe.copy_nested_dicts(m.wrappers)
    to["callbacks"] = pe.copy_nested_dicts(m.callbacks)
    return to


REFINED: dict = {}   # id(ModelPatcher) -> the refined text context (cleared when a family is dropped)


def context_for(m, inp):
    """The context one sampling step gets: core's ``MiniMaxH3.extra_conds`` runs ``condition_proj`` + the token refiner
    once per sampling run (``preprocess_text_embeds``) and every step's forward receives the refined states. RAW_CTX=1
    (or a core without that method): the raw Qwen states, so every direct forward runs the refiner again."""
    if id(m) in REFINED:
        return REFINED[id(m)]
    get = getattr(m.model, "get_dtype_inference", None) or m.model.get_dtype
    ctx = inp.ctx if get() == inp.ctx.dtype else inp.ctx.to(get())     # the model's compute dtype (bf16 on GPU)
    pre = getattr(m.model.diffusion_model, "preprocess_text_embeds", None)
    if RAW_CTX or pre is None:
        RES["context"] = "raw text states (the refiner runs in every direct forward)"
        return ctx
    REFINED[id(m)] = pre(ctx)
    RES["context"] = "refined once per model, as core's extra_conds does per sampling run"
    return REFINED[id(m)]


def forward(m, inp):
    dm = m.model.diffusion_model
    ctx = context_for(m, inp)
    sync()
    t0 = time.perf_counter()
    o = dm([inp.xv, inp.xa], inp.t, ctx, transformer_options=transformer_options(m))
    sync()
    return time.perf_counter() - t0, o


def sample4(m, sampler, sigmas, inp):
    """One whole sampling run through core's SamplerCustomAdvanced; (wall s, [per-forward s], (video, audio))."""
    from comfy_extras.nodes_custom_sampler import Guider_Basic, Noise_RandomNoise, SamplerCustomAdvanced

    dm = m.model.diffusion_model
    ev = []

    def pre(mod, args, kwargs):
        if CUDA:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            ev.append(e)
        else:
            ev.append(time.perf_counter())

    def post(mod, args, kwargs, out):
        pre(mod, args, kwargs)

    hs = [dm.register_forward_pre_hook(pre, with_kwargs=True), dm.register_forward_hook(post, with_kwargs=True)]
    try:
        guider = Guider_Basic(m)
        guider.set_conds([[inp.ctx_cpu, {}]])
        sync()
        t0 = time.perf_counter()
        out = SamplerCustomAdvanced.execute(Noise_RandomNoise(SEED), guider, sampler, sigmas, inp.latent)
        sync()
        wall = time.perf_counter() - t0
    finally:
        for h in hs:
            h.remove()
    steps = [(ev[i].elapsed_time(ev[i + 1]) / 1e3 if CUDA else ev[i + 1] - ev[i]) for i in range(0, len(ev) - 1, 2)]
    v, a = out.args[0]["samples"].unbind()
    return wall, steps, (v.float().cpu(), a.float().cpu())


def category(name: str) -> str:
    n = name.lower()
    rules = [
        ("attention", ("flash", "fmha", "sdpa", "attn", "attention", "softmax", "_quant_kv", "_quant_q_kernel", "cudnn")),
        ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "gemv", "matmul", "splitk")),
        ("quantization", ("quant", "dequant", "fold", "nvfp4", "e4m3", "float8", "fp8", "amax", "_scale")),
        ("norm_rope", ("rms", "norm", "rope")),
        ("copies", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter", "pad")),
        ("reduction", ("reduce",)),
    ]
    for cat, keys in rules:
        if any(k in n for k in keys):
            if cat == "copies" and "elementwise" in n and "copy" in n:
                return "elementwise:copy/cast"
            return cat
    if "elementwise" in n or "vectorized" in n or "unrolled" in n or "functor" in n:
        for kind, keys in (("act", ("silu", "sigmoid", "gelu", "swiglu", "tanh", "exp")), ("mul", ("mul",)),
                           ("add", ("add",)), ("div", ("div",)), ("sub", ("sub",)), ("fill", ("fill",)),
                           ("where", ("where",)), ("neg", ("neg",))):
            if any(k in n for k in keys):
                return f"elementwise:{kind}"
        return "elementwise:other"
    return "other"


def idle_gaps(kern) -> list:
    """GPU idle gaps of kernels ``kern`` [(name, start_us, end_us)]: (us, from_us, to_us, kernel before, kernel
    after, fraction of the kernels before it) between the latest end so far and the next start, in start order."""
    kern = sorted(kern, key=lambda k: k[1])
    if not kern:
        return []
    out, end, prev = [], kern[0][2], kern[0][0]
    for i, (nm, s0, t0) in enumerate(kern[1:], 1):
        if s0 > end:
            out.append((s0 - end, end, s0, prev[:60], nm[:60], round(i / len(kern), 3)))
        if t0 >= end:
            end, prev = t0, nm
    return out


def gap_host(m, inp) -> list:
    """A second profiled forward (its CPU ops recorded): for the GAP_OPS largest GPU idle gaps, the top-level torch
    ops the host started inside each, i.e. what the GPU waited for. (Python frames would name the code; torch 2.11's
    ``events()`` lists none, with or without ``with_stack``.)"""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward(m, inp)
    ev = list(prof.events())
    kern = [(e.name, e.time_range.start, e.time_range.end) for e in ev
            if getattr(e, "device_type", None) == DeviceType.CUDA]
    ops = [e for e in ev if getattr(e, "device_type", None) == DeviceType.CPU and e.cpu_parent is None]
    out = []
    for us, a, b, after, before, _ in sorted(idle_gaps(kern), reverse=True)[:GAP_OPS]:
        inside = sorted((e for e in ops if a <= e.time_range.start < b), key=lambda e: e.time_range.start)
        out.append({"us": round(us, 1), "after": after, "before": before, "ops_n": len(inside),
                    "ops": [{"op": e.name[:80], "us": round(e.time_range.end - e.time_range.start, 1)}
                            for e in inside[:30]]})
    return out


def host_phases(m, inp, name, reps=5):
    """Where an unprofiled forward's host and GPU are at each mark (module hooks: the diffusion model, the text
    refiner, the time embedder, blocks 0, 1 and the last, the final layer): host ms and GPU ms (a CUDA event recorded
    at the mark) from the forward's start, median over ``reps`` forwards. When the GPU reaches block 0 as soon as the
    host does, the prologue is host-bound and its host time is what the GPU waits. Then one forward under cProfile
    from the forward's start to block 0: the host functions of the prologue by own and cumulative time."""
    import cProfile
    import io
    import pstats

    dm = m.model.diffusion_model
    marks: list = []

    def mk(label):
        def hook(*a, **k):
            e = None
            if CUDA:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
            marks.append((label, time.perf_counter(), e))
        return hook

    mods = [("forward", dm), ("refiner", getattr(dm, "token_refiner", None)),
            ("time_embedder", getattr(dm, "time_embedder", None)), ("block0", dm.blocks[0]),
            ("block1", dm.blocks[1] if len(dm.blocks) > 1 else None), ("last_block", dm.blocks[-1]),
            ("final_layer", getattr(dm, "final_layer", None))]
    hs = []
    for label, mod in mods:
        if mod is not None:
            hs.append(mod.register_forward_pre_hook(mk(label + ":pre")))
            hs.append(mod.register_forward_hook(mk(label + ":post")))
    # blocks run by a ("double_block", i) patch (the fused blocks) never call the block module: mark the patch too
    dit = m.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    patched = {}
    for i, label in ((0, "block0"), (1, "block1"), (len(dm.blocks) - 1, "last_block")):
        fn = dit.get(("double_block", i))
        if fn is not None:
            patched[("double_block", i)] = fn

            def marked(args, extra, _fn=fn, _label=label):
                mk(_label + ":pre")()
                out = _fn(args, extra)
                mk(_label + ":post")()
                return out
            dit[("double_block", i)] = marked
    per: dict = {}
    try:
        for _ in range(reps):
            marks.clear()
            wall, o = forward(m, inp)
            del o
            h0, e0 = marks[0][1], marks[0][2]
            for label, t, e in marks:
                d = per.setdefault(label, {"host_ms": [], "gpu_ms": []})
                d["host_ms"].append((t - h0) * 1e3)
                d["gpu_ms"].append(e0.elapsed_time(e) if CUDA else 0.0)
            per.setdefault("wall", {"host_ms": [], "gpu_ms": []})["host_ms"].append(wall * 1e3)
    finally:
        for h in hs:
            h.remove()
        dit.update(patched)
    med = {k: {kk: round(sorted(v)[len(v) // 2], 3) for kk, v in d.items() if v} for k, d in per.items()}
    prof = cProfile.Profile()
    state = {"on": False}

    def start(*a, **k):
        if not state["on"]:
            state["on"] = True
            prof.enable()

    def stop(*a, **k):
        if state["on"]:
            prof.disable()
            state["on"] = False

    hs = [dm.register_forward_pre_hook(start), dm.blocks[0].register_forward_pre_hook(stop)]
    first = dit.get(("double_block", 0))
    if first is not None:
        def stopped(args, extra):
            stop()
            return first(args, extra)
        dit[("double_block", 0)] = stopped
    try:
        forward(m, inp)
    finally:
        stop()
        for h in hs:
            h.remove()
        if first is not None:
            dit[("double_block", 0)] = first
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(70)
        out[key] = buf.getvalue()[-16000:]
    RES.setdefault("host_phases", {}).setdefault(inp.key, {})[name] = {"marks": med, "cprofile_prologue": out}
    b0 = med.get("block0:pre", {})
    mark(f"host phases {name}: block0 at host {b0.get('host_ms')} ms / GPU {b0.get('gpu_ms')} ms, "
         f"wall {med['wall']['host_ms']} ms")


def profile_forward(m, inp, name):
    """Kernel time by category over one forward (torch profiler), and the GPU idle time inside it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    sync()
    with profile(activities=acts) as prof:
        wall, _ = forward(m, inp)
    kern = []
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if (CUDA and dt == DeviceType.CUDA) or (not CUDA and dt == DeviceType.CPU and e.cpu_parent is None):
            kern.append((e.name, e.time_range.start, e.time_range.end))
    cats, per = {}, {}
    for nm, s, t in kern:
        c = category(nm)
        cats[c] = cats.get(c, 0.0) + (t - s) / 1e3
        p = per.setdefault(nm, [0.0, 0, c])
        p[0] += (t - s) / 1e3
        p[1] += 1
    busy, span = 0.0, 0.0
    gaps_hist, top_gaps, phases = {}, [], {}
    if kern:
        # where the GPU idles: gaps between one kernel's end (the latest so far) and the next start, by size
        gaps = idle_gaps(kern)
        found = [(us / 1e3, after, before, at) for us, _, _, after, before, at in gaps]
        for lo, hi in ((0, 0.002), (0.002, 0.005), (0.005, 0.01), (0.01, 0.05), (0.05, 0.2), (0.2, 1e9)):
            sel = [g[0] for g in found if lo <= g[0] < hi]
            label = f">={lo * 1e3:g}us" if hi > 1e8 else f"{lo * 1e3:g}-{hi * 1e3:g}us"
            gaps_hist[label] = [len(sel), round(sum(sel), 3)]     # [gaps, their ms]
        top_gaps = [{"ms": round(g[0], 3), "after": g[1], "before": g[2], "at": g[3]}
                    for g in sorted(found, key=lambda g: -g[0])[:8]]
        iv = sorted((s, t) for _, s, t in kern)
        span = (iv[-1][1] - iv[0][0]) / 1e3
        # the DiT blocks' part: from the first fused-block kernel to the last (before: core's prologue and the text
        # refiner; after: the final layer), with the idle time of each part
        fb = [(s, t) for nm, s, t in kern if "_norm_mod_kernel" in nm or "_gate_res_kernel" in nm]
        if fb:
            a, b = min(x[0] for x in fb), max(x[1] for x in fb)
            phases = {"before_blocks_ms": round((a - iv[0][0]) / 1e3, 2), "blocks_ms": round((b - a) / 1e3, 2),
                      "after_blocks_ms": round((iv[-1][1] - b) / 1e3, 2),
                      "idle_before_blocks_ms": round(sum(g[0] for g in gaps if g[2] <= a) / 1e3, 2),
                      "idle_in_blocks_ms": round(sum(g[0] for g in gaps if a < g[2] <= b) / 1e3, 2),
                      "idle_after_blocks_ms": round(sum(g[0] for g in gaps if g[2] > b) / 1e3, 2)}
        cs, ce = iv[0]
        for s, t in iv[1:]:
            if s > ce:
                busy += ce - cs
                cs, ce = s, t
            else:
                ce = max(ce, t)
        busy = (busy + ce - cs) / 1e3
    if CUDA and not kern:          # no device events in prof.events(): fall back to the per-op device totals
        for ka in prof.key_averages():
            t = getattr(ka, "self_device_time_total", 0) or getattr(ka, "self_cuda_time_total", 0)
            if t:
                c = category(ka.key)
                cats[c] = cats.get(c, 0.0) + t / 1e3
                per[ka.key] = [t / 1e3, ka.count, c]
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:40]
    r = {"wall_ms": round(wall * 1e3, 2), "gpu_span_ms": round(span, 2), "gpu_busy_ms": round(busy, 2),
         "launch_gaps_ms": round(span - busy, 2), "kernels": len(kern), "gaps_hist": gaps_hist, "top_gaps": top_gaps,
         "phases": phases,
         "category_ms": {k: round(v, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
         "top_kernels": [{"name": k[:160], "ms": round(v[0], 3), "calls": v[1], "category": v[2]} for k, v in top]}
    if GAP_OPS and (CUDA or DRY):
        try:
            r["gap_host"] = gap_host(m, inp)
        except Exception:  # noqa: BLE001 - a diagnostic: recorded, the run goes on
            r["gap_host_error"] = traceback.format_exc()[-2000:]
    RES["profiles"].setdefault(inp.key, {})[name] = r
    mark(f"profile {name}: span {r['gpu_span_ms']} ms, busy {r['gpu_busy_ms']}, gaps {r['launch_gaps_ms']}, "
         f"{r['category_ms']}")


def run_config(name, m, sampler, sigmas, inp, fam_base, est):
    """Everything measured for one configuration at one shape (saved into RES)."""
    import comfy.model_management as mm

    rows = RES["shapes"].setdefault(inp.key, {})
    if CONFIGS and name not in CONFIGS and f"{name}@{inp.key}" not in CONFIGS:
        return
    if now() + est > DEADLINE:
        rows.setdefault(name, {})["skipped"] = f"deadline {DEADLINE} s (at {now():.0f} s, estimate {est:.0f} s)"
        mark(f"skip {name} @ {inp.key}: deadline")
        save()
        return
    rr = rows.setdefault(name, {})
    mark(f"config {name} @ {inp.key}")
    try:
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        mm.load_models_gpu([m] + m.get_nested_additional_models())
        sync()
        rr["to_gpu_s"] = round(time.perf_counter() - t0, 3)
        r0 = lora_routes()
        rr["first_s"], o = forward(m, inp)
        FWD.setdefault(inp.key, {})[name] = tuple(t.float().cpu() for t in o)
        rr["finite_forward"] = all(bool(torch.isfinite(t).all()) for t in FWD[inp.key][name])
        del o
        if CUDA:
            rr["resident_gb"] = gb(torch.cuda.memory_allocated() - fam_base)
        fts = []
        for _ in range(FWD_REPS):
            dt, o = forward(m, inp)
            del o
            fts.append(dt)
        rr["forward_reps_s"] = [round(x, 4) for x in fts]
        from h3_turbo.runtime.adaln_memo import WEIGHT_READS
        w0 = WEIGHT_READS.counts
        wall, steps, lat = sample4(m, sampler, sigmas, inp)
        rr["turbo4_adaln_weight_reads"] = {k: v - w0.get(k, 0) for k, v in WEIGHT_READS.counts.items()}
        LAT.setdefault(inp.key, {})[name] = lat
        rr["turbo4_s"] = round(wall, 4)
        rr["turbo4_forward_s"] = [round(x, 4) for x in steps]
        rr["finite_turbo4"] = all(bool(torch.isfinite(t).all()) for t in lat)
        if TURBO4_AGAIN:    # the same 4-step run again: every timestep group cached (adaln=table's steady state)
            w1 = WEIGHT_READS.counts
            wall2, _, lat2 = sample4(m, sampler, sigmas, inp)
            rr["turbo4_again_s"] = round(wall2, 4)
            rr["turbo4_again_adaln_weight_reads"] = {k: v - w1.get(k, 0) for k, v in WEIGHT_READS.counts.items()}
            rr["turbo4_first_over_again"] = round(wall / wall2, 4)
            rr["turbo4_again_equal"] = all(torch.equal(a, b) for a, b in zip(lat, lat2))
        rr["forward_s"] = round(statistics.median(fts + steps), 4)
        rr["first_call_overhead_s"] = round(rr["first_s"] - rr["forward_s"], 3)
        rr["sampler_overhead_s"] = round(wall - sum(steps), 3)
        rr["lora_routes"] = {k: v - r0.get(k, 0) for k, v in lora_routes().items() if v - r0.get(k, 0)}
        if CUDA:
            rr["peak_gb"] = gb(torch.cuda.max_memory_allocated())
            rr["peak_over_family_base_gb"] = gb(torch.cuda.max_memory_allocated() - fam_base)
        rr["model_size_gb"] = gb(m.model_size())
        to = m.model_options.get("transformer_options", {})
        rr["attention_override"] = type(to.get("optimized_attention_override")).__name__
        mark(f"  {name}: forward {rr['forward_s']} s (first {rr['first_s']:.2f}), 4-step {rr['turbo4_s']} s, "
             f"peak {rr.get('peak_gb')} GB, resident {rr.get('resident_gb')} GB")
        if name in PROFILE:
            profile_forward(m, inp, name)
        if name in HOST_PHASES:
            host_phases(m, inp, name)
    except Exception as e:  # noqa: BLE001
        rr["error"] = f"{type(e).__name__}: {str(e)[:800]}"
        rr["tb"] = traceback.format_exc()[-2500:]
        mark(f"  {name} failed: {rr['error'][:300]}")
    save()


def est_for(family, inp):
    """Rough seconds one configuration takes (for the deadline): 7 forwards at the family's speed."""
    per_tok = {"core_bf16": 3.1, "core_nvfp4": 3.2, "ours_exact": 2.4, "ours_fp8": 1.9, "ours_fp8t": 2.6}.get(family, 3.0)
    return 7 * per_tok * (inp.shapes["video_tokens"] / 18870) ** 1.2 if CUDA else 0.0


def check_settings(b, what: str) -> None:
    """ValueError unless ``b`` is a dict of known keys (``kernels.fused.SETTINGS``, ``prologue.<key>``,
    ``attn.<KEY>``); ``what`` names it in the message (SETTINGS_B, AB_SETTINGS[i])."""
    from h3_turbo.kernels import fused as fk
    from h3_turbo.kernels.attention import int8_kernels
    from h3_turbo.runtime import prologue

    if not isinstance(b, dict):
        raise ValueError(f"{what}: expected a JSON object of settings, got {type(b).__name__} {b!r}")
    known = (sorted(fk.SETTINGS) + [f"prologue.{k}" for k in prologue.SETTINGS]
             + [f"attn.{k}" for k in int8_kernels.DEFAULT_CONFIG])
    unknown = sorted(set(b) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; known: {known}")


class settings_b:
    """Context manager: ``kernels.fused.SETTINGS``, ``runtime.prologue.SETTINGS`` (``prologue.<key>``) and the
    int8_sage launch defaults (``attn.<KEY>``) updated from ``b`` inside, restored after; unknown keys raise
    ValueError. An empty ``b`` changes nothing."""

    def __init__(self, b: dict):
        self.b = b
        self.saved = None

    def __enter__(self):
        if not self.b:
            return self
        from h3_turbo.kernels import fused as fk
        from h3_turbo.kernels.attention import int8_kernels
        from h3_turbo.runtime import prologue

        self.dicts = (fk.SETTINGS, prologue.SETTINGS, int8_kernels.DEFAULT_CONFIG)
        self.saved = tuple(dict(d) for d in self.dicts)
        check_settings(self.b, "settings")
        fk.SETTINGS.update({k: v for k, v in self.b.items() if "." not in k})
        prologue.SETTINGS.update({k[9:]: v for k, v in self.b.items() if k.startswith("prologue.")})
        int8_kernels.DEFAULT_CONFIG.update({k[5:]: v for k, v in self.b.items() if k.startswith("attn.")})
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            for d, old in zip(self.dicts, self.saved):
                d.clear()
                d.update(old)
        return False


def ab_rounds(variants: dict, inp):
    """AB_ROUNDS=N: for each ``<name>_fused`` row that ran, one untimed forward per setting of AB_SETTINGS (compiles;
    its output's relative L2 error against the row's first forward), then N rounds of one forward with the defaults
    ("a") and one per setting ("b0", "b1", ...), the order rotated each round, on the same MODEL; per setting the
    seconds, the median and median / median("a") in ``RES["ab"][shape][name]``. The card's drift over the rounds (clock,
    power cap) falls on every setting alike."""
    rows = RES["shapes"].get(inp.key, {})
    sets = [("a", {})] + [(f"b{i}", st) for i, st in enumerate(AB_SETTINGS)]
    for a_name, m in variants.items():
        if "_fused" not in a_name or "_fused_b" in a_name or not rows.get(a_name, {}).get("forward_s") \
                or (a_name.endswith("_turbo4") and a_name[:-7] in variants):     # the plain row's A/B covers it
            continue
        if now() + (AB_ROUNDS + 1) * len(sets) * rows[a_name]["forward_s"] + 10 > DEADLINE:
            mark(f"skip A/B rounds {a_name}: deadline")
            continue
        r = {"rounds": AB_ROUNDS, "settings": {lab: st for lab, st in sets}, "rel_err_vs_a": {}}
        ref = FWD.get(inp.key, {}).get(a_name)
        ov = transformer_options(m).get("optimized_attention_override")
        r["effective"] = {}
        for lab, st in sets[1:]:
            with settings_b(st):
                if hasattr(ov, "config_for") and any(k.startswith("attn.") for k in st):
                    # what the kernels get: an override built with its own config ignores the launch defaults
                    eff = ov.config_for(torch.device("cuda" if CUDA else "cpu"), 1 << 20)[1]
                    r["effective"][lab] = {k: eff.get(k[5:]) for k in st if k.startswith("attn.")}
                    if any(eff.get(k[5:]) != v for k, v in st.items() if k.startswith("attn.")):
                        mark(f"A/B {a_name} {lab}: the override's config does not take {st} (it has its own)")
                _, o = forward(m, inp)
            if ref is not None:
                r["rel_err_vs_a"][lab] = [float((t.float().cpu() - w).norm() / w.norm().clamp_min(1e-30))
                                          for t, w in zip(o, ref)]
            del o
        times = {lab: [] for lab, _ in sets}
        for i in range(AB_ROUNDS):
            for lab, st in sets[i % len(sets):] + sets[:i % len(sets)]:
                with settings_b(st):
                    dt, o = forward(m, inp)
                del o
                times[lab].append(dt)
        ma = statistics.median(times["a"])
        for lab, ts in times.items():
            r[lab] = {"s": [round(x, 4) for x in ts], "median_s": round(statistics.median(ts), 4),
                      "over_a": round(statistics.median(ts) / ma, 4),
                      "over_a_per_round": [round(y / x, 4) for x, y in zip(times["a"], ts)]}
        RES.setdefault("ab", {}).setdefault(inp.key, {})[a_name] = r
        mark(f"A/B {a_name}: " + ", ".join(f"{lab} {r[lab]['median_s']} s ({r[lab]['over_a']})" for lab, _ in sets))
        save()


def run_family(family, path, lname, inputs, sd_gpu, dev):
    import comfy.sd
    import nodes as comfy_nodes
    from comfy_extras.nodes_custom_sampler import KSamplerSelect
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3SigmaShift

    from h3_turbo.nodes import attention as nattn
    from h3_turbo.nodes import lora as nlora
    from h3_turbo.nodes.sampler import H3TurboSampler
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.samplers import schedules

    fr = RES.setdefault("families", {}).setdefault(family, {})
    names = [f"{family}{s}" for s in ("", "_turbo4")] if family.startswith("core") else \
        [f"{family}_{a}{s}" for a in ATTN for s in ("_turbo4", "")]
    if FUSED and family in ("ours_fp8", "ours_fp8t"):
        names += [n.replace(f"_{a}", f"_{a}_fused", 1) for n in list(names) for a in ATTN if f"_{a}" in n]
        if SETTINGS_B:
            names += [n.replace("_fused", "_fused_b", 1) for n in names if "_fused" in n]
    if CONFIGS and not any(c.split("@")[0] in names for c in CONFIGS):
        mark(f"skip family {family}: none of its configurations {names} is in CONFIGS")
        return
    if now() + 25 + est_for(family, inputs[0]) > DEADLINE:
        fr["skipped"] = "deadline"
        mark(f"skip family {family}: deadline")
        return
    drop_all()
    fam_base = torch.cuda.memory_allocated() if CUDA else 0
    if family == "core_bf16" and sd_gpu is not None:
        fam_base -= sum(t.nbytes for t in sd_gpu.values())     # the drawn state dict becomes this family's model
    fr["base_allocated_gb"] = gb(fam_base)
    mark(f"family {family}: loading")
    t0 = time.perf_counter()
    if family == "core_bf16":
        sd = bf16_state_dict(sd_gpu if sd_gpu is not None else path, dev)
        fr["bf16_state_dict_s"] = round(time.perf_counter() - t0, 2)
        base = comfy.sd.load_diffusion_model_state_dict(sd)
        sd.clear()          # the caller's dict too (weights were copied into the model)
        del sd
        gc.collect()
    elif family == "core_nvfp4":
        base = comfy_nodes.UNETLoader().load_unet(os.path.basename(path), "default")[0]
    else:
        table = family == "ours_fp8t"
        compute = "reference" if DRY else "fp8" if table else family.split("_")[1]    # DRY: exact/fp8 need CUDA
        adaln = "table" if table else "resident"
        fr["compute"], fr["adaln"] = compute, adaln
        base = load_h3_model(path, compute, adaln=adaln)
    sync()
    fr["load_s"] = round(time.perf_counter() - t0, 2)
    fr["patcher"] = type(base).__name__
    fr["model_size_gb"] = gb(base.model_size())
    if CUDA:
        torch.cuda.empty_cache()
    mark(f"family {family}: loaded in {fr['load_s']} s ({type(base).__name__}, {fr['model_size_gb']} GB)")
    save()
    shifted = MiniMaxH3SigmaShift.execute(base, 6.0, 3.0).args[0]
    sigmas = schedules.shifted_grid(4, 6.0, dtype=torch.float32)
    RES["sigmas"] = [float(s) for s in sigmas]
    if family.startswith("core"):
        sampler = KSamplerSelect.execute("euler").args[0]
        variants = [(f"{family}", shifted)]
        t0 = time.perf_counter()
        lm = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(shifted, lname, 1.0)[0]
        fr["lora_patches"] = len(getattr(lm, "patches", {}))
        fr["lora_node_s"] = round(time.perf_counter() - t0, 2)
        variants.append((f"{family}_turbo4", lm))
    else:
        sampler = H3TurboSampler.execute("fp32").args[0]
        t0 = time.perf_counter()
        tm = nlora.H3TurboLoRA.execute(shifted, lname, 1.0).args[0]
        fr["lora_node_s"] = round(time.perf_counter() - t0, 2)
        variants = []
        for a in ATTN:
            variants.append((f"{family}_{a}_turbo4", nattn.H3TurboAttention.execute(tm, a).args[0]))
            variants.append((f"{family}_{a}", nattn.H3TurboAttention.execute(shifted, a).args[0]))
        if FUSED and family in ("ours_fp8", "ours_fp8t"):
            from h3_turbo.runtime import fused_block

            for name, vm in list(variants):
                stem, sfx = (name[:-7], "_turbo4") if name.endswith("_turbo4") else (name, "")
                variants.append((f"{stem}_fused{sfx}", fused_block.apply(vm, "fp8")))
            if SETTINGS_B:      # the same MODELs again with SETTINGS_B (kernels.fused.SETTINGS) while they run
                variants += [(n.replace("_fused", "_fused_b", 1), vm) for n, vm in list(variants) if "_fused" in n]
    for inp in inputs:
        for name, m in variants:
            with settings_b(SETTINGS_B if SETTINGS_B and "_fused_b" in name else {}):
                run_config(name, m, sampler, sigmas, inp, fam_base, est_for(family, inp))
        if AB_ROUNDS and AB_SETTINGS:
            ab_rounds(dict(variants), inp)
    del variants, base, shifted
    REFINED.clear()
    drop_all()


def plot(res_list, png):
    """Bar chart of seconds per 4-step run by configuration (one group per shape) and a stacked bar of the
    profile categories."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, profs = {}, {}
    for res in res_list:
        for sk, rows in res.get("shapes", {}).items():
            for n, r in rows.items():
                if r.get("turbo4_s"):
                    shapes.setdefault(sk, {})[n] = r["turbo4_s"]
        for sk, pr in res.get("profiles", {}).items():
            for n, p in pr.items():
                profs[f"{n} @ {sk}"] = p
    fig, axes = plt.subplots(1, 1 + bool(profs), figsize=(15 if profs else 9, 6))
    axes = list(axes) if profs else [axes]
    ax = axes[0]
    names = sorted({n for rows in shapes.values() for n in rows}, key=lambda n: (not n.startswith("core"), n))
    w = 0.8 / max(len(shapes), 1)
    for i, (sk, rows) in enumerate(sorted(shapes.items())):
        ys = [rows.get(n, 0) for n in names]
        ax.barh([j + i * w for j in range(len(names))], ys, height=w, label=sk)
    ax.set_yticks([j + 0.4 - w / 2 for j in range(len(names))])
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per whole 4-step sampling run (one H200)")
    ax.legend()
    ax.grid(axis="x", alpha=0.3)
    for cont in ax.containers:
        ax.bar_label(cont, labels=[f"{b.get_width():.2f}" if b.get_width() else "" for b in cont], fontsize=7, padding=2)
    if profs:
        ax = axes[1]
        for p in profs.values():       # fold categories under 1% of the forward into one bar segment
            tot = sum(p["category_ms"].values()) or 1.0
            small = {c: v for c, v in p["category_ms"].items() if v < 0.01 * tot}
            p["category_ms"] = {c: v for c, v in p["category_ms"].items() if c not in small}
            if small:
                p["category_ms"]["other (<1% each)"] = sum(small.values())
        cats = sorted({c for p in profs.values() for c in p["category_ms"]} | {"launch_gaps"})
        bottom = [0.0] * len(profs)
        keys = list(profs)
        cmap = plt.get_cmap("tab20")
        for ci, c in enumerate(cats):
            vals = [profs[k]["launch_gaps_ms"] if c == "launch_gaps" else profs[k]["category_ms"].get(c, 0.0)
                    for k in keys]
            ax.bar(range(len(keys)), vals, bottom=bottom, label=c, color=cmap(ci % 20))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("ms of GPU time in one forward (kernel time by category + idle gaps)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


# ----------------------------------------------------------------------------------------- main

SHAPES = [s for s in os.environ.get("SHAPES", "96x64x22" if DRY else "960x544x124").split(",") if s]
FAMILIES = [f for f in os.environ.get("FAMILIES", "core_bf16,core_nvfp4,ours_exact,ours_fp8").split(",") if f]
CONFIGS = [c for c in os.environ.get("CONFIGS", "").split(",") if c]
PROFILE = [c for c in os.environ.get("PROFILE", "").split(",") if c]
ATTN = [a for a in os.environ.get("ATTN", "int8_sage,exact").split(",") if a]
TURBO4_AGAIN = os.environ.get("TURBO4_AGAIN") == "1"
FWD_REPS = int(os.environ.get("FWD_REPS", 1))
RAW_CTX = os.environ.get("RAW_CTX") == "1"     # direct forwards on the raw text states (context_for)
HOST_PHASES = [c for c in os.environ.get("HOST_PHASES", "").split(",") if c]   # configurations: host_phases()
GAP_OPS = int(os.environ.get("GAP_OPS", 0))   # profiles: the host ops inside the GPU's N largest idle gaps
FUSED = os.environ.get("FUSED") == "1"     # ours_fp8 also with the fused DiT blocks (runtime/fused_block.py)
SETTINGS_B = json.loads(os.environ.get("SETTINGS_B", "") or "{}")   # kernels.fused.SETTINGS for the _fused_b rows
AB_ROUNDS = int(os.environ.get("AB_ROUNDS", 0))   # interleaved forwards, defaults vs AB_SETTINGS (ab_rounds)
AB_SETTINGS = json.loads(os.environ.get("AB_SETTINGS", "") or "[]") or ([SETTINGS_B] if SETTINGS_B else [])
TEXT = int(os.environ.get("TEXT", 16 if DRY else 300))
SEED = 42


RESULT_KEYS = ("forward_s", "turbo4_s", "peak_gb", "resident_gb", "rel_err_forward", "rel_err_turbo4",
               "ratio_forward_to_core_nvfp4", "ratio_turbo4_to_core_nvfp4")


def _gpu_slug(res: dict) -> str:
    """'h200' / 'h100' / ... from a run file's ``env.gpu`` ('unknown' without one)."""
    m = re.search(r"[A-Z]\d{2,4}", str(res.get("env", {}).get("gpu", "")))
    return m.group(0).lower() if m else "unknown"


def merge(paths, out_json):
    """The issue's result file from raw run files (MERGE=run1.json,run2.json): per shape, per configuration the
    RESULT_KEYS (+ first-call and per-step times, the run it came from); ratios recomputed against the
    core_nvfp4 row with the same Turbo setting and shape (from whichever run has it); errors as each run
    measured them (None where the reference did not run in the same process); the targets."""
    runs = [json.load(open(p)) for p in paths]
    gpus = [_gpu_slug(r) for r in runs]
    out: dict = {"meta": {"runs": [os.path.basename(p) for p in paths], "gpu": gpus[0],
                          "reference_rules": summarize.__doc__.strip(),
                          "keys": "shape for runs on meta.gpu; '<gpu>:<shape>' for runs on another GPU (ratios within "
                                  "a GPU only); a fused row whose run logged the fused route's failure is left out"},
                 "profiles": {}, "targets": {}}
    for ri, res in enumerate(runs):
        fams = res.get("families", {})
        route_failed = any("fused int8_sage route failed" in str(line) for line in res.get("log", []))
        for sk, rows in res.get("shapes", {}).items():
            dst = out.setdefault(sk if gpus[ri] == gpus[0] else f"{gpus[ri]}:{sk}", {})
            for n, r in rows.items():
                if not r.get("forward_s") or re.search(r"_fused_(b|sage)(_|$)", n):
                    continue    # an A/B row (SETTINGS_B; FUSED_SAGE=ab of older runs) stays in its run's file
                if route_failed and "_fused" in n:
                    continue    # the route fell back to the unfused override in that run: not a fused measurement
                row = {k: r.get(k) for k in RESULT_KEYS}
                row.update({k: r.get(k) for k in ("first_s", "first_call_overhead_s", "turbo4_forward_s",
                                                   "sampler_overhead_s", "to_gpu_s", "reference_forward",
                                                   "reference_turbo4", "lora_routes", "attention_override")})
                fam = next((f for f in fams if n.startswith(f)), None)
                if fam:
                    row["family_load_s"] = fams[fam].get("load_s")
                    row["family_model_size_gb"] = fams[fam].get("model_size_gb")
                    if fam == "core_bf16" and fams[fam].get("base_allocated_gb", 0) > 1 and row["resident_gb"] is not None:
                        # run 1 counted the drawn NVFP4 GPU state dict (consumed into this model) in the family base
                        row["resident_gb"] = round(row["resident_gb"] + fams[fam]["base_allocated_gb"], 3)
                row["run"] = os.path.basename(paths[ri])
                dst[n] = row
        for sk, pr in res.get("profiles", {}).items():
            out["profiles"].setdefault(sk, {}).update(pr)
    for sk in [k for k in out if re.fullmatch(r"([a-z0-9]+:)?\d+x\d+x\d+", k)]:
        rows = out[sk]
        for n, r in rows.items():
            core = rows.get("core_nvfp4" + ("_turbo4" if n.endswith("_turbo4") else ""))
            if core:
                r["ratio_forward_to_core_nvfp4"] = round(r["forward_s"] / core["forward_s"], 4)
                r["ratio_turbo4_to_core_nvfp4"] = round(r["turbo4_s"] / core["turbo4_s"], 4)
                r["ratio_same_run"] = core["run"] == r["run"]
        t = out["targets"].setdefault(sk, {})
        ours = {n: r for n, r in rows.items() if n.startswith("ours_") and n.endswith("_turbo4")}
        if ours:
            best = min(ours, key=lambda n: ours[n]["turbo4_s"])
            t["fastest_ours_turbo4"] = best
            t["fastest_turbo4_s"] = ours[best]["turbo4_s"]
            t["fastest_ratio_turbo4_to_core_nvfp4"] = ours[best].get("ratio_turbo4_to_core_nvfp4")
            if t["fastest_ratio_turbo4_to_core_nvfp4"] is not None:
                t["met_turbo4_le_0.50x_core"] = t["fastest_ratio_turbo4_to_core_nvfp4"] <= 0.50
            t["fastest_rel_err_turbo4_vs_ours_exact"] = ours[best].get("rel_err_turbo4")
            if t["fastest_rel_err_turbo4_vs_ours_exact"] is not None:
                t["met_latent_within_2pct"] = t["fastest_rel_err_turbo4_vs_ours_exact"] <= 0.02
            t["branch_forward_overhead"] = {n[:-7]: round(r["forward_s"] / rows[n[:-7]]["forward_s"] - 1, 4)
                                            for n, r in ours.items() if n[:-7] in rows}
            t["met_branch_le_5pct"] = {k: v <= 0.05 for k, v in t["branch_forward_overhead"].items()}
    with open(out_json, "w") as f:
        json.dump(out, f, indent=1)
    return out


def main():
    if os.environ.get("MERGE"):
        paths = os.environ["MERGE"].split(",")
        merge(paths, os.path.join(OUT, f"{TAG}.json"))
        if os.environ.get("PLOT"):
            print(plot([json.load(open(p)) for p in paths], os.path.join(OUT, f"{TAG}.png")))
        return
    if os.environ.get("PLOT_ONLY"):
        res = [json.load(open(p)) for p in os.environ["PLOT_ONLY"].split(",")]
        print(plot(res, os.path.join(OUT, f"{TAG}.png")))
        return
    from _common import import_package

    import_package()
    if SETTINGS_B:
        check_settings(SETTINGS_B, "SETTINGS_B")
    if not isinstance(AB_SETTINGS, list):
        raise ValueError(f"AB_SETTINGS: expected a JSON list of settings objects, got {AB_SETTINGS!r}")
    for i, st in enumerate(AB_SETTINGS):
        check_settings(st, f"AB_SETTINGS[{i}]")
    from h3_turbo.harness import boot

    t0 = time.perf_counter()
    runner = boot(cpu=DRY)
    root = os.environ.get("CKPT_DIR") or os.path.join(OUT if DRY else pick_disk(), "h3bench_models")
    for sub in ("diffusion_models", "loras"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    runner.add_models_dir(root)
    runner.set_output_dir(os.path.join(root, "out"))
    import comfy.model_management as mm
    import comfy.utils
    import comfy.memory_management as cmm

    comfy.utils.PROGRESS_BAR_ENABLED = False
    RES["boot_s"] = round(time.perf_counter() - t0, 2)
    RES["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if CUDA else "cpu",
                  "vram_state": str(mm.vram_state), "aimdo_enabled": bool(getattr(cmm, "aimdo_enabled", False)),
                  "comfy_args": sys.argv[1:], "shapes": SHAPES, "families": FAMILIES, "configs": CONFIGS,
                  "attention": ATTN, "fwd_reps": FWD_REPS, "text_tokens": TEXT, "deadline_s": DEADLINE,
                  "settings_b": SETTINGS_B, "ab_settings": AB_SETTINGS, "ab_rounds": AB_ROUNDS}
    try:
        import comfy_kitchen.backends.cuda as ckc
        RES["env"]["ck_cuda_ext"] = bool(getattr(ckc, "_EXT_AVAILABLE", None))
    except Exception as e:  # noqa: BLE001
        RES["env"]["ck_cuda_ext"] = repr(e)[:200]
    mark(f"booted in {RES['boot_s']} s; {RES['env']}")
    save()
    dev = "cuda" if CUDA else "cpu"
    cfg = full_cfg(int(os.environ.get("NB", 3 if DRY else 50)))
    RES["cfg"] = cfg.__dict__
    with torch.inference_mode():
        path, lname, sd = make_files(cfg, root, dev)
        save()
        if sd is not None and "core_bf16" not in FAMILIES:
            del sd
            sd = None
        if CUDA:
            torch.cuda.empty_cache()
        inputs = []
        for s in SHAPES:
            w, h, n = (int(v) for v in s.split("x"))
            inp = Inputs(w, h, n, cfg.text_dim, dev)
            RES.setdefault("inputs", {})[inp.key] = inp.shapes
            inputs.append(inp)
        for fam in FAMILIES:
            try:
                run_family(fam, path, lname, inputs, sd, dev)
            except Exception as e:  # noqa: BLE001
                RES["errors"][fam] = traceback.format_exc()[-3000:]
                mark(f"family {fam} failed: {e}")
                drop_all()
            sd = None        # the GPU state dict is consumed by core_bf16 (or dropped)
            save()
    if os.environ.get("PLOT"):
        try:
            plot([RES], os.path.join(OUT, f"{TAG}.png"))
        except Exception:  # noqa: BLE001
            RES["errors"]["plot"] = traceback.format_exc()[-1500:]
    save()
    for sk, rows in RES["shapes"].items():
        print(f"\n{sk}: config | forward_s | turbo4_s | peak_gb | resident_gb | err_fwd | err_t4 | r_fwd | r_t4")
        for n, r in rows.items():
            print(n, *[r.get(k) if not isinstance(r.get(k), float) else round(r.get(k), 4) for k in
                       ("forward_s", "turbo4_s", "peak_gb", "resident_gb", "rel_err_forward", "rel_err_turbo4",
                        "ratio_forward_to_core_nvfp4", "ratio_turbo4_to_core_nvfp4")], r.get("error", "")[:100],
                  sep=" | ")
    print(json.dumps(RES["summary"], indent=1))
    print(json.dumps({"ok": True, "errors": list(RES["errors"]), "elapsed_s": round(now(), 1)}))


if __name__ == "__main__":
    main()
