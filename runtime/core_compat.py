"""The shapes of core's hook points that differ between ComfyUI releases, read from the core in use with
``getattr`` (never from a version number). ``hook_points()`` reports every variant found
(tests/test_reliability2.py prints it); docs/h3-facts.md ("Newer core") and docs/compat.md state each with its
source.

- :func:`fc2_bypass`: when core's H3 MLP (``comfy.ops.linear_input_act(fc2, fc1(x), "swiglu")``) computes
  ``fc2`` without calling ``fc2.forward``: ``"int8"`` (0.33: TensorWiseINT8 weights, comfy-kitchen's fused
  swiglu + int8 kernel) or ``"int8+fp16"`` (newer cores with ``comfy.ops._fp16_linear_wanted``: also plain
  weights when the activation is fp16 on CUDA with fp16 accumulation on, through ``ck.fp16_linear``).
  :func:`fc2_bypass_reason` says why one fc2 layer needs the Turbo branch at the MLP level.
- :func:`pdd_heads`: whether core's FinalLayer runs PDD head banks (``final_layer.video_out`` with n heads).
- :func:`fun_controlnet`: whether core has the Fun ControlNet node (``MiniMaxH3FunControlNetApply``).
- :func:`mod_rows`: what a modulation row in core's ``mod_segments`` [(start, stop, row)] (and the final layer's
  ``video_seg`` / ``audio_seg``) may be: ``"index"`` (0.33: one int per segment) or ``"index|per-token"`` (cores with
  ``_mod_row``, 2026-08-22 and newer: also an int64 index tensor with one entry per row of the segment, made for a
  latent denoise mask). :func:`check_mod_row` validates one row against that contract for the hooks that
  re-implement core's modulation (the fused block, the Multi-GPU shard).
Comfy is imported lazily (these are called with a booted ComfyUI).
"""
from __future__ import annotations

import sys

import torch

FUN_CONTROL_PATCH = "MiniMaxH3FunControlPatch"  # core's class whose bound method is the Fun ControlNet's wrapper


def fc2_bypass() -> str:
    """``"int8+fp16"`` when core's ``comfy.ops`` has the fp16 fast path (``_fp16_linear_wanted``), else ``"int8"``
    (also when ComfyUI is not importable: then no core forward can bypass ``fc2.forward``)."""
    comfy_ops = sys.modules.get("comfy.ops")
    if comfy_ops is None:
        try:
            import comfy.ops as comfy_ops
        except ImportError:
            return "int8"
    return "int8+fp16" if callable(getattr(comfy_ops, "_fp16_linear_wanted", None)) else "int8"


def fc2_bypass_reason(fc2) -> str | None:
    """Why core may compute this ``mlp.fc2`` layer without calling its ``forward`` (so a Turbo branch wrapping
    ``forward`` would be skipped), or None when it always calls it."""
    w = getattr(fc2, "weight", None)
    if getattr(w, "_layout_cls", None) == "TensorWiseINT8Layout":  # a string in core's QuantizedTensor
        return "INT8 tensor-wise weight (core's fused swiglu + int8 kernel)"
    if fc2_bypass() == "int8+fp16":
        from comfy.quant_ops import QuantizedTensor

        if not isinstance(w, QuantizedTensor):
            return "plain weight on a core with the fp16 fast path (_fp16_linear_wanted -> ck.fp16_linear)"
    return None


def pdd_heads() -> bool:
    """True when core's H3 FinalLayer runs PDD head banks (``comfy.ldm.minimax.model._pdd_head`` exists)."""
    import comfy.ldm.minimax.model as m

    return callable(getattr(m, "_pdd_head", None))


def fun_controlnet() -> bool:
    """True when core registers ``MiniMaxH3FunControlNetApply`` (``comfy_extras.nodes_minimax_h3``)."""
    mod = sys.modules.get("comfy_extras.nodes_minimax_h3")
    if mod is None:
        try:
            import comfy_extras.nodes_minimax_h3 as mod
        except ImportError:
            return False
    return hasattr(mod, "MiniMaxH3FunControlNetApply")


def core_version() -> str:
    """ComfyUI's ``comfyui_version.__version__``, or "unknown"."""
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def mod_rows() -> str:
    """``"index|per-token"`` when core's H3 has ``_mod_row`` (a modulation row may be a per-token index tensor), else
    ``"index"``."""
    import comfy.ldm.minimax.model as m

    return "index|per-token" if callable(getattr(m, "_mod_row", None)) else "index"


def check_mod_row(row, n: int, where: str):
    """The modulation row of one segment of ``n`` rows, as core's ``_mod_row`` reads it: an int (also a 0-d int64 /
    int32 tensor, returned as int) or an int64 / int32 index tensor [n] (returned as it is). Anything else is a
    ValueError naming ``where``, the row's type / shape and the ComfyUI version (a core whose modulation rows the
    pack does not know)."""
    if isinstance(row, torch.Tensor):
        if row.dtype in (torch.int64, torch.int32):        # (uint8 / bool would index as a mask)
            if row.ndim == 0:
                return int(row)
            if row.ndim == 1 and row.shape[0] == n:
                return row
        what = f"a {row.dtype} tensor of shape {tuple(row.shape)}"
    elif isinstance(row, int) and not isinstance(row, bool):
        return row
    else:
        what = f"a {type(row).__name__}"
    raise ValueError(f"{where}: core's modulation row is {what}; the pack knows an int or an int64 / int32 index "
                     f"tensor with one entry per row of the segment ({n}) (ComfyUI {core_version()})")


def hook_points() -> dict[str, str]:
    """{hook point: the variant the core in use has}."""
    return {"linear_input_act fc2 bypass": fc2_bypass(),
            "FinalLayer PDD head banks": "yes" if pdd_heads() else "no",
            "MiniMaxH3FunControlNetApply": "yes" if fun_controlnet() else "no",
            "mod_segments modulation rows": mod_rows()}


def is_fun_controlnet_wrapper(fn) -> bool:
    """True for the DIFFUSION_MODEL wrapper core's MiniMaxH3FunControlNetApply registers (unkeyed): a bound
    method of ``MiniMaxH3FunControlPatch``."""
    return type(getattr(fn, "__self__", None)).__name__ == FUN_CONTROL_PATCH
