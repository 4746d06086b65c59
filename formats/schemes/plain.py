"""Plain float checkpoints (``bf16``, ``fp16``, ``fp32``, ``mixed-plain``) and the unclaimed file (``unknown``).

A plain file has no quantization marker at all (:attr:`HeaderView.quant_marked` is False); its format is
the dtype of the 4 x (layers + refiner) block projections' ``.weight``: one of BF16 / F16 / F32, or
``mixed-plain`` when they mix those. Converting it quantizes the selected layers to native NVFP4 with
:func:`h3_turbo.formats.nvfp4.quantize` (comfy-kitchen's quantizer bit for bit).

:data:`UNCLAIMED` (``unknown``) is what detect uses when no registered scheme claims a file (or the file is
not H3): it keeps the findings for projections in a dtype no scheme explains and for stray quantization keys.
"""
from __future__ import annotations

import json

import torch

from .. import nvfp4
from .base import (NATIVE_MARKER, QUANT_SUFFIXES, Evidence, HeaderView, Scheme, marker_tensor,
                   native_layer_entries, native_stems, split_key)

PLAIN_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def orphan_quant_keys(det, view: HeaderView, fmt: str) -> None:
    """Error for every quantization key in a file no quantized scheme claims (``alpha`` may be a LoRA's)."""
    for k in view.tensors:
        stem, suf = split_key(k)
        if suf in QUANT_SUFFIXES and suf != "alpha":
            det.error(f"quantization key in a plain {fmt} checkpoint (no layer is marked quantized)", k)


class Plain(Scheme):
    """Float block projections; ``dtype``: the safetensors dtype they all share, None for ``mixed-plain``."""

    is_plain = True

    def __init__(self, name: str, dtype: str | None):
        self.name, self.dtype = name, dtype

    def claims(self, view: HeaderView) -> Evidence | None:
        if view.quant_marked:
            return None
        dts = view.projection_dtypes
        if self.dtype is not None:
            ok = len(dts) == 1 and self.dtype in dts
        else:
            ok = len(dts) > 1 and all(d in PLAIN_DTYPES for d in dts)
        if not ok:
            return None
        held = ", ".join(f"{n} {d}" for d, n in sorted(dts.items()))
        return Evidence(f"block projections are {held} and no layer carries a quantization marker")

    def detect_layers(self, det, view):
        det.projection_dtypes = dict(view.projection_dtypes)

    def validate(self, det, view):
        orphan_quant_keys(det, view, self.name)

    def to_native(self, plan, stem, get, present, device="cpu"):
        """Quantize one float layer to native NVFP4 on ``device`` (results on the CPU); ``bias`` copied.
        Raises ValueError for non-2-D or non-finite weights (from :func:`nvfp4.quantize`)."""
        w = get("weight")
        q, bs, s = nvfp4.quantize(w.to(device))
        del w
        layer = {"weight": q.cpu(), "weight_scale": bs.cpu(), "weight_scale_2": s.cpu(), "comfy_quant": marker_tensor()}
        if "bias" in present:
            layer["bias"] = get("bias")
        return layer

    def native_entries(self, det, T, stem):
        n, k = T[f"{stem}.weight"].shape
        return native_layer_entries(T, stem, n, k, f"{stem}.bias" in T, False, None, len(NATIVE_MARKER))

    def from_native(self, sd, metadata=None, dtypes=None, **_):
        """Every NVFP4 ``comfy_quant`` layer dequantized (exact float64 product, rounded once) to this
        scheme's dtype (``mixed-plain``: ``dtypes`` cycled over the layers, default BF16 then F16) with its
        stored (padded) shape; its scales and ``comfy_quant`` dropped. Layers in other core formats and every
        other tensor are kept. Metadata unchanged."""
        cycle = [PLAIN_DTYPES[self.dtype]] if self.dtype else [PLAIN_DTYPES[d] for d in (dtypes or ("BF16", "F16"))]
        out, drop = {}, set()
        for i, s in enumerate(native_stems(sd)):
            if json.loads(bytes(sd[f"{s}.comfy_quant"].tolist())).get("format") != "nvfp4":
                continue
            w = nvfp4.dequantize_fp64(sd[f"{s}.weight"], sd[f"{s}.weight_scale_2"].float(), sd[f"{s}.weight_scale"])
            out[f"{s}.weight"] = w.to(cycle[i % len(cycle)]).contiguous()
            drop |= {f"{s}.{x}" for x in ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale",
                                          "comfy_quant")}
        return {k: out.get(k, v) for k, v in sd.items() if k not in drop}, dict(metadata or {})


BF16 = Plain("bf16", "BF16")
FP16 = Plain("fp16", "F16")
FP32 = Plain("fp32", "F32")
MIXED = Plain("mixed-plain", None)


class Unclaimed(Scheme):
    """No registered scheme claims the file (``unknown``): never claims, keeps today's findings."""

    name = "unknown"

    def claims(self, view):
        return None

    def detect_layers(self, det, view):
        dts = dict(view.projection_dtypes)
        det.projection_dtypes = dts
        if dts:
            det.error(f"block projections stored as {sorted(dts)} without quantization markers "
                      "(no comfy_quant / _quantization_metadata / weight_scale_2): cannot tell the format")

    def validate(self, det, view):
        orphan_quant_keys(det, view, self.name)

    def from_native(self, sd, metadata=None, **options):
        raise ValueError("no format to write: 'unknown' is what detection reports when no scheme claims a file")


UNCLAIMED = Unclaimed()
