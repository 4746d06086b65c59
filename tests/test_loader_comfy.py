"""Issue 3: ``H3TurboNVFP4Loader`` in the real ComfyUI (CPU): every format loads and samples, the native
file through our loader equals core's UNETLoader bit for bit, failed loads leave loaded models alone,
and the memory size reported to ComfyUI is the packed size."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from corpus import euler_av_prompt  # tests/ is on sys.path
from h3_turbo.harness import PromptFailed
from h3_turbo.tools.variants import damage, make_format_variants

pytestmark = pytest.mark.comfyui

VAR = "h3t_variants"


@pytest.fixture(scope="module")
def variants(comfy, fixtures_dir):
    if "nvfp4" not in fixtures_dir:
        pytest.skip("comfy-kitchen missing: no NVFP4 fixture")
    d = os.path.join(fixtures_dir["root"], "diffusion_models", VAR)
    paths = make_format_variants(fixtures_dir["nvfp4"], fixtures_dir["bf16"], d)
    return {k: f"{VAR}/{os.path.basename(p)}" for k, p in paths.items()} | {"_dir": d}


def _prompt(loader: dict, lora: str | None = None, prefix: str = "h3t/x",
            lora_node: str = "LoraLoaderModelOnly") -> dict:
    p = {"1": loader, **euler_av_prompt(["2" if lora else "1", 0], prefixes=(prefix + "_v", prefix + "_a"))}
    if lora:
        p["2"] = {"class_type": lora_node, "inputs": {"model": ["1", 0], "lora_name": lora,
                                                                   "strength_model": 1.0}}
    return p


def _ours(name, compute="reference"):
    return {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": name, "compute": compute}}


def _core(name):
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def _sample(comfy, loader, lora=None, lora_node="LoraLoaderModelOnly") -> tuple[torch.Tensor, torch.Tensor]:
    res = comfy.run_latents(_prompt(loader, lora, lora_node=lora_node), ("12", "13"), remove=False)
    assert all(torch.isfinite(r).all() for r in res)
    return res[0], res[1]


def _eq(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture(scope="module")
def native_sample(comfy, fixtures_dir):
    if "nvfp4" not in fixtures_dir:
        pytest.skip("no NVFP4 fixture")
    return _sample(comfy, _ours("h3_tiny_nvfp4.safetensors"))


def test_native_reference_equals_core_unetloader(comfy, native_sample):
    v, a = native_sample
    cv, ca = _sample(comfy, _core("h3_tiny_nvfp4.safetensors"))
    assert _eq(v, cv) and _eq(a, ca)
    assert v.shape[1] == 24 and a.shape[1] == 32 and float(v.std()) > 0.1


@pytest.mark.parametrize("name", ["metadata", "modelopt_lo_linear", "modelopt_hi_linear_meta",
                                  "modelopt_lo_swizzled_meta", "prefixed", "native_input_scale", "bf16_prefixed"])
def test_each_format_samples_like_native(comfy, variants, native_sample, name):
    v, a = _sample(comfy, _ours(variants[name]))
    # lossless conversions, and BF16 quantized on load with our quantizer (= comfy-kitchen's) -> identical
    assert _eq(v, native_sample[0]) and _eq(a, native_sample[1])


def test_bf16_file_quantized_on_load_samples_like_native(comfy, native_sample):
    v, a = _sample(comfy, _ours("h3_tiny_bf16.safetensors"))
    assert _eq(v, native_sample[0]) and _eq(a, native_sample[1])


def test_lightx2v_samples_close_to_native(comfy, variants, native_sample):
    v, a = _sample(comfy, _ours(variants["lightx2v"]))
    # weight_scale_2 = 1/weight_global_scale is within 1 fp32 ulp of the native scale on 32 layers
    assert float((v - native_sample[0]).abs().max()) < 1e-4 and float((a - native_sample[1]).abs().max()) < 1e-4


@pytest.mark.parametrize("lora_node", ["LoraLoaderModelOnly", "LoraLoaderBypassModelOnly"])
def test_core_lora_loader_on_our_model_equals_core(comfy, fixtures_dir, native_sample, lora_node):
    lora = os.path.basename(fixtures_dir["lora_4step"])
    v, a = _sample(comfy, _ours("h3_tiny_nvfp4.safetensors"), lora=lora, lora_node=lora_node)
    cv, ca = _sample(comfy, _core("h3_tiny_nvfp4.safetensors"), lora=lora, lora_node=lora_node)
    assert _eq(v, cv) and _eq(a, ca)
    assert float((v - native_sample[0]).abs().max()) > 1e-3     # the LoRA did something


def _hash_model(mp) -> str:
    h = hashlib.sha256()
    for k, t in sorted(mp.model.state_dict().items()):
        h.update(k.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_failed_loads_leave_loaded_model_untouched(comfy, fixtures_dir, variants):
    from h3_turbo import state
    from h3_turbo.nodes.loader import H3TurboNVFP4Loader

    mp = H3TurboNVFP4Loader.execute("h3_tiny_nvfp4.safetensors", "reference")[0]
    before = _hash_model(mp)
    d = variants["_dir"]
    bad_scales = load_file(os.path.join(d, "h3_tiny_native_input_scale.safetensors"))
    b = bad_scales["blocks.2.mlp.fc2.weight_scale"].view(torch.uint8).clone()
    b[0, 0] = 0x7F
    bad_scales["blocks.2.mlp.fc2.weight_scale"] = b.view(torch.float8_e4m3fn)
    save_file(bad_scales, os.path.join(d, "bad_nan_scale.safetensors"))
    damage(fixtures_dir["nvfp4"], "truncated", os.path.join(d, "bad_truncated.safetensors"))
    damage(fixtures_dir["nvfp4"], "lfs_pointer", os.path.join(d, "bad_lfs.safetensors"))
    import shutil

    shutil.copy(fixtures_dir["lora_8step"], os.path.join(d, "bad_is_lora.safetensors"))
    cases = {"bad_nan_scale": ("blocks.2.mlp.fc2.weight_scale", "1 block scales are NaN"),
             "bad_truncated": ("file is truncated", "re-download"),
             "bad_lfs": ("Git LFS pointer", "git lfs pull"),
             "bad_is_lora": ("not a MiniMax H3 diffusion model", "LoRA adapter")}
    n_loaded = len(state.snapshot()["loaded_models"])
    for name, texts in cases.items():
        with pytest.raises(PromptFailed) as ei:
            comfy.run(_prompt(_ours(f"{VAR}/{name}.safetensors")))
        msg = str(ei.value)
        assert f"{name}.safetensors" in msg and all(t in msg for t in texts), msg
    assert _hash_model(mp) == before
    assert len(state.snapshot()["loaded_models"]) == n_loaded
    # and the model still samples exactly like a fresh load
    v, a = _sample(comfy, _ours("h3_tiny_nvfp4.safetensors"))
    assert torch.isfinite(v).all()


def test_model_size_reported_is_packed(comfy, fixtures_dir):
    import comfy.sd

    from h3_turbo import state
    from h3_turbo.formats.detect import detect
    from h3_turbo.formats.safetensors_io import read_header
    from h3_turbo.runtime.loading import load_h3_model

    ours = load_h3_model(fixtures_dir["nvfp4"], "reference")
    plain = comfy.sd.load_diffusion_model(fixtures_dir["bf16"])
    det = detect(read_header(fixtures_dir["nvfp4"]))
    # every projection: the plain model keeps N*K elements of its dtype, ours the packed bytes
    item = plain.model.diffusion_model.blocks[0].mlp.fc1.weight.element_size()
    proj_plain = sum(q.n * q.k for q in det.quant_layers.values()) * item
    assert plain.model_size() - ours.model_size() == proj_plain - det.packed_bytes
    assert det.packed_bytes == 1252160 + 208 * 19 and det.packed_bytes < 0.3 * proj_plain / item * 2
    rec = state.snapshot()["loaded_models"][fixtures_dir["nvfp4"]]
    assert rec["packed_bytes"] == det.packed_bytes and rec["bytes"] == ours.model_size()
    assert rec["format"] == "comfy_native" and rec["compute"] == "reference"


def test_cached_patcher_init_rebuilds(comfy, fixtures_dir):
    from h3_turbo.runtime.loading import load_h3_model

    mp = load_h3_model(fixtures_dir["nvfp4"], "auto")
    fn, args = mp.cached_patcher_init
    again = fn(*args, disable_dynamic=True)
    assert type(again).__name__ == "ModelPatcher" and again is not mp
    assert _hash_model(again) == _hash_model(mp)
    clone = mp.clone(disable_dynamic=True)   # core's non-dynamic delegate path needs cached_patcher_init
    assert clone is not None


def test_compute_modes_on_cpu(comfy, fixtures_dir, caplog):
    from h3_turbo.runtime.loading import load_h3_model, resolve_compute

    assert resolve_compute("auto", torch.device("cpu"))[0] == "reference"
    assert resolve_compute("reference", torch.device("cpu")) == ("reference", "requested")
    mp = load_h3_model(fixtures_dir["nvfp4"], "auto")
    assert mp.model_options["h3_turbo"]["compute"] == "reference"
    for c in ("exact", "fp8"):
        with pytest.raises(PromptFailed, match=f"compute={c}"):
            comfy.run(_prompt(_ours("h3_tiny_nvfp4.safetensors", c)))
    with pytest.raises(ValueError, match="expected one of auto, exact, fp8, reference"):
        resolve_compute("fast", torch.device("cpu"))


def test_progress_bar_while_quantizing(comfy, fixtures_dir):
    import comfy.utils

    from h3_turbo.runtime.loading import load_h3_model

    seen = []
    old = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda v, t, preview=None, node_id=None: seen.append((v, t)))
    try:
        load_h3_model(fixtures_dir["bf16"], "reference")
    finally:
        comfy.utils.set_progress_bar_global_hook(old)
    assert seen[0] == (1, 208) and seen[-1] == (208, 208)


def test_fp32_island_operations(comfy):
    from comfy_kitchen.tensor import QuantizedTensor

    from h3_turbo.formats import nvfp4
    from h3_turbo.runtime.ops import make_operations

    ops = make_operations(torch.device("cpu"), compute_dtype=torch.bfloat16)
    island = ops.Linear(64, 32, bias=True, dtype=torch.float32)
    normal = ops.Linear(64, 32, bias=True, dtype=None)
    w = torch.randn(32, 64)
    for m in (island, normal):
        m.load_state_dict({"weight": w, "bias": torch.ones(32)}, strict=False)
    assert island.weight.dtype == torch.float32 and island.bias.dtype == torch.float32
    assert torch.equal(island.weight, w)
    assert normal.weight.dtype == torch.bfloat16 and normal.bias.dtype == torch.bfloat16
    # a quantized layer still loads as core's QuantizedTensor
    q, bs, s = nvfp4.quantize(w.to(torch.bfloat16))
    ql = ops.Linear(64, 32, bias=False, dtype=None)
    ql.load_state_dict({"weight": q, "weight_scale": bs, "weight_scale_2": s,
                        "comfy_quant": torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)}, strict=False)
    assert isinstance(ql.weight, QuantizedTensor)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, nvfp4.dequantize(q, s, bs, torch.bfloat16))
    assert torch.equal(ql(x), ref)


def test_pre_quant_scale_applies_to_base_path_only(comfy, variants):
    from h3_turbo.formats import nvfp4
    from h3_turbo.runtime.loading import load_h3_model

    d = variants["_dir"]
    sd = load_file(os.path.join(d, "h3_tiny_native_input_scale.safetensors"))
    pqs = torch.linspace(0.5, 2.0, 64)
    sd["blocks.0.mlp.fc1.pre_quant_scale"] = pqs
    p = os.path.join(d, "pqs.safetensors")
    save_file(sd, p)
    mp = load_h3_model(p, "reference")
    fc1 = mp.model.diffusion_model.blocks[0].mlp.fc1
    assert torch.equal(fc1.pre_quant_scale.float(), pqs)
    x = torch.randn(5, 64, dtype=fc1.pre_quant_scale.dtype)
    w = nvfp4.dequantize(sd["blocks.0.mlp.fc1.weight"], sd["blocks.0.mlp.fc1.weight_scale_2"],
                         sd["blocks.0.mlp.fc1.weight_scale"], x.dtype)
    assert torch.equal(fc1(x), torch.nn.functional.linear(x * pqs.to(x.dtype), w))
    # a branch installed by wrapping module.forward from outside sees the unsmoothed x
    seen = []
    base = fc1.forward

    def wrapped(inp, *a, **k):
        seen.append(inp)
        return base(inp, *a, **k)

    fc1.forward = wrapped
    try:
        fc1(x)
    finally:
        del fc1.forward
    assert torch.equal(seen[0], x)


def test_kernel_dispatch_plumbing_on_cpu(comfy, fixtures_dir, native_sample):
    """compute paths other than reference route the 208 projections through kernels.dispatch.linear;
    on a CPU the dispatcher computes its reference (fp32 ``(E2M1*bs)*gs``) -> close to core's output."""
    pytest.importorskip("h3_turbo.kernels.dispatch")
    from h3_turbo.kernels import dispatch
    from h3_turbo.runtime.ops import install_compute
    from h3_turbo.runtime.loading import load_h3_model

    mp = load_h3_model(fixtures_dir["nvfp4"], "reference")
    calls = []
    real = dispatch.linear

    def spy(x, prepared, path, bias=None):
        calls.append(path)
        return real(x, prepared, path, bias)

    assert install_compute(mp, "exact") == 208
    fc2 = mp.model.diffusion_model.blocks[4].mlp.fc2
    x = torch.randn(7, 128)
    dispatch.linear = spy
    try:
        y = fc2(x)
    finally:
        dispatch.linear = real
    assert calls == ["exact"]
    from h3_turbo.formats import nvfp4

    w = fc2.weight
    ref = torch.nn.functional.linear(x, nvfp4.dequantize_fp64(w._qdata, w._params.scale, w._params.block_scale).float())
    assert float((y - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    assert install_compute(mp, "reference") == 208 and fc2._h3_path is None


def test_kernel_work_buffers_released_on_unload(comfy, fixtures_dir):
    """A kernel path registers one ON_DETACH callback (re-installing does not add a second); ComfyUI's
    detach (model unload) then frees kernels.dispatch's reused per-call buffers, which the loader counted in
    the model's size. The reference path registers none."""
    from comfy.patcher_extension import CallbacksMP

    from h3_turbo.kernels import dispatch
    from h3_turbo.kernels.paths import base as paths_base
    from h3_turbo.runtime.ops import WORKSPACE_CALLBACK, install_compute
    from h3_turbo.runtime.loading import load_h3_model

    mp = load_h3_model(fixtures_dir["nvfp4"], "reference")
    assert mp.get_callbacks(CallbacksMP.ON_DETACH, WORKSPACE_CALLBACK) == []
    install_compute(mp, "exact")
    install_compute(mp, "fp8")
    assert len(mp.get_callbacks(CallbacksMP.ON_DETACH, WORKSPACE_CALLBACK)) == 1
    clone = mp.clone()                               # e.g. the Turbo LoRA node's patcher
    assert len(clone.get_callbacks(CallbacksMP.ON_DETACH, WORKSPACE_CALLBACK)) == 1
    paths_base.scratch("cpu", torch.bfloat16, 1000)    # what a GPU call leaves behind
    paths_base.WORK_BUFFERS.data[("tiles", "cpu", torch.bfloat16, 8, 16)] = [torch.empty(8, 16, dtype=torch.bfloat16)] * 2
    fc2 = mp.model.diffusion_model.blocks[0].mlp.fc2
    fc2._h3_cache = (("key",), "prepared")              # what a layer's first GPU call leaves behind
    try:
        # a clone handed over without unloading (load_models_gpu detaching the loaded clone for another one, a
        # clone collected while its parent stays loaded): the model stays loaded, so both are kept
        clone.detach(unpatch_all=False)
        assert paths_base.WORK_BUFFERS.data and fc2._h3_cache is not None
        clone.detach()                                  # model_unload: freed
        assert paths_base.WORK_BUFFERS.data == {} and fc2._h3_cache is None
        assert dispatch.release_workspace() == 0
    finally:
        paths_base.WORK_BUFFERS.clear()
        fc2._h3_cache = None
    install_compute(mp, "reference")


def test_prepared_weights_survive_comfyui_handing_the_model_to_another_clone(comfy, fixtures_dir):
    """ComfyUI's ``load_models_gpu`` with a second clone of a loaded model (the sampler's patcher after a node
    changed, a Turbo adapter switched per request) detaches the loaded clone without unloading the model: the
    prepared weights stay (before, each hand-over dropped them and the next call prepared all 208 layers again;
    docs/memory.md); a real unload (``unload_all_models``) still frees them."""
    import comfy.model_management as mm

    from h3_turbo.runtime.ops import install_compute
    from h3_turbo.runtime.loading import load_h3_model

    mp = load_h3_model(fixtures_dir["nvfp4"], "reference")
    install_compute(mp, "fp8")
    fc2 = mp.model.diffusion_model.blocks[0].mlp.fc2
    try:
        a, b = mp.clone(), mp.clone()
        mm.load_models_gpu([a])
        fc2._h3_cache = (("key",), "prepared")
        mm.load_models_gpu([b])                         # a is detached (unpatch_all=False), b loaded
        assert fc2._h3_cache is not None
        assert any(x.model is b for x in mm.current_loaded_models)
        mm.unload_all_models()
        assert fc2._h3_cache is None
    finally:
        mm.unload_all_models()
        fc2._h3_cache = None
        install_compute(mp, "reference")


def test_kernel_extra_bytes_accounting(comfy):
    from h3_turbo.runtime.loading import kernel_extra_bytes

    full = [(21504, 5376), (5376, 7168), (28672, 5376), (5376, 14336)] * 52   # real H3 projections
    nk = sum(n * k for n, k in full)
    assert nk == 20_038_287_360          # H3_FACTS §1: "20.04 B"
    assert kernel_extra_bytes(full, "reference") == 0 and kernel_extra_bytes(full, "blackwell_fp4") == 0
    # exact reads the native storage (its fp32 global scale per layer); fp8 resident: e4m3 copy + sw + amax per
    # row, lean: sw + amax + inv per row (issue 17)
    assert kernel_extra_bytes(full, "exact") == 4 * 208
    rows = sum(n for n, _ in full)
    assert kernel_extra_bytes(full, "fp8") == nk + 8 * rows
    from h3_turbo.kernels import dispatch
    assert dispatch.prepared_bytes(full, "fp8", lean=True) == 12 * rows < 40e6      # 38 MB vs 20 GB
    assert dispatch.prepared_bytes(full, "exact", lean=True) == dispatch.prepared_bytes(full, "exact")
    # the reused per-call buffers (kernels.dispatch._scratch / _TILE_BUFS): largest layer fc1 28672 x 5376
    from h3_turbo.kernels.paths.exact import PATH as EXACT
    from h3_turbo.kernels.dispatch import workspace_bytes as kernel_workspace_bytes
    assert EXACT.settings.tile_rows == 3072
    assert kernel_workspace_bytes(full, "exact") == 28672 * 5376 * 2 + 2 * 3072 * (5376 + 7168 + 14336) * 2
    assert kernel_workspace_bytes(full, "fp8") == 28672 * 5376 + 4 * 28672
    assert kernel_workspace_bytes(full, "reference") == 0 and kernel_workspace_bytes([], "exact") == 0
    assert kernel_workspace_bytes([(300, 208)], "exact") == 300 * 208 * 2 + 2 * 300 * 208 * 2   # one tile = N rows


@pytest.mark.comfyui
def test_moving_a_layer_drops_its_prepared_weight(comfy, fixtures_dir):
    """Core gives an NVFP4 layer new weight tensors when ComfyUI moves or offloads it (``_apply``): the pack's
    prepared copy (which references the old storage) is dropped with it, so the old weights are freed. On the CPU
    the kernel paths are refused, so the cache is filled by hand here."""
    import gc
    import weakref

    from h3_turbo.runtime.loading import load_h3_model

    mp = load_h3_model(fixtures_dir["nvfp4"], "reference")
    lin = mp.model.diffusion_model.blocks[0].mlp.fc1
    assert hasattr(lin, "_h3_cache") and not lin.h3turbo_fusable(torch.randn(2, lin.in_features))
    old = lin.weight._qdata
    ref_old = weakref.ref(old)
    lin._h3_cache = (("key",), old)          # what _kernel_forward stores: (key, prepared holding the old storage)
    del old
    lin._apply(lambda t: t.clone())
    assert lin._h3_cache is None
    gc.collect()
    assert ref_old() is None                  # nothing of ours keeps the moved-away storage alive


def test_prepared_weight_is_made_again_when_the_weight_changes(comfy, fixtures_dir):
    """A layer's prepared copy is reused while its weight is the same object with the same storage and unchanged
    in place; an in-place change of its data or scales (ComfyUI's ``weight_inplace_update`` patching) or a new
    weight object (ComfyUI's default patching) prepares it again, with the new numbers."""
    from h3_turbo.runtime.ops import install_compute
    from h3_turbo.runtime.loading import load_h3_model

    mp = load_h3_model(fixtures_dir["nvfp4"], "reference")
    assert install_compute(mp, "fp8") == 208
    fc2 = mp.model.diffusion_model.blocks[0].mlp.fc2
    x = torch.randn(3, fc2.in_features)
    try:
        y0 = fc2(x)
        first = fc2._h3_cache[1]
        assert torch.equal(fc2(x), y0) and fc2._h3_cache[1] is first             # reused
        w = fc2.weight
        w._params.scale.mul_(2.0)                                               # in place: the per-tensor scale
        y1 = fc2(x)
        assert fc2._h3_cache[1] is not first
        torch.testing.assert_close(y1, 2.0 * y0, rtol=1e-2, atol=1e-3)
        second = fc2._h3_cache[1]
        w._params.scale.div_(2.0)
        fc2.weight = torch.nn.Parameter(w.clone(), requires_grad=False)         # a new weight object
        assert torch.equal(fc2(x), y0) and fc2._h3_cache[1] is not second
    finally:
        install_compute(mp, "reference")
