"""Per-channel q / k balancing before 8-bit Q K^T: ``q k^T = (q diag(l)) (k diag(l)^-1)^T`` for any positive ``l``.

A K channel far larger than the others (H3's late blocks concentrate the attention-key signal in a few channels)
sets the range of every INT8 K block; the Hadamard rotation (``int8_kernels`` ``ROTATE``) spreads its energy over all
channels but keeps it. Dividing those channels by ``l`` and multiplying q's by the same ``l`` leaves every score
unchanged and moves the magnitude to q, whose channels there are small. This is SmoothQuant's migration between two
operands of a product (Xiao et al., arXiv:2211.10438, alpha = 0.5) applied to q and k as QServe's SmoothAttention
(Lin et al., arXiv:2405.04532, section 4.3).

``l`` is a power of two per channel (:func:`pow2_sqrt`), so ``q * l`` and ``k / l`` are exact in floating point:
the balanced q.k equals the unbalanced one bit for bit before quantization. Two sources of ``l``:

* :func:`from_k_amax`: from the current call's K (``int8_sage``'s standalone kernels; ``r_c = max_tokens |k'_c|``
  over the smoothed k, relative to the median channel).
* :func:`norm_weight_exponents` / :func:`fold_into_norm_weights`: from the q / k RMSNorm weights (the fused route,
  whose producer quantizes q before any K statistic exists): ``l_c`` about ``sqrt(|w_k,c| / |w_q,c|)`` from the
  two weights' exponent fields; the two channels of a RoPE pair get one ``l``, so the scaling commutes with the
  rotation. The RMSNorm + RoPE launch computes it from the weights it reads (``fused.qk_norm_rope_sage(balance=
  True)``): no extra launch, no cache an in-place weight patch could leave stale.
"""
from __future__ import annotations

import torch

#: |log2 l| is at most this (a ratio beyond 2^(2 * MAX_EXP) is balanced only that far)
MAX_EXP = 12


def pow2_sqrt(ratio: torch.Tensor) -> torch.Tensor:
    """``2 ** floor(e / 2)`` for ``ratio = m * 2 ** e`` (``torch.frexp``, m in [0.5, 1)): a power of two within a
    factor sqrt(2) of ``sqrt(ratio)``, from integer arithmetic only (the same on every device); 1 where ``ratio`` is 0,
    negative or not finite; the exponent clamped to [-MAX_EXP, MAX_EXP]. float32, ``ratio``'s shape (a float64
    ``ratio`` is read in float64, so ratios beyond float32's range clamp instead of counting as not finite)."""
    if not isinstance(ratio, torch.Tensor) or not ratio.is_floating_point():
        raise ValueError(f"attention balance: ratio must be a floating-point tensor, got {type(ratio).__name__} "
                         f"{getattr(ratio, 'dtype', '')}")
    r = ratio if ratio.dtype == torch.float64 else ratio.float()
    ok = torch.isfinite(r) & (r > 0)
    _, e = torch.frexp(torch.where(ok, r, torch.ones_like(r)))
    e = torch.where(ok, torch.div(e, 2, rounding_mode="floor"), torch.zeros_like(e)).clamp(-MAX_EXP, MAX_EXP)
    return torch.ldexp(torch.ones_like(r, dtype=torch.float32), e)


def _relative(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] divided by its median over D (x itself where that median is 0)."""
    med = x.median(dim=-1, keepdim=True).values
    return torch.where(med > 0, x / torch.where(med > 0, med, torch.ones_like(med)), x)


def from_k_amax(k_amax: torch.Tensor) -> torch.Tensor:
    """``l`` float32 [..., D] from ``k_amax`` [..., D] = max over tokens of |k - mean_tokens(k)| per channel:
    :func:`pow2_sqrt` of k_amax relative to its median channel (a channel 24x the median gets l = 4)."""
    return pow2_sqrt(_relative(k_amax.float()))


def k_amax(k: torch.Tensor, km: torch.Tensor) -> torch.Tensor:
    """k [B, H, L, D] (any strides), km float32 [B*H, D] its token mean -> float32 [B*H, D]
    ``max_tokens |k - km|`` per channel (from k's per-channel min and max: one pass over k)."""
    B, H, _, D = k.shape
    kmin, kmax = torch.aminmax(k, dim=2)
    kmin, kmax = kmin.reshape(B * H, D).float(), kmax.reshape(B * H, D).float()
    return torch.maximum(kmax - km, km - kmin)


def _check_norm_weights(q_weight, k_weight, rot_dim) -> int:
    ok_dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    if not (isinstance(q_weight, torch.Tensor) and isinstance(k_weight, torch.Tensor)) \
            or q_weight.dtype not in ok_dtypes or k_weight.dtype not in ok_dtypes:
        raise ValueError(f"attention balance: q / k norm weights must be bf16 / fp16 / fp32 / fp64 tensors, got "
                         f"{getattr(q_weight, 'dtype', type(q_weight).__name__)}, "
                         f"{getattr(k_weight, 'dtype', type(k_weight).__name__)}")
    if q_weight.shape != k_weight.shape or q_weight.ndim != 1 or q_weight.shape[0] < 1:
        raise ValueError(f"attention balance: q / k norm weights must be two [D] tensors (D >= 1), got "
                         f"{tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    if q_weight.device != k_weight.device:
        raise ValueError(f"attention balance: q / k norm weights on {q_weight.device} and {k_weight.device}; expected "
                         f"one device")
    d = q_weight.shape[0]
    if not isinstance(rot_dim, int) or isinstance(rot_dim, bool) or rot_dim < 0 or rot_dim % 2 or rot_dim > d:
        raise ValueError(f"attention balance: rot_dim {rot_dim!r}; expected an even int in [0, {d}]")
    return rot_dim // 2


def norm_weight_exponents(q_weight: torch.Tensor, k_weight: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """int32 [D] n with ``l = 2 ** n`` for the q / k RMSNorm weights [D] of a per-head RMSNorm followed by core's
    split-half RoPE on the first ``rot_dim`` channels (channel c < rot_dim / 2 pairs with c + rot_dim / 2):
    ``n_c = clamp(trunc((E_k,c - E_q,c) / 2), -MAX_EXP, MAX_EXP)`` (so l is within a factor 2 of
    ``sqrt(|w_k,c| / |w_q,c|)``, and 1 for ratios within [1/2, 2]) with E the larger float32 exponent field of c's
    RoPE pair (of w_c itself past rot_dim), and 0 where either field is 0 (zero, float32 subnormal) or 255 (inf,
    NaN). Integer arithmetic on the bits: what ``fused._qk_rope_kernel`` computes in its launch (``BALANCE``).
    A scale common to every channel needs no balancing (per-row INT8 scales absorb it), so no reference channel is
    taken. ValueError on non-float or mismatched weights or an odd / too large ``rot_dim``."""
    h = _check_norm_weights(q_weight, k_weight, rot_dim)
    fields = []
    for w in (q_weight, k_weight):
        f = (w.float().abs().contiguous().view(torch.int32) >> 23) & 255
        if h:       # the pair's larger field (a NaN's 255 wins whatever its partner, as in the launch)
            m = torch.maximum(f[:h], f[h:2 * h])
            f = torch.cat([m, m, f[2 * h:]])
        fields.append(f)
    fq, fk = fields
    ok = (fq > 0) & (fq < 255) & (fk > 0) & (fk < 255)
    n = torch.div(fk - fq, 2, rounding_mode="trunc")
    return torch.where(ok, n, torch.zeros_like(n)).clamp(-MAX_EXP, MAX_EXP).to(torch.int32)


def fold_into_norm_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, rot_dim: int):
    """(q_weight * l, k_weight / l, l), all float32 [D], ``l = 2 ** n`` from :func:`norm_weight_exponents`: the
    balanced weights ``fused.qk_norm_rope_sage(balance=True)`` reads in float32. The products are exact for bf16 /
    fp16 weights (times 2^+-MAX_EXP they stay normal float32 values); fp32 / fp64 weights near float32's smallest
    normal can round to a subnormal. Arguments and errors as :func:`norm_weight_exponents`."""
    n = norm_weight_exponents(q_weight, k_weight, rot_dim)
    lam = torch.ldexp(torch.ones_like(n, dtype=torch.float32), n)
    return q_weight.float() * lam, k_weight.float() / lam, lam
