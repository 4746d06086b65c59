"""Issue 8, in-process half: every bad input of the generated corpus (tests/corpus) through the REAL ComfyUI
graph (``comfy.run`` -> ComfyUI's validate_prompt + PromptExecutor) and through ``python -m h3_turbo.tools
inspect``. Each failing case asserts the exact error text (file, key, node, expected value) and that the
loaded model is unchanged afterwards (:func:`corpus.model_fingerprint`, before vs after).

Models used:
- bad MODEL files are built from the 50+2-block NVFP4 / BF16 fixtures; the model proven untouched is the
  small model below, loaded by the same loader node in an earlier prompt;
- bad ADAPTERS are built from the 50+2-block 4-step fixture (the official 208 targets) and applied to the
  50+2-block NVFP4 model (prompt: loader -> H3TurboLoRA -> H3TurboSigmas -> PreviewAny; no sampling);
- everything that SAMPLES uses a 2+1-block variant of the same fixtures (same widths and latents, 12 targets:
  ~0.15 s per step instead of ~1.5 s), 64x64, length 5 (latent T=2), 4 steps.

Fingerprint protocol (:func:`_fp`): the patcher's own state (patches, object_patches, model_options,
injections, additional_models, hook patches, parameters) is hashed as it is; then every model is unloaded
(``unload_all_models``: ComfyUI ejects injections and weight patches) and the whole model is hashed again,
including which modules carry a ``forward`` override. (While a Turbo clone is loaded, the shared modules
legitimately carry its injected forwards; a failed prompt may unload it. That is ComfyUI's memory
management, not a change to the model.)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import (ADAPTER_BAD_CASES, CONFIG_CASES, MODEL_CASES, av_prompt, build_adapter_corpus,  # noqa: E402
                    build_model_corpus, fingerprint_parts, model_fingerprint, write_small_fixtures)

pytestmark = pytest.mark.comfyui

REPO = Path(__file__).resolve().parent.parent
SMALL_UNET = "zz_rel_small/h3rel_small_nvfp4.safetensors"  # the 2+1-block fixture (see module doc)
SMALL_4 = "zz_rel_small/h3rel_small_turbo_4step.safetensors"
SMALL_8 = "zz_rel_small/h3rel_small_turbo_8step.safetensors"
BIG_UNET = "h3_tiny_nvfp4.safetensors"


def graph(unet=SMALL_UNET, turbo=SMALL_4, **kw) -> dict:
    """:func:`corpus.av_prompt` with the small model and its 4-step adapter by default."""
    return av_prompt(unet=unet, turbo=turbo, **kw)


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def rel_models(comfy, fixtures_dir, tmp_path_factory) -> dict:
    """The corpus and the small fixtures in a models tree registered with the in-process ComfyUI."""
    root = tmp_path_factory.mktemp("reliability_models")
    dm, lo = root / "diffusion_models", root / "loras"
    models = build_model_corpus(fixtures_dir, str(dm / "zz_rel"))
    adapters = build_adapter_corpus(fixtures_dir, str(lo / "zz_rel"))
    small = write_small_fixtures(str(root), "zz_rel_small", str(tmp_path_factory.mktemp("small_src")))
    assert (small["unet"], small["lora_4step"], small["lora_8step"]) == (SMALL_UNET, SMALL_4, SMALL_8)
    ok_adapters = build_adapter_corpus({"lora_4step": small["lora_4step_path"]}, str(lo / "zz_rel_small" / "ok"))
    comfy.add_models_dir(root)
    return {"root": root, "models": models, "adapters": adapters, "ok_adapters": ok_adapters}


def run_latents(comfy, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Run and return the (video, audio) latents SaveLatent wrote (files removed afterwards)."""
    v, a = comfy.run_latents(prompt, ("11", "12"))
    return v, a


def loaded_patcher(comfy, node_id="1"):
    """The MODEL output of ``node_id`` of the last prompt, from ComfyUI's own output cache."""
    entry = comfy.executor.caches.outputs.get_local(node_id)
    assert entry is not None, f"node {node_id} has no cached output"
    return entry.outputs[0][0]


def _fp(mp) -> tuple[dict, str]:
    """(patcher state as it is [without module forward overrides], full fingerprint after unloading all)."""
    import comfy.model_management as mm

    live = {k: v for k, v in fingerprint_parts(mp).items() if k != "forward_overrides"}
    with torch.inference_mode():  # as ComfyUI's executor does (outside it, the next load fails on inference tensors)
        mm.unload_all_models()
    return live, model_fingerprint(mp)


def expect_failure(comfy, prompt, node_type: str):
    """Run ``prompt``; it must fail in a node of class ``node_type``. Returns ComfyUI's exception message."""
    from h3_turbo.harness import PromptFailed

    with pytest.raises(PromptFailed) as ei:
        comfy.run(prompt)
    err = ei.value.error or {}
    assert err.get("node_type") == node_type, (err.get("node_type"), str(ei.value))
    return str(ei.value).strip()


@pytest.fixture(scope="module")
def small_ref(comfy, rel_models):
    """The small model with the 4-step adapter, run once: {"mp": base ModelPatcher, "v"/"a": latents}."""
    v, a = run_latents(comfy, graph(tag="ref4"))
    return {"mp": loaded_patcher(comfy), "v": v, "a": a}


@pytest.fixture(scope="module")
def big_base(comfy, rel_models):
    """The 50+2-block NVFP4 model loaded through the graph with the 4-step fixture adapter (no sampling)."""
    comfy.run(graph(unet=BIG_UNET, turbo="4step", sample=False))
    return loaded_patcher(comfy)


# ----------------------------------------------------------------------------------------------- model files
# {case: (exact message after "<path>: ", or a tuple of substrings when it carries byte counts)}
H3_FIX = ". Fix: re-download or re-export the file; `python -m h3_turbo.tools inspect FILE` lists every finding."
NOT_H3_FIX = (". Fix: this pack's loaders and tools take MiniMax H3 diffusion models only; in a workflow, load other "
              "models with the loader made for them (e.g. core's UNETLoader).")
MODEL_MESSAGES = {
    "truncated": ("file is truncated: it stops at data byte", "(re-download the file) (expected file size"),
    "lfs_pointer": "this is a Git LFS pointer file, not the model: the real file was never downloaded (run `git lfs "
                   "pull` or download the file itself) (expected a safetensors file)",
    "header_too_long": ("header length field says", "(file truncated or not safetensors) (expected <= "),
    "trailing_bytes": ("100 trailing bytes after the last tensor (the file was appended to or the header is wrong) "
                       "(expected data size",),
    "json_garbage": "header is not valid UTF-8 JSON (JSONDecodeError: Expecting value: line 1 column 8 (char 7)) "
                    "(expected a JSON object)",
    "scale_wrong_dtype": "1 problem(s): [error] blocks.3.attn.out_proj.weight_scale: block scales are F32 (expected "
                         "F8_E4M3, or U8 bytes of e4m3)" + H3_FIX,
    "global_scale_nan": "1 problem(s): [error] blocks.3.attn.out_proj.weight_scale_2: weight_scale_2 is nan (expected "
                        "a finite positive number)" + H3_FIX,
    "global_scale_inf": "1 problem(s): [error] blocks.3.attn.out_proj.weight_scale_2: weight_scale_2 is inf (expected "
                        "a finite positive number)" + H3_FIX,
    "global_scale_zero": "1 problem(s): [error] blocks.3.attn.out_proj.weight_scale_2: weight_scale_2 is 0.0 "
                         "(expected > 0)" + H3_FIX,
    "block_scale_nan": "tensor 'blocks.3.attn.out_proj.weight_scale': 1 block scales are NaN (e4m3 0x7F/0xFF; "
                       "expected finite)",
    "missing_weight_scale": "1 problem(s): [error] blocks.3.attn.out_proj.weight_scale: missing weight_scale for an "
                            "NVFP4 layer (comfy_native)" + H3_FIX,
    "wan_like": "1 problem(s): [error] not a MiniMax H3 diffusion model: looks like Wan 2.x (not MiniMax H3)"
                + NOT_H3_FIX,
    "bf16_shape_vs_config": "1 problem(s): [error] blocks.7.mlp.fc1.weight: shape [384, 64] (expected [256, 64] from "
                            "hidden 64, heads 2x32, ffn 128)" + H3_FIX,
}
# what `python -m h3_turbo.tools inspect` prints for the same files (one finding line each)
INSPECT_FINDINGS = dict(
    {k: "[error] " for k in ("truncated", "lfs_pointer", "header_too_long", "trailing_bytes", "json_garbage")},
    scale_wrong_dtype="[error] blocks.3.attn.out_proj.weight_scale: block scales are F32",
    global_scale_nan="[error] blocks.3.attn.out_proj.weight_scale_2: weight_scale_2 is nan",
    global_scale_inf="[error] blocks.3.attn.out_proj.weight_scale_2: weight_scale_2 is inf",
    global_scale_zero="[error] blocks.3.attn.out_proj.weight_scale_2: weight_scale_2 is 0.0 (expected > 0)",
    block_scale_nan="[error] blocks.3.attn.out_proj.weight_scale: 1 block scales are NaN (e4m3 0x7F/0xFF; expected "
                    "finite)",
    missing_weight_scale="[error] blocks.3.attn.out_proj.weight_scale: missing weight_scale for an NVFP4 layer",
    wan_like="[error] not a MiniMax H3 diffusion model: looks like Wan 2.x (not MiniMax H3)",
    bf16_shape_vs_config="[error] blocks.7.mlp.fc1.weight: shape [384, 64] (expected [256, 64]",
)


def _content(path: str):
    """A file's bytes, or for a valid safetensors file (parsed header, data bytes): safetensors writes a
    multi-key __metadata__ in hash-map order, so the bytes of equal files may differ."""
    import json
    import struct

    raw = Path(path).read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        return json.loads(raw[8:8 + n]), raw[8 + n:]
    except (ValueError, UnicodeDecodeError, struct.error):
        return raw


def test_corpus_is_complete_and_deterministic(rel_models, fixtures_dir, tmp_path):
    assert set(MODEL_MESSAGES) == set(MODEL_CASES) == set(rel_models["models"]) - set(CONFIG_CASES)
    again = build_model_corpus(fixtures_dir, str(tmp_path / "m"))
    for k in list(MODEL_CASES) + list(CONFIG_CASES):
        assert _content(again[k]) == _content(rel_models["models"][k]), k


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bad_model_file_through_graph(comfy, rel_models, small_ref, case):
    from h3_turbo import state

    path = rel_models["models"][case]
    before = _fp(small_ref["mp"])
    n_loaded = len(state.snapshot()["loaded_models"])
    msg = expect_failure(comfy, graph(unet=f"zz_rel/{case}.safetensors", tag=case), "H3TurboNVFP4Loader")
    want = MODEL_MESSAGES[case]
    assert msg.startswith(f"{path}: "), msg
    if isinstance(want, str):
        assert msg == f"{path}: {want}"
    else:
        assert all(w in msg for w in want), msg
    assert _fp(small_ref["mp"]) == before
    assert len(state.snapshot()["loaded_models"]) == n_loaded   # nothing recorded as loaded


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bad_model_file_through_inspect(rel_models, case, capsys):
    from h3_turbo.tools.__main__ import main

    path = rel_models["models"][case]
    rc = main(["inspect", path])
    out = capsys.readouterr().out
    assert rc == 1 and "RESULT: ERRORS" in out, out
    want = INSPECT_FINDINGS[case]
    if want == "[error] ":  # container damage: the loader's own message, verbatim
        tail = MODEL_MESSAGES[case]
        line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("[error] "))
        assert line.startswith(f"[error] {path}: ")
        if isinstance(tail, str):
            assert line == f"[error] {path}: {tail}"
        else:
            assert all(w in line for w in tail), line
    else:
        assert want in out, out


@pytest.mark.parametrize("case", ["bf16_config_ffn", "bf16_config_layers"])
def test_bf16_metadata_config_disagreeing_with_shapes_is_refused(comfy, rel_models, small_ref, case):
    before = _fp(small_ref["mp"])
    msg = expect_failure(comfy, graph(unet=f"zz_rel/{case}.safetensors", turbo="none", steps=4, sample=False),
                         "H3TurboNVFP4Loader")
    key = next(iter(CONFIG_CASES[case]))
    assert msg.startswith(rel_models["models"][case]) and "config" in msg and key in msg, msg
    assert _fp(small_ref["mp"]) == before


def test_bf16_metadata_config_override_is_honoured(comfy, rel_models):
    """A non-shape override in __metadata__ config (sigma_shift_video 7) is legitimate: it loads and core's
    DiT carries it (core's model_sampling keeps its default shift 12: core reads the override only inside the
    DiT, for the audio timestep mapping)."""
    comfy.run(graph(unet="zz_rel/bf16_config_shift.safetensors", turbo="none", steps=4, sample=False))
    mp = loaded_patcher(comfy)
    assert float(mp.model.diffusion_model.sigma_shift_video) == 7.0
    assert float(mp.get_model_object("model_sampling").shift) == 12.0


@pytest.mark.parametrize("case", ["truncated", "wan_like"])
def test_inspect_cli_subprocess(rel_models, case):
    """The real command line (``python -m h3_turbo.tools inspect FILE``): exit 1 and the finding."""
    path = rel_models["models"][case]
    p = subprocess.run([sys.executable, "-m", "h3_turbo.tools", "inspect", path], capture_output=True, text=True,
                       timeout=120, cwd=str(REPO.parent))
    assert p.returncode == 1, p.stdout + p.stderr
    assert "RESULT: ERRORS" in p.stdout
    assert ("file is truncated" if case == "truncated" else "looks like Wan 2.x") in p.stdout


# ----------------------------------------------------------------------------------------------- adapters
ADAPTER_MESSAGES = {
    "missing_targets": "Turbo LoRA 'missing_targets.safetensors' does not fit this model (208 targets expected, 204 "
                       "in the file); missing targets: 4 [blocks.1.attn.out_proj, blocks.1.attn.qkv_proj, "
                       "blocks.1.mlp.fc1, blocks.1.mlp.fc2]. File: {path}",
    "extra_adaln_proj": "Turbo LoRA 'extra_adaln_proj.safetensors' also targets modules outside the 208 block "
                        "projections (keys: 3 [diffusion_model.blocks.0.adaln_proj.linear.alpha, "
                        "diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight, "
                        "diffusion_model.blocks.0.adaln_proj.linear.lora_B.weight]). The official Turbo LoRAs touch "
                        "only attn.qkv_proj/out_proj and mlp.fc1/fc2: this adapter was made for a different base "
                        "(e.g. an unpruned H3 with per-block adaln_proj, while pruned checkpoints replace AdaLN with "
                        "adaln_t_table) and is refused. File: {path}",
    "extra_final_layer": "Turbo LoRA 'extra_final_layer.safetensors' also targets modules outside the 208 block "
                         "projections (keys: 2 [diffusion_model.final_layer.video_out.lora_A.weight, "
                         "diffusion_model.final_layer.video_out.lora_B.weight]).",
    "other_hidden": "Turbo LoRA 'other_hidden.safetensors' does not fit this model (208 targets expected, 208 in the "
                    "file); wrong hidden sizes: 208 [blocks.0.attn.out_proj: A [4, 64] B [96, 4] vs model [out 64, "
                    "in 64], blocks.0.attn.qkv_proj: A [12, 96] B [192, 12] vs model [out 192, in 64],",
    "alpha_missing": "Turbo LoRA 'alpha_missing.safetensors' is not valid: targets without rank/alpha (missing "
                     "lora_A, lora_B or alpha): 1 [blocks.0.mlp.fc1 (missing alpha)]. File: {path}",
    "lora_b_missing": "Turbo LoRA 'lora_b_missing.safetensors' is not valid: targets without rank/alpha (missing "
                      "lora_A, lora_B or alpha): 1 [blocks.1.mlp.fc2 (missing lora_B.weight)]. File: {path}",
    "alpha_vs_metadata": "Turbo LoRA 'alpha_vs_metadata.safetensors' is not valid: alpha/rank disagreeing with "
                         "__metadata__ training_scale 1: 1 [blocks.1.attn.out_proj: alpha 1 / rank 4 = 0.25]. "
                         "File: {path}",
}


@pytest.mark.parametrize("case", ADAPTER_BAD_CASES)
def test_bad_adapter_through_graph(comfy, rel_models, big_base, case):
    from h3_turbo.adapters import residency

    path = rel_models["adapters"][case]
    before = _fp(big_base)
    resident = residency.resident_keys()
    msg = expect_failure(comfy, graph(unet=BIG_UNET, turbo=f"zz_rel/{case}.safetensors", sample=False),
                         "H3TurboLoRA")
    want = ADAPTER_MESSAGES[case].format(path=path)
    if want.endswith(path):
        assert msg == want
    else:
        assert msg.startswith(want) and msg.endswith(f"File: {path}"), msg
    assert _fp(big_base) == before
    assert residency.resident_keys() == resident          # a refused adapter is not cached
    assert loaded_patcher(comfy) is big_base               # the loader's output was reused, not rebuilt


#: what ``inspect`` says offline about each bad adapter (the same reader messages as Apply H3 Turbo LoRA, or the
#: coverage check that needs no model)
ADAPTER_INSPECT_FINDINGS = {
    "missing_targets": "[error] missing targets (an adapter must cover all four projections of every block): 4 "
                       "[blocks.1.attn.out_proj, blocks.1.attn.qkv_proj, blocks.1.mlp.fc1, blocks.1.mlp.fc2]",
    # self-consistent, only for another model's width: a warning offline, an error against the model
    "other_hidden": "[warning] sized for an H3 of hidden 96, attention 64, FFN 128",
}


@pytest.mark.parametrize("case", ADAPTER_BAD_CASES)
def test_bad_adapter_through_inspect(rel_models, case, capsys):
    """``inspect`` checks an adapter offline and names the problem the graph would stop on (exit 1)."""
    from h3_turbo.tools.__main__ import main

    path = rel_models["adapters"][case]
    rc = main(["inspect", path])
    out = capsys.readouterr().out
    assert "kind: Turbo LoRA" in out, out
    want = ADAPTER_INSPECT_FINDINGS.get(case) or "[error] " + ADAPTER_MESSAGES[case].format(path=path)
    assert want in out, out
    assert (rc, out.rstrip().endswith("RESULT: OK" if case == "other_hidden" else "RESULT: ERRORS")) == \
        (0 if case == "other_hidden" else 1, True), out


@pytest.mark.parametrize("case", ["bare_keys", "peft_default", "diffusers_twin"])
def test_accepted_adapter_layouts_equal_official(comfy, rel_models, small_ref, case):
    """Bare ``blocks.N`` keys, PEFT ``.default`` keys on core's names (DiffSynth-Studio: qkv rows interleaved per
    head, de-interleaved) and the Diffusers twin (split q/k/v, fc1 [up; gate], alpha from __metadata__) of the
    same adapter give bit-identical latents."""
    from h3_turbo.adapters import residency

    r = residency.get(rel_models["ok_adapters"][case], head_dim=32)   # the fixture's head size (DiffSynth needs it)
    assert (r.layout, r.key_style) == {"bare_keys": ("comfy", "bare"), "peft_default": ("diffsynth", "diffsynth"),
                                       "diffusers_twin": ("diffusers", "diffusers")}[case]
    v, a = run_latents(comfy, graph(turbo=f"zz_rel_small/ok/{case}.safetensors", tag=case))
    assert torch.equal(v, small_ref["v"]) and torch.equal(a, small_ref["a"])


def test_diffusers_twin_with_fc1_halves_swapped_is_not_detectable(comfy, rel_models, small_ref):
    """A twin whose fc1 B rows are in ComfyUI order ([gate; up]) instead of Diffusers' [up; gate]: NOT
    detectable from the file (both halves have the same shape and statistics; no key or metadata tells the
    order), so it is accepted and the fc1 branch lands on the wrong halves: the output differs."""
    v, a = run_latents(comfy, graph(turbo="zz_rel_small/ok/diffusers_twin_fc1_swapped.safetensors", tag="swap"))
    assert torch.isfinite(v).all() and torch.isfinite(a).all()
    assert not torch.equal(v, small_ref["v"])
    assert float((v - small_ref["v"]).abs().max()) > 1e-4


def _chain(prompt, class_type, **inputs):
    """Insert a second model node after "2" and route the guider, conditioning and sigmas through it."""
    prompt["17"] = {"class_type": class_type, "inputs": dict(model=["2", 0], **inputs)}
    for n in ("3", "4", "5"):
        prompt[n]["inputs"]["model"] = ["17", 0]
    return prompt


def test_same_adapter_applied_twice_is_applied_once(comfy, rel_models, small_ref):
    """H3TurboLoRA(4step) -> H3TurboLoRA(4step): the second install REPLACES the first (same injection key),
    so the output is bit-identical to one application (not a double-strength branch)."""
    v, a = run_latents(comfy, _chain(graph(tag="twice"), "H3TurboLoRA", turbo=SMALL_4, strength=1.0))
    assert torch.equal(v, small_ref["v"]) and torch.equal(a, small_ref["a"])


def test_second_turbo_adapter_replaces_the_first(comfy, rel_models):
    """H3TurboLoRA(4step) -> H3TurboLoRA(8step) equals 8step alone (contract and branch of the last one)."""
    v8, a8 = run_latents(comfy, graph(turbo=SMALL_8, tag="ref8"))
    v, a = run_latents(comfy, _chain(graph(tag="48"), "H3TurboLoRA", turbo=SMALL_8, strength=1.0))
    assert torch.equal(v, v8) and torch.equal(a, a8)


def test_stacking_a_second_turbo_adapter_is_reported(comfy, rel_models, caplog):
    import logging

    from h3_turbo.harness import PromptFailed

    caplog.set_level(logging.INFO, logger="h3_turbo")
    try:
        # strength 0.999: inputs no other test uses, so ComfyUI's cache cannot skip the node's execution
        comfy.run(_chain(graph(tag="48log"), "H3TurboLoRA", turbo=SMALL_8, strength=0.999))
    except PromptFailed as e:
        assert "already" in str(e) and "4step" in str(e)
        return
    assert any("already" in r.getMessage() and "4step" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_turbo_branch_plus_core_merge_of_same_file_is_refused(comfy, rel_models):
    from h3_turbo.harness import PromptFailed

    with pytest.raises(PromptFailed, match="h3rel_small_turbo_4step"):
        comfy.run(_chain(graph(tag="dbl"), "LoraLoaderModelOnly", lora_name=SMALL_4, strength_model=1.0))


# ----------------------------------------------------------------------------------------------- sampling
def _cfg2(p):
    p["13"] = {"class_type": "H3TurboTestConditioning", "inputs": {"model": ["2", 0], "seed": 1, "tokens": 16}}
    p["4"] = {"class_type": "CFGGuider", "inputs": {"model": ["2", 0], "positive": ["3", 0], "negative": ["13", 0],
                                                    "cfg": 2.0}}
    return p


def _easycache(p):
    p["14"] = {"class_type": "EasyCache", "inputs": {"model": ["2", 0], "reuse_threshold": 0.2, "start_percent": 0.15,
                                                     "end_percent": 0.95, "verbose": False}}
    p["4"]["inputs"]["model"] = ["14", 0]
    return p


def _sigmashift(p):
    p["15"] = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["2", 0], "shift_video": 12.0,
                                                               "shift_audio": 3.0}}
    p["4"]["inputs"]["model"] = ["15", 0]
    p["5"]["inputs"]["model"] = ["15", 0]
    return p


def _basic_scheduler_5(p):
    p["5"] = {"class_type": "BasicScheduler", "inputs": {"model": ["2", 0], "scheduler": "simple", "steps": 5,
                                                         "denoise": 1.0}}
    return p


WHO = "Turbo 'h3rel_small_turbo_4step.safetensors' (4step, shifts 6/3)"
SAMPLING_CASES = {
    "steps_n_plus_1_sigmas_node": (
        lambda p: p, {"steps": 5}, "H3TurboSigmas",
        "H3 Turbo Sigmas: Turbo 'h3rel_small_turbo_4step.safetensors' (4step) wants 4 model evaluations, got steps=5. "
        "Set steps to 4 or 0 (= the contract's). You gave grid points, not model evaluations: 4 evaluations use 5 "
        "sigmas, and ComfyUI's steps count evaluations."),
    "steps_n_plus_1_core_scheduler": (
        _basic_scheduler_5, {}, "SamplerCustomAdvanced",
        f"H3 Turbo Sampler: {WHO} wants 4 model evaluations (a 5-point sigma grid), but the SIGMAS have 6 points = 5 "
        "model evaluations. You gave grid points, not model evaluations: ComfyUI's steps count model calls, set steps "
        "to 4 (not 5)."),
    "cfg_2": (
        _cfg2, {}, "SamplerCustomAdvanced",
        f"H3 Turbo Sampler: {WHO} is guidance-distilled and runs without CFG, but the guider CFGGuider has cfg=2. "
        "Use BasicGuider (or CFGGuider with cfg 1.0)."),
    "easycache": (
        _easycache, {}, "SamplerCustomAdvanced",
        f"H3 Turbo Sampler: the MODEL carries the denoiser cache EasyCache, which skips or reuses model evaluations; "
        f"{WHO} takes only 4 steps and each must be a real model evaluation. Remove the EasyCache node from the MODEL "
        "path."),
    "sigmashift_disagrees": (
        _sigmashift, {}, "SamplerCustomAdvanced",
        f"H3 Turbo Sampler: the MODEL's model_sampling patch (ModelSamplingMiniMaxH3 / ModelSamplingAV) disagrees "
        f"with {WHO}: shift_video 12 (contract 6). Set ModelSamplingMiniMaxH3 to 6/3 or remove it."),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_turbo_contract_violation_through_graph(comfy, rel_models, small_ref, case):
    edit, kw, node_type, want = SAMPLING_CASES[case]
    before = _fp(small_ref["mp"])
    msg = expect_failure(comfy, edit(graph(tag=case, **kw)), node_type)
    assert msg.strip() == want
    assert _fp(small_ref["mp"]) == before


def test_frame_count_not_17k_plus_5_is_snapped_up(comfy, rel_models):
    """length 6 (not 17k+5): core's EmptyMiniMaxH3LatentAV snaps it UP to 22 frames (latent T = 7, audio 37 =
    round(22/24*40)); the result is bit-identical to asking for 22. No error, no warning: core's documented
    behaviour ("Duration snaps to the model's 17k+5 frame grid")."""
    v6, a6 = run_latents(comfy, graph(length=6, tag="len6"))
    v22, a22 = run_latents(comfy, graph(length=22, tag="len22"))
    assert tuple(v6.shape) == (1, 24, 7, 4, 4) and tuple(a6.shape) == (1, 32, 2, 37)
    assert torch.equal(v6, v22) and torch.equal(a6, a22)


def test_batch_2_via_core_repeat_latent_batch(comfy, rel_models, small_ref):
    """Core's RepeatLatentBatch cannot batch an H3 AV latent at all (a core limitation): the prompt fails in
    that node with core's AttributeError text, before any model is touched."""
    p = graph(tag="b2r")
    p["16"] = {"class_type": "RepeatLatentBatch", "inputs": {"samples": ["8", 0], "amount": 2}}
    p["9"]["inputs"]["latent_image"] = ["16", 0]
    before = _fp(small_ref["mp"])
    msg = expect_failure(comfy, p, "RepeatLatentBatch")
    assert msg.strip() == "'NestedTensor' object has no attribute 'repeat'"
    assert _fp(small_ref["mp"]) == before


def test_batch_2_latent_gets_a_clear_message(comfy, rel_models, small_ref):
    """A batch-2 H3 AV latent (core's own ``_empty_av_latent(..., batch_size=2)``, through a test node): the user
    sees core's "MiniMax H3 supports batch size 1" from SamplerCustomAdvanced, and the model is unchanged."""
    import nodes

    class H3RelBatch2Latent:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"length": ("INT", {"default": 5, "min": 5, "max": 100})}}

        RETURN_TYPES = ("LATENT",)
        FUNCTION = "make"
        CATEGORY = "testing"

        def make(self, length):
            from comfy_extras.nodes_minimax_h3 import _empty_av_latent

            return (_empty_av_latent(64, 64, length, batch_size=2)[0],)

    nodes.NODE_CLASS_MAPPINGS["H3RelBatch2Latent"] = H3RelBatch2Latent
    try:
        p = graph(tag="b2")
        p["8"] = {"class_type": "H3RelBatch2Latent", "inputs": {"length": 5}}
        before = _fp(small_ref["mp"])
        msg = expect_failure(comfy, p, "SamplerCustomAdvanced")
        assert "MiniMax H3 supports batch size 1" in msg, msg
        assert _fp(small_ref["mp"]) == before
    finally:
        nodes.NODE_CLASS_MAPPINGS.pop("H3RelBatch2Latent", None)


def test_after_the_corpus_the_model_samples_bit_identically(comfy, rel_models, small_ref):
    """Last: after every failure above, the same request still gives the very same latents."""
    v, a = run_latents(comfy, graph(tag="after"))
    assert torch.equal(v, small_ref["v"]) and torch.equal(a, small_ref["a"])


# ----------------------------------------------------------------------------------------------- fingerprint
def test_model_fingerprint_sees_each_kind_of_change(comfy, rel_models, small_ref):
    """The helper is not blind: a parameter byte, a weight patch, an object patch, a model_options entry and an
    injection each change the fingerprint (on clones / restored copies: the shared model is left as it was)."""
    import comfy.patcher_extension as pe

    mp = small_ref["mp"]
    base = model_fingerprint(mp)
    c = mp.clone()
    assert model_fingerprint(c) == base
    k = "diffusion_model.blocks.0.norm1.weight"
    c.add_patches({k: (torch.zeros_like(mp.model.state_dict()[k]),)}, 1.0)
    assert model_fingerprint(c) != base
    c = mp.clone()
    c.add_object_patch("model_sampling", object())
    assert model_fingerprint(c) != base
    c = mp.clone()
    c.model_options["h3rel_probe"] = 1
    assert model_fingerprint(c) != base
    c = mp.clone()
    c.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "t", lambda ex, *a, **kw: ex(*a, **kw))
    assert model_fingerprint(c) != base
    c = mp.clone()
    c.add_callback_with_key(pe.CallbacksMP.ON_PRE_RUN, "t", lambda *a: None)
    assert model_fingerprint(c) != base
    c = mp.clone()
    c.set_injections("t", [pe.PatcherInjection(inject=lambda *a: None, eject=lambda *a: None)])
    assert model_fingerprint(c) != base
    c = mp.clone()
    c.set_additional_models("t", [mp])
    assert model_fingerprint(c) != base
    p = mp.model.diffusion_model.blocks[0].norm1.weight
    old = p.data.clone()
    try:
        p.data.view(torch.uint8).view(-1)[0] ^= 1
        assert model_fingerprint(mp) != base
    finally:
        p.data.copy_(old)
    assert model_fingerprint(mp) == base
