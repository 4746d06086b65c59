"""``H3TurboNVFP4Loader``: load a MiniMax H3 diffusion model as ComfyUI-native NVFP4, from any supported file.

Order of work (a failed load builds nothing and touches no loaded model):
1. resolve ``compute`` (errors for an impossible request come first);
2. read and validate the safetensors header, detect the format and the H3 sizes (``formats.detect``);
3. stream the file into the ComfyUI-native layout in memory (``formats.convert.iter_native``): native
   files pass through, ModelOpt / LightX2V / whole-file-metadata files are converted bit-preservingly,
   BF16/FP16/FP32 files get their 208 block projections quantized (progress bar);
4. check the values (finite, non-negative block scales; finite positive global scales);
5. build core's H3 with core's loader ``comfy.sd.load_diffusion_model_state_dict``, with operations
   derived from core's ``mixed_precision_ops`` that keep H3's fp32 island in fp32 (core's mixed ops
   build every Linear in the compute dtype, research/comfyui-h3.md §4.3 caveat 7).
"""
from __future__ import annotations

import logging
import os

import torch
from comfy_api.latest import io

from . import CATEGORY
from .. import state
from ..adapters import contracts
from ..formats.convert import iter_native, make_plan, native_metadata
from ..formats.detect import Detection, detect
from ..formats.nvfp4 import roundup
from ..formats.safetensors_io import CheckpointError, read_header

log = logging.getLogger("h3_turbo")

COMPUTE_CHOICES = ("auto", "exact", "fp8", "reference")
_LOGGED: set = set()


def _log_once(key, msg, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(msg, *args)


def resolve_compute(requested: str, device: torch.device) -> tuple[str, str]:
    """Compute path for ``requested`` on ``device``: ``(path, reason)``.

    Delegates to ``h3_turbo.kernels.dispatch.resolve_compute`` when that module exists. Without it:
    ``reference`` and ``auto`` give ``reference`` (core's exact E2M1 dequant + matmul); ``exact`` and
    ``fp8`` raise RuntimeError (never a silent fallback).
    """
    if requested not in COMPUTE_CHOICES:
        raise ValueError(f"compute={requested!r}; expected one of {', '.join(COMPUTE_CHOICES)}")
    missing = "h3_turbo.kernels.dispatch has no resolve_compute"
    try:
        from ..kernels import dispatch  # written by the kernels helper
    except ImportError as e:
        dispatch = None
        missing = str(e)
    if dispatch is not None and hasattr(dispatch, "resolve_compute"):
        try:
            return dispatch.resolve_compute(requested, device)
        except ValueError as e:
            raise RuntimeError(f"compute={requested}: {e}") from None
    if requested == "reference":
        return "reference", "requested"
    if requested == "auto":
        why = "CPU device" if torch.device(device).type == "cpu" else \
            f"the h3_turbo Hopper kernels are not importable ({missing})"
        return "reference", why
    raise RuntimeError(f"compute={requested} needs a CUDA sm_89+ GPU and the h3_turbo Hopper kernels; "
                       "use auto or reference")


def make_operations(load_device, compute_dtype: torch.dtype | None = None):
    """Core's ``mixed_precision_ops`` for H3, except that Linears built with ``dtype=torch.float32``
    (H3's fp32 island: patch projections, time embedder, final video/audio outputs) keep fp32 weights.

    compute_dtype: default = what core picks for a quantized model on ``load_device``
    (``unet_manual_cast(None, load_device, MiniMaxH3.supported_inference_dtypes)``); the disabled
    formats are decided as in ``comfy.ops.pick_operations``.
    """
    import comfy.model_management as mm
    import comfy.ops

    if compute_dtype is None:
        import comfy.supported_models

        compute_dtype = mm.unet_manual_cast(None, load_device, comfy.supported_models.MiniMaxH3.supported_inference_dtypes)

    class _Cfg:
        quant_config = {"mixed_ops": True}

    base = comfy.ops.pick_operations(None, compute_dtype, load_device=load_device, model_config=_Cfg())
    base_linear = base.Linear

    class H3TurboOps(base):
        class Linear(base_linear):
            def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
                super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
                self._h3_path = None      # set by install_compute on the NVFP4 block projections
                self._h3_cache = None
                if dtype == torch.float32 and self.factory_kwargs["dtype"] not in (None, torch.float32):
                    self.factory_kwargs = {"device": device, "dtype": torch.float32}
                    if bias:
                        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=torch.float32))

            def forward(self, input, *args, **kwargs):
                path = self._h3_path
                if path is None or path == "reference":
                    return super().forward(input, *args, **kwargs)
                why = _kernel_blocker(self, input)
                if why is not None:
                    _log_once(("fallback", path, why), "H3 Turbo compute=%s: %s; this call uses core's path "
                              "(dequantize + matmul)", path, why)
                    return super().forward(input, *args, **kwargs)
                comfy.ops.run_every_op()
                return _kernel_forward(self, input, path)

            def _apply(self, fn, recurse=True):
                # core hands the layer new weight tensors when ComfyUI moves/offloads it: drop the prepared copy
                # (and its references to the old storage) so they are freed with the old weights
                self._h3_cache = None
                return super()._apply(fn, recurse)

            def h3turbo_fusable(self, input) -> bool:
                """Cheap check: can :meth:`h3turbo_lora_forward` serve this call (GPU kernel path, bf16/fp16 input,
                no weight patch/offload/grad, no ``pre_quant_scale``)?"""
                if self._h3_path not in ("exact", "fp8") or input.dtype not in (torch.bfloat16, torch.float16) \
                        or input.device.type != "cuda":
                    return False
                if _kernel_blocker(self, input) is not None:
                    return False
                if getattr(self, "pre_quant_scale", None) is not None:
                    _log_once(("lora_pqs", self._h3_path), "H3 Turbo compute=%s: layers with pre_quant_scale run the "
                              "Turbo branch unfused (it must see the unsmoothed input)", self._h3_path)
                    return False
                return True

            def h3turbo_lora_forward(self, input, A, Bc, coef, blocks, amax_a, key=None):
                """This layer's output with the Turbo branch ``coef * Bc @ (A @ input)`` computed together by
                ``kernels.dispatch.linear_with_lora`` (weight-side fold / fused epilogue). Call it only for an input
                :meth:`h3turbo_fusable` accepted (the runtime branch checks first, once per call). A [blocks*r, K],
                Bc [N, r] and amax_a fp32 [blocks*r] on input's device and dtype; ``key`` identifies the adapter
                target (fp8: the fold stays in the layer's fp8 weight until another key or the base is needed). The
                branch sees ``input`` itself (layers with ``pre_quant_scale`` are never fusable)."""
                comfy.ops.run_every_op()
                return _kernel_forward(self, input, self._h3_path, lora=(A, Bc, coef, blocks, amax_a, key))

    H3TurboOps.__name__ = "H3TurboOps"
    return H3TurboOps


def _kernel_blocker(m, x) -> str | None:
    """Why a layer cannot use the h3_turbo kernels for this call (None = it can)."""
    from comfy.quant_ops import QuantizedTensor

    w = m.weight
    if not isinstance(w, QuantizedTensor) or getattr(m, "quant_format", None) != "nvfp4":
        return "the weight is not an NVFP4 QuantizedTensor"
    if len(m.weight_function) or len(m.bias_function):
        return "a weight patch (merged LoRA/hook) is active on the layer"
    if getattr(m, "comfy_force_cast_weights", False) or getattr(m, "comfy_cast_weights", False):
        return "the layer is offloaded (weights cast per call by ComfyUI's low-VRAM mode)"
    if x.requires_grad:
        return "the input requires grad"
    if w.device != x.device:
        return f"weight on {w.device}, input on {x.device}"
    return None


def _kernel_forward(m, x, path, lora=None):
    """y = dispatch.linear(x * pre_quant_scale, prepared(weight), path) + bias; ``prepared`` is cached
    per weight object (core's weight patching replaces the Parameter, which re-prepares). ``lora``:
    (A, Bc, coef, blocks, amax_a, key) -> ``dispatch.linear_with_lora`` (only without pre_quant_scale)."""
    from ..kernels import dispatch

    w = m.weight
    key = (id(w), w._qdata.data_ptr(), str(w._qdata.device), path)
    if m._h3_cache is None or m._h3_cache[0] != key:
        p = w._params
        packed = dispatch.PackedNVFP4(w._qdata, p.block_scale, p.scale, m.out_features, m.in_features)
        m._h3_cache = (key, dispatch.prepare(packed, path))
    pqs = getattr(m, "pre_quant_scale", None)
    if pqs is not None:
        x = x * pqs.to(device=x.device, dtype=x.dtype)
    bias = m.bias
    if bias is not None:
        bias = bias.to(device=x.device, dtype=x.dtype)
    if lora is not None:
        a, bc, coef, blocks, amax_a, key = lora
        return dispatch.linear_with_lora(x, m._h3_cache[1], path, a, bc, coef, blocks, bias=bias, amax_a=amax_a,
                                         fold_key=key)
    return dispatch.linear(x, m._h3_cache[1], path, bias)


WORKSPACE_CALLBACK = "h3turbo_workspace"


def _release_workspace_on_detach(patcher, unpatch_all=True) -> None:
    """ComfyUI ``ON_DETACH`` callback: free ``kernels.dispatch``'s reused per-call buffers when a model that
    uses them is unloaded (they are part of the size the loader reports, so ComfyUI expects them freed)."""
    from ..kernels import dispatch

    freed = dispatch.release_workspace()
    if freed:
        log.info("H3 Turbo: model unloaded, released %.0f MiB of kernel work buffers", freed / 2**20)


def install_compute(model_patcher, path: str) -> int:
    """Route the NVFP4 block projections of ``model_patcher``'s H3 through ``kernels.dispatch`` with
    ``path`` ("exact", "fp8", "blackwell_fp4"; "reference" restores core's forward). Returns the number
    of layers switched; RuntimeError if the model was not built with :func:`make_operations`. For a kernel
    path the patcher also gets an ``ON_DETACH`` callback that frees the kernels' work buffers on unload."""
    dm = model_patcher.model.diffusion_model
    n = 0
    for name, mod in dm.named_modules():
        if not name.endswith(PROJ_SUFFIXES) or not ("blocks." in name):
            continue
        if not hasattr(mod, "_h3_path"):
            raise RuntimeError(f"{name}: not built with the H3 Turbo operations; cannot install compute={path}")
        if getattr(mod, "quant_format", None) == "nvfp4":
            mod._h3_path = None if path == "reference" else path
            mod._h3_cache = None
            n += 1
    if path != "reference":
        from comfy.patcher_extension import CallbacksMP

        model_patcher.remove_callbacks_with_key(CallbacksMP.ON_DETACH, WORKSPACE_CALLBACK)   # once per patcher
        model_patcher.add_callback_with_key(CallbacksMP.ON_DETACH, WORKSPACE_CALLBACK, _release_workspace_on_detach)
    return n


PROJ_SUFFIXES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def kernel_extra_bytes(shapes: list[tuple[int, int]], path: str) -> int:
    """GPU bytes ``kernels.dispatch.prepare`` adds per model for ``path`` (kept beside the packed weight).

    shapes: logical [N, K] of every NVFP4 layer. exact: split-packed codes N*Kp/2 + plain scales N*Kp/16
    + 4; fp8: e4m3 weight roundup(N,16)*K + fp32 row scales 4*roundup(N,16); reference/blackwell_fp4: 0.
    """
    r = roundup
    if path == "exact":
        return sum(n * r(k, 16) // 2 + n * r(k, 16) // 16 + 4 for n, k in shapes)
    if path == "fp8":
        return sum(r(n, 16) * k + 4 * r(n, 16) for n, k in shapes)
    return 0


def check_values(path: str, sd: dict[str, torch.Tensor], det: Detection) -> None:
    """Value checks on the native state dict before building: block scales finite (no e4m3 NaN byte)
    and non-negative, global scales finite and > 0. Raises :class:`CheckpointError` naming the key."""
    for stem in det.quant_layers:
        bs = sd.get(f"{stem}.weight_scale")
        if bs is not None:
            u = bs.contiguous().view(-1).view(torch.uint8)
            nan = int(((u & 0x7F) == 0x7F).sum())
            if nan:
                raise CheckpointError(path, f"{nan} block scales are NaN", key=f"{stem}.weight_scale",
                                      expected="finite e4m3 scales")
            neg = int(((u & 0x80) != 0).sum())
            if neg:
                raise CheckpointError(path, f"{neg} block scales are negative", key=f"{stem}.weight_scale",
                                      expected="scales >= 0")
        for s in ("weight_scale_2", "input_scale"):
            v = sd.get(f"{stem}.{s}")
            if v is not None:
                x = float(v.float().reshape(-1)[0])
                if not (x > 0 and x != float("inf")):
                    raise CheckpointError(path, f"{s} is {x}", key=f"{stem}.{s}", expected="a finite number > 0")


def load_h3_model(path: str, compute: str = "auto", disable_dynamic: bool = False, keep_fp32_island: bool = True):
    """Validate, convert and build an H3 MODEL (a ComfyUI ModelPatcher) from ``path``.

    Raises :class:`CheckpointError` (damaged / not H3 / bad values) or RuntimeError (impossible
    ``compute``) before anything is built.
    """
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    load_device = mm.get_torch_device()
    cpath, reason = resolve_compute(compute, load_device)
    _log_once(("compute", compute, str(load_device), cpath),
              "H3 Turbo loader: compute=%s -> %s on %s (%s)", compute, cpath, load_device, reason)

    det = detect(read_header(path))
    det.raise_if_errors()
    for f in det.findings:
        if f.level == "warning":
            log.warning("%s: %s", path, f)
    plan = make_plan(det)
    work = len(plan.quantize) + len(plan.convert)
    pbar = comfy.utils.ProgressBar(max(work, 1))
    qdev = load_device if (plan.quantize and torch.device(load_device).type == "cuda") else "cpu"
    if plan.quantize:
        log.info("%s: %s checkpoint, quantizing %d layers to NVFP4 on %s", path, det.format, len(plan.quantize), qdev)
    elif det.format != "comfy_native":
        log.info("%s: converting %s (%d layers; nibbles %s [%s], scales %s [%s]) to the ComfyUI-native layout",
                 path, det.format, len(plan.convert), plan.nibble_order, det.nibble_order_source,
                 plan.scale_layout, det.scale_layout_source)
    try:
        sd = dict(iter_native(plan, progress=lambda d, t: pbar.update_absolute(d, t), device=qdev))
    except ValueError as e:
        raise CheckpointError(path, f"cannot quantize: {e}") from None
    check_values(path, sd, det)
    packed = sum(sd[f"{s}.{x}"].nbytes for s in set(plan.quantize) | set(plan.convert)
                 for x in ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")
                 if f"{s}.{x}" in sd)
    model_options = {}
    if keep_fp32_island:
        model_options["custom_operations"] = make_operations(load_device)
    kernels = cpath != "reference"
    extra = work_b = 0
    if kernels and not disable_dynamic:
        # DynamicVRAM streams every weight per call (comfy_cast_weights), which the kernels cannot use:
        # build with the classic ModelPatcher so the projections stay resident on the GPU.
        _log_once(("classic", cpath), "H3 Turbo loader: compute=%s uses ComfyUI's classic ModelPatcher "
                  "(resident weights) instead of DynamicVRAM streaming", cpath)
    mp = comfy.sd.load_diffusion_model_state_dict(sd, model_options=model_options, metadata=native_metadata(plan),
                                                  disable_dynamic=disable_dynamic or kernels)
    if mp is None:
        raise CheckpointError(path, "ComfyUI could not detect the model type of the converted state dict")
    mp.cached_patcher_init = (_reload, (path, compute, keep_fp32_island))
    if cpath != "reference":
        if not keep_fp32_island:
            raise RuntimeError(f"compute={cpath} needs the H3 Turbo operations (keep_fp32_island=True)")
        n = install_compute(mp, cpath)
        shapes = [(q.n, q.k) for q in det.quant_layers.values()]
        extra = kernel_extra_bytes(shapes, cpath)
        from ..kernels.dispatch import workspace_bytes

        work_b = workspace_bytes(shapes, cpath)
        # what ComfyUI reserves: packed weights + the kernels' prepared copies + their reused work buffers
        mp.size = int(mp.model_size()) + extra + work_b
        _log_once(("installed", path, cpath), "H3 Turbo loader: %d NVFP4 projections use compute=%s "
                  "(+%.2f GiB prepared weights, +%.2f GiB work buffers on the GPU)", n, cpath, extra / 2**30,
                  work_b / 2**30)
    contracts.attach(mp, None, compute=cpath, compute_reason=reason, source_format=det.format,
                     checkpoint=os.path.basename(path), packed_bytes=packed)
    state.record_loaded_model(path, format=det.format, compute=cpath, packed_bytes=packed,
                              bytes=int(mp.model_size()), layers_nvfp4=work,
                              kernel_extra_bytes=extra, kernel_workspace_bytes=work_b)
    return mp


def _reload(path, compute, keep_fp32_island=True, disable_dynamic=False):
    """``cached_patcher_init`` factory (core calls it with ``disable_dynamic=True`` for delegates)."""
    return load_h3_model(path, compute, disable_dynamic=disable_dynamic, keep_fp32_island=keep_fp32_island)


class H3TurboNVFP4Loader(io.ComfyNode):
    """Load an H3 diffusion model (native NVFP4, ModelOpt, LightX2V, or BF16 quantized on load) as MODEL."""

    @classmethod
    def define_schema(cls):
        import folder_paths

        return io.Schema(
            node_id="H3TurboNVFP4Loader",
            display_name="Load H3 NVFP4 Diffusion Model",
            category=CATEGORY,
            description="Loads a MiniMax H3 diffusion model with its 208 block projections in NVFP4 (ComfyUI-native, "
                        "ModelOpt or LightX2V files; BF16 files are quantized while loading). The file is validated "
                        "before anything is built. compute: auto picks the fastest exact path for the GPU; "
                        "reference is core's dequantize + matmul.",
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models")),
                io.Combo.Input("compute", options=list(COMPUTE_CHOICES), default="auto"),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name, compute="auto"):
        """Reload when the file changes on disk (size and mtime), not only when the name changes."""
        import folder_paths

        path = folder_paths.get_full_path("diffusion_models", unet_name)
        if path is None or not os.path.exists(path):
            return (unet_name, compute)
        st = os.stat(path)
        return (unet_name, compute, st.st_size, st.st_mtime_ns)

    @classmethod
    def execute(cls, unet_name, compute="auto") -> io.NodeOutput:
        import folder_paths

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        return io.NodeOutput(load_h3_model(path, compute))


NODES = [H3TurboNVFP4Loader]
