"""The pack's operations inside core's H3: core's ``mixed_precision_ops`` with H3's fp32 island kept in fp32,
and the NVFP4 block projections routed through :mod:`h3_turbo.kernels.dispatch` on a compute path.

- :func:`make_operations`: the operations class for ``comfy.sd.load_diffusion_model_state_dict``
  (``model_options["custom_operations"]``); its Linear implements :class:`.layer.FusedLoRALinear`;
- :func:`install_compute`: switch a built model's 208 NVFP4 projections to a compute path and weight mode;
  registers an ``ON_DETACH`` callback that frees the kernels' work buffers and prepared copies on unload.

A call the kernels cannot serve (no NVFP4 weight, a weight patch, low-VRAM offload, grad, device
mismatch) runs core's own forward, logged once with the reason. ComfyUI is imported lazily.
"""
from __future__ import annotations

import sys
import weakref

import torch

from ..logs import log, log_once
from ..model_facts import PROJECTIONS

WORKSPACE_CALLBACK = "h3turbo_workspace"


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
                self._h3_lean = False     # weights=lean: no per-layer prepared copy (install_compute)
                self._h3_cache = None
                if dtype == torch.float32 and self.factory_kwargs["dtype"] not in (None, torch.float32):
                    self.factory_kwargs = {"device": device, "dtype": torch.float32}
                    if bias:
                        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=torch.float32))

            def forward(self, input, *args, **kwargs):
                path = self._h3_path
                if path is None or path == "reference":
                    return super().forward(input, *args, **kwargs)
                why = kernel_blocker(self, input)
                if why is not None:
                    log_once(("fallback", path, why), "H3 Turbo compute=%s: %s; this call uses core's path "
                             "(dequantize + matmul)", path, why)
                    return super().forward(input, *args, **kwargs)
                comfy.ops.run_every_op()
                return kernel_forward(self, input, path)

            def _apply(self, fn, recurse=True):
                # core hands the layer new weight tensors when ComfyUI moves/offloads it: drop the prepared copy
                # (and its references to the old storage) so they are freed with the old weights
                self._h3_cache = None
                return super()._apply(fn, recurse)

            def h3turbo_fusable(self, input) -> bool:
                """See :class:`h3_turbo.runtime.layer.FusedLoRALinear`."""
                if self._h3_path not in ("exact", "fp8") or input.dtype not in (torch.bfloat16, torch.float16) \
                        or input.device.type != "cuda":
                    return False
                if kernel_blocker(self, input) is not None:
                    return False
                if getattr(self, "pre_quant_scale", None) is not None:
                    log_once(("lora_pqs", self._h3_path), "H3 Turbo compute=%s: layers with pre_quant_scale run the "
                             "Turbo branch unfused (it must see the unsmoothed input)", self._h3_path)
                    return False
                return True

            def h3turbo_lora_forward(self, input, A, Bc, coef, blocks, amax_a, key=None):
                """See :class:`h3_turbo.runtime.layer.FusedLoRALinear` (``kernels.dispatch.linear_with_lora``)."""
                comfy.ops.run_every_op()
                return kernel_forward(self, input, self._h3_path, lora=(A, Bc, coef, blocks, amax_a, key))

    H3TurboOps.__name__ = "H3TurboOps"
    return H3TurboOps


def kernel_blocker(m, x) -> str | None:
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


def prepared(m, path: str):
    """The layer's prepared weight for ``path`` (made at the first call, cached per weight object, storage, in-place
    version, path and weight mode in ``m._h3_cache``; core's weight patching replaces the Parameter or copies into it,
    either of which re-prepares). The one cache
    every user of a layer's prepared weight goes through (:func:`kernel_forward`, the fused block)."""
    from ..kernels import dispatch

    w = m.weight
    lean = bool(getattr(m, "_h3_lean", False))
    p = w._params
    # the weight object itself (a weak reference: an id can be reused), its storage, and the in-place version
    # counters of its data and scales (ComfyUI's weight_inplace_update patches copy into the same storage)
    key = (w._qdata.data_ptr(), _versions(w._qdata, p.block_scale, p.scale), str(w._qdata.device), path, lean)
    c = m._h3_cache
    if c is None or c[0] != key or c[2]() is not w:
        packed = dispatch.PackedNVFP4(w._qdata, p.block_scale, p.scale, m.out_features, m.in_features)
        m._h3_cache = None            # the old prepared copy goes before the new one is made (peak memory)
        m._h3_cache = (key, dispatch.prepare(packed, path, lean=lean), weakref.ref(w))
    return m._h3_cache[1]


def _versions(*tensors) -> tuple:
    """The in-place version counters of ``tensors`` (None for a tensor made under ``torch.inference_mode``, which
    has none: its cache key is then the weight object and its storage alone). Asked with ``is_inference()``, not
    by catching ``_version``'s RuntimeError: the exception costs ~20 us a tensor, three per layer call."""
    return tuple(t._version if isinstance(t, torch.Tensor) and not t.is_inference() else None for t in tensors)


def kernel_forward(m, x, path, lora=None):
    """y = dispatch.linear(x * pre_quant_scale, prepared(weight), path) + bias; ``prepared`` is cached
    per weight object (core's weight patching replaces the Parameter, which re-prepares). ``lora``:
    (A, Bc, coef, blocks, amax_a, key) -> ``dispatch.linear_with_lora`` (only without pre_quant_scale)."""
    from ..kernels import dispatch

    prep = prepared(m, path)
    pqs = getattr(m, "pre_quant_scale", None)
    if pqs is not None:
        x = x * pqs.to(device=x.device, dtype=x.dtype)
    bias = m.bias
    if bias is not None:
        bias = bias.to(device=x.device, dtype=x.dtype)
    if lora is not None:
        a, bc, coef, blocks, amax_a, key = lora
        return dispatch.linear_with_lora(x, prep, path, a, bc, coef, blocks, bias=bias, amax_a=amax_a,
                                         fold_key=key)
    return dispatch.linear(x, prep, path, bias)


def _release_workspace_on_detach(patcher, unpatch_all=True) -> None:
    """ComfyUI ``ON_DETACH`` callback: when a model that uses the kernels is unloaded (``unpatch_all`` True:
    ``model_unload`` from ``free_memory`` / ``unload_all_models``), free their reused per-call buffers and every
    layer's prepared copy (both are part of the size the loader reports, so ComfyUI expects them freed; a layer
    prepares again at its next call). ``unpatch_all`` False is a patcher handing the same model over: another clone
    being loaded (``load_models_gpu`` detaches the loaded clone first, e.g. the sampler's patcher after a node
    changed) or a clone collected while ComfyUI keeps the model loaded through its parent. The model stays loaded
    and counted then, so both are kept (the prepared copies re-validate themselves per weight object: a patched
    weight prepares again)."""
    if not unpatch_all:
        if sys.meta_path is not None:         # not from a patcher's __del__ at interpreter exit
            log_once(("detach_kept",), "H3 Turbo: a patcher of this model was detached without unloading it (a "
                     "clone handed over) -> the kernels' prepared weights and buffers are kept")
        return
    from ..kernels import dispatch

    freed = dispatch.release_workspace()
    dropped = drop_prepared(patcher)
    if freed or dropped:
        log.info("H3 Turbo: model unloaded, released %.0f MiB of kernel work buffers and the prepared weights of "
                 "%d layers", freed / 2**20, dropped)


def drop_prepared(model_patcher) -> int:
    """Drop the prepared copy of every NVFP4 projection of ``model_patcher``'s H3 (made again at the next call);
    returns how many layers held one."""
    n = 0
    for mod in model_patcher.model.diffusion_model.modules():
        if getattr(mod, "_h3_cache", None) is not None:
            mod._h3_cache = None
            n += 1
    return n


def install_compute(model_patcher, path: str, weights: str = "resident") -> int:
    """Route the NVFP4 block projections of ``model_patcher``'s H3 through ``kernels.dispatch`` with
    ``path`` ("exact", "fp8", "blackwell_fp4"; "reference" restores core's forward) and ``weights``
    ("resident": the path's prepared copies; "lean": none, derived per call — same output). Returns the number
    of layers switched; RuntimeError if the model was not built with :func:`make_operations`, ValueError for
    an unknown ``weights``. For a kernel path the patcher also gets an ``ON_DETACH`` callback that frees the
    kernels' work buffers and prepared copies on unload."""
    if weights not in ("resident", "lean"):
        raise ValueError(f"weights={weights!r}: expected resident or lean")
    dm = model_patcher.model.diffusion_model
    n = 0
    for name, mod in dm.named_modules():
        if not name.endswith(PROJECTIONS) or not ("blocks." in name):
            continue
        if not hasattr(mod, "_h3_path"):
            raise RuntimeError(f"{name}: not built with the H3 Turbo operations; cannot install compute={path}")
        if getattr(mod, "quant_format", None) == "nvfp4":
            mod._h3_path = None if path == "reference" else path
            mod._h3_lean = weights == "lean"
            mod._h3_cache = None
            n += 1
    if path != "reference":
        from comfy.patcher_extension import CallbacksMP

        model_patcher.remove_callbacks_with_key(CallbacksMP.ON_DETACH, WORKSPACE_CALLBACK)   # once per patcher
        model_patcher.add_callback_with_key(CallbacksMP.ON_DETACH, WORKSPACE_CALLBACK, _release_workspace_on_detach)
    return n
