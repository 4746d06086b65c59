"""Issue 18 (reliability round 2), in-process: each case through the REAL ComfyUI graph (``comfy.run`` ->
ComfyUI's validate_prompt + PromptExecutor) with the exact message asserted and the loaded model's fingerprint
unchanged (``test_reliability._fp``), plus the CLI cases of ``python -m h3_turbo.tools``.

Models: the 2+1-block fixture samples (``test_reliability.small_ref`` is its 4-step reference run); the bad
model files are built from the 50+2-block fixtures (``corpus.build_model_corpus_2``); adapters with bad values
are applied to the 50+2-block NVFP4 model without sampling. Items of the issue: 1 contracts of unofficial
adapters, 2 numbers that are not numbers, 3 NaN/Inf anywhere in a checkpoint, 4 tools and file identity,
5 missing blocks, 8 LoRA layouts, 9 newer core's fp16 fc2 path, 11 newer H3 variants (PDD, VSA, Fun ControlNet).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import (ADAPTER_BAD_VALUE_CASES, LAYOUT_CASES, MODEL_CASES_2, _load, _save,  # noqa: E402
                    build_model_corpus_2, model_node, with_vsa_gates)
from test_reliability import (BIG_UNET, SMALL_4, _chain, _fp, big_base, expect_failure, graph,  # noqa: E402,F401
                              loaded_patcher, rel_models, run_latents, small_ref)

pytestmark = pytest.mark.comfyui

CUSTOM = "zz_rel2/my_turbo_lora.safetensors"   # the small 4-step adapter renamed, without contract metadata
SMALL_BF16 = "zz_rel_small/h3rel_small_bf16.safetensors"
SMALL_VSA = "zz_rel2/h3rel_small_bf16_vsa.safetensors"


@pytest.fixture(scope="module")
def rel2(comfy, rel_models, fixtures_dir):
    """Issue 18's files in the reliability models tree: the model corpus 2, the custom adapter, the VSA model."""
    root = Path(rel_models["root"])
    models = build_model_corpus_2(fixtures_dir, str(root / "diffusion_models" / "zz_rel2"))
    small_lora = root / "loras" / SMALL_4
    t, meta = _load(str(small_lora))
    meta.pop("h3_turbo_fixture")
    (root / "loras" / "zz_rel2").mkdir(exist_ok=True)
    custom = _save(t, str(root / "loras" / CUSTOM), meta)
    vsa = with_vsa_gates(str(root / "diffusion_models" / SMALL_BF16), str(root / "diffusion_models" / SMALL_VSA))
    return {"models": models, "custom": custom, "vsa": vsa, "root": root}


def _node_output(comfy, node_id, slot=0):
    entry = comfy.executor.caches.outputs.get_local(node_id)
    assert entry is not None, f"node {node_id} has no cached output"
    return entry.outputs[slot][0]


def _basic_scheduler(p, steps):
    p["5"] = {"class_type": "BasicScheduler", "inputs": {"model": ["2", 0], "scheduler": "simple", "steps": steps,
                                                         "denoise": 1.0}}
    return p


# ----------------------------------------------------------------------------------------------- item 1
def test_unofficial_adapter_carries_no_contract(comfy, rel2):
    """A user's own adapter (custom name, no published SHA-256, no contract metadata) carries NO contract:
    H3 Turbo Sigmas with steps=2 gives 2 evaluations at the model's shift 12 (not "wants 0 evaluations")."""
    from h3_turbo.adapters import contracts
    from h3_turbo.samplers import schedules

    comfy.run(graph(turbo=CUSTOM, steps=2, sample=False, tag="c1"))
    assert torch.equal(_node_output(comfy, "5"), schedules.shifted_grid(2, 12.0, dtype=torch.float32))
    entry = contracts.copy_entry(_node_output(comfy, "2").model_options)
    assert "contract" not in entry and entry["adapter_file"] == "my_turbo_lora.safetensors"


def test_steps_0_without_a_contract_says_what_to_do(comfy, rel2, small_ref):
    before = _fp(small_ref["mp"])
    msg = expect_failure(comfy, graph(turbo=CUSTOM, steps=0, sample=False, tag="c2"), "H3TurboSigmas")
    assert msg == ("H3 Turbo Sigmas: steps=0 means 'the Turbo contract's NFE', but the MODEL carries no Turbo contract "
                   "(its Turbo adapter 'my_turbo_lora.safetensors' carries none (not an official file: pick variant "
                   "4step or 8step on Apply H3 Turbo LoRA to use an official contract)); or set steps > 0.")
    assert _fp(small_ref["mp"]) == before


def test_core_scheduler_and_turbo_sampler_run_an_unofficial_adapter(comfy, rel2):
    """BasicScheduler (2 steps) + H3 Turbo Sampler with the contract-less adapter samples (it used to say "wants 0
    model evaluations (a 1-point sigma grid)")."""
    v, a = run_latents(comfy, _basic_scheduler(graph(turbo=CUSTOM, tag="c3"), 2))
    assert tuple(v.shape) == (1, 24, 2, 4, 4) and torch.isfinite(v).all() and torch.isfinite(a).all()


def test_variant_4step_gives_an_unofficial_adapter_the_official_contract(comfy, rel2, small_ref):
    """variant=4step: the official 4-step contract (4 evaluations at 6/3); the same tensors as the 4-step
    fixture (whose metadata contract is 4 at 6/3) give bit-identical latents."""
    p = graph(turbo=CUSTOM, tag="c4")
    p["2"]["inputs"]["variant"] = "4step"
    v, a = run_latents(comfy, p)
    assert torch.equal(v, small_ref["v"]) and torch.equal(a, small_ref["a"])


def test_variant_contradicting_the_file_is_refused(comfy, rel2, small_ref):
    before = _fp(small_ref["mp"])
    p = graph(tag="c5", sample=False)
    p["2"]["inputs"]["variant"] = "8step"
    msg = expect_failure(comfy, p, "H3TurboLoRA")
    assert msg == ("Apply H3 Turbo LoRA: variant '8step' contradicts 'h3rel_small_turbo_4step.safetensors', whose own "
                   "contract is 4step (4 model evaluations, shifts 6/3, from metadata). Pick 'auto' (or '4step'), or "
                   "'none' to sample without a contract.")
    assert _fp(small_ref["mp"]) == before


def test_variant_none_samples_without_enforcing(comfy, rel2):
    """variant=none on a file with a contract: no contract, so 5 steps (an error under the 4-step contract) run."""
    p = graph(tag="c6", steps=5)
    p["2"]["inputs"]["variant"] = "none"
    v, a = run_latents(comfy, p)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()


def test_sampler_and_sigma_nodes_say_what_they_do_without_a_contract():
    from h3_turbo.nodes.sampler import H3TurboSampler, H3TurboSigmas

    assert H3TurboSigmas.define_schema().description.endswith(
        "Without a Turbo contract (no Turbo LoRA, variant none, or an adapter that is not an official file) steps must "
        "be > 0 and the grid uses the model's video shift.")
    assert H3TurboSampler.define_schema().description.endswith(
        "Without a Turbo contract it steps the SIGMAS it is given, the audio on the grid of the model's shifts, and "
        "enforces nothing (CFG and denoiser caches are then allowed).")


# ----------------------------------------------------------------------------------------------- item 2
def _primitive(p, node, name, class_type, value):
    p["30"] = {"class_type": class_type, "inputs": {"value": value}}
    p[node]["inputs"][name] = ["30", 0]
    return p


@pytest.mark.parametrize("how,value,want", [
    ("json", float("nan"), "strength = nan is not a finite number (expected a number in [-2, 2])"),
    ("link", float("nan"), "strength = nan is not a finite number (expected a number in [-2, 2])"),
    ("link", 1e6, "strength = 1000000.0 is out of range (expected a number in [-2, 2])"),
    ("link", -3.5, "strength = -3.5 is out of range (expected a number in [-2, 2])"),
])
def test_strength_not_a_finite_number_in_range_is_refused(comfy, rel2, small_ref, how, value, want):
    """JSON accepts NaN and ComfyUI's min/max checks let it through; a linked value is not checked at all."""
    before = _fp(small_ref["mp"])
    p = graph(tag="n1", sample=False)
    if how == "json":
        p["2"]["inputs"]["strength"] = value
    else:
        _primitive(p, "2", "strength", "PrimitiveFloat", value)
    assert expect_failure(comfy, p, "H3TurboLoRA") == f"Apply H3 Turbo LoRA: {want}"
    assert _fp(small_ref["mp"]) == before


def test_linked_int_out_of_range_is_refused(comfy, rel2, small_ref):
    before = _fp(small_ref["mp"])
    p = _primitive(graph(tag="n2", sample=False), "5", "steps", "PrimitiveInt", -3)
    assert expect_failure(comfy, p, "H3TurboSigmas") == \
        "H3 Turbo Sigmas: steps = -3 is out of range (expected an integer in [0, 1000])"
    assert _fp(small_ref["mp"]) == before


def test_every_numeric_input_of_every_node_is_checked_in_the_node(comfy):
    """Each io.Float / io.Int input of every pack node is declared in its NUMBERS (same default and range as the
    schema) and execute() refuses NaN, Inf and values outside the range before doing anything else."""
    from comfy_api.latest import io

    from h3_turbo.errors import InputError
    from h3_turbo.nodes import all_nodes

    seen = []
    for cls in all_nodes():
        schema = cls.define_schema()
        for inp in schema.inputs:
            if not isinstance(inp, (io.Float.Input, io.Int.Input)):
                continue
            spec = getattr(cls, "NUMBERS", {}).get(inp.id)
            assert spec is not None, f"{schema.node_id}.{inp.id} is not declared in {cls.__name__}.NUMBERS"
            assert (spec.default, spec.min, spec.max) == (inp.default, inp.min, inp.max), (schema.node_id, inp.id)
            others = {i.id: cls.NUMBERS[i.id].default if i.id in cls.NUMBERS else None
                      for i in schema.inputs if i.id != inp.id and not i.optional}
            for bad in (float("nan"), float("inf"), float("-inf"), spec.max + 1, spec.min - 1):
                with pytest.raises(InputError, match="^" + re.escape(f"{cls.DISPLAY}: {inp.id} = ")):
                    cls.execute(**others, **{inp.id: bad})
            seen.append(f"{schema.node_id}.{inp.id}")
    assert sorted(seen) == ["H3TurboLoRA.strength", "H3TurboSequenceParallel.gpus", "H3TurboSigmas.steps",
                            "H3TurboTestConditioning.seed", "H3TurboTestConditioning.tokens"]


ADAPTER_VALUE_MESSAGES = {
    "alpha_zero": "alpha <= 0 (0 switches the target off, a negative alpha flips the sign of its delta; expected "
                  "alpha > 0): 1 [blocks.1.mlp.fc2: alpha 0]",
    "alpha_negative": "alpha <= 0 (0 switches the target off, a negative alpha flips the sign of its delta; expected "
                      "alpha > 0): 1 [blocks.1.attn.qkv_proj: alpha -12]",
    "lora_nan": "tensors with NaN or Inf values: 1 [diffusion_model.blocks.1.mlp.fc1.lora_B.weight: 1 NaN and 0 Inf "
                "values of 1024 (expected finite values)]",
    "metadata_alpha_zero": "alpha <= 0 (0 switches the target off, a negative alpha flips the sign of its delta; "
                           "expected alpha > 0): 208 [blocks.0.attn.out_proj: alpha 0, blocks.0.attn.qkv_proj: alpha 0,",
    "diffsynth_no_alpha": "targets without alpha (DiffSynth-Studio layout: no alpha tensors and no "
                          "__metadata__['alpha']; the alpha it was trained with is not in the file): 208 "
                          "[blocks.0.attn.out_proj (missing alpha),",
}


@pytest.mark.parametrize("case", ADAPTER_BAD_VALUE_CASES)
def test_adapter_with_bad_values_is_refused(comfy, rel_models, big_base, case):
    from h3_turbo.adapters import residency

    path = rel_models["adapters"][case]
    before = _fp(big_base)
    resident = residency.resident_keys()
    msg = expect_failure(comfy, graph(unet=BIG_UNET, turbo=f"zz_rel/{case}.safetensors", sample=False), "H3TurboLoRA")
    assert msg.startswith(f"Turbo LoRA '{case}.safetensors' is not valid: {ADAPTER_VALUE_MESSAGES[case]}"), msg
    assert msg.endswith(f"File: {path}")
    assert _fp(big_base) == before and residency.resident_keys() == resident


# ----------------------------------------------------------------------------------------------- item 3
VALUE_CASES = {
    "bf16_nan_projection": ("blocks.3.attn.out_proj.weight", "1 NaN and 0 Inf values of 4096 (expected finite values)"),
    "bf16_inf_output_head": ("final_layer.video_out.weight", "0 NaN and 1 Inf values of 6144 (expected finite values)"),
    "nvfp4_nan_output_bias": ("final_layer.audio_out.bias", "1 NaN and 0 Inf values of 32 (expected finite values)"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_nan_or_inf_anywhere_is_refused_by_the_loader(comfy, rel2, small_ref, case):
    """In a projection (quantized on load) or in a weight that is never quantized (an output head), a BF16 or
    an NVFP4 file: one error naming the tensor, before anything is built."""
    from h3_turbo import state

    path = rel2["models"][case]
    key, phrase = VALUE_CASES[case]
    before = _fp(small_ref["mp"])
    n_loaded = len(state.snapshot()["loaded_models"])
    msg = expect_failure(comfy, graph(unet=f"zz_rel2/{case}.safetensors", turbo="none", steps=4, sample=False),
                         "H3TurboNVFP4Loader")
    assert msg == f"{path}: tensor '{key}': {phrase}"
    assert _fp(small_ref["mp"]) == before and len(state.snapshot()["loaded_models"]) == n_loaded


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_nan_or_inf_is_reported_by_inspect(rel2, case, capsys):
    from h3_turbo.tools.__main__ import main

    key, phrase = VALUE_CASES[case]
    assert main(["inspect", rel2["models"][case]]) == 1
    out = capsys.readouterr().out
    assert f"  [error] {key}: {phrase}\n" in out and "RESULT: ERRORS" in out, out


def test_quantize_refuses_nan_without_a_traceback(rel2, tmp_path, capsys):
    from h3_turbo.tools.__main__ import main

    src, dst = rel2["models"]["bf16_nan_projection"], str(tmp_path / "out.safetensors")
    assert main(["quantize", src, dst]) == 1
    err = capsys.readouterr().err
    assert err.endswith(f"error: {src}: tensor 'blocks.3.attn.out_proj.weight': 1 NaN and 0 Inf values of 4096 "
                        "(expected finite values)\n"), err
    assert os.listdir(tmp_path) == []                  # neither the output nor its .part


# ----------------------------------------------------------------------------------------------- item 4
def test_quantize_into_the_input_through_a_symlinked_folder_is_refused(fixtures_dir, tmp_path, capsys):
    from h3_turbo.tools.__main__ import main

    real = tmp_path / "real"
    real.mkdir()
    src = shutil.copy(fixtures_dir["bf16"], real / "h3.safetensors")
    os.symlink(real, tmp_path / "link", target_is_directory=True)
    digest = hashlib.sha256(Path(src).read_bytes()).hexdigest()
    out = str(tmp_path / "link" / "h3.safetensors")
    assert main(["quantize", str(src), out]) == 1
    assert capsys.readouterr().err == (f"error: {src}: the output {out} is this same file (compared by file identity, "
                                       "through links) (expected a different output file)\n")
    assert hashlib.sha256(Path(src).read_bytes()).hexdigest() == digest and sorted(os.listdir(real)) == ["h3.safetensors"]


def test_make_fixtures_into_an_existing_file_is_a_clear_error(tmp_path, capsys):
    from h3_turbo.tools.__main__ import main

    f = tmp_path / "models"
    f.write_text("x")
    assert main(["make-fixtures", str(f)]) == 1
    assert capsys.readouterr().err == (f"error: {f}: is an existing file, not a folder (expected a folder to write the "
                                       "models tree into, e.g. ./h3_fixtures)\n")


# ----------------------------------------------------------------------------------------------- item 5
@pytest.mark.parametrize("case,gone", [("depth_49", "blocks.49"), ("depth_25", "blocks.25..49")])
def test_missing_trailing_blocks_load_with_a_warning(comfy, rel2, caplog, case, gone):
    caplog.set_level(logging.WARNING, logger="h3_turbo")
    comfy.run(graph(unet=f"zz_rel2/{case}.safetensors", turbo="none", steps=4, sample=False))
    n = 49 if case == "depth_49" else 25
    assert len(loaded_patcher(comfy).model.diffusion_model.blocks) == n
    want = (f"{rel2['models'][case]}: [warning] {n} DiT blocks, MiniMax H3 has 50: {gone} absent (a checkpoint shard "
            f"missing?); the model is built {n} blocks deep")
    assert want in [r.getMessage() for r in caplog.records]


def test_a_hole_in_the_block_indices_is_refused_naming_it(comfy, rel2, small_ref):
    before = _fp(small_ref["mp"])
    msg = expect_failure(comfy, graph(unet="zz_rel2/block_hole.safetensors", turbo="none", steps=4, sample=False),
                         "H3TurboNVFP4Loader")
    assert msg.startswith(f"{rel2['models']['block_hole']}: 1 problem(s): [error] DiT blocks missing: blocks.10 (the "
                          "file has blocks.0..49 except these; a checkpoint shard missing?); core would build only "
                          "blocks.0..9 and ignore the rest."), msg
    assert _fp(small_ref["mp"]) == before


# ----------------------------------------------------------------------------------------------- item 8
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_lora_layout_gives_the_official_latents(comfy, rel_models, small_ref, case):
    """kohya, kohya/musubi lora_unet_ (core and Diffusers names), Diffusers names under diffusion_model. / model.,
    DiffSynth-Studio (interleaved qkv rows, de-interleaved): the same adapter, bit-identical latents."""
    v, a = run_latents(comfy, graph(turbo=f"zz_rel_small/ok/{case}.safetensors", tag=case))
    assert torch.equal(v, small_ref["v"]) and torch.equal(a, small_ref["a"])


# ----------------------------------------------------------------------------------------------- item 9
def _fresh(comfy):
    """Forget cached node outputs and loaded models, so the next prompt loads (and injects) again."""
    import comfy.model_management as mm

    comfy.executor.reset()
    with torch.inference_mode():
        mm.unload_all_models()


def _core_bf16_graph(tag):
    p = graph(tag=tag)
    p["1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": SMALL_BF16, "weight_dtype": "default"}}
    return p


def _newer_core_fp16_path(monkeypatch):
    """Make the installed core behave like a newer one (0.35-0.38) whose linear_input_act takes the fp16 fast path
    for plain fc2 weights: ``comfy.ops._fp16_linear_wanted`` exists and answers True, and ``linear_input_act``
    then computes ``fc2(swiglu(h))`` from the cast weight without calling ``fc2.forward``."""
    import comfy.ops
    from comfy.quant_ops import QuantizedTensor

    original = comfy.ops.linear_input_act
    bypassed = []

    def linear_input_act(linear, x, input_act, *args, **kwargs):
        if not isinstance(linear.weight, QuantizedTensor) and comfy.ops._fp16_linear_wanted(x):
            bypassed.append(1)
            w, b = comfy.ops.cast_bias_weight(linear, x)
            return torch.nn.functional.linear(comfy.ops.INPUT_ACT_EAGER[input_act](x), w, b)
        return original(linear, x, input_act, *args, **kwargs)

    monkeypatch.setattr(comfy.ops, "_fp16_linear_wanted", lambda x: True, raising=False)
    monkeypatch.setattr(comfy.ops, "linear_input_act", linear_input_act)
    return bypassed


def test_core_hook_points_are_reported(comfy, capsys):
    """Reads the core in use: which variant of each hook point the pack found (printed; the suite also runs on the
    newer core when one is set up, tests/test_second_core.py)."""
    from h3_turbo.runtime import core_compat

    found = core_compat.hook_points()
    with capsys.disabled():
        print(f"\n[core hook points] {found}")
    assert found["linear_input_act fc2 bypass"] in ("int8", "int8+fp16")
    assert set(found) == {"linear_input_act fc2 bypass", "FinalLayer PDD head banks", "MiniMaxH3FunControlNetApply",
                          "mod_segments modulation rows"}
    import comfy.ldm.minimax.model as core_h3
    import comfy.ops

    assert (found["linear_input_act fc2 bypass"] == "int8+fp16") == hasattr(comfy.ops, "_fp16_linear_wanted")
    # 0.33: one int per segment; cores with _mod_row (2026-08-22 and newer): also a per-token index tensor
    assert found["mod_segments modulation rows"] == ("index|per-token" if hasattr(core_h3, "_mod_row") else "index")


def test_newer_core_fp16_fc2_path_gets_the_mlp_level_branch(comfy, rel_models, monkeypatch):
    """Core's UNETLoader (plain weights) + the 4-step adapter: on a core whose fp16 path skips fc2.forward the
    fc2 branch runs at the MLP level, and the latents equal the run on the installed core bit for bit."""
    _fresh(comfy)
    ref = run_latents(comfy, _core_bf16_graph("fp16ref"))
    _fresh(comfy)
    bypassed = _newer_core_fp16_path(monkeypatch)
    got = run_latents(comfy, _core_bf16_graph("fp16new"))
    _fresh(comfy)
    assert bypassed and all(torch.equal(x, y) for x, y in zip(got, ref))


def test_without_the_mlp_level_branch_the_coverage_check_catches_it(comfy, rel_models, monkeypatch):
    """The hazard item 9 fixes: were the fc2 branch left on fc2.forward, the newer core would skip it; the
    coverage check refuses the run naming the targets."""
    from h3_turbo.harness import PromptFailed
    from h3_turbo.runtime import core_compat

    _fresh(comfy)
    _newer_core_fp16_path(monkeypatch)
    monkeypatch.setattr(core_compat, "fc2_bypass", lambda: "int8")
    with pytest.raises(PromptFailed) as ei:
        comfy.run(_core_bf16_graph("fp16old"))
    _fresh(comfy)
    assert "the branch did not run on 2 of the 8 DiT-block targets in this model call [blocks.0.mlp.fc2, " \
           "blocks.1.mlp.fc2]" in str(ei.value)


# ----------------------------------------------------------------------------------------------- item 11
def test_pdd_head_bank_checkpoint_is_refused_naming_it(comfy, rel2, small_ref):
    before = _fp(small_ref["mp"])
    msg = expect_failure(comfy, graph(unet="zz_rel2/pdd_heads.safetensors", turbo="none", steps=4, sample=False),
                         "H3TurboNVFP4Loader")
    assert msg.startswith(
        f"{rel2['models']['pdd_heads']}: 1 problem(s): [error] final_layer.video_out.weight: final_layer.video_out "
        "has 192 rows = 2 x 96 (video_patch_proj's input width): a PDD head-bank checkpoint (2 output heads per "
        "stream, which newer core's FinalLayer blends per step from the sampler's sigma schedule). This loader does "
        "not support PDD head banks; load the file with core's UNETLoader on a core that has them."), msg
    assert _fp(small_ref["mp"]) == before


def test_vsa_gates_are_left_out_and_the_model_runs_dense(comfy, rel2, caplog):
    """blocks.N.attn.to_gate_compress (FastVideo's VSA gate): core's dense forward ignores it; so does the loader
    (warned), and the latents equal those of the same file without the gates."""
    caplog.set_level(logging.WARNING, logger="h3_turbo")
    p = graph(tag="vsa0")
    p["1"]["inputs"]["unet_name"] = SMALL_BF16
    ref = run_latents(comfy, p)
    p = graph(tag="vsa1")
    p["1"]["inputs"]["unet_name"] = SMALL_VSA
    got = run_latents(comfy, p)
    assert all(torch.equal(x, y) for x, y in zip(got, ref))
    assert any(r.getMessage().startswith(f"{rel2['vsa']}: [warning] 2 blocks carry attn.to_gate_compress (the "
                                         "compression gate of FastVideo's VSA") for r in caplog.records)


class MiniMaxH3FunControlPatch:
    """Stands in for core's (0.37+) class of that name: its bound method is the unkeyed DIFFUSION_MODEL wrapper
    MiniMaxH3FunControlNetApply registers (here it changes nothing)."""

    def diffusion_model_wrapper(self, executor, *args, **kwargs):
        return executor(*args, **kwargs)


def _fun_controlnet(comfy, p, variant=None):
    import nodes

    def add_fun_control(m):
        import comfy.patcher_extension as pe

        m.add_wrapper(pe.WrappersMP.DIFFUSION_MODEL, MiniMaxH3FunControlPatch().diffusion_model_wrapper)

    H3RelFunControlNetApply = model_node(add_fun_control, "Test-only: core's Fun ControlNet wrapper on the MODEL.",
                                         name="H3RelFunControlNetApply")

    nodes.NODE_CLASS_MAPPINGS["H3RelFunControlNetApply"] = H3RelFunControlNetApply
    _chain(p, "H3RelFunControlNetApply")
    if variant:
        p["2"]["inputs"]["variant"] = variant
    return p


def test_fun_controlnet_under_a_turbo_contract_is_refused_saying_why(comfy, rel2, small_ref):
    before = _fp(small_ref["mp"])
    msg = expect_failure(comfy, _fun_controlnet(comfy, graph(tag="fun")), "SamplerCustomAdvanced")
    assert msg == ("H3 Turbo Sampler: Turbo 'h3rel_small_turbo_4step.safetensors' (4step, shifts 6/3) refuses the Fun "
                   "ControlNet (core's MiniMaxH3FunControlNetApply: an unkeyed DIFFUSION_MODEL wrapper of "
                   "MiniMaxH3FunControlPatch that adds control residuals to the DiT blocks). The Turbo adapter was "
                   "distilled without control injection, so its contract (4 steps at shifts 6/3) is not known to hold "
                   "with it. Pick variant 'none' on Apply H3 Turbo LoRA to sample without the contract, or remove the "
                   "ControlNet.")
    assert _fp(small_ref["mp"]) == before


def test_fun_controlnet_without_a_contract_samples(comfy, rel2):
    v, a = run_latents(comfy, _fun_controlnet(comfy, graph(tag="fun0", steps=4), variant="none"))
    assert torch.isfinite(v).all() and torch.isfinite(a).all()


def test_corpus_2_is_complete(rel2):
    assert set(rel2["models"]) == set(MODEL_CASES_2)


# ----------------------------------------------------------------------------------------------- item 6
def test_saved_workflow_without_new_inputs_runs(comfy, rel_models, small_ref):
    """A prompt saved before state_dtype (H3TurboSampler) and variant (H3TurboLoRA) existed runs with their
    defaults (fp32, auto): the latents equal the reference run that sets them (tests/test_saved_workflows.py
    validates the saved files themselves)."""
    p = graph(tag="saved")
    p["6"]["inputs"].pop("state_dtype")
    assert "variant" not in p["2"]["inputs"] and p["6"]["inputs"] == {}
    v, a = run_latents(comfy, p)
    assert torch.equal(v, small_ref["v"]) and torch.equal(a, small_ref["a"])
