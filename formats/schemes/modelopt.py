"""NVIDIA ModelOpt NVFP4 export (``modelopt``): NVFP4 tensors without any ComfyUI or LightX2V marker.

Per layer ``P``: ``P.weight`` uint8 [N, K/2], ``P.weight_scale`` e4m3 [N, K/16] (plain) or swizzled,
``P.weight_scale_2`` fp32 [], ``P.input_scale`` fp32 [], optional ``P.pre_quant_scale`` [K]. Nibble order
and scale layout are not fixed by the format: ``__metadata__["nvfp4_nibble_order"]`` (hi_first |
lo_first) and ``["nvfp4_scale_layout"]`` (linear | swizzled) state them; else the scale shapes decide
the layout when they can, else (lo_first, linear) is ASSUMED and reported. Public source: NVIDIA
TensorRT-Model-Optimizer ``modelopt/torch/export/quant_utils.py``; see ``docs/formats.md``.
"""
from __future__ import annotations

import torch

from .. import nvfp4
from ..nvfp4 import roundup
from .base import HeaderView, NVFP4Scheme, native_stems, read_nibble_order, swap_if_lo_first


class ModelOpt(NVFP4Scheme):
    name = "modelopt"
    detects_layout = True
    marks = "carry NVFP4 weight_scale / weight_scale_2 tensors without a comfy_quant, metadata or LightX2V marker"

    def layer_stems(self, view: HeaderView) -> set[str]:
        """NVFP4 stems that no marker-carrying scheme (comfy_quant, metadata layers, weight_global_scale) owns."""
        return (view.nvfp4_stems - view.stems_with("comfy_quant") - view.stems_with("weight_global_scale")
                - set(view.meta_layers))

    def read_layout(self, det, view):
        read_nibble_order(det)
        sl = det.metadata.get("nvfp4_scale_layout")
        if sl in ("linear", "swizzled"):
            det.scale_layout, det.scale_layout_source = sl, "metadata"
            return
        votes = set()
        for s, q in det.quant_layers.items():
            t = view.tensors.get(f"{s}.weight_scale")
            if t is None or len(t.shape) != 2:
                continue
            lin = (q.n, q.k // 16)
            swz = (roundup(q.n, 128), roundup(q.k // 16, 4))
            if lin != swz:
                if tuple(t.shape) == lin:
                    votes.add("linear")
                elif tuple(t.shape) == swz:
                    votes.add("swizzled")
        if len(votes) == 1:
            det.scale_layout, det.scale_layout_source = votes.pop(), "shapes"
        elif len(votes) > 1:
            det.error("modelopt: block-scale shapes disagree between layers (some plain [N,K/16], some swizzled)")
        else:
            det.scale_layout, det.scale_layout_source = "linear", "assumed"
            det.warn("modelopt: block-scale layout cannot be told from the shapes or metadata; ASSUMED plain "
                     "[N, K/16] (ModelOpt export). Override with `convert --scale-layout swizzled`")

    def native_weight(self, w, plan):
        return swap_if_lo_first(w, plan)

    def native_block_scales(self, bs, plan):
        return nvfp4.to_blocked(bs) if plan.scale_layout == "linear" else bs

    def from_native(self, sd, metadata=None, nibble_order="lo_first", scale_layout="linear", declare=False, **_):
        """Every ``comfy_quant`` layer re-expressed: nibbles swapped when ``nibble_order == "lo_first"``,
        block scales plain [N, K/16] when ``scale_layout == "linear"`` (else swizzled), ``weight_scale_2`` and
        ``input_scale`` kept, ``comfy_quant`` dropped. ``declare``: state both in ``__metadata__``."""
        out, skip = {}, set()
        for s in native_stems(sd):
            w = sd[f"{s}.weight"]
            n, k = w.shape[0], w.shape[1] * 2
            skip |= {f"{s}.{x}" for x in ("weight", "weight_scale", "weight_scale_2", "input_scale", "comfy_quant")}
            out[f"{s}.weight"] = nvfp4.swap_nibbles(w) if nibble_order == "lo_first" else w.clone()
            bs = sd[f"{s}.weight_scale"].view(torch.uint8)
            if scale_layout == "linear":
                bs = nvfp4.from_blocked(bs, n, k // 16).contiguous()
            out[f"{s}.weight_scale"] = bs.view(torch.float8_e4m3fn).clone()
            out[f"{s}.weight_scale_2"] = sd[f"{s}.weight_scale_2"].float().reshape(()).clone()
            ins = sd.get(f"{s}.input_scale")
            if ins is not None:
                out[f"{s}.input_scale"] = ins.float().reshape(()).clone()
        out.update((k, v) for k, v in sd.items() if k not in skip)
        meta = dict(metadata or {})
        if declare:
            meta.update(nvfp4_nibble_order=nibble_order, nvfp4_scale_layout=scale_layout)
        return out, meta


SCHEME = ModelOpt()
