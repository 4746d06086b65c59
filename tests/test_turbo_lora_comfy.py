"""``H3TurboLoRA`` through the real ComfyUI (CPU, tiny fixtures): full sampling runs and in-process checks.

Bounds used here (CPU runs compute in fp32: ComfyUI loads the BF16/NVFP4 fixtures with fp32 compute):
- branch vs core's merged ``LoraLoaderModelOnly`` on the BF16 fixture, 4 Euler steps: the two differ
  only by fp32 rounding order (merged W' = W + s*B@A vs W@x + s*B@(A@x)), measured 1.5e-7..2.3e-7
  relative (4step, 128x96x22); bound: max|diff| <= 1e-5 * max|latent| (a bf16-ish bound would be
  2^-8 = 3.9e-3). The Turbo effect itself (vs base) is ~2e-2 (4step) / ~1e-3 (8step), asserted.
- disabled paths (turbo none, strength 0): bit-identical to the prompt without the node.
"""
from __future__ import annotations

import os

import pytest
import torch

from corpus import euler_av_prompt  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.comfyui

LORA4 = "h3_tiny_turbo_4step_comfyui_bf16.safetensors"
LORA8 = "h3_tiny_turbo_8step_comfyui_bf16.safetensors"


def _prompt(unet="h3_tiny_bf16.safetensors", lora=None, steps=4, shifts=(6.0, 3.0), tag="x"):
    """API prompt (the tiny-demo graph with core euler); ``lora`` = None | ("turbo", turbo, strength) | ("core", file, s)."""
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
         **euler_av_prompt(["2", 0], steps=steps, shifts=shifts, tokens=16,
                           prefixes=(f"h2lora/{tag}_v", f"h2lora/{tag}_a"))}
    if lora is None:
        p["3"]["inputs"]["model"] = ["1", 0]
    elif lora[0] == "turbo":
        p["2"] = {"class_type": "H3TurboLoRA", "inputs": {"model": ["1", 0], "turbo": lora[1], "strength": lora[2]}}
    else:
        p["2"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora[1],
                                                                  "strength_model": lora[2]}}
    return p


def _run(comfy, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Run and return (video latent, audio latent) as saved by SaveLatent."""
    v, a = comfy.run_latents(prompt, ("12", "13"))
    return v, a


_MEMO: dict[str, tuple] = {}


def _run_memo(comfy, prompt):
    """:func:`_run` once per distinct prompt (runs are deterministic; saves CPU time across tests)."""
    import json

    key = json.dumps({k: v for k, v in prompt.items() if k not in ("12", "13")}, sort_keys=True)
    if key not in _MEMO:
        _MEMO[key] = _run(comfy, prompt)
    return _MEMO[key]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(scope="module")
def base_run(comfy):
    return _run_memo(comfy, _prompt(tag="base"))


def test_turbo_none_and_strength_zero_bit_identical(comfy, base_run):
    from h3_turbo import state

    before = state.snapshot()["current_turbo"]
    for lora in (("turbo", "none", 1.0), ("turbo", "4step", 0.0)):
        v, a = _run(comfy, _prompt(lora=lora, tag="none"))
        assert torch.equal(v, base_run[0]) and torch.equal(a, base_run[1]), lora
    # Turbo off through core's sampler installs no branch, so these runs either report "none" or leave the value of
    # whichever run came before (which depends on the tests selected); they never report an adapter themselves
    assert state.snapshot()["current_turbo"] in ("none", before)


@pytest.mark.parametrize("off", [("none", 1.0), ("4step", 0.0)])
def test_turbo_off_after_an_upstream_turbo_node_restores_the_base(comfy, base_run, off):
    """H3TurboLoRA(4step) -> H3TurboLoRA(none | strength 0): Turbo is switched OFF (the branch, its wrappers,
    the adapter model and the contract are removed): the sample is bit-identical to the base, and differs
    from the 4-step sample (so the test can fail)."""
    p = _prompt(lora=("turbo", "4step", 1.0), tag=f"off{off[1]}")
    p["2b"] = {"class_type": "H3TurboLoRA", "inputs": {"model": ["2", 0], "turbo": off[0], "strength": off[1]}}
    p["3"]["inputs"]["model"] = ["2b", 0]
    v, a = _run(comfy, p)
    assert torch.equal(v, base_run[0]) and torch.equal(a, base_run[1])
    on = _run_memo(comfy, _prompt(lora=("turbo", "4step", 1.0), tag="t4step"))
    assert not torch.equal(on[0], v)


def test_uninstall_removes_exactly_what_install_added(comfy, fixtures_dir):
    import nodes

    from h3_turbo.adapters import contracts, residency
    from h3_turbo.nodes.lora import H3TurboLoRA

    (base,) = nodes.UNETLoader().load_unet(os.path.basename(fixtures_dir["bf16"]), "default")
    contracts.attach(base, None, compute="reference")  # a non-Turbo entry of the pack must survive
    on = H3TurboLoRA.execute(base, "4step", 1.0).args[0]
    off = H3TurboLoRA.execute(on, "none", 1.0).args[0]
    assert off is not on and residency.uninstall(off.clone()) is None
    assert off.model_options[contracts.MODEL_OPTIONS_KEY] == {"compute": "reference"}
    assert contracts.get(off.model_options) is None
    assert off.get_injections(residency.WRAPPER_KEY) is None
    assert off.get_additional_models_with_key(residency.WRAPPER_KEY) == []
    assert contracts.get(on.model_options) is not None  # the upstream MODEL is unchanged


@pytest.mark.parametrize("turbo,file,steps,shifts,effect", [("4step", LORA4, 4, (6.0, 3.0), 5e-3),
                                                            ("8step", LORA8, 4, (6.0, 3.0), 2e-4)])
def test_branch_matches_core_merged_lora_bf16(comfy, turbo, file, steps, shifts, effect):
    """Same sample as core's merged LoraLoaderModelOnly (which also reads alpha per tensor): a 16x error on
    the 1/16 file would show as a difference ~15x the adapter's effect, the bound is 1e-5 relative.
    Both adapters run 4 Euler steps at shifts 6/3 (the comparison, not the 8-step contract, is the subject;
    this also reuses the base run)."""
    from h3_turbo import state

    ours = _run_memo(comfy, _prompt(lora=("turbo", turbo, 1.0), steps=steps, shifts=shifts, tag=f"t{turbo}"))
    assert state.snapshot()["current_turbo"] == turbo
    core = _run_memo(comfy, _prompt(lora=("core", file, 1.0), steps=steps, shifts=shifts, tag=f"c{turbo}"))
    base = _run_memo(comfy, _prompt(steps=steps, shifts=shifts, tag=f"b{turbo}"))
    for o, c, b in zip(ours, core, base):
        assert torch.isfinite(o).all()
        assert _rel(o, c) <= 1e-5, _rel(o, c)
        assert _rel(o, b) > effect  # the adapter does change the sample (so the comparison can fail)


def test_nvfp4_model_runs_with_branch(comfy, base_run):
    """A full run on core's NVFP4 model passes the per-call and per-run coverage checks and lands near the
    BF16 base + branch (FP4 weight error only; the layer-level delta on NVFP4 is checked exactly below)."""
    ours = _run_memo(comfy, _prompt(unet="h3_tiny_nvfp4.safetensors", lora=("turbo", "4step", 1.0), tag="nt"))
    bf16 = _run_memo(comfy, _prompt(lora=("turbo", "4step", 1.0), tag="bt"))
    for o, r, b in zip(ours, bf16, base_run):
        assert torch.isfinite(o).all()
        assert _rel(o, r) < 0.25 and _rel(o, r) < _rel(o, b)  # nearer BF16+branch than the BF16 base


def _loaded_clone(unet, turbo, strength=1.0):
    import comfy.model_management as mm
    import nodes

    from h3_turbo.nodes.lora import H3TurboLoRA

    base = nodes.UNETLoader().load_unet(unet, "default")[0]
    out = H3TurboLoRA.execute(model=base, turbo=turbo, strength=strength)
    clone = out.result[0] if hasattr(out, "result") else out[0]
    mm.load_models_gpu([clone])
    return base, clone


@pytest.mark.parametrize("unet", ["h3_tiny_bf16.safetensors", "h3_tiny_nvfp4.safetensors"])
def test_layer_delta_on_loaded_model_and_pre_quant_scale(comfy, fixtures_dir, unet):
    """On core's loaded BF16 and NVFP4 layers: delta == float64 s*B@A@x on each kind; a pre_quant_scale set
    on the layer changes the base output but not the branch (x is the activation entering the layer)."""
    import comfy.model_management as mm

    from h3_turbo.adapters import contracts, turbo_lora

    base, clone = _loaded_clone(unet, "8step")
    assert base.model_options.get(contracts.MODEL_OPTIONS_KEY) is None  # input untouched
    c = contracts.get(clone.model_options)
    assert (c.variant, c.nfe, c.shift_video) == ("8step", 8, 12.0)
    assert clone.model_options["h3_turbo"]["adapter"] == "8step"
    extra = clone.get_additional_models_with_key("h3turbo_lora")
    assert len(extra) == 1 and extra[0].model_size() == sum(
        p.numel() * p.element_size() for p in extra[0].model.parameters())
    # comfy.sampler_helpers.prepare_sampling loads [model] + get_nested_additional_models() together
    assert any(m.model is extra[0].model for m in clone.get_nested_additional_models())
    mm.load_models_gpu([clone] + clone.get_nested_additional_models())
    assert any(lm.model.model is extra[0].model for lm in mm.current_loaded_models)
    lora = turbo_lora.load_turbo_lora(fixtures_dir["lora_8step"])
    dm = clone.model.diffusion_model
    g = torch.Generator().manual_seed(0)
    for tgt in ("blocks.0.attn.qkv_proj", "blocks.20.attn.out_proj", "blocks.33.mlp.fc1", "token_refiner.blocks.1.mlp.fc2"):
        mod = dm.get_submodule(tgt)
        x = torch.randn(9, mod.in_features, generator=g)
        with torch.no_grad():
            y = mod(x)
            yb = type(mod).forward(mod, x)
            tl = lora.targets[tgt]
            ref = tl.scale * (x.double() @ tl.A.double().T @ tl.B.double().T)
            assert ((y.double() - yb.double()) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), tgt
            if "nvfp4" not in unet:
                continue  # core applies pre_quant_scale only in its mixed-precision (quantized) Linear
            mod.pre_quant_scale = torch.linspace(0.5, 2.0, mod.in_features)
            try:
                y2, yb2 = mod(x), type(mod).forward(mod, x)
            finally:
                del mod.pre_quant_scale
            assert not torch.equal(yb2, yb)
            assert ((y2.double() - yb2.double()) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), tgt
    mm.load_models_gpu([base])  # loading the base detaches the clone: forward restored
    assert all("forward" not in dm.get_submodule(t).__dict__ for t in lora.targets)


def test_node_none_passes_input_through(comfy):
    import nodes

    from h3_turbo.nodes.lora import H3TurboLoRA

    base = nodes.UNETLoader().load_unet("h3_tiny_bf16.safetensors", "default")[0]
    for turbo, s in (("none", 1.0), ("4step", 0.0)):
        out = H3TurboLoRA.execute(model=base, turbo=turbo, strength=s)
        m = out.result[0] if hasattr(out, "result") else out[0]
        assert m is base and "h3_turbo" not in m.model_options


def test_switching_4_8_none_without_reload(comfy, base_run):
    """4step -> 8step -> none -> 4step on one loaded base (4 Euler steps each, to keep CPU time
    low; the sampler contract is not this test's subject): the base is never reloaded, each adapter is
    read from disk once, and each setting reproduces its own result bit for bit (no leftover branch)."""
    from h3_turbo.adapters import residency

    residency.clear()
    residency.LOAD_STATS.update(loads=0, hits=0)
    outs = {}
    for i, turbo in enumerate(("4step", "8step", "none", "4step")):
        outs.setdefault(turbo, []).append(_run(comfy, _prompt(lora=("turbo", turbo, 1.0), tag="s")))
        executed = [n for n, _ in comfy.node_times()]
        assert "10" in executed  # really sampled
        if i:
            assert "1" not in executed, "the base model was reloaded"
    assert residency.LOAD_STATS["loads"] == 2  # each adapter read from disk once
    assert torch.equal(outs["4step"][0][0], outs["4step"][1][0]) and torch.equal(outs["4step"][0][1], outs["4step"][1][1])
    assert not torch.equal(outs["4step"][0][0], outs["8step"][0][0])
    assert torch.equal(outs["none"][0][0], base_run[0]) and torch.equal(outs["none"][0][1], base_run[1])


def test_coverage_fires_when_foreign_patch_takes_a_layer(comfy, base_run):
    """A foreign injection that replaces blocks.3.mlp.fc2's forward (not calling ours) makes the run fail,
    naming the layer; a later run without it is clean again."""
    import nodes
    from comfy.patcher_extension import PatcherInjection
    from comfy_api.latest import io

    from h3_turbo.harness import PromptFailed

    class H3TurboTestForeignPatch(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id="H3TurboTestForeignPatch", category="testing",
                             inputs=[io.Model.Input("model")], outputs=[io.Model.Output()])

        @classmethod
        def execute(cls, model):
            m = model.clone()
            saved = {}

            def inject(mp):
                lin = mp.model.diffusion_model.blocks[3].mlp.fc2
                saved["f"] = lin.__dict__.get("forward")
                lin.forward = lambda x, *a, **k: type(lin).forward(lin, x, *a, **k)

            def eject(mp):
                lin = mp.model.diffusion_model.blocks[3].mlp.fc2
                if saved.get("f") is None:
                    lin.__dict__.pop("forward", None)
                else:
                    lin.forward = saved["f"]

            m.set_injections("zz_foreign", [PatcherInjection(inject, eject)])
            return io.NodeOutput(m)

    nodes.NODE_CLASS_MAPPINGS["H3TurboTestForeignPatch"] = H3TurboTestForeignPatch
    try:
        p = _prompt(lora=("turbo", "4step", 1.0), tag="f")
        p["2b"] = {"class_type": "H3TurboTestForeignPatch", "inputs": {"model": ["2", 0]}}
        p["3"]["inputs"]["model"] = ["2b", 0]
        with pytest.raises(PromptFailed, match=r"did not run on 1 of the 200 DiT-block targets.*\[blocks.3.mlp.fc2\]"):
            comfy.run(p)
    finally:
        nodes.NODE_CLASS_MAPPINGS.pop("H3TurboTestForeignPatch", None)
    v, a = _run(comfy, _prompt(tag="after"))
    assert torch.equal(v, base_run[0]) and torch.equal(a, base_run[1])


def test_bad_adapter_in_loras_folder_fails_prompt_and_leaves_model(comfy, fixtures_dir, base_run):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3_turbo.harness import PromptFailed

    with safe_open(fixtures_dir["lora_4step"], framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys() if "blocks.7." not in k}
        meta = f.metadata()
    bad = os.path.join(os.path.dirname(fixtures_dir["lora_4step"]), "zz_bad_turbo.safetensors")
    save_file(t, bad, metadata=meta)
    try:
        with pytest.raises(PromptFailed, match=r"zz_bad_turbo.safetensors.*missing targets: 4 \[blocks.7"):
            comfy.run(_prompt(lora=("turbo", "zz_bad_turbo.safetensors", 1.0), tag="bad"))
    finally:
        os.remove(bad)


def _int8_fc2_model(fixtures_dir) -> str:
    """The BF16 fixture with every mlp.fc2 in core's INT8 tensor-wise format (comfy-kitchen quantizer);
    written once next to the fixtures. Returns the file name for UNETLoader."""
    import json

    from comfy_kitchen.tensor import TensorWiseINT8Layout
    from safetensors.torch import load_file, save_file

    name = "h3_tiny_int8fc2_test.safetensors"
    path = os.path.join(os.path.dirname(fixtures_dir["bf16"]), name)
    if not os.path.exists(path):
        sd = load_file(fixtures_dir["bf16"])
        marker = torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8)
        for k in [k for k in sd if k.endswith("mlp.fc2.weight")]:
            q, params = TensorWiseINT8Layout.quantize(sd[k])
            sd[k] = q.contiguous()
            sd[k[:-len("weight")] + "weight_scale"] = params.scale.float().reshape(()).contiguous()
            sd[k[:-len("weight")] + "comfy_quant"] = marker.clone()
        save_file(sd, path)
    return name


def test_int8_fused_fc2_branch_applied_at_mlp_level(comfy, fixtures_dir):
    """Hazard H1: core computes an INT8 tensor-wise fc2 inside linear_input_act without calling fc2.forward
    (asserted with a spy, so this test notices if core changes). The branch then rides on the MLP: its
    output == linear_input_act(fc2, h, swiglu) + s*B2@A2@swiglu(h), h = fc1(x) with fc1's own branch;
    a full sampling run passes the coverage check."""
    import comfy.model_management as mm
    import nodes
    from comfy.ops import INPUT_ACT_EAGER, linear_input_act

    from h3_turbo.adapters import turbo_lora
    from h3_turbo.nodes.lora import H3TurboLoRA

    unet = _int8_fc2_model(fixtures_dir)
    base = nodes.UNETLoader().load_unet(unet, "default")[0]
    mm.load_models_gpu([base])
    dm = base.model.diffusion_model
    fc2 = dm.blocks[5].mlp.fc2
    assert getattr(fc2.weight, "_layout_cls", None) == "TensorWiseINT8Layout"
    calls = []
    fc2.forward = lambda x, *a, **k: (calls.append(1), type(fc2).forward(fc2, x, *a, **k))[1]
    x = torch.randn(6, fc2.out_features, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        dm.blocks[5].mlp(x)
    del fc2.forward
    assert calls == []  # H1 holds in this core: fc2.forward is bypassed

    out = H3TurboLoRA.execute(model=base, turbo="4step", strength=1.0)
    clone = out.result[0] if hasattr(out, "result") else out[0]
    mm.load_models_gpu([clone])
    mlp = dm.blocks[5].mlp
    assert "forward" in mlp.__dict__ and "forward" not in fc2.__dict__
    tl = turbo_lora.load_turbo_lora(fixtures_dir["lora_4step"]).targets["blocks.5.mlp.fc2"]
    with torch.no_grad():
        got = mlp(x)
        h = mlp.fc1(x)
        act = INPUT_ACT_EAGER["swiglu"](h)
        base_part = linear_input_act(fc2, h, "swiglu")
        ref = base_part.double() + tl.scale * (act.double() @ tl.A.double().T @ tl.B.double().T)
    d = (ref - base_part.double()).abs().max().item()
    assert d > 1e-3 * base_part.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    mm.load_models_gpu([base])
    assert "forward" not in mlp.__dict__

    v, a = _run(comfy, _prompt(unet=unet, lora=("turbo", "4step", 1.0), tag="int8"))
    assert torch.isfinite(v).all() and torch.isfinite(a).all()


def _bad_files(fixtures_dir) -> dict[str, tuple[dict, dict, str]]:
    """{kind: (tensors, metadata, expected message regex)} of broken adapters built from the 4-step fixture."""
    import dataclasses

    from safetensors import safe_open

    from h3_turbo.tools.fixtures import TinyH3Config, make_turbo_lora

    with safe_open(fixtures_dir["lora_4step"], framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    out = {}
    out["missing"] = ({k: v for k, v in t.items() if "blocks.7." not in k}, meta, r"missing targets: 4 \[blocks.7")
    adaln = dict(t)
    adaln["diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight"] = torch.zeros(4, 32, dtype=torch.bfloat16)
    out["adaln"] = (adaln, meta, r"outside the 208 block projections.*different base")
    wide, wmeta = make_turbo_lora({}, dataclasses.replace(TinyH3Config(), hidden=96))
    out["dims"] = (wide, wmeta, r"wrong hidden sizes: 208 .*different H3")
    noalpha = {k: v for k, v in t.items() if not k.endswith("blocks.2.mlp.fc1.alpha")}
    out["alpha_missing"] = (noalpha, meta, r"without rank/alpha.*blocks.2.mlp.fc1 \(missing alpha\)")
    disagree = dict(t)
    disagree["diffusion_model.blocks.9.attn.out_proj.alpha"] = torch.tensor(1.0)
    out["alpha_meta"] = (disagree, meta, r"disagreeing with __metadata__ training_scale 1")
    return out


@pytest.mark.parametrize("kind", ["missing", "adaln", "dims", "alpha_missing", "alpha_meta"])
def test_bad_adapter_refused_model_untouched(comfy, fixtures_dir, kind):
    import nodes
    from safetensors.torch import save_file

    from h3_turbo.adapters import residency
    from h3_turbo.adapters.turbo_lora import TurboLoRAError
    from h3_turbo.nodes.lora import H3TurboLoRA

    tensors, meta, pattern = _bad_files(fixtures_dir)[kind]
    name = f"zz_bad_{kind}.safetensors"
    path = os.path.join(os.path.dirname(fixtures_dir["lora_4step"]), name)
    save_file(tensors, path, metadata=meta)
    try:
        base = nodes.UNETLoader().load_unet("h3_tiny_bf16.safetensors", "default")[0]
        opts_before = repr(base.model_options)
        with pytest.raises(TurboLoRAError, match=pattern) as ei:
            H3TurboLoRA.execute(model=base, turbo=name, strength=1.0)
        assert name in str(ei.value)
        assert repr(base.model_options) == opts_before and base.injections == {} and base.additional_models == {}
        dm = base.model.diffusion_model
        assert not any("forward" in m.__dict__ for m in dm.modules())
        assert all(r.file != name for r in residency._cache.values())
    finally:
        os.remove(path)
