"""ComfyUI native NVFP4, marked for the whole file (``comfy_metadata``).

The tensors of :mod:`.comfy_native` without ``P.comfy_quant``; instead ``__metadata__["_quantization_metadata"]``
= ``{"format_version": "1.0", "layers": {P: {"format": "nvfp4"}, ...}}`` (layers in other core formats are
listed there too). Core turns each entry into a per-layer ``comfy_quant`` on load (ComfyUI
``comfy/utils.py`` ``convert_old_quants``); the conversion does the same and drops the whole-file entry.
"""
from __future__ import annotations

import json

from .base import Evidence, HeaderView, NVFP4Scheme, marker_tensor, native_stems


def _layers(det) -> dict:
    return json.loads(det.metadata["_quantization_metadata"])["layers"]


class ComfyMetadata(NVFP4Scheme):
    name = "comfy_metadata"

    def layer_stems(self, view: HeaderView) -> set[str]:
        return set(view.meta_layers)

    def claims(self, view):
        layers = view.meta_layers
        if not layers:
            return None
        return Evidence(f"__metadata__['_quantization_metadata'] lists {len(layers)} layer(s) "
                        f"(e.g. {min(layers)})", frozenset(layers))

    def layer_format(self, det, view, stem):
        conf = view.meta_layers.get(stem)
        return conf.get("format") if isinstance(conf, dict) else None

    def native_marker(self, det, stem, get):
        return marker_tensor(_layers(det).get(stem))

    def native_marker_len(self, det, T, stem):
        return len(json.dumps(_layers(det)[stem]).encode())

    def other_layer_markers(self, det):
        if not det.other_quant:
            return {}
        layers = _layers(det)
        return {s: layers[s] for s in det.other_quant}

    def from_native(self, sd, metadata=None, **options):
        """Every ``P.comfy_quant`` moved into ``__metadata__["_quantization_metadata"]``; no options."""
        layers = {s: json.loads(bytes(sd[f"{s}.comfy_quant"].tolist()).decode("utf-8")) for s in native_stems(sd)}
        out = {k: v for k, v in sd.items() if not k.endswith(".comfy_quant")}
        meta = dict(metadata or {}, _quantization_metadata=json.dumps({"format_version": "1.0", "layers": layers}))
        return out, meta


SCHEME = ComfyMetadata()
