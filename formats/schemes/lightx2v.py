"""LightX2V NVFP4 (``lightx2v``): global scales stored as their reciprocals.

Per layer ``P``: ``P.weight`` uint8 [N, K/2], ``P.weight_scale`` e4m3 swizzled, ``P.weight_global_scale``
fp32 [] = 1 / weight_scale_2; optional ``P.input_global_scale`` (= 1 / input_scale) with ``P.alpha``
(= input_scale * weight_scale_2), or ``P.input_absmax``. Nibble order as for ModelOpt
(``__metadata__["nvfp4_nibble_order"]``, else ASSUMED lo_first). Public source: ModelTC/LightX2V
``lightx2v/common/ops/mm/mm_weight.py`` (the NVFP4 MM weights); see ``docs/formats.md``.

Conversion computes ``weight_scale_2 = 1 / weight_global_scale`` (and ``input_scale`` likewise) in float64,
rounded once to fp32; ``alpha`` is dropped after a consistency check (core recomputes it).
"""
from __future__ import annotations

import logging
import math

import torch

from .. import nvfp4
from .base import HeaderView, NVFP4Scheme, native_stems, read_nibble_order, scalar_ok, swap_if_lo_first

log = logging.getLogger("h3_turbo")


class LightX2V(NVFP4Scheme):
    name = "lightx2v"
    detects_layout = True
    required = frozenset({"weight", "weight_scale", "weight_global_scale"})
    optional = frozenset({"input_global_scale", "alpha", "input_absmax"})
    alpha_is_quant_key = True
    marks = "carry a LightX2V weight_global_scale"

    def layer_stems(self, view: HeaderView) -> set[str]:
        return view.stems_with("weight_global_scale")

    def read_layout(self, det, view):
        read_nibble_order(det)

    def check_scalars(self, det, view, stem, present):
        for suf in ("weight_global_scale", "input_global_scale", "alpha", "input_absmax"):
            scalar_ok(det, view, f"{stem}.{suf}", suf)
        if "alpha" in present and "input_global_scale" not in present:
            det.error("alpha without input_global_scale", f"{stem}.alpha")

    def native_weight(self, w, plan):
        return swap_if_lo_first(w, plan)

    def native_tensor_scales(self, det, stem, get, present, out):
        wg = get("weight_global_scale").double().reshape(())
        out["weight_scale_2"] = (1.0 / wg).float()
        ins = None
        if "input_global_scale" in present:
            ins = (1.0 / get("input_global_scale").double().reshape(()))
        elif "input_absmax" in present:
            ins = get("input_absmax").double().reshape(()) / (nvfp4.F8_E4M3_MAX * nvfp4.F4_E2M1_MAX)
        if ins is not None:
            out["input_scale"] = ins.float()
            if "alpha" in present:
                a = float(get("alpha").double().reshape(()))
                want = float(ins) / float(wg)
                if not math.isclose(a, want, rel_tol=1e-4):
                    log.warning("%s: %s.alpha = %g but input_scale*weight_scale_2 = %g (alpha dropped; core "
                                "recomputes it)", det.path, stem, a, want)

    def native_has_input_scale(self, present):
        return "input_scale" in present or bool({"input_global_scale", "input_absmax"} & present)

    def from_native(self, sd, metadata=None, nibble_order="lo_first", **_):
        """Every ``comfy_quant`` layer re-expressed: nibbles swapped when ``nibble_order == "lo_first"``,
        swizzled scales kept, ``weight_global_scale = 1/weight_scale_2`` and, with an ``input_scale``,
        ``input_global_scale = 1/input_scale`` and ``alpha = input_scale * weight_scale_2`` (float64, rounded
        once to fp32); ``comfy_quant`` dropped. Metadata unchanged."""
        out, skip = {}, set()
        for s in native_stems(sd):
            w = sd[f"{s}.weight"]
            skip |= {f"{s}.{x}" for x in ("weight", "weight_scale", "weight_scale_2", "input_scale", "comfy_quant")}
            out[f"{s}.weight"] = nvfp4.swap_nibbles(w) if nibble_order == "lo_first" else w.clone()
            out[f"{s}.weight_scale"] = sd[f"{s}.weight_scale"].view(torch.uint8).view(torch.float8_e4m3fn).clone()
            ws2 = sd[f"{s}.weight_scale_2"].float().reshape(())
            out[f"{s}.weight_global_scale"] = (1.0 / ws2.double()).float()
            ins = sd.get(f"{s}.input_scale")
            if ins is not None:
                out[f"{s}.input_global_scale"] = (1.0 / ins.double()).float().reshape(())
                out[f"{s}.alpha"] = (ins.double() * ws2.double()).float().reshape(())
        out.update((k, v) for k, v in sd.items() if k not in skip)
        return out, dict(metadata or {})


SCHEME = LightX2V()
