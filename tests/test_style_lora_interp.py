"""A core-loaded style LoRA beside ``H3TurboLoRA`` on the kernel paths, on the CPU under TRITON_INTERPRET=1.

The small NVFP4 fixture (2+1 blocks) loaded by the pack's loader, a style LoRA loaded by core (merged:
``comfy.sd.load_lora_for_models``; bypass: ``load_bypass_lora_for_models``), the Turbo branch on top, the MODEL
loaded by ComfyUI (which patches the merged weights). Then the four NVFP4 projections of a DiT block and of a
refiner block run the same bf16 input on ``exact`` and ``fp8`` (resident and lean weights; the kernels themselves
run, counted) and on the reference path (core's dequantize + matmul of the same, patched, weight):

- kernel path vs reference path: relative L2 < the path's ``error_bound`` on every layer (exact 1e-2, fp8 5e-2);
- the style LoRA's effect (reference with vs without it, Turbo on in both) >= 10x that bound on every layer, so a
  kernel weight prepared before the patch (or a bypass wrapper skipped) would fail the first check.

Run through tests/test_style_lora.py::test_style_lora_on_kernel_paths_interpreted; collected in-process without
that variable, the module skips itself.
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: run via "
                "tests/test_style_lora.py::test_style_lora_on_kernel_paths_interpreted", allow_module_level=True)

import torch  # noqa: E402

from corpus import write_small_fixtures  # noqa: E402  (tests/ is on sys.path)
from h3_turbo.model_facts import PROJECTIONS  # noqa: E402

pytestmark = pytest.mark.comfyui

SUB = "zz_style_interp"
CASES = [("exact", "resident"), ("fp8", "resident"), ("fp8", "lean")]
#: the projections checked: a DiT block's and a refiner block's four (the interpreter is slow)
LAYERS = ("blocks.1.", "token_refiner.blocks.0.")


@pytest.fixture(scope="module")
def setup(comfy, tmp_path_factory):
    from comfy.sd import load_diffusion_model
    from comfy.utils import load_torch_file
    from safetensors.torch import save_file

    from h3_turbo.tools import style_lora

    root = tmp_path_factory.mktemp("style_interp_models")
    small = write_small_fixtures(str(root), SUB, str(tmp_path_factory.mktemp("style_interp_src")))
    dm = load_diffusion_model(small["unet_bf16_path"]).model.diffusion_model
    path = os.path.join(str(root), "loras", SUB, "style_proj.safetensors")
    save_file(style_lora.for_model(dm, adaln=False, rel=1.0), path)
    comfy.add_models_dir(root)
    return {"unet": small["unet_path"], "turbo": small["lora_4step"], "style": load_torch_file(path, safe_load=True)}


def _model(setup, style: str | None):
    """A fresh load with the style LoRA (None / "merged" / "bypass") and the Turbo branch, loaded by ComfyUI."""
    import comfy.model_management as mm
    from comfy.sd import load_bypass_lora_for_models, load_lora_for_models

    from h3_turbo.nodes.lora import H3TurboLoRA
    from h3_turbo.runtime.loading import load_h3_model

    mp = load_h3_model(setup["unet"], "reference")
    if style == "merged":
        mp = load_lora_for_models(mp, None, setup["style"], 1.0, 0)[0]
    elif style == "bypass":
        mp = load_bypass_lora_for_models(mp, None, setup["style"], 1.0, 0)[0]
    out = H3TurboLoRA.execute(model=mp, turbo=setup["turbo"], strength=1.0)
    mp = out.result[0] if hasattr(out, "result") else out[0]
    mm.load_models_gpu([mp])
    return mp


def _layers(mp):
    dm = mp.model.diffusion_model
    return [(n, m) for n, m in dm.named_modules() if n.endswith(PROJECTIONS) and n.startswith(LAYERS)]


def _outputs(mp, path, weights, xs, monkeypatch, calls):
    from h3_turbo.kernels import registry
    from h3_turbo.kernels.paths import base
    from h3_turbo.runtime.ops import install_compute

    install_compute(mp, path, weights=weights)
    if path != "reference":
        monkeypatch.setattr(base.ComputePath, "takes", lambda self, x2d: True)   # CPU tensors to the kernels
        kl = registry.get(path).kernel_linear

        def counted(x2d, prepared):
            calls[path] = calls.get(path, 0) + 1
            return kl(x2d, prepared)

        monkeypatch.setattr(registry.get(path), "kernel_linear", counted)
    with torch.no_grad():
        out = {n: m(xs[n]) for n, m in _layers(mp)}
    monkeypatch.undo()
    install_compute(mp, "reference")
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("style", ["merged", "bypass"])
def test_style_lora_beside_turbo_on_kernel_paths(comfy, setup, style, monkeypatch):
    from h3_turbo.kernels import registry

    plain = _model(setup, None)
    g = torch.Generator().manual_seed(3)
    xs = {n: torch.randn(37, m.in_features, generator=g).to(torch.bfloat16) for n, m in _layers(plain)}
    base_ref = _outputs(plain, "reference", "resident", xs, monkeypatch, {})
    mp = _model(setup, style)
    if style == "merged":
        from comfy.quant_ops import QuantizedTensor

        assert all(isinstance(m.weight, QuantizedTensor) for _, m in _layers(mp))   # patched, NVFP4 again
    ref = _outputs(mp, "reference", "resident", xs, monkeypatch, {})
    for path, weights in CASES:
        bound = registry.get(path).error_bound
        calls: dict = {}
        got = _outputs(mp, path, weights, xs, monkeypatch, calls)
        assert calls.get(path) == len(xs), (path, calls)        # every layer ran the path's kernel
        for n in xs:
            err, effect = _rel(got[n], ref[n]), _rel(ref[n], base_ref[n])
            assert torch.isfinite(got[n]).all()
            assert err < bound, (path, weights, n, err)
            assert effect >= 10 * bound, (path, n, effect)
