"""The value check of every tensor of a checkpoint: one validation for ``inspect``, ``quantize`` / ``convert``
and the loader (and, through :func:`problems`, for Turbo LoRA adapters).

What is checked, per tensor (:func:`problems`):

- float tensors (F16, BF16, F32, F64): every value finite (NaN and Inf counted);
- float8 tensors: F8_E4M3 has no Inf and NaN is the byte 0x7F / 0xFF; F8_E5M2 is non-finite when its
  exponent bits are all ones;
- NVFP4 block scales (``P.weight_scale`` of an NVFP4 layer, e4m3 or uint8 bytes of e4m3): finite and >= 0;
- integer and packed tensors (E2M1 codes, ``comfy_quant`` JSON) hold no invalid values.

The check reads one tensor at a time (streaming): :func:`scan` (``inspect``) reports every bad tensor as a
finding; :class:`CheckedReader` (``formats.convert.iter_native``: the loader, ``quantize``, ``convert``)
raises :class:`CheckpointError` naming the first bad tensor before anything is built or written. Its cost
is one pass over the data: ``docs/formats.md`` ("Value check").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .safetensors_io import CheckpointError, open_tensors

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_finite(t: torch.Tensor) -> bool:
    """True when every value of the float tensor ``t`` (not empty) is finite. ``aminmax`` propagates NaN and
    +-Inf and reads ``t`` once without a temporary (``isfinite(t).all()`` is ~50x slower on BF16 on the CPU)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def problems(t: torch.Tensor, block_scale: bool = False) -> list[str]:
    """What is wrong with the values of ``t`` (an empty list when nothing is): one phrase per problem, each
    ending in what was expected. ``block_scale``: ``t`` is an NVFP4 block-scale tensor (e4m3 or its uint8
    bytes), which must also be >= 0."""
    if t.dtype in _FLOATS:
        if t.numel() == 0 or all_finite(t):
            return []
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        return [f"{nan} NaN and {inf} Inf values of {t.numel()} (expected finite values)"]
    if t.dtype == torch.float8_e4m3fn or (block_scale and t.dtype == torch.uint8):
        u = t.contiguous().view(-1).view(torch.uint8)
        nan = int(((u & 0x7F) == 0x7F).sum())
        if not block_scale:
            return [f"{nan} NaN values of {t.numel()} (e4m3 0x7F/0xFF; expected finite values)"] if nan else []
        out = [f"{nan} block scales are NaN (e4m3 0x7F/0xFF; expected finite)"] if nan else []
        neg = int(((u & 0x80) != 0).sum())
        return out + ([f"{neg} block scales are negative (expected >= 0)"] if neg else [])
    if t.dtype == torch.float8_e5m2:
        u = t.contiguous().view(-1).view(torch.uint8)
        bad = int(((u & 0x7C) == 0x7C).sum())
        return [f"{bad} NaN or Inf values of {t.numel()} (e5m2; expected finite values)"] if bad else []
    return []


def block_scale_keys(det) -> set[str]:
    """File keys (with the file's prefix) of the NVFP4 layers' block scales in a :class:`Detection`."""
    return {f"{det.prefix}{s}.weight_scale" for s in det.quant_layers}


class CheckedReader:
    """A tensor reader whose :meth:`get_tensor` checks each tensor it returns (:func:`problems`) and raises
    :class:`CheckpointError` naming ``path``, the key and the first problem. ``stats``: tensors, bytes, seconds."""

    def __init__(self, reader, path: str, block_scales: set[str]):
        self._r, self.path, self.block_scales = reader, path, block_scales
        self.stats = {"tensors": 0, "bytes": 0, "seconds": 0.0}

    def get_tensor(self, key: str) -> torch.Tensor:
        t = self._r.get_tensor(key)
        t0 = time.perf_counter()
        bad = problems(t, key in self.block_scales)
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["tensors"] += 1
        self.stats["bytes"] += t.numel() * t.element_size()
        if bad:
            raise CheckpointError(self.path, "; ".join(bad), key=key)
        return t


@dataclass
class ScanResult:
    """What :func:`scan` found: ``bad`` [(key, phrase)] (at most ``max_report`` tensors), ``bad_tensors`` (all),
    ``tensors`` / ``bytes`` read and ``seconds`` taken (reading included)."""

    bad: list = field(default_factory=list)
    bad_tensors: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def scan(path: str, det, header=None, max_report: int = 8) -> ScanResult:
    """Read every tensor under the detected prefix of ``path`` once and check its values (:func:`problems`)."""
    out = ScanResult()
    scales = block_scale_keys(det)
    t0 = time.perf_counter()
    with open_tensors(path, header=header) as f:
        for key in f.keys():
            if det.prefix and not key.startswith(det.prefix):
                continue
            t = f.get_tensor(key)
            out.tensors += 1
            out.bytes += t.numel() * t.element_size()
            bad = problems(t, key in scales)
            del t
            if bad:
                out.bad_tensors += 1
                if len(out.bad) < max_report:
                    out.bad.extend((key, p) for p in bad)
    out.seconds = time.perf_counter() - t0
    return out
