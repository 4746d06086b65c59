"""Eager attention references and the error measures the backends are tested with (torch only).

:func:`reference_attention` is softmax(q k^T / sqrt(D)) v computed head by head in float32 or float64;
:func:`accuracy` and :func:`rel_l2` compare a backend's output with it. Every backend states its bound
against this reference (``AttentionBackend.tolerance``); ``tests/test_attention.py`` checks it.
"""
from __future__ import annotations

import math

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows=None, heads=None,
                        dtype=torch.float32) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in ``dtype`` for q/k/v [1, H, L, D], on a sample: query ``rows``
    (index tensor, default all) of ``heads`` (index tensor, default all). Returns [h, r, D]."""
    hs = torch.arange(q.shape[1], device=q.device) if heads is None else heads
    out = []
    for h in hs.tolist():
        qh = q[0, h] if rows is None else q[0, h, rows]
        s = (qh.to(dtype) @ k[0, h].to(dtype).T) / math.sqrt(q.shape[-1])
        out.append(torch.softmax(s, dim=-1) @ v[0, h].to(dtype))
    return torch.stack(out)


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Per-head cosine (min over heads) and relative L2 of ``out`` [h, r, D] against ``ref`` (same shape)."""
    o = out.double().flatten(1)
    r = ref.double().flatten(1)
    cos = torch.nn.functional.cosine_similarity(o, r, dim=-1)
    return {"cos_min": float(cos.min()), "rel_l2": float((o - r).norm() / r.norm())}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 if both are zero, inf if only b is)."""
    num = (a.double() - b.double()).norm().item()
    den = b.double().norm().item()
    return (0.0 if num == 0 else math.inf) if den == 0 else num / den
