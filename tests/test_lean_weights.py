"""Issue 17 items 1 and 3 through the real ComfyUI (CPU): the loader's ``weights`` input (lean / resident / auto),
what the model reports to ComfyUI, unloading, and ComfyUI's low-VRAM partial loading.

The kernels cannot run on a CPU, so the bit-identity of lean and resident *kernel* outputs is tested under the
Triton interpreter (tests/test_kernels_interp.py: ``test_fp8_lean_*``); here the plumbing is: the mode reaches every
NVFP4 projection, a lean layer holds no [N, K] copy, sampling through the real graph gives the same latents in
both modes, unloading frees every prepared copy and work buffer, and a layer ComfyUI offloads (low VRAM) runs
core's own path.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from corpus import euler_av_prompt  # tests/ is on sys.path

pytestmark = pytest.mark.comfyui

NVFP4 = "h3_tiny_nvfp4.safetensors"
#: this module's prompts load a copy under its own name: the test node mutates the loaded model (install_compute),
#: and ComfyUI caches a loader's output per inputs, so other tests' prompts must not receive that model
LEAN = "h3t_lean/h3_tiny_nvfp4_lean.safetensors"


class _Install:
    """Test-only: switch a loaded MODEL's NVFP4 projections to a compute path and weight mode (on the CPU the
    loader itself refuses the kernel paths, so the switch is made here, as ``load_h3_model`` makes it on a GPU)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "path": ("STRING", {"default": "fp8"}),
                             "weights": ("STRING", {"default": "lean"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "go"
    CATEGORY = "h3_turbo_tests"

    def go(self, model, path, weights):
        from h3_turbo.runtime.ops import install_compute

        install_compute(model, path, weights=weights)
        return (model,)


@pytest.fixture(scope="module")
def installer(comfy, fixtures_dir):
    import nodes

    if "nvfp4" not in fixtures_dir:
        pytest.skip("comfy-kitchen missing: no NVFP4 fixture")
    import shutil

    dst = os.path.join(fixtures_dir["root"], "diffusion_models", LEAN)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(fixtures_dir["nvfp4"], dst)
    nodes.NODE_CLASS_MAPPINGS["H3TurboTestInstall"] = _Install
    yield
    nodes.NODE_CLASS_MAPPINGS.pop("H3TurboTestInstall", None)


def _prompt(path, weights, prefix):
    p = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": LEAN, "compute": "reference"}},
         "2": {"class_type": "H3TurboTestInstall", "inputs": {"model": ["1", 0], "path": path, "weights": weights}},
         **euler_av_prompt(["2", 0], prefixes=(prefix + "_v", prefix + "_a"))}
    return p


def _layers(mp):
    return [m for n, m in mp.model.diffusion_model.named_modules() if getattr(m, "_h3_path", None) is not None]


def test_lean_and_resident_sample_identically_and_lean_holds_no_copy(comfy, installer):
    from h3_turbo.kernels.paths.fp8 import PreparedFP8
    from h3_turbo.runtime.loading import load_h3_model

    res = comfy.run_latents(_prompt("fp8", "resident", "h3t/lean_r"), ("12", "13"))
    lean = comfy.run_latents(_prompt("fp8", "lean", "h3t/lean_l"), ("12", "13"))
    assert all(torch.equal(a, b) for a, b in zip(res, lean)) and float(res[0].std()) > 0.1
    # the same layers, prepared directly: lean keeps the fp32 row factors only
    mp = load_h3_model(fixtures_dir_nvfp4(comfy), "reference")
    from h3_turbo.runtime.ops import install_compute

    assert install_compute(mp, "fp8", weights="lean") == 208
    x = torch.randn(3, mp.model.diffusion_model.blocks[0].mlp.fc1.in_features)
    fc1 = mp.model.diffusion_model.blocks[0].mlp.fc1
    fc1(x)
    prepared = fc1._h3_cache[1]
    assert isinstance(prepared, PreparedFP8) and prepared.lean and prepared.w8 is None
    install_compute(mp, "fp8", weights="resident")
    fc1(x)
    assert not fc1._h3_cache[1].lean and fc1._h3_cache[1].w8.shape[1] == fc1.in_features
    with pytest.raises(ValueError, match="weights='big': expected resident or lean"):
        install_compute(mp, "fp8", weights="big")


def fixtures_dir_nvfp4(comfy):
    import folder_paths

    return folder_paths.get_full_path_or_raise("diffusion_models", NVFP4)


def test_weights_input_resolution(comfy, monkeypatch):
    """exact/reference have no copies to keep (always lean); fp8 auto is resident when model + copies + work
    buffers + 10% + 4 GiB fit the free memory, else lean (the numbers in the reason); an unknown name is refused."""
    import comfy.model_management as mm

    from h3_turbo.kernels import dispatch
    from h3_turbo.runtime.loading import resolve_weights

    full = [(21504, 5376), (5376, 7168), (28672, 5376), (5376, 14336)] * 52
    model = 12 << 30
    assert resolve_weights("resident", "exact", "cuda:0", model, full)[0] == "lean"
    assert resolve_weights("auto", "reference", "cpu", model, full)[0] == "lean"
    assert resolve_weights("lean", "fp8", "cuda:0", model, full) == ("lean", "requested")
    assert resolve_weights("auto", "fp8", "cpu", model, full)[0] == "resident"
    copies = dispatch.prepared_bytes(full, "fp8") - dispatch.prepared_bytes(full, "fp8", lean=True)
    assert 20.0e9 < copies < 20.1e9                    # one e4m3 byte per weight element
    need = int((model + copies + dispatch.workspace_bytes(full, "fp8")) * 1.1) + (4 << 30)
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: need)
    mode, why = resolve_weights("auto", "fp8", "cuda:0", model, full)
    assert mode == "resident" and why.startswith("fits:")
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: need - 1)
    mode, why = resolve_weights("auto", "fp8", "cuda:0", model, full)
    assert mode == "lean" and "does not fit" in why and "18.7 GiB fp8 copies" in why
    with pytest.raises(ValueError, match="weights='x': expected one of auto, lean, resident"):
        resolve_weights("x", "fp8", "cuda:0", model, full)


def test_loader_refuses_unknown_weights_before_building_and_says_when_it_does_nothing(comfy, caplog):
    import logging

    from h3_turbo import state
    from h3_turbo.runtime.loading import load_h3_model

    with pytest.raises(ValueError, match="weights='fast'"):
        load_h3_model(fixtures_dir_nvfp4(comfy), "reference", weights="fast")
    state.LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        load_h3_model(fixtures_dir_nvfp4(comfy), "reference", weights="lean")
    assert "weights=lean has no effect with compute=reference" in caplog.text


def test_unload_frees_every_prepared_copy_and_work_buffer(comfy, installer):
    """After a sampling run with prepared fp8 copies, ComfyUI's unload (detach) leaves no prepared object alive and
    no work buffer (counted with the garbage collector)."""
    import comfy.model_management as mm

    from h3_turbo.kernels.paths import base as paths_base
    from h3_turbo.kernels.paths.fp8 import PreparedFP8
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.runtime.ops import install_compute

    mp = load_h3_model(fixtures_dir_nvfp4(comfy), "reference")
    install_compute(mp, "fp8", weights="resident")
    dm = mp.model.diffusion_model
    x = torch.randn(4, dm.blocks[0].mlp.fc1.in_features)
    for m in _layers(mp):
        if m.in_features == x.shape[1]:
            m(x)
    paths_base.scratch("cpu", torch.float8_e4m3fn, 4096)      # what a GPU call leaves behind

    def alive():
        gc.collect()
        return sum(type(o) is PreparedFP8 for o in gc.get_objects())

    assert alive() >= 100 and paths_base.WORK_BUFFERS.data
    mm.load_models_gpu([mp])
    mm.unload_all_models()
    assert all(m._h3_cache is None for m in _layers(mp))
    assert alive() == 0 and paths_base.WORK_BUFFERS.data == {}


def test_lowvram_offloaded_layers_run_cores_path(comfy, installer, caplog):
    """ComfyUI's partial (low-VRAM) load marks the layers it leaves on the offload device ``comfy_cast_weights``:
    those run core's own forward (logged once with the reason), the others keep the compute path; both give the
    reference numbers."""
    import logging

    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.runtime.ops import install_compute, kernel_blocker

    mp = load_h3_model(fixtures_dir_nvfp4(comfy), "reference")
    install_compute(mp, "exact")
    layers = _layers(mp)
    mp.load(torch.device("cpu"), lowvram_model_memory=mp.model_size() // 3)
    try:
        off = [m for m in layers if getattr(m, "comfy_cast_weights", False)]
        assert 0 < len(off) < len(layers)
        x = torch.randn(2, off[0].in_features)
        assert "offloaded" in kernel_blocker(off[0], x)
        with caplog.at_level(logging.INFO, logger="h3_turbo"):
            y = off[0](x)
        assert "low-VRAM" in caplog.text and "core's path" in caplog.text
        from h3_turbo.formats import nvfp4

        w = off[0].weight
        want = torch.nn.functional.linear(x, nvfp4.dequantize_fp64(w._qdata, w._params.scale,
                                                                   w._params.block_scale).float())
        assert float((y - want).abs().max()) < 1e-4 * float(want.abs().max())
    finally:
        mp.detach()
