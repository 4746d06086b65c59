"""ComfyUI native NVFP4, marked per layer (``comfy_native``): the layout core's loader and this pack run.

Per layer ``P``: ``P.weight`` uint8 [roundup(N,16), roundup(K,16)/2] (element 2j in the high nibble),
``P.weight_scale`` e4m3 swizzled [roundup(N,128), roundup(K/16,4)], ``P.weight_scale_2`` fp32 [],
optional ``P.input_scale`` fp32 [] and ``P.pre_quant_scale`` [K], and ``P.comfy_quant`` = uint8 bytes of
the JSON ``{"format": "nvfp4"}`` (other core formats carry their own JSON and are left as they are).
Public source: ComfyUI ``comfy/ops.py`` / ``comfy/quant_ops.py``; see ``docs/formats.md``.
"""
from __future__ import annotations

import json

from .base import SKIP, HeaderView, NVFP4Scheme


class ComfyNative(NVFP4Scheme):
    name = "comfy_native"
    is_native = True
    required = frozenset({"weight", "weight_scale", "weight_scale_2", "comfy_quant"})
    marks = "carry a per-layer comfy_quant JSON tensor"

    def layer_stems(self, view: HeaderView) -> set[str]:
        return view.stems_with("comfy_quant")

    def layer_format(self, det, view, stem):
        ck = view.small.get(f"{stem}.comfy_quant")
        if ck is None:
            det.error("comfy_quant is not a small uint8 tensor", f"{stem}.comfy_quant")
            return SKIP
        try:
            conf = json.loads(bytes(ck.to("cpu").view(-1).tolist()).decode("utf-8"))
            return conf.get("format")
        except Exception as e:
            det.error(f"comfy_quant is not UTF-8 JSON ({e})", f"{stem}.comfy_quant")
            return SKIP

    def native_marker(self, det, stem, get):
        return get("comfy_quant")

    def native_marker_len(self, det, T, stem):
        return T[f"{stem}.comfy_quant"].shape[0]

    def from_native(self, sd, metadata=None, **options):
        """The native state dict itself (a shallow copy); no options."""
        return dict(sd), dict(metadata or {})


SCHEME = ComfyNative()
