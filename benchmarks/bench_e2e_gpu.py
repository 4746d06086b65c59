"""End-to-end GPU proof of the pack THROUGH ComfyUI (in-process harness), plus a full-width timing.

Part 1 (PART1=1): boot the real ComfyUI on the GPU (``h3_turbo.harness.boot(cpu=False)``), write the tiny
fixtures (tools/fixtures.py), and run the real graph for every compute (reference, exact, fp8, auto) x
LoRA (no LoRA node, H3TurboLoRA turbo=none, 4step):
  H3TurboNVFP4Loader -> [H3TurboLoRA] -> H3TurboAttention(auto) -> H3TurboTestConditioning / BasicGuider /
  H3TurboSigmas / H3TurboSampler / RandomNoise / EmptyMiniMaxH3LatentAV -> SamplerCustomAdvanced ->
  LTXVSeparateAVLatent -> SaveLatent (video, audio) [+ H3TurboSaveLatentPreview (PyAV) if PREVIEW=1]
each twice (noise seed 42 = first/cold run, seed 43 = warm: only the sampler re-executes). Records
ComfyUI's per-node times, the saved latents' finiteness, rel. L2 exact vs reference, fp8 vs exact, auto vs
its resolved path, and bit-identity of turbo=none vs no LoRA node. Every h3_turbo log line is kept
(dispatch's fallback reasons for the tiny K=64/128 projections).

Part 2 (PART2=1): full-width, partial-depth H3 (hidden 5376, 56x128 heads, ffn 14336, text 5120, $NB DiT
blocks + 2 refiner blocks), random weights generated on the GPU, projections quantized with
``formats.nvfp4.quantize``, written as a ComfyUI-native NVFP4 safetensors (real key layout) plus a rank-128
Turbo LoRA (qkv 384) in the loras folder; then, per compute in (reference = core's dequant path, exact,
fp8): ``runtime.loading.load_h3_model`` (the loader node's logic) -> optional ``H3TurboLoRA.execute`` ->
``H3TurboAttention.execute(auto)`` -> ``comfy.model_management.load_models_gpu`` -> the DiT forward at
960x544x124 (video [1,24,37,34,60], audio [1,32,2,207]: 19584 rows), with the model's own
transformer_options (attention override, wrappers). Per-block time: CUDA events around each DiT block
(forward pre/post hooks), median over REPS forwards after one warm-up.

Env: COMFYUI_PATH (ComfyUI tree), OUT (result folder), DRY=1 (CPU, small widths: checks the script),
NB (DiT blocks, default 3), REPS (default 3), COMFY_ARGS (extra ComfyUI CLI args, e.g.
"--disable-dynamic-vram"), PART1/PART2 (1/0), COMPUTES (part 1 computes, comma list), P1_BUDGET (s since
start after which part 1 stops), PREVIEW=1 (add H3TurboSaveLatentPreview, needs PyAV), P2_COMPUTES
(default reference,exact,fp8), CORE_ATTN=1 (part 2 also runs compute=reference without H3TurboAttention:
core as core's users run it), P2_ATTN (comma list of further H3TurboAttention backends for part 2, e.g.
int8_sage). Writes $OUT/e2e_gpu_h200.json after every step.

Run (GPU): ``OUT=benchmarks/results COMFYUI_PATH=<ComfyUI> python3 benchmarks/bench_e2e_gpu.py``; CPU check:
``DRY=1 OUT=/tmp/dry COMFYUI_PATH=$HOME/ComfyUI python benchmarks/bench_e2e_gpu.py``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

DRY = bool(os.environ.get("DRY"))
OUT = os.environ.get("OUT", ".")
sys.argv = ["main.py"] + os.environ.get("COMFY_ARGS", "").split()
RES: dict = {"dry": DRY, "errors": {}, "log": []}
T_START = time.perf_counter()
P1_BUDGET = float(os.environ.get("P1_BUDGET", 1e9))   # seconds since start after which part 1 stops
os.makedirs(OUT, exist_ok=True)


def save():
    with open(os.path.join(OUT, "e2e_gpu_h200.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


from _common import collect_logs, lora_routes, rel_l2  # noqa: E402

collect_logs(RES["log"], 400)

import torch  # noqa: E402


def sync():
    if torch.cuda.is_available() and not DRY:
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------- part 1
FIX = {"nvfp4": "h3_tiny_nvfp4.safetensors", "lora4": "h3_tiny_turbo_4step_comfyui_bf16.safetensors"}


def graph(compute, lora, seed, tag, preview=False):
    p = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": FIX["nvfp4"], "compute": compute}}}
    m = ["1", 0]
    if lora is not None:
        p["2"] = {"class_type": "H3TurboLoRA", "inputs": {"model": m, "turbo": lora, "strength": 1.0}}
        m = ["2", 0]
    p["3"] = {"class_type": "H3TurboAttention", "inputs": {"model": m, "backend": "auto"}}
    m = ["3", 0]
    p.update({
        "4": {"class_type": "H3TurboTestConditioning", "inputs": {"model": m, "seed": 0, "tokens": 16}},
        "5": {"class_type": "BasicGuider", "inputs": {"model": m, "conditioning": ["4", 0]}},
        "6": {"class_type": "H3TurboSigmas", "inputs": {"model": m, "steps": 0 if lora == FIX["lora4"] else 4}},
        "7": {"class_type": "H3TurboSampler", "inputs": {"state_dtype": "fp32"}},
        "8": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "9": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 128, "height": 96, "length": 22}},
        "10": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["8", 0], "guider": ["5", 0], "sampler": ["7", 0],
                                                                "sigmas": ["6", 0], "latent_image": ["9", 0]}},
        "11": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["10", 0]}},
        "12": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"e2e/{tag}_video"}},
        "13": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 1], "filename_prefix": f"e2e/{tag}_audio"}},
    })
    if preview:
        p["14"] = {"class_type": "H3TurboSaveLatentPreview", "inputs": {"av_latent": ["10", 0], "filename_prefix": f"e2e/{tag}_prev"}}
    return p


def read_latents(outdir, outputs):
    from safetensors.torch import load_file

    got = {}
    for nid, name in (("12", "video"), ("13", "audio")):
        it = outputs[nid]["latents"][0]
        got[name] = load_file(os.path.join(outdir, it.get("subfolder", ""), it["filename"]))["latent_tensor"]
    return got


def part1(runner, models, outdir):
    import comfy.model_management as mm

    r1 = RES.setdefault("part1", {"runs": {}})
    r1["device"] = str(mm.get_torch_device())
    r1["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() and not DRY else "cpu"
    lat = {}
    computes = ("reference", "exact", "fp8", "auto") if not DRY else ("reference", "auto")
    if os.environ.get("COMPUTES"):
        computes = tuple(os.environ["COMPUTES"].split(","))
    for compute in computes:
        for lname, lora in (("nolora", None), ("none", "none"), ("4step", FIX["lora4"])):
            for seed in (42, 43):
                tag = f"{compute}_{lname}_{seed}"
                if time.perf_counter() - T_START > P1_BUDGET:
                    r1["runs"][tag] = {"skipped": f"P1_BUDGET {P1_BUDGET} s reached"}
                    continue
                prompt = graph(compute, lora, seed, tag, preview=bool(os.environ.get("PREVIEW")) and seed == 42)
                nlog = len(RES["log"])
                routes0 = lora_routes()
                t0 = time.perf_counter()
                try:
                    outs = runner.run(prompt)
                    sync()
                    wall = time.perf_counter() - t0
                    times = {f"{n}:{prompt[n]['class_type']}": round(s, 4) for n, s in runner.node_times()}
                    L = read_latents(outdir, outs)
                    lat[tag] = L
                    r1["runs"][tag] = {"wall_s": round(wall, 3), "node_s": times,
                                       "finite": {k: bool(torch.isfinite(v).all()) for k, v in L.items()},
                                       "shape": {k: list(v.shape) for k, v in L.items()},
                                       "std": {k: float(v.float().std()) for k, v in L.items()},
                                       "new_log": RES["log"][nlog:],
                                       "lora_routes": {k: v - routes0.get(k, 0) for k, v in lora_routes().items()
                                                       if v - routes0.get(k, 0)}}
                    if "14" in outs:
                        r1["runs"][tag]["preview"] = outs["14"]
                except Exception as e:  # noqa: BLE001
                    r1["runs"][tag] = {"error": f"{type(e).__name__}: {str(e)[:1500]}", "new_log": RES["log"][nlog:]}
                print("part1", tag, json.dumps({k: v for k, v in r1["runs"][tag].items() if k != "new_log"})[:600], flush=True)
                save()
    cmp = {}

    def c(name, a, b, bit=False):
        if a in lat and b in lat:
            d = {k: rel_l2(lat[a][k], lat[b][k]) for k in ("video", "audio")}
            if bit:
                d["bit_identical"] = all(torch.equal(lat[a][k], lat[b][k]) for k in ("video", "audio"))
            cmp[name] = d

    for lname in ("nolora", "none", "4step"):
        for seed in (42, 43):
            s = f"{lname}_{seed}"
            c(f"exact_vs_reference[{s}]", f"exact_{s}", f"reference_{s}", bit=True)
            c(f"fp8_vs_exact[{s}]", f"fp8_{s}", f"exact_{s}", bit=True)
            c(f"fp8_vs_reference[{s}]", f"fp8_{s}", f"reference_{s}")
            for p in ("reference", "exact", "fp8"):
                c(f"auto_vs_{p}[{s}]", f"auto_{s}", f"{p}_{s}", bit=True)
    for compute in computes:
        for seed in (42, 43):
            c(f"none_vs_nolora[{compute}_{seed}]", f"{compute}_none_{seed}", f"{compute}_nolora_{seed}", bit=True)
            c(f"4step_vs_nolora[{compute}_{seed}]", f"{compute}_4step_{seed}", f"{compute}_nolora_{seed}")
    r1["compare"] = cmp
    try:
        from h3_turbo import state
        r1["state"] = json.loads(json.dumps(state.snapshot() if hasattr(state, "snapshot") else {}, default=str))
    except Exception as e:  # noqa: BLE001
        r1["state"] = repr(e)
    save()


# ----------------------------------------------------------------------------------------- part 2
def fw_cfg(nb):
    from _common import h3_config

    return h3_config(nb, DRY)


def write_fullwidth(cfg, path, dev):
    """Random H3 state dict of tools/fixtures.py (its key layout and scales), drawn on ``dev``, with the 4 block
    projections quantized to ComfyUI-native NVFP4 by formats.nvfp4.quantize (on ``dev``) as they are drawn."""
    from safetensors.torch import save_file

    from h3_turbo.formats import nvfp4
    from h3_turbo.tools.fixtures import make_tiny_h3_state_dict

    marker = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)

    def native_nvfp4(w):
        q, bs, s = nvfp4.quantize(w.to(torch.bfloat16))
        return {"weight": q, "weight_scale": bs, "weight_scale_2": s.float().reshape(()), "comfy_quant": marker.clone()}

    out = {k: v.cpu() for k, v in make_tiny_h3_state_dict(cfg, seed=0, device=dev, projection=native_nvfp4).items()}
    save_file(out, path)
    return sum(t.nbytes for t in out.values())


def part2(models):
    import comfy.model_management as mm

    from h3_turbo.nodes import attention as nattn
    from h3_turbo.nodes import lora as nlora
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.tools.fixtures import make_turbo_lora

    from safetensors.torch import save_file

    dev = "cpu" if DRY else "cuda"
    nb = int(os.environ.get("NB", 3))
    reps = int(os.environ.get("REPS", 3))
    cfg = fw_cfg(nb)
    r2 = RES.setdefault("part2", {"cfg": cfg.__dict__ if hasattr(cfg, "__dict__") else str(cfg), "runs": {}})
    path = os.path.join(models, "diffusion_models", "h3_fullwidth_nvfp4.safetensors")
    t0 = time.perf_counter()
    r2["file_bytes"] = write_fullwidth(cfg, path, dev)
    lt, lm = make_turbo_lora(None, cfg, alpha_over_rank=1.0, seed=1, nfe=4, shifts=(6.0, 3.0))
    lname = "h3_fullwidth_turbo_4step.safetensors"
    save_file(lt, os.path.join(models, "loras", lname), metadata=lm)
    del lt
    r2["write_s"] = time.perf_counter() - t0
    save()
    print("part2 wrote", path, r2["file_bytes"], "bytes in", round(r2["write_s"], 1), "s", flush=True)
    if DRY:
        w, h, frames, text = 96, 64, 22, 16
    else:
        w, h, frames, text = 960, 544, 124, 300
    lt_ = 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2
    at = round(frames / 24 * 40)
    g = torch.Generator(device=dev).manual_seed(1)
    x = [torch.randn(1, 24, lt_, h // 16, w // 16, device=dev, generator=g),
         torch.randn(1, 32, 2, at, device=dev, generator=g)]
    ctx = torch.randn(1, text, cfg.text_dim, device=dev, generator=g).to(torch.bfloat16)
    tt = torch.tensor([800.0], device=dev)
    r2["shape"] = {"video": list(x[0].shape), "audio": list(x[1].shape), "ctx": list(ctx.shape),
                   "video_tokens": lt_ * (h // 32) * (w // 32)}
    outs = {}
    for compute in tuple(os.environ.get("P2_COMPUTES", "reference,exact,fp8").split(",")):
        try:
            t0 = time.perf_counter()
            base = load_h3_model(path, compute)
            load_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            r2["runs"][compute] = {"error": f"load: {type(e).__name__}: {str(e)[:800]}", "tb": traceback.format_exc()[-1500:]}
            save()
            continue
        variants = [(None, "auto"), (lname, "auto")]
        if compute == "reference" and os.environ.get("CORE_ATTN", "1") == "1":
            variants.append((None, None))     # core as core users run it: core's attention, no override
        for extra in [b for b in os.environ.get("P2_ATTN", "").split(",") if b and b != "auto"]:
            variants += [(None, extra), (lname, extra)]    # another H3TurboAttention backend, e.g. int8_sage
        for lora, use_attn in variants:
            suffix = "" if use_attn == "auto" else ("_coreattn" if use_attn is None else f"_{use_attn}")
            key = f"{compute}{'_lora' if lora else ''}{suffix}"
            rr = {"load_s": load_s}
            try:
                m = base
                if lora:
                    m = nlora.H3TurboLoRA.execute(m, lora, 1.0).args[0]
                if use_attn:
                    m = nattn.H3TurboAttention.execute(m, use_attn).args[0]
                t0 = time.perf_counter()
                mm.load_models_gpu([m] + m.get_nested_additional_models())   # the adapter too, as sampling does
                sync()
                rr["to_gpu_s"] = time.perf_counter() - t0
                dm = m.model.diffusion_model
                import comfy.patcher_extension as pe
                to = pe.copy_nested_dicts(m.model_options.get("transformer_options", {}))
                to["wrappers"] = pe.copy_nested_dicts(m.wrappers)
                to["callbacks"] = pe.copy_nested_dicts(m.callbacks)
                rr["override"] = type(to.get("optimized_attention_override")).__name__
                rr["patcher"] = type(m).__name__
                rr["is_dynamic"] = bool(getattr(m, "is_dynamic", lambda: None)())
                ev = []

                def pre(mod, inp, _i=[0]):
                    if not DRY:
                        e = torch.cuda.Event(enable_timing=True)
                        e.record()
                        ev.append(["s", e])

                def post(mod, inp, outp):
                    if not DRY:
                        e = torch.cuda.Event(enable_timing=True)
                        e.record()
                        ev.append(["e", e])

                routes0 = lora_routes()
                hs = [b.register_forward_pre_hook(pre) for b in dm.blocks] + [b.register_forward_hook(post) for b in dm.blocks]
                fts, bts = [], []
                try:
                    with torch.inference_mode():
                        for i in range(1 + reps):
                            ev.clear()
                            sync()
                            t0 = time.perf_counter()
                            o = dm(x, tt, ctx, transformer_options=dict(to))
                            sync()
                            dt = time.perf_counter() - t0
                            if i == 0:
                                rr["first_s"] = dt
                                continue
                            fts.append(dt)
                            if not DRY:
                                pairs = [ev[j][1].elapsed_time(ev[j + 1][1]) for j in range(0, len(ev) - 1, 2)
                                         if ev[j][0] == "s" and ev[j + 1][0] == "e"]
                                bts.append(pairs)
                finally:
                    for hd in hs:
                        hd.remove()
                fts.sort()
                rr["lora_routes"] = {k: v - routes0.get(k, 0) for k, v in lora_routes().items() if v - routes0.get(k, 0)}
                rr["forward_median_s"] = fts[len(fts) // 2]
                if bts:
                    per = [sorted(col)[len(col) // 2] for col in zip(*bts)]
                    rr["block_ms"] = per
                    rr["block_ms_mean"] = sum(per) / len(per)
                oo = [t.float().cpu() for t in (o if isinstance(o, (list, tuple)) else [o])]
                outs[key] = oo
                rr["finite"] = all(bool(torch.isfinite(t).all()) for t in oo)
                if not DRY:
                    rr["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            except Exception as e:  # noqa: BLE001
                rr["error"] = f"{type(e).__name__}: {str(e)[:800]}"
                rr["tb"] = traceback.format_exc()[-2000:]
            r2["runs"][key] = rr
            print("part2", key, json.dumps({k: v for k, v in rr.items() if k != "tb"})[:700], flush=True)
            save()
        try:
            mm.unload_all_models()
            mm.soft_empty_cache()
        except Exception:  # noqa: BLE001
            pass
        del base
    cmp = {}
    for key in list(outs):
        for ref in ("reference", "exact"):
            rk = ref + ("_lora" if "_lora" in key else "")
            if key != rk and rk in outs:
                cmp[f"{key}_vs_{rk}"] = [rel_l2(a, b) for a, b in zip(outs[key], outs[rk])]
        if key.endswith("_coreattn") and key[:-9] in outs:
            cmp[f"{key}_vs_{key[:-9]}"] = [rel_l2(a, b) for a, b in zip(outs[key], outs[key[:-9]])]
        for extra in [b for b in os.environ.get("P2_ATTN", "").split(",") if b and b != "auto"]:
            if key.endswith("_" + extra) and key[:-len(extra) - 1] in outs:
                base_key = key[:-len(extra) - 1]
                cmp[f"{key}_vs_{base_key}"] = [rel_l2(a, b) for a, b in zip(outs[key], outs[base_key])]
        if key.endswith("_lora") and key[:-5] in outs:
            cmp[f"{key}_vs_{key[:-5]}(lora effect)"] = [rel_l2(a, b) for a, b in zip(outs[key], outs[key[:-5]])]
    r2["compare"] = cmp
    save()


def main():
    from h3_turbo.harness import boot
    from h3_turbo.tools.fixtures import make_fixtures

    t0 = time.perf_counter()
    models = tempfile.mkdtemp(prefix="h3e2e_models_")
    RES["fixtures"] = {k: os.path.basename(v) for k, v in make_fixtures(models).items()}
    RES["fixtures_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner = boot(cpu=DRY)
    runner.add_models_dir(models)
    outdir = tempfile.mkdtemp(prefix="h3e2e_out_")
    runner.set_output_dir(outdir)
    RES["boot_s"] = time.perf_counter() - t0
    RES["torch"] = torch.__version__
    try:
        import comfy_kitchen.backends.cuda as ckc
        RES["ck_cuda_ext"] = bool(getattr(ckc, "_EXT_AVAILABLE", None))
    except Exception as e:  # noqa: BLE001
        RES["ck_cuda_ext"] = repr(e)[:200]
    import comfy.model_management as mm
    RES["comfy_vram_state"] = str(getattr(mm, "vram_state", "?"))
    RES["dynamic_vram"] = str(getattr(mm, "DYNAMIC_VRAM", getattr(mm, "dynamic_vram_enabled", "?")))
    print("booted", RES["boot_s"], RES.get("ck_cuda_ext"), flush=True)
    save()
    if os.environ.get("PART1", "1") == "1":
        try:
            part1(runner, models, outdir)
        except Exception as e:  # noqa: BLE001
            RES["errors"]["part1"] = traceback.format_exc()[-3000:]
            print("part1 failed", e, flush=True)
            save()
    if os.environ.get("PART2", "1") == "1":
        try:
            part2(models)
        except Exception as e:  # noqa: BLE001
            RES["errors"]["part2"] = traceback.format_exc()[-3000:]
            print("part2 failed", e, flush=True)
            save()
    print(json.dumps({"ok": True, "errors": list(RES["errors"])}))


if __name__ == "__main__":
    main()
