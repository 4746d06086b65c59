"""Test material for the loader: the tiny native NVFP4 fixture re-expressed in every supported format (with
each scheme's ``from_native``, :mod:`h3_turbo.formats.registry`), and damaged copies of a safetensors file
(one kind of damage each). No ComfyUI needed.

``make_format_variants(native, bf16, out_dir)`` writes (names -> paths):

- ``metadata``: whole-file ``_quantization_metadata`` instead of per-layer ``comfy_quant``;
- ``modelopt_lo_linear``: ModelOpt-style, nibbles low-first, plain [N, K/16] scales, no metadata hints;
- ``modelopt_hi_linear_meta``: nibbles high-first + plain scales, declared in ``__metadata__``;
- ``modelopt_lo_swizzled_meta``: nibbles low-first + swizzled scales, declared in ``__metadata__``;
- ``lightx2v``: ``weight_global_scale`` / ``input_global_scale`` / ``alpha``, swizzled scales, low-first;
- ``prefixed``: the native file with every key under ``model.diffusion_model.``;
- ``bf16_prefixed``: the BF16 file under ``diffusion_model.``.
"""
from __future__ import annotations

import json
import os
import struct

import torch

from ..formats import registry


def _load(path):
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _save(sd, path, meta):
    from safetensors.torch import save_file

    save_file(sd, path, metadata=meta or None)
    return path


def make_format_variants(native: str, bf16: str, out_dir: str, input_scale: float | None = 0.01) -> dict[str, str]:
    """Write the variants listed in the module doc into ``out_dir``; returns {name: path}.

    input_scale: when set, every NVFP4 layer gets ``input_scale`` (so LightX2V gets
    ``input_global_scale`` and ``alpha``; core only uses it on Blackwell's FP4 path).
    """
    os.makedirs(out_dir, exist_ok=True)
    sd, meta = _load(native)
    if input_scale is not None:
        for k in [k for k in sd if k.endswith(".comfy_quant")]:
            sd[k[: -len("comfy_quant")] + "input_scale"] = torch.tensor(float(input_scale), dtype=torch.float32)
    out: dict[str, str] = {}
    p = lambda n: os.path.join(out_dir, f"h3_tiny_{n}.safetensors")  # noqa: E731

    def write(name, fmt, **options):
        tensors, m = registry.get(fmt).from_native(sd, meta, **options)
        out[name] = _save(tensors, p(name), m)

    write("metadata", "comfy_metadata")
    write("modelopt_lo_linear", "modelopt", nibble_order="lo_first", scale_layout="linear")
    write("modelopt_hi_linear_meta", "modelopt", nibble_order="hi_first", scale_layout="linear", declare=True)
    write("modelopt_lo_swizzled_meta", "modelopt", nibble_order="lo_first", scale_layout="swizzled", declare=True)
    write("lightx2v", "lightx2v", nibble_order="lo_first")
    out["prefixed"] = _save({"model.diffusion_model." + k: v for k, v in sd.items()}, p("prefixed"), meta)
    bsd, bmeta = _load(bf16)
    out["bf16_prefixed"] = _save({"diffusion_model." + k: v for k, v in bsd.items()}, p("bf16_prefixed"), bmeta)
    out["native_input_scale"] = _save(sd, p("native_input_scale"), meta)
    return out


DAMAGE_KINDS = ("lfs_pointer", "header_too_long", "json_garbage", "truncated", "trailing_bytes", "shape_mismatch",
                "too_small")


def damage(src: str, kind: str, dst: str) -> str:
    """Write a damaged copy of ``src`` to ``dst`` (one of :data:`DAMAGE_KINDS`). Returns ``dst``."""
    raw = open(src, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    if kind == "lfs_pointer":
        data = (b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 +
                b"\nsize " + str(len(raw)).encode() + b"\n")
    elif kind == "header_too_long":
        data = struct.pack("<Q", len(raw) * 4) + raw[8:]
    elif kind == "json_garbage":
        data = raw[:8] + b"{\"a\": [" + b"\x00" * (n - 7) + raw[8 + n:]
    elif kind == "truncated":
        data = raw[: 8 + n + (len(raw) - 8 - n) // 2]
    elif kind == "trailing_bytes":
        data = raw + b"\x00" * 100
    elif kind == "shape_mismatch":
        key = next(k for k, v in hdr.items() if k != "__metadata__" and v["dtype"] == "BF16" and len(v["shape"]) == 2)
        hdr[key]["shape"] = [hdr[key]["shape"][0], hdr[key]["shape"][1] * 2]
        h = json.dumps(hdr).encode()
        h += b" " * ((8 - len(h) % 8) % 8)
        data = struct.pack("<Q", len(h)) + h + raw[8 + n:]
    elif kind == "too_small":
        data = raw[:5]
    else:
        raise ValueError(f"unknown damage kind {kind!r}; expected one of {DAMAGE_KINDS}")
    with open(dst, "wb") as f:
        f.write(data)
    return dst
