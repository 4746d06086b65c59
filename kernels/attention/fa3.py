"""FlashAttention-3's Hopper forward from the ``fa3-fwd`` wheel (PyPI ``fa3-fwd==0.0.3``, the optional extra
``h3_turbo[fa3]``; GPU only): a candidate of the ``exact`` backend's per-shape chooser, not a node backend.

The wheel (FlashAttention-3's ``hopper/`` forward built for torch's stable ABI, fp16 kernels disabled) provides the
module ``fa3_fwd_interface`` with ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...,
q_descale=None, k_descale=None, v_descale=None)``: q/k/v [batch, seqlen, heads, head_dim] with unit last stride
(core's H3 tensors are such views: no copy), bf16 or e4m3 (with float32 [batch, heads] descales), output
[batch, seqlen, heads, head_dim] bf16.

Contract: :func:`available` -> None or why it cannot run (module not importable, logged once at INFO by
:func:`.exact.default_candidates`); :func:`attention` q/k/v [B, H, L, D] bf16 CUDA views (any strides with a unit
last stride) -> [B, H, Lq, D] (a view of FA3's [B, Lq, H, D] output), exact up to bf16 rounding like the SDPA
candidates. :func:`attention_fp8` (benchmarks only: FA3's e4m3 path after the pack's own quantization) is not offered
to any node: it fails the stress corpus's bounds (docs/attention.md).
"""
from __future__ import annotations

import math

import torch

MODULE = "fa3_fwd_interface"
NAME = "FA3"                    # its name among the exact backend's candidates
_STATE: dict = {}


def interface():
    """The wheel's ``fa3_fwd_interface`` module, or None when it does not import (reason: :func:`available`)."""
    if "mod" not in _STATE:
        try:
            import importlib

            mod = importlib.import_module(MODULE)
            if not hasattr(mod, "flash_attn_func"):
                raise ImportError(f"{MODULE} has no flash_attn_func")
            _STATE["mod"], _STATE["err"] = mod, None
        except Exception as e:  # noqa: BLE001 - an optional GPU-only wheel
            _STATE["mod"], _STATE["err"] = None, f"{type(e).__name__}: {e}"
    return _STATE["mod"]


def available() -> str | None:
    """None when ``fa3_fwd_interface`` imports, else why not (install: ``pip install h3_turbo[fa3]``)."""
    interface()
    return None if _STATE["mod"] is not None else f"{MODULE} not importable ({_STATE['err']})"


def _blhd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v by FA3's bf16 forward: q [B, H, Lq, D], k/v [B, H, Lk, D] bf16 on a CUDA device ->
    [B, H, Lq, D] bf16. Raises RuntimeError without the wheel, ValueError for another dtype (the chooser then
    rejects this candidate for the shape)."""
    mod = interface()
    if mod is None:
        raise RuntimeError(f"FA3: {available()}")
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        raise ValueError(f"FA3: bf16 inputs only (the wheel has no fp16 kernels), got {q.dtype}")
    out = mod.flash_attn_func(_blhd(q), _blhd(k), _blhd(v), softmax_scale=scale)
    if isinstance(out, tuple):
        out = out[0]
    return out.transpose(1, 2)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  rotate: bool = False, smooth: bool = False) -> torch.Tensor:
    """FA3's e4m3 forward after the pack's quantization (benchmarks only): per-(batch, head) amax scales, optionally
    q and k Hadamard-rotated (``rotate``, normalised H_D) and k / v smoothed by their token means (``smooth``: k's
    mean dropped, softmax ignores it; v's mean added back). q/k/v [B, H, L, D] bf16 CUDA -> [B, H, Lq, D] bf16."""
    mod = interface()
    if mod is None:
        raise RuntimeError(f"FA3: {available()}")
    d = q.shape[-1]
    sm = d ** -0.5 if scale is None else float(scale)
    qf, kf, vf = q.float(), k.float(), v.float()
    vm = None
    if smooth:
        kf = kf - kf.mean(dim=2, keepdim=True)
        vm = vf.mean(dim=2, keepdim=True)
        vf = vf - vm
    if rotate:
        from .int8_kernels import fwht

        qf, kf = fwht(qf) / math.sqrt(d), fwht(kf) / math.sqrt(d)
    e4m3 = torch.float8_e4m3fn
    xs, ds = [], []
    for t in (qf, kf, vf):
        amax = t.abs().amax(dim=(2, 3)).clamp_min(2.0 ** -20)               # [B, H]
        xs.append(_blhd((t * (448.0 / amax)[..., None, None]).to(e4m3)).contiguous())
        ds.append((amax / 448.0).float().contiguous())
    out = mod.flash_attn_func(xs[0], xs[1], xs[2], softmax_scale=sm, q_descale=ds[0], k_descale=ds[1],
                              v_descale=ds[2])
    if isinstance(out, tuple):
        out = out[0]
    out = out.transpose(1, 2).float()
    if vm is not None:
        out = out + vm
    return out.to(q.dtype)
