"""Issue 5 through the real ComfyUI (tiny fixture model on CPU): H3 Turbo Sigmas + H3 Turbo Sampler in
SamplerCustomAdvanced graphs, against core's euler, with the network's calls and embedded timesteps
spied, every sampling-time contract violation, and the Turbo-off base path bit-identical.

A Turbo contract is attached by a test-only node (``H3TurboTestAttachContract``, registered only while
this module runs) so these tests do not depend on the Turbo LoRA node.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from corpus import model_node  # noqa: E402  (tests/ is on sys.path)

from h3_turbo.adapters import contracts
from h3_turbo.samplers import schedules

pytestmark = pytest.mark.comfyui

CONTRACTS = {
    "4step": contracts.KNOWN_ARTIFACTS[0].contract,   # 4 NFE, 6/3
    "8step": contracts.KNOWN_ARTIFACTS[1].contract,   # 8 NFE, 12/3
    "dmd": contracts.TURBOH3_DMD,                     # 4 NFE, 12/3
}
CAPTURED: dict[str, dict] = {}


def _foreign_wrapper(m):
    import comfy.patcher_extension as pe

    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "foreign_cache_pack", lambda executor, *a, **k: executor(*a, **k))


_AttachContract = model_node(lambda m, variant: contracts.attach(m, CONTRACTS[variant], adapter=f"test-{variant}"),
                             "Test-only: attach a Turbo contract (and adapter alias) to a clone of the MODEL.",
                             {"variant": (list(CONTRACTS),)})
_ForeignWrapper = model_node(_foreign_wrapper, "Test-only: a foreign DIFFUSION_MODEL wrapper (like a third-party cache "
                             "pack would add).")


class _Capture:
    """Test-only output node: keep a LATENT's streams in CAPTURED[tag]."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",), "denoised": ("LATENT",), "tag": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    FUNCTION = "go"
    OUTPUT_NODE = True
    CATEGORY = "h3_turbo_tests"

    def go(self, latent, denoised, tag):
        CAPTURED[tag] = {"out": [t.clone() for t in latent["samples"].unbind()],
                         "x0": [t.clone() for t in denoised["samples"].unbind()]}
        return {}


TEST_NODES = {"H3TurboTestAttachContract": _AttachContract, "H3TurboTestForeignWrapper": _ForeignWrapper,
              "H3TurboTestCapture": _Capture}


@pytest.fixture(scope="module")
def rt(comfy):
    import nodes

    for k, v in TEST_NODES.items():
        nodes.NODE_CLASS_MAPPINGS[k] = v
    yield comfy
    for k in TEST_NODES:
        nodes.NODE_CLASS_MAPPINGS.pop(k, None)


_SEQ = [0]


def graph(*, sampler="turbo", sigmas="turbo", contract="4step", shift=(6.0, 3.0), steps=0, scheduler="simple",
          seed=42, guider="basic", cfg=1.0, cache=None, foreign=False, unet="h3_tiny_bf16.safetensors",
          tag=None, state_dtype="fp32", turbo_lora=None, core_lora=None):
    """An API prompt: UNETLoader -> [ModelSamplingMiniMaxH3] -> [cache] -> [contract] -> guider ->
    SamplerCustomAdvanced -> capture. Returns (prompt, tag)."""
    _SEQ[0] += 1
    tag = tag or f"run{_SEQ[0]}"
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}}}
    m = ["1", 0]
    if core_lora is not None:
        p["1l"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": m, "lora_name": core_lora,
                                                                  "strength_model": 1.0}}
        m = ["1l", 0]
    if turbo_lora is not None:
        p["1t"] = {"class_type": "H3TurboLoRA", "inputs": {"model": m, "turbo": turbo_lora, "strength": 1.0}}
        m = ["1t", 0]
    if shift is not None:
        p["2"] = {"class_type": "MiniMaxH3SigmaShift",
                  "inputs": {"model": m, "shift_video": shift[0], "shift_audio": shift[1]}}
        m = ["2", 0]
    if cache is not None:
        p["3"] = {"class_type": cache, "inputs": {"model": m, "reuse_threshold": 0.2, "start_percent": 0.0,
                                                 "end_percent": 1.0, "verbose": False}}
        m = ["3", 0]
    if foreign:
        p["3b"] = {"class_type": "H3TurboTestForeignWrapper", "inputs": {"model": m}}
        m = ["3b", 0]
    if contract is not None:
        p["4"] = {"class_type": "H3TurboTestAttachContract", "inputs": {"model": m, "variant": contract}}
        m = ["4", 0]
    p["5"] = {"class_type": "H3TurboTestConditioning", "inputs": {"model": m, "seed": 0, "tokens": 16}}
    if guider == "basic":
        p["6"] = {"class_type": "BasicGuider", "inputs": {"model": m, "conditioning": ["5", 0]}}
    else:
        p["5n"] = {"class_type": "H3TurboTestConditioning", "inputs": {"model": m, "seed": 1, "tokens": 16}}
        p["6"] = {"class_type": "CFGGuider", "inputs": {"model": m, "positive": ["5", 0], "negative": ["5n", 0],
                                                       "cfg": cfg}}
    if sigmas == "turbo":
        p["7"] = {"class_type": "H3TurboSigmas", "inputs": {"model": m, "steps": steps}}
    else:
        p["7"] = {"class_type": "BasicScheduler", "inputs": {"model": m, "scheduler": scheduler, "steps": steps,
                                                            "denoise": 1.0}}
    if sampler == "turbo":
        p["8"] = {"class_type": "H3TurboSampler", "inputs": {"state_dtype": state_dtype}}
    else:
        p["8"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}}
    p["9"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}}
    p["10"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 128, "height": 96, "length": 22}}
    p["11"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["9", 0], "guider": ["6", 0],
                                                                "sampler": ["8", 0], "sigmas": ["7", 0],
                                                                "latent_image": ["10", 0]}}
    p["12"] = {"class_type": "H3TurboTestCapture", "inputs": {"latent": ["11", 0], "denoised": ["11", 1], "tag": tag}}
    return p, tag


def run(rt, **kw):
    p, tag = graph(**kw)
    rt.run(p)
    return CAPTURED[tag]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------------------- sigmas

def test_turbo_sigmas_node_values(rt):
    import nodes as comfy_nodes

    from h3_turbo.nodes.sampler import turbo_sigmas

    loader = comfy_nodes.NODE_CLASS_MAPPINGS["UNETLoader"]()
    (model,) = loader.load_unet("h3_tiny_bf16.safetensors", "default")
    for name, c in CONTRACTS.items():
        m = model.clone()
        contracts.attach(m, c)
        s = turbo_sigmas(m, 0)
        assert s.dtype == torch.float32 and s[-1].item() == 0.0 and s[0].item() == 1.0
        assert torch.equal(s, schedules.shifted_grid(c.nfe, c.shift_video).float())
        assert torch.equal(turbo_sigmas(m, c.nfe), s)
    # no contract: the model's model_sampling shift (default 12; ModelSamplingMiniMaxH3 patch 6)
    assert torch.equal(turbo_sigmas(model, 8), schedules.shifted_grid(8, 12.0).float())
    patched = comfy_nodes.NODE_CLASS_MAPPINGS["MiniMaxH3SigmaShift"].execute(model, 6.0, 3.0)[0]
    assert torch.equal(turbo_sigmas(patched, 4), schedules.shifted_grid(4, 6.0).float())
    with pytest.raises(ValueError, match="no Turbo contract"):
        turbo_sigmas(model, 0)


@pytest.mark.parametrize("steps,match", [
    (5, r"wants 4 model evaluations, got steps=5.*grid points, not model evaluations"),
    (3, r"minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16.*wants 4 model evaluations, got steps=3"),
])
def test_turbo_sigmas_node_refuses_wrong_steps(rt, steps, match):
    from h3_turbo.harness import PromptFailed

    with pytest.raises(PromptFailed, match=match):
        run(rt, steps=steps)


# ------------------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("shift", [(6.0, 3.0), None], ids=["patched-6-3", "unpatched-12-3"])
def test_equals_core_euler_simple_shift_6_3(rt, shift):
    """Same mathematics: per-stream Euler on uniform shifted grids == core's carried Euler on 'simple'
    with ModelSamplingMiniMaxH3(6, 3). Unpatched, the model's carry scale is 4 instead of 2 and the
    sampler sets the shifts per call: still equal."""
    core = run(rt, sampler="euler", sigmas="core", scheduler="simple", steps=4, contract=None, shift=(6.0, 3.0))
    ours = run(rt, shift=shift)
    for a, b in zip(ours["out"], core["out"]):
        assert a.shape == b.shape and _rel(a, b) < 1e-5
    # the last step goes to sigma 0: the final x0 prediction (from the callback) is the output
    for a, b in zip(ours["x0"], ours["out"]):
        assert _rel(a, b) < 1e-5
    if shift is not None:
        # not a test that cannot fail: core with another audio shift is far away
        other = run(rt, sampler="euler", sigmas="core", scheduler="simple", steps=4, contract=None, shift=(6.0, 2.0))
        assert _rel(ours["out"][1], other["out"][1]) > 1e-3
        # state_dtype=model: the tiny model computes in fp32 on the CPU, so the result is the fp32 one exactly
        model_dtype = run(rt, shift=shift, state_dtype="model")
        for a, b in zip(model_dtype["out"], ours["out"]):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------- calls and timesteps

@pytest.mark.parametrize("variant", list(CONTRACTS))
def test_model_calls_and_embedded_timesteps(rt, fixtures_dir, variant):
    from h3_turbo import state

    c = CONTRACTS[variant]
    gv, ga = schedules.turbo_grids(c.nfe, c.shift_video, c.shift_audio)
    calls, temb = [], []

    def hook(module, args):
        name = type(module).__name__
        if name == "MiniMaxH3Model":
            calls.append(1)
        elif name == "TimeEmbedder":
            temb.append(sorted(args[0].detach().double().flatten().tolist()))

    h = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        # the 4-step case runs the tiny NVFP4 checkpoint (the user's format; needs comfy-kitchen), others BF16
        nvfp4 = variant == "4step" and "nvfp4" in fixtures_dir
        unet = "h3_tiny_nvfp4.safetensors" if nvfp4 else "h3_tiny_bf16.safetensors"
        run(rt, contract=variant, shift=(c.shift_video, c.shift_audio), seed=100 + len(variant), unet=unet)
    finally:
        h.remove()
    assert len(calls) == c.nfe and len(temb) == c.nfe
    for i in range(c.nfe):
        want = sorted({round(1.0 - gv[i].item(), 12), round(1.0 - ga[i].item(), 12)})
        got = temb[i]
        assert len(got) == len(want), (i, got, want)
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-6, (i, got, want)
    assert state.snapshot()["current_turbo"] == f"test-{variant}"


# ------------------------------------------------------------------------------------------ contracts

VIOLATIONS = {
    "grid points": (dict(sigmas="core", steps=5),
                    r"wants 4 model evaluations \(a 5-point sigma grid\).*grid points, not model evaluations"),
    "too few": (dict(sigmas="core", steps=3), r"minimax_h3_fl2v_turbo_4step_v1.1.*wants 4 model evaluations"),
    "beta grid": (dict(sigmas="core", scheduler="beta", steps=4), r"not the video grid of Turbo"),
    "cfg": (dict(guider="cfg", cfg=2.0), r"guidance-distilled.*CFGGuider has cfg=2"),
    "easycache": (dict(cache="EasyCache"), r"denoiser cache EasyCache"),
    "lazycache": (dict(cache="LazyCache"), r"denoiser cache LazyCache"),
    "foreign wrapper": (dict(foreign=True), r"foreign model wrappers.*diffusion_model:foreign_cache_pack"),
    "shift patch": (dict(shift=(12.0, 3.0)), r"ModelSamplingMiniMaxH3 / ModelSamplingAV\) disagrees.*"
                                             r"shift_video 12 \(contract 6\)"),
}


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_contract_violations(rt, case):
    from h3_turbo.harness import PromptFailed

    kw, match = VIOLATIONS[case]
    with pytest.raises(PromptFailed, match=match):
        run(rt, **kw)


def test_dmd_contract_refuses_the_4step_grid(rt):
    from h3_turbo.harness import PromptFailed

    # TurboH3 DMD (12/3) with the 6/3 patch: both the grid and the patch are wrong; the grid is checked first
    with pytest.raises(PromptFailed, match=r"not the video grid of Turbo 'TurboH3-FL2VA-I2VA'.*expected \[1.000000, 0\.972973"):
        run(rt, contract="dmd", sigmas="core", steps=4, shift=(6.0, 3.0))


def test_no_contract_cfg_equals_core_euler(rt):
    """Without Turbo, CFG > 1 runs two forwards per step: the sampler reads the combined velocities from
    core's denoised (inverting the carried conversion) and still equals core's euler on the same grid."""
    ours = run(rt, contract=None, sigmas="turbo", steps=4, guider="cfg", cfg=2.0, seed=3)
    core = run(rt, contract=None, sampler="euler", sigmas="core", scheduler="simple", steps=4, guider="cfg",
               cfg=2.0, seed=3)
    for a, b in zip(ours["out"], core["out"]):
        assert _rel(a, b) < 1e-5  # (reading only one of the two forwards would be far off)


def _count_forward(fn):
    n = []
    h = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: n.append(1) if type(m).__name__ == "TimeEmbedder" else None)
    try:
        out = fn()
    finally:
        h.remove()
    return out, len(n)


def test_no_contract_easycache_skips_and_equals_core_euler(rt):
    """Without Turbo a denoiser cache is allowed: when EasyCache skips the network, the sampler reads the
    velocities from core's denoised; the result equals core's euler with the same EasyCache."""
    # both runs use core's grid (for steps not dividing 1000, 'simple' is not the uniform grid)
    kw = dict(contract=None, steps=8, cache="EasyCache", seed=5, sigmas="core", scheduler="simple")
    ours, n_ours = _count_forward(lambda: run(rt, **kw))
    core, n_core = _count_forward(lambda: run(rt, sampler="euler", **kw))
    assert n_ours < 8 and n_ours == n_core  # the cache really skipped evaluations, the same ones
    for a, b in zip(ours["out"], core["out"]):
        assert _rel(a, b) < 1e-5


def test_denoise_below_one_starts_from_carried_latent(rt):
    """denoise < 1: the sampler starts below sigma 1 from a non-empty latent that core handed over carried
    (audio x k); it must convert it to native audio first. Same mathematics as core's euler."""
    def second(sampler, seed):
        p, tag = graph(contract=None, sampler=sampler, sigmas="core", scheduler="simple", steps=4, seed=seed)
        p["7"]["inputs"]["denoise"] = 0.5  # 'simple' over 8 steps, the last 4 run: starts at sigma < 1
        first, _ = graph(contract=None, sampler="euler", sigmas="core", scheduler="simple", steps=2, seed=11)
        for k, v in first.items():
            if k not in ("12",):
                p["f" + k] = json.loads(json.dumps(v).replace('["', '["f'))
        p["11"]["inputs"]["latent_image"] = ["f11", 0]
        rt.run(p)
        return CAPTURED[tag]

    ours, core = second("turbo", 12), second("euler", 12)
    for a, b in zip(ours["out"], core["out"]):
        assert _rel(a, b) < 1e-5


# ------------------------------------------------------------------------------- with the real LoRA node

LORA4 = "h3_tiny_turbo_4step_comfyui_bf16.safetensors"
LORA8 = "h3_tiny_turbo_8step_comfyui_bf16.safetensors"


@pytest.fixture
def turbo_lora_node(rt):
    import nodes

    if "H3TurboLoRA" not in nodes.NODE_CLASS_MAPPINGS:
        pytest.skip("H3TurboLoRA (nodes/lora.py) is not registered: the contract comes from the test node only")
    return rt


def test_real_turbo_lora_contract_end_to_end(turbo_lora_node):
    """H3TurboLoRA (unmerged branch, attaches the contract) + H3 Turbo Sigmas(0) + H3 Turbo Sampler ==
    core's merged LoRA + ModelSamplingMiniMaxH3(6,3) + simple + euler; the ready state names the adapter."""
    from h3_turbo import state
    from h3_turbo.harness import PromptFailed

    rt = turbo_lora_node
    state.set_current_turbo("none")
    ours = run(rt, contract=None, shift=None, turbo_lora=LORA4, seed=21)
    assert state.snapshot()["current_turbo"] not in ("none", "", None)
    core = run(rt, contract=None, shift=(6.0, 3.0), core_lora=LORA4, sampler="euler", sigmas="core", steps=4, seed=21)
    for a, b in zip(ours["out"], core["out"]):
        assert _rel(a, b) < 1e-4  # branch vs merged weights: fp32 rounding only
    base = run(rt, contract=None, shift=(6.0, 3.0), sampler="euler", sigmas="core", steps=4, seed=21)
    assert _rel(core["out"][0], base["out"][0]) > 1e-3  # the LoRA matters
    with pytest.raises(PromptFailed, match=r"wants 8 model evaluations, got steps=9.*grid points"):
        run(rt, contract=None, shift=None, turbo_lora=LORA8, steps=9)


# ------------------------------------------------------------------------------------------ Turbo off

_REFERENCE = textwrap.dedent(r"""
    import sys, json, torch
    comfy_path, models, out, shapes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    sys.path.insert(0, comfy_path)
    from comfy.cli_args import args
    args.cpu = True
    import comfy.sd, comfy.samplers, comfy.sample, comfy.utils, comfy.nested_tensor
    import comfy.model_management, comfy.latent_formats
    assert not any(m.startswith("h3_turbo") for m in sys.modules), "reference must not import the pack"
    model = comfy.sd.load_diffusion_model(models + "/diffusion_models/h3_tiny_bf16.safetensors")
    text_dim = model.model.diffusion_model.condition_proj.in_features
    ctx = torch.randn(1, 16, text_dim, generator=torch.Generator().manual_seed(0))  # H3TurboTestConditioning
    video, audio = torch.zeros(shapes[0]), torch.zeros(shapes[1])  # EmptyMiniMaxH3LatentAV: zeros
    latent = comfy.nested_tensor.NestedTensor((video, audio))
    noise = comfy.sample.prepare_noise(latent, 42)
    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "beta", 6)
    guider = comfy.samplers.CFGGuider(model)
    guider.inner_set_conds({"positive": [[ctx, {}]]})
    samples = guider.sample(noise, latent, comfy.samplers.sampler_object("res_multistep"), sigmas, seed=42)
    torch.save([t.contiguous() for t in samples.unbind()], out)
""")


def test_turbo_off_beta_res_multistep_bit_identical(rt, fixtures_dir, tmp_path):
    """Core's base path (beta + res_multistep, no Turbo) through our booted ComfyUI, after Turbo runs
    used the same cached model, equals a reference computed in a fresh process that never imports the
    pack: bit for bit."""
    from h3_turbo.harness import find_comfyui

    run(rt, seed=42)  # Turbo first: it must leave the shared (cached) model untouched
    base = run(rt, sampler="res_multistep", sigmas="core", scheduler="beta", steps=6, contract=None, shift=None)
    ref_file = tmp_path / "ref.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    shapes = json.dumps([list(t.shape) for t in base["out"]])
    r = subprocess.run([sys.executable, "-c", _REFERENCE, str(find_comfyui()), fixtures_dir["root"], str(ref_file), shapes],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = torch.load(ref_file)
    assert [tuple(t.shape) for t in ref] == [tuple(t.shape) for t in base["out"]]
    for a, b in zip(base["out"], ref):
        assert torch.equal(a, b), _rel(a, b)
