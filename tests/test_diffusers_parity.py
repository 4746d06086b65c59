"""Parity with diffusers 0.42.1, the independent H3 reference (issue 40; what is compared with what and the measured
numbers: docs/parity.md). Tiny config on the CPU; every comparison has a bound and a negative control that breaks
it (a changed convention moves the result by orders of magnitude), so a test that cannot fail would show.

(a) one forward: the DMD loader (Diffusers-named shards written by diffusers' ``save_pretrained``) and core's
    ``UNETLoader`` (core naming) vs ``MiniMaxH3Transformer3DModel``, text-to-video+audio and first+last keyframes;
(b) the sigma grids of the 4step / 8step / DMD contracts vs ``MiniMaxH3Scheduler``, and the 4-update sampling
    (H3 Turbo Sigmas + H3 Turbo Sampler, ``update=euler``) vs diffusers' own denoise loop;
(c) the NVFP4 ``exact`` path (Triton interpreter) vs diffusers on the dequantized weights;
(d) the Turbo LoRA runtime branch vs diffusers on the weights merged with diffusers' own MiniMax-H3 LoRA converter
    (diffusers applies LoRAs through PEFT, which is not a dependency of this pack).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers==0.42.1 is in the [test] extra")
import diffusers_ref as R  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.comfyui

SUB = "h3t_parity"
#: relative L2 bound of a forward / a sampled latent (both sides compute in fp32 from the same BF16 weights)
BOUND = 2e-6
#: a negative control must move the result at least this much (relative L2)
BROKEN = 1e-2
LAT = dict(T=2, H=4, W=6, TA=5, TEXT=8)
LAST_FRAME = 4                                # 2 latent frames = 5 pixel frames: keyframes at pixel frames 0 and 4


def _rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm())


def parity_state_dict(cfg) -> dict:
    """The tiny fixture's weights (core names, BF16 + the FP32 island) with the blocks' residual branches and
    modulation x4 (exact in BF16): every block moves the output by O(1), so a wrong convention inside a block shows
    (with the fixture's unit gains the input's path dominates)."""
    from h3_turbo.tools.fixtures import make_tiny_h3_state_dict

    return {k: v * 4 if k.endswith(("attn.out_proj.weight", "mlp.fc2.weight", "adaln_proj.linear.weight")) else v
            for k, v in make_tiny_h3_state_dict(cfg, seed=3).items()}


def parity_inputs(cfg) -> dict:
    g = torch.Generator().manual_seed(11)
    return {"video": torch.randn(1, cfg.latents_dim, LAT["T"], LAT["H"], LAT["W"], generator=g),
            "audio": torch.randn(1, cfg.audio_latents_dim, 2, LAT["TA"], generator=g),
            "context": torch.randn(1, LAT["TEXT"], cfg.text_dim, generator=g),
            "keyframes": [torch.randn(1, cfg.latents_dim, 1, LAT["H"], LAT["W"], generator=g) for _ in range(2)]}


def save_diffusers_shards(ref, tdir: str) -> str:
    """``ref.save_pretrained`` into ``tdir`` (several shards + index + config.json); returns the index path."""
    ref.save_pretrained(tdir, max_shard_size="200KB")
    return os.path.join(tdir, next(f for f in os.listdir(tdir) if f.endswith(".safetensors.index.json")))


@pytest.fixture(scope="module")
def parity(comfy, fixtures_dir):
    from diffusers.utils import logging as dlog

    from h3_turbo.tools.fixtures import _save_aligned
    from h3_turbo.tools.release import tiny_dmd_config

    dlog.set_verbosity_error()
    cfg = tiny_dmd_config()
    sd = parity_state_dict(cfg)
    root = os.path.join(fixtures_dir["root"], "diffusion_models", SUB)
    os.makedirs(root, exist_ok=True)
    _save_aligned(sd, os.path.join(root, "parity_core_bf16.safetensors"), {"h3_turbo_fixture": "diffusers parity"})
    ref = R.model_from_core(sd, cfg)
    tdir = os.path.join(root, "TurboH3-diffusers", "transformer")
    index = save_diffusers_shards(ref, tdir)
    return {"cfg": cfg, "sd": sd, "ref": ref, "ref32": R.fp32(ref), "inputs": parity_inputs(cfg),
            "shards": len([f for f in os.listdir(tdir) if f.endswith(".safetensors")]),
            "index": index, "core": f"{SUB}/parity_core_bf16.safetensors"}


def _core_model(parity, which: str):
    if which == "dmd":
        from h3_turbo.runtime.dmd import load_dmd_model

        return load_dmd_model(parity["index"], "none", "reference")
    import nodes

    return nodes.UNETLoader().load_unet(parity["core"], "default")[0]


def _payload(parity, keyframes: bool) -> dict:
    if not keyframes:
        return {}
    z = parity["inputs"]["keyframes"]
    return {"keyframes": [{"resolved_frame_index": 0, "latent": z[0]},
                          {"resolved_frame_index": LAST_FRAME, "latent": z[1]}],
            "cond_video_latents": list(z), "seed": 5}


def core_forward(mp, parity, sigma_v: float, keyframes: bool, dtype=torch.float32):
    """Core's H3 forward as its sampler calls it (timestep = fp32 sigma * 1000, shifts 12/3; core computes in the
    context's dtype) -> data-ward velocities (core returns noise - x0)."""
    i = parity["inputs"]
    dm = mp.model.diffusion_model
    to = {"minimax_h3_sigma_shift_video": 12.0, "minimax_h3_sigma_shift_audio": 3.0}
    with torch.no_grad():
        v, a = dm([i["video"], i["audio"]], torch.tensor([sigma_v], dtype=torch.float32) * 1000, i["context"].to(dtype),
                  transformer_options=to, minimax_payload=_payload(parity, keyframes))
    return -v.float(), -a.float()


def ref_inputs(parity, keyframes: bool, audio_time_major: bool = False):
    """diffusers' layout and rows for the same latents (keyframe rows noise-augmented to 0.999 as core does:
    ``MiniMaxH3Scheduler.scale_noise`` with the condition noise core draws, one seeded stream per keyframe)."""
    i = parity["inputs"]
    lay = R.layout(LAT["TEXT"], LAT["T"], LAT["H"], LAT["W"], LAT["TA"], ("first", "last") if keyframes else ())
    vr, ar = R.rows(i["video"], i["audio"])
    if audio_time_major:
        ar = i["audio"][0].permute(2, 1, 0).reshape(-1, i["audio"].shape[1])       # negative control
    if keyframes:
        from diffusers import MiniMaxH3Scheduler

        cond = []
        for z in i["keyframes"]:
            r = R.rows(z, i["audio"])[0]
            noise = torch.randn(r.shape, generator=torch.Generator("cpu").manual_seed(5), dtype=torch.float32)
            cond.append(MiniMaxH3Scheduler().scale_noise(r, R.KEYFRAME_NOISE_AUG, noise))
        vr = torch.cat(cond + [vr])
    return lay, vr, ar


def ref_forward(model, parity, step: int, keyframes: bool, t_is_sigma: bool = False, audio_time_major=False):
    lay, vr, ar = ref_inputs(parity, keyframes, audio_time_major)
    sv, sa = R.schedulers(5, 12.0, 3.0)
    ts, idx = R.plan(lay, sv, sa)[step]
    if t_is_sigma:
        ts = 1 - ts                                                                   # negative control
    v, a = R.forward(model, lay, vr, ar, parity["inputs"]["context"], ts, idx)
    return v[lay["n_cond_video"]:], a, float(sv.sigmas[step])


def _mutated(parity, how: str):
    """The diffusers reference built from deliberately mis-converted weights (negative controls)."""
    cfg, sd = parity["cfg"], dict(parity["sd"])
    H = cfg.inner
    for k in list(sd):
        if how == "fc1_unswapped" and k.endswith("mlp.fc1.weight"):
            g, u = sd[k].chunk(2)
            sd[k] = torch.cat([u, g])
        if how == "qk_swapped" and k.endswith("attn.qkv_proj.weight"):
            sd[k] = torch.cat([sd[k][H:2 * H], sd[k][:H], sd[k][2 * H:]])
    return R.fp32(R.model_from_core(sd, cfg))


# --------------------------------------------------------------------------------------------- (a) one forward

@pytest.mark.parametrize("keyframes", [False, True], ids=["t2va", "keyframes"])
def test_forward_matches_diffusers(comfy, parity, keyframes, record_property):
    """The DMD loader (save_pretrained shards) and UNETLoader (core file) vs diffusers, at DMD steps 1 and 3."""
    from h3_turbo.formats.dmd import detect_dmd

    det = detect_dmd(parity["index"])        # save_pretrained keeps the release's precisions and split q/k/v
    assert parity["shards"] >= 2 and det.dtype_counts["F32"] == 12 and det.qkv == "split" and not det.errors
    worst = 0.0
    for which in ("dmd", "unet"):
        mp = _core_model(parity, which)
        for step in (1, 3):
            rv, ra, sigma = ref_forward(parity["ref32"], parity, step, keyframes)
            cv, ca = core_forward(mp, parity, sigma, keyframes)
            cvr, car = R.rows(cv, ca)
            ev, ea = _rel(cvr, rv), _rel(car, ra)
            worst = max(worst, ev, ea)
            assert ev < BOUND and ea < BOUND, (which, step, ev, ea)
    record_property("forward_rel_l2_max", worst)
    # negative controls: one convention changed at a time, against the DMD loader's step-1 output
    cv, ca = R.rows(*core_forward(_core_model(parity, "dmd"), parity, float(R.schedulers(5, 12.0, 3.0)[0].sigmas[1]),
                                  keyframes))
    broken = {"t = sigma": ref_forward(parity["ref32"], parity, 1, keyframes, t_is_sigma=True),
              "audio rows time-major": ref_forward(parity["ref32"], parity, 1, keyframes, audio_time_major=True),
              "fc1 halves unswapped": ref_forward(_mutated(parity, "fc1_unswapped"), parity, 1, keyframes),
              "q/k swapped": ref_forward(_mutated(parity, "qk_swapped"), parity, 1, keyframes)}
    for name, (rv, ra, _) in broken.items():
        err = max(_rel(cv, rv), _rel(ca, ra))
        record_property(f"negative_{name}", err)
        assert err > BROKEN, (name, err)


# --------------------------------------------------------------------------------------------- (b) sampling

def _contracts():
    from h3_turbo.adapters import contracts as C

    by_name = {a.contract.name: a.contract for a in C.KNOWN_ARTIFACTS}
    return {"4step": by_name[C.ALIASES["4step"]], "8step": by_name[C.ALIASES["8step"]], "dmd": C.TURBOH3_DMD}


@pytest.mark.parametrize("name", ["4step", "8step", "dmd"])
def test_sigma_grids_match_diffusers_scheduler(comfy, name, record_property):
    """H3 Turbo Sigmas (the video SIGMAS) and H3 Turbo Sampler's audio grid for each contract vs MiniMaxH3Scheduler
    with N + 1 grid points (diffusers counts grid points, ComfyUI model evaluations); and the forwards' timesteps
    core computes vs the scheduler's t = 1 - sigma (what a table written by diffusers is keyed by) within the AdaLN
    lookup tolerance. Negative controls: N grid points (the step-count trap), the other video shift."""
    from types import SimpleNamespace

    from h3_turbo.adapters import contracts as C
    from h3_turbo.nodes.sampler import turbo_sigmas
    from h3_turbo.runtime import adaln as A
    from h3_turbo.samplers.schedules import shifted_grid

    c = _contracts()[name]
    holder = SimpleNamespace(model_options={})
    C.attach(holder, c)
    ours_v = turbo_sigmas(holder, 0)
    ours_a = shifted_grid(c.nfe, c.shift_audio)                       # the sampler's audio grid (float64)
    dv, da = R.schedulers(c.nfe + 1, c.shift_video, c.shift_audio)
    assert ours_v.dtype == torch.float32 and len(ours_v) == len(dv.sigmas) == c.nfe + 1
    ev = float((ours_v.double() - dv.sigmas.double()).abs().max())
    ea = float((ours_a - da.sigmas.double()).abs().max())
    assert ev <= 1.2e-7 and ea <= 1.2e-7, (ev, ea)                     # <= 2 ulp of fp32 below 1
    # the forwards' timesteps: core's fp32 closed form (audio from the video sigma) vs diffusers' 1 - sigma
    groups = A.timestep_groups(A.Schedule(name, c.nfe, c.shift_video, c.shift_audio), conds=(None,))
    want = [sorted({float(tv), float(ta)}) for tv, ta in zip(dv.timesteps, da.timesteps)]
    assert [len(g) for g in groups] == [len(w) for w in want]
    dt = max(abs(a - b) for g, w in zip(groups, want) for a, b in zip(g, w))
    assert dt <= A.TOLERANCE
    record_property("sigma_max_abs_diff", max(ev, ea))
    record_property("timestep_max_abs_diff", dt)
    # negative controls
    trap, _ = R.schedulers(c.nfe, c.shift_video, c.shift_audio)
    assert len(trap.sigmas) == c.nfe != len(ours_v)
    other, _ = R.schedulers(c.nfe + 1, 18.0 - c.shift_video, c.shift_audio)   # 6 <-> 12
    assert float((ours_v.double() - other.sigmas.double()).abs().max()) > 1e-2


_N = [0]


def _sample_prompt(index: str, update: str, seed: int) -> dict:
    from corpus import turbo_av_prompt  # tests/ is on sys.path

    _N[0] += 1
    p = {"1": {"class_type": "H3TurboDMDLoader", "inputs": {"model_name": index, "adaln": "none",
                                                            "compute": "reference"}}}
    p.update(turbo_av_prompt(["1", 0], update=update, seed=seed, tokens=LAT["TEXT"],
                             prefixes=(f"h3t/par{_N[0]}_v", f"h3t/par{_N[0]}_a")))
    return p


def test_four_update_euler_trajectory_matches_diffusers_denoise_loop(comfy, parity, record_property):
    """SamplerCustomAdvanced + H3 Turbo Sigmas + H3 Turbo Sampler (update=euler) on the DMD model vs diffusers'
    MiniMaxH3DenoiseStep (its transformer and MiniMaxH3Scheduler x 2) from the same noise and conditioning: the
    final latents. Negative controls: diffusers run with N grid points (3 updates), with the audio grid on the
    video shift, and the pack's update=renoise (the DMD contract's default) against diffusers' Euler."""
    from comfy.sample import prepare_noise
    from comfy_extras.nodes_minimax_h3 import _empty_av_latent

    index = f"{SUB}/TurboH3-diffusers/transformer/{os.path.basename(parity['index'])}"
    seed = 42
    v, a = comfy.run_latents(_sample_prompt(index, "euler", seed), ("12", "13"))
    # the same noise ComfyUI drew (RandomNoise: one CPU generator, video then audio) and the same conditioning
    lat, _ = _empty_av_latent(64, 64, 5)
    nv, na = prepare_noise(lat["samples"], seed).unbind()
    ctx = torch.randn(1, LAT["TEXT"], parity["cfg"].text_dim, generator=torch.Generator().manual_seed(0))
    lay = R.layout(LAT["TEXT"], nv.shape[2], nv.shape[3], nv.shape[4], na.shape[-1])
    vr, ar = R.rows(nv, na)

    def ref(steps=5, shift_a=3.0):
        return R.denoise(parity["ref32"], lay, vr, ar, ctx, steps, 12.0, shift_a)

    fv, fa = ref()
    ov, oa = R.rows(v, a)
    ev, ea = _rel(ov, fv), _rel(oa, fa)
    record_property("trajectory_rel_l2", max(ev, ea))
    assert ev < BOUND and ea < BOUND, (ev, ea)
    for label, (xv, xa) in {"3 updates (grid-point count)": ref(steps=4), "audio on shift 12": ref(shift_a=12.0),
                            "update=renoise": R.rows(*comfy.run_latents(_sample_prompt(index, "renoise", seed),
                                                                        ("12", "13")))}.items():
        err = max(_rel(ov, xv), _rel(oa, xa))
        record_property(f"negative_{label}", err)
        assert err > BROKEN, (label, err)


# --------------------------------------------------------------------------------------------- (c) NVFP4 exact

def test_nvfp4_exact_path_interpreted(record_property):
    """tests/test_diffusers_parity_interp.py in a fresh process with TRITON_INTERPRET=1 (the interpreter must be
    set before triton is first imported): the exact path's Triton kernel in the DMD model's forward vs diffusers on
    comfy-kitchen's dequantization of the same NVFP4 weights."""
    import re
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           os.path.join(here, "test_diffusers_parity_interp.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and re.search(r"\b1 passed", proc.stdout), tail
    m = re.search(r"NVFP4-EXACT forward rel L2 (\S+) \(vs BF16 weights (\S+)\)", proc.stdout)
    assert m, tail
    record_property("nvfp4_exact_forward_rel_l2", float(m.group(1)))
    record_property("negative_unquantized_weights", float(m.group(2)))


# --------------------------------------------------------------------------------------------- (d) Turbo LoRA

def _merged_reference(parity, lora_sd: dict, scale_extra: float = 1.0):
    """diffusers' reference with a Comfy-layout LoRA converted by diffusers' own MiniMax-H3 LoRA converter
    (``_convert_non_diffusers_minimax_h3_lora_to_diffusers``: split q/k/v, fc1 halves swapped, alpha folded) and
    merged into the fp32 weights, W + B @ A in float64. (diffusers applies LoRAs through PEFT, not a dependency of
    this pack: the branch is compared with the merged weights.)"""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers

    conv = _convert_non_diffusers_minimax_h3_lora_to_diffusers({k: v.clone() for k, v in lora_sd.items()})
    model = R.fp32(parity["ref"])
    n = 0
    for k, a in conv.items():
        if not k.endswith(".lora_A.weight"):
            continue
        mod = model.get_submodule(k[len("transformer."):-len(".lora_A.weight")])
        b = conv[k.replace(".lora_A.", ".lora_B.")]
        mod.weight.data = (mod.weight.double() + scale_extra * (b.double() @ a.double())).float()
        n += 1
    return model, n


def test_turbo_lora_branch_matches_diffusers_merged_lora(comfy, parity, fixtures_dir, record_property):
    """UNETLoader (core file) + H3 Turbo LoRA (the unmerged runtime branch) + H3 Turbo Sigmas + H3 Turbo Sampler
    (euler, the 4step contract, 6/3) vs diffusers' denoise loop on the LoRA-merged weights, from the same noise.
    Negative controls: the base model (no LoRA), the LoRA's alpha/rank not applied."""
    from comfy.sample import prepare_noise
    from comfy_extras.nodes_minimax_h3 import _empty_av_latent
    from safetensors.torch import save_file

    from h3_turbo.tools.fixtures import make_turbo_lora

    cfg = parity["cfg"]
    lora, meta = make_turbo_lora(parity["sd"], cfg, alpha_over_rank=0.5, seed=7, nfe=4, shifts=(6.0, 3.0), b_std=0.3)
    name = "h3t_parity_lora.safetensors"
    os.makedirs(os.path.join(fixtures_dir["root"], "loras"), exist_ok=True)
    save_file(lora, os.path.join(fixtures_dir["root"], "loras", name), metadata=meta)
    p = _sample_prompt("", "euler", 42)
    p["1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": parity["core"], "weight_dtype": "default"}}
    p["2"] = {"class_type": "H3TurboLoRA", "inputs": {"model": ["1", 0], "turbo": name, "strength": 1.0,
                                                      "variant": "4step"}}
    for nid in ("4", "5", "6"):
        p[nid]["inputs"]["model"] = ["2", 0]
    v, a = comfy.run_latents(p, ("12", "13"))
    lat, _ = _empty_av_latent(64, 64, 5)
    nv, na = prepare_noise(lat["samples"], 42).unbind()
    ctx = torch.randn(1, LAT["TEXT"], cfg.text_dim, generator=torch.Generator().manual_seed(0))
    lay = R.layout(LAT["TEXT"], nv.shape[2], nv.shape[3], nv.shape[4], na.shape[-1])
    vr, ar = R.rows(nv, na)
    ov, oa = R.rows(v, a)
    merged, n = _merged_reference(parity, lora)
    assert n == 6 * (cfg.num_layers + cfg.refiner_layers)           # to_q, to_k, to_v, to_out, fc1, fc2 per block
    fv, fa = R.denoise(merged, lay, vr, ar, ctx, 5, 6.0, 3.0)
    err = max(_rel(ov, fv), _rel(oa, fa))
    record_property("lora_trajectory_rel_l2", err)
    assert err < BOUND, err
    for label, model in {"no LoRA": parity["ref32"], "alpha/rank not applied": _merged_reference(parity, lora, 2.0)[0]
                         }.items():
        xv, xa = R.denoise(model, lay, vr, ar, ctx, 5, 6.0, 3.0)
        e = max(_rel(ov, xv), _rel(oa, xa))
        record_property(f"negative_{label}", e)
        assert e > BROKEN, (label, e)
