"""A stress corpus of attention inputs: q/k/v statistics that break 8-bit attention with one shared scale per block.

Each case is a function ``case(length, heads, head_dim, seed, dtype=torch.bfloat16)`` returning q, k, v
[1, length, heads, head_dim] in core's H3 memory layout: strided views of one [length, 3 * heads * head_dim] buffer
(the qkv projection's output; q and k columns, then v), as core's attention reads them. :func:`bhld` gives the
[1, heads, length, head_dim] views core hands an attention override (``skip_reshape=True``). Deterministic for a
seed and ``device`` (keyword, default CPU; the random numbers are drawn there).

Cases (:data:`CASES`, in this order; "channel" = one of the head_dim entries of a head, the chosen channels are
:data:`N_CHANNELS` per head, drawn per head from the seed):

- ``rand``: q and k RMS-normalised per head (H3 norms q and k per head), times a gain in [1, 1.5) per (head,
  channel); v standard normal. What every earlier benchmark of the pack used.
- ``k_outlier``: ``rand`` with k x 24 and q x 0.05 on the chosen channels: K's range is set by channels that carry
  little of q.k (the pattern a public report, Comfy-Org/docs pull request 1698, describes for H3's last blocks).
- ``qk_outlier``: ``rand`` with q and k x 6 on the chosen channels.
- ``k_bias``: ``rand`` with +16 added to k on the chosen channels for every token (a per-channel offset; softmax
  ignores it, K smoothing removes it).
- ``massive``: ``rand`` with :data:`N_MASSIVE` evenly spaced tokens whose v rows are x 100 and k rows x 8
  (attention-sink tokens: a few rows with a norm far above the others).
- ``sharp``: ``rand`` with q and k x 3 (scores spread ~9x wider: a near one-hot softmax, where a logit error moves
  the output most).
"""
from __future__ import annotations

from typing import Callable

import torch

N_CHANNELS = 4          # outlier channels per head
N_MASSIVE = 4           # massive-norm tokens per sequence


def _gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def _base(length: int, heads: int, head_dim: int, g: torch.Generator):
    """float32 q, k, v [length, heads, head_dim] of ``rand``."""
    if length < 1 or heads < 1 or head_dim < N_CHANNELS:
        raise ValueError(f"stress: length {length}, heads {heads}, head_dim {head_dim}; expected >= 1, >= 1, "
                         f">= {N_CHANNELS}")
    x = torch.randn(3, length, heads, head_dim, generator=g, device=g.device)
    q, k, v = x[0], x[1], x[2]
    out = []
    for t in (q, k):
        gain = 1.0 + 0.5 * torch.rand(heads, head_dim, generator=g, device=g.device)
        out.append(t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * gain)
    return out[0], out[1], v


def _channels(heads: int, head_dim: int, g: torch.Generator) -> torch.Tensor:
    """A [heads, head_dim] bool mask with N_CHANNELS chosen channels per head."""
    m = torch.zeros(heads, head_dim, dtype=torch.bool, device=g.device)
    for h in range(heads):
        m[h, torch.randperm(head_dim, generator=g, device=g.device)[:N_CHANNELS]] = True
    return m


def _pack(q, k, v, dtype):
    """q, k, v float32 [L, H, D] -> [1, L, H, D] views of one [L, 3*H*D] ``dtype`` buffer (core's qkv layout)."""
    L, H, D = q.shape
    buf = torch.cat([t.reshape(L, H * D) for t in (q, k, v)], dim=1).to(dtype)
    return tuple(buf[:, i * H * D:(i + 1) * H * D].view(L, H, D).unsqueeze(0) for i in range(3))


def rand(length, heads, head_dim, seed=0, dtype=torch.bfloat16, device="cpu"):
    """q, k RMS-normalised per head times a gain in [1, 1.5); v standard normal (module docstring)."""
    return _pack(*_base(length, heads, head_dim, _gen(seed, device)), dtype)


def k_outlier(length, heads, head_dim, seed=0, dtype=torch.bfloat16, device="cpu"):
    """``rand`` with k x 24 and q x 0.05 on N_CHANNELS channels per head."""
    g = _gen(seed, device)
    q, k, v = _base(length, heads, head_dim, g)
    m = _channels(heads, head_dim, g)
    return _pack(torch.where(m, q * 0.05, q), torch.where(m, k * 24.0, k), v, dtype)


def qk_outlier(length, heads, head_dim, seed=0, dtype=torch.bfloat16, device="cpu"):
    """``rand`` with q and k x 6 on N_CHANNELS channels per head."""
    g = _gen(seed, device)
    q, k, v = _base(length, heads, head_dim, g)
    m = _channels(heads, head_dim, g)
    return _pack(torch.where(m, q * 6.0, q), torch.where(m, k * 6.0, k), v, dtype)


def k_bias(length, heads, head_dim, seed=0, dtype=torch.bfloat16, device="cpu"):
    """``rand`` with +16 on k's N_CHANNELS channels per head, every token."""
    g = _gen(seed, device)
    q, k, v = _base(length, heads, head_dim, g)
    m = _channels(heads, head_dim, g)
    return _pack(q, k + 16.0 * m.float(), v, dtype)


def massive(length, heads, head_dim, seed=0, dtype=torch.bfloat16, device="cpu"):
    """``rand`` with N_MASSIVE evenly spaced tokens whose v rows are x 100 and k rows x 8 (every head)."""
    q, k, v = _base(length, heads, head_dim, _gen(seed, device))
    rows = massive_rows(length).to(q.device)
    k[rows] *= 8.0
    v[rows] *= 100.0
    return _pack(q, k, v, dtype)


def massive_rows(length: int) -> torch.Tensor:
    """The token indices ``massive`` scales: N_MASSIVE evenly spaced (fewer for short sequences)."""
    n = min(N_MASSIVE, length)
    return torch.unique(torch.linspace(0, length - 1, n + 2)[1:-1].round().long()) if length > 2 else torch.arange(n)


def sharp(length, heads, head_dim, seed=0, dtype=torch.bfloat16, device="cpu"):
    """``rand`` with q and k x 3 (a near one-hot softmax)."""
    q, k, v = _base(length, heads, head_dim, _gen(seed, device))
    return _pack(q * 3.0, k * 3.0, v, dtype)


CASES: dict[str, Callable] = {"rand": rand, "k_outlier": k_outlier, "qk_outlier": qk_outlier, "k_bias": k_bias,
                              "massive": massive, "sharp": sharp}


def make(case: str, length: int, heads: int, head_dim: int, seed: int = 0, dtype=torch.bfloat16, device="cpu"):
    """``CASES[case](...)``; ValueError naming the cases for an unknown one."""
    if case not in CASES:
        raise ValueError(f"stress: unknown case {case!r}; expected one of {list(CASES)}")
    return CASES[case](length, heads, head_dim, seed, dtype, device=device)


def bhld(*ts: torch.Tensor):
    """[1, L, H, D] tensors -> the [1, H, L, D] views core passes to an attention override (no copy)."""
    out = tuple(t.transpose(1, 2) for t in ts)
    return out[0] if len(out) == 1 else out
