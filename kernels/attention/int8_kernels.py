"""The 8-bit attention kernels of the ``int8_sage`` backend: INT8 Q K^T and FP8 (e4m3) P V in Triton,
after the SageAttention-2 recipe (Zhang et al., "SageAttention2: Efficient Attention with Thorough Outlier
Smoothing and Per-thread INT4 Quantization", arXiv:2411.10958; per-block INT8 Q/K with K smoothing,
FP8 P V with per-channel V scales). The core override that uses them: :mod:`.int8_sage`.

Entry points: :func:`sage_attention` (q [B, H, Lq, D], k/v [B, H, Lk, D], bf16/fp16, D in 64/128, any
strides -> q's dtype, layout ``bhld`` or core's ``blhd``); :func:`sage_attention_prequantized` (one sequence
whose Q its producer already quantized per row and whose K/V statistics it summed; optional e4m3 output for an
fp8 out_proj); the pre-kernels :func:`quantize_kv` / :func:`quantize_q`; the torch models :func:`quantize_reference` / :func:`sage_reference` (the same math in
float32/float64, for tests). Bad inputs or configs raise ValueError naming them; without Triton the kernels
raise :class:`h3_turbo.errors.NoCapablePathError`. A new variant is a config key (:data:`DEFAULT_CONFIG`,
checked by :func:`_cfg`) plus its branch in the kernels and in :func:`sage_reference`.

Math, for q, k, v [B, H, L, D] (any strides), ``scale`` (default ``D ** -0.5``), ``log2e = 1/ln 2``:

* K smoothing: ``k' = k - mean_tokens(k)`` per (b, h, channel), in float32 (softmax is invariant to
  adding ``q . const`` to every score of a row).
* Balance (``BALANCE``, on by default; :mod:`.balance`): the smoothed k' is divided and q multiplied per channel by
  a power of two ``l`` [B*H, D] (from max_tokens |k'| per channel: :func:`.balance.from_k_amax`), so q.k is unchanged
  exactly and a few dominant K channels no longer set K's quantization step (SmoothAttention, QServe,
  arXiv:2405.04532). :func:`sage_attention_prequantized` takes q and k already balanced by the fused route's
  producer (its norm weights, :func:`.balance.fold_into_norm_weights`) and applies none.
* Rotation (``ROTATE``, on by default): q and the smoothed (balanced) k' are multiplied by the unnormalised Sylvester
  Hadamard matrix H_D (entries +-1, ``H H^T = D I``; :func:`fwht`, butterfly stages in float32) before their INT8
  quantization, and the score scale is divided by D, so q.k is unchanged in exact arithmetic. A few outlier
  channels are spread over all D channels, so one scale per block no longer spends its range on them (the
  Hadamard rotation of QuaRot, Ashkboos et al., arXiv:2404.00456). Below, q and k' mean the rotated ones.
* Q: per block of ``BLOCK_M`` query rows of one head, ``a = max |q|``, ``sq = a / 127``,
  ``q8 = round_half_away(q * (127 / a))`` (int8, 0 where a = 0); inside the attention kernel, or by the
  pre-kernel :func:`quantize_q` with ``QPRE``.
* K: the same on ``k'`` per block of ``BLOCK_N`` keys (``sk``), by the pre-kernel :func:`quantize_kv`.
* Scores in the exp2 domain: ``s = (q8 . k8) * (sq * scale * log2e) * sk`` with an exact int32 dot (``scale / D``
  with ``ROTATE``: :func:`qk_scale`).
* V: optional per-channel mean ``mv`` subtracted (``V_MEAN``; added back at the end since softmax rows
  sum to 1), then per (b, h, channel) ``sv = max_tokens |v - mv| / 448``,
  ``v8 = e4m3(clamp((v - mv) * (448 / max), +-448))`` (round to nearest even), stored transposed
  ([B*H, D, L_pad], the K-major B operand Hopper's FP8 wgmma needs).
* Online softmax over key blocks with float32 running max ``m`` and sum ``l``:
  ``p = exp2(s - m_new + log2 448)`` (P scaled by 448 to use e4m3's range), ``l = l * alpha + sum(p)``
  (float32, unrounded p; with ``ROWSUM_MMA`` the sum of the e4m3-rounded p, taken per key block on the
  tensor cores), ``acc = acc * alpha + e4m3(p) @ v8`` with ``alpha = exp2(m_old - m_new)`` (the fp8 MMA
  accumulates in float32 registers).
* A negative ``scale`` runs as ``(-q, |scale|)`` (the same softmax).
* ``out = acc / l * sv + mv``, in q's dtype.

Config keys (:data:`DEFAULT_CONFIG`): ``BLOCK_M``/``BLOCK_N``/``num_warps``/``num_stages`` (launch);
``PV_FP8=False`` runs P V in bf16 instead (P rounded to bf16, v - mv in bf16). ``MAGIC=True`` converts
the int32 scores to float with no conversion instruction: the int32 accumulator starts at 0x4B400000
(the bits of 2^23 + 2^22), so its bits read as float are exactly ``12582912 + q8.k8``
(|q8.k8| <= 127*127*128 < 2^22) and a multiply-add gives the score. ``V_MEAN`` (default off): subtract
v's channel mean before the fp8 rounding (pays only for large channel offsets). ``IMPRECISE``:
``max_num_imprecise_acc`` of the fp8 P V dot (None: Triton's Hopper default; a number promotes to fp32
every that many keys). ``TMA``: K/V tiles through tensor descriptors (bulk tensor copies) instead of
per-thread ``cp.async``. ``QPRE``: Q is quantized by its own pre-kernel (:func:`quantize_q`, the same
float32 ops) into an int8 [B*H, L_pad, D] copy that the tensor cores read from shared memory.
``Q_ROW`` (needs ``QPRE``): one Q scale per row (``max|q_row| / 127``) instead of per BLOCK_M block; the
score scale is then a per-row vector. ``ROWSUM_MMA``: the softmax row sum is taken on the tensor cores as ``e4m3(p) @ ones`` (a fresh
accumulator per key block, added to a float32 running sum), i.e. ``l`` sums the same rounded P that
multiplies V (needs ``PV_FP8``). ``MAXNREG``: register cap per thread (Triton's ``maxnreg``). ``ROTATE``: the
Hadamard rotation of q and k above (off: the unrotated SageAttention-2 quantization, kept as the negative control
of the outlier tests). ``ROT_MMA`` (with ``ROTATE``): k's rotation in :func:`quantize_kv` and q's in the fused route's
RMSNorm + RoPE launch as a tensor-core product with H_D in bf16 (:func:`hadamard_matrix`; k' as bf16 plus its bf16
remainder, ~16 significant bits; q is already bf16, so its products are exact) instead of the butterfly: the same
values up to float32 rounding, not the same bits (the INT8 codes differ by one step at rounding boundaries).
:func:`tuned_config` picks the configuration when none is given: :data:`HOPPER_CONFIGS` on compute
capability 9.x, else :data:`DEFAULT_CONFIG` (which needs no TMA, e.g. Ada). Why each option is on or off,
with the measurements: ``docs/attention.md``.

Under ``TRITON_INTERPRET=1`` (CPU tests) values are rounded to the e4m3/bf16/fp16 grid in fp32 before
each cast and bf16 dots run in fp32: the interpreter's own casts truncate without mantissa carry and its
bf16 dot multiplies raw bits. On the GPU the hardware conversions (round to nearest even) are used.
"""
from __future__ import annotations

import math
import os

import torch

from ... import state
from ...errors import NoCapablePathError
from . import balance

try:  # Triton is optional: without it the kernels raise NoCapablePathError and int8_sage runs exact
    import triton
    import triton.language as tl
    _TRITON_ERROR = None
except Exception as _e:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    _TRITON_ERROR = f"{type(_e).__name__}: {_e}"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAGIC_INT = 0x4B400000          # float bits of 12582912.0 = 2^23 + 2^22
MAGIC_F = 12582912.0
LOG2E = 1.4426950408889634
FP8_MAX = 448.0
LOG2_FP8_MAX = math.log2(FP8_MAX)

# Default launch configuration (any GPU with FP8 tensor cores; cp.async loads, Q quantized in-kernel).
DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "MAGIC": True,
                  "PV_FP8": True, "V_MEAN": False, "IMPRECISE": None,
                  "TMA": False, "QPRE": False, "ROWSUM_MMA": False, "MAXNREG": None, "Q_ROW": False,
                  "GLUON": False, "ROTATE": True, "BALANCE": True, "ROT_MMA": False}
# Hopper (compute capability 9.x): (largest key length or None, changes from DEFAULT_CONFIG); the first row
# that fits is used. K/V through TMA, Q quantized by its pre-kernel, row sums on the tensor cores, at most
# 168 registers per thread (how this row was chosen: docs/attention.md); one Q scale per row (Q_ROW, as the fused
# route: with the rotation it keeps the k_outlier stress case within the bound, docs/attention.md).
HOPPER_CONFIGS = (
    (None, {"TMA": True, "QPRE": True, "ROWSUM_MMA": True, "num_stages": 2, "MAXNREG": 168, "Q_ROW": True}),
)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


if triton is not None:

    # INT8 rounding (shared with kernels/fused.py) and the interpreter-only rounding onto the e4m3 / bf16 / fp16
    # grids (shared with kernels/triton_nvfp4.py)
    from ..triton_interp import rne_bf16 as _rne_bf16, rne_e4m3 as _rne_e4m3, rne_f16 as _rne_f16
    from ..triton_interp import round_i8 as _round_i8

    @triton.jit
    def _bhld_ptrs(X, b, h, offs_l, offs_d, sb, sh, sl, sd):
        """Pointers [len(offs_l), len(offs_d)] into a [B, H, L, D] tensor of any strides (64-bit offsets)."""
        return (X + b.to(tl.int64) * sb + h.to(tl.int64) * sh + offs_l[:, None].to(tl.int64) * sl
                + offs_d[None, :] * sd)

    @triton.jit
    def _fwht(x, ROWS: tl.constexpr, D: tl.constexpr):
        """Each row of the float32 tile x [ROWS, D] times the unnormalised Sylvester Hadamard matrix H_D (entries
        +-1, D a power of two): log2(D) butterfly stages (a, b) -> (a + b, a - b) over pairs (i, i + h), h = 1, 2, 4,
        ..., the float32 ops of :func:`fwht` (the same bits on the GPU, in the interpreter and in torch)."""
        sgn = tl.reshape(tl.where(tl.arange(0, 2) == 0, 1.0, -1.0), [1, 1, 2, 1])
        first = tl.reshape(tl.arange(0, 2) == 0, [1, 1, 2, 1])
        for s in tl.static_range(0, 9):                               # D <= 512
            if (2 << s) <= D:
                x4 = tl.reshape(x, [ROWS, D // (2 << s), 2, 1 << s])
                apb = tl.expand_dims(tl.sum(x4, axis=2), 2)          # a + b
                amb = tl.expand_dims(tl.sum(x4 * sgn, axis=2), 2)    # a + (-b)
                x = tl.reshape(tl.where(first, apb, amb), [ROWS, D])
        return x

    @triton.jit
    def _mm(a, b, acc, INTERP: tl.constexpr):
        """acc + a @ b in float32 for bf16 / fp16 a, b (under the interpreter, whose bf16 dot gives wrong values: the
        float32 product of the same values)."""
        if INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
        return tl.dot(a, b, acc, out_dtype=tl.float32)

    @triton.jit
    def _hdot(x, hm, SPLIT: tl.constexpr, INTERP: tl.constexpr):
        """x [ROWS >= 16, D] times H_D on the tensor cores (``ROT_MMA``): ``hm`` the [D, D] matrix (entries +-1, exact
        in bf16 / fp16) in x's dtype, or bf16 for float32 x, which is rounded to it; SPLIT: plus the product of x's
        bf16 remainder (~16 significant bits in all). float32 accumulation: the :func:`_fwht` values up to float32
        rounding (not its bits). An infinite x gives infinities in its row, as the butterfly does (remainder 0)."""
        acc = tl.zeros([x.shape[0], hm.shape[1]], dtype=tl.float32)
        if SPLIT:
            hi = x.to(tl.bfloat16)
            hf = hi.to(tl.float32)
            acc = _mm(hi, hm, acc, INTERP)
            acc = _mm(tl.where(x == hf, 0.0, x - hf).to(tl.bfloat16), hm, acc, INTERP)
        else:
            acc = _mm(x, hm, acc, INTERP)
        return acc

    @triton.jit
    def _quant_i8_block(x):
        """float32 block -> (int8 codes round(x * 127 / max|x|), half away from zero; max|x|), one scale per
        block (codes 0 for an all-zero block)."""
        amax = tl.max(tl.max(tl.abs(x), 1), 0)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.zeros_like(amax) + 127.0, amax), 0.0)
        return _round_i8(x * inv, 127.0), amax

    @triton.jit
    def _e4m3_scales(amax):
        """:func:`_v_scales` in a kernel, the same bits as torch on the CPU: (``amax / 448``, ``448 / amax`` or 0 where
        amax is 0), with IEEE divisions (``div_rn``; Triton's ``/`` is approximate) and torch's ``448 / t`` =
        ``reciprocal(t) * 448`` (torch on CUDA divides by a Python scalar as ``a * (1/b)``: within one ulp)."""
        c448 = tl.full(amax.shape, 448.0, tl.float32)
        inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(amax > 0, amax, 1.0)) * 448.0
        return tl.math.div_rn(amax, c448), tl.where(amax > 0, inv, 0.0)

    @triton.jit
    def _kv_colstats_kernel(K, V, KSUM, VAMAX, skl, skh, svl, svh, H, L, ROWS,
                            HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr):
        """Partial column statistics of one head over rows [r * ROWS, (r + 1) * ROWS): KSUM[r, h, :] = sum of k,
        VAMAX[r, h, :] = max |v| (float32; fixed summation order: deterministic)."""
        h = tl.program_id(0)
        r = tl.program_id(1)
        offs_d = tl.arange(0, HEAD_DIM)
        start = r * ROWS
        stop = tl.minimum(start + ROWS, L)
        acc = tl.zeros([BLOCK_L, HEAD_DIM], dtype=tl.float32)
        am = tl.zeros([BLOCK_L, HEAD_DIM], dtype=tl.float32)
        for l0 in range(start, stop, BLOCK_L):
            offs_l = l0 + tl.arange(0, BLOCK_L)
            ok = (offs_l < stop)[:, None]
            rows = offs_l[:, None].to(tl.int64)
            k = tl.load(K + rows * skl + h * skh + offs_d[None, :], mask=ok, other=0.0)
            v = tl.load(V + rows * svl + h * svh + offs_d[None, :], mask=ok, other=0.0)
            acc += k.to(tl.float32)
            am = tl.maximum(am, tl.abs(v.to(tl.float32)))
        tl.store(KSUM + (r * H + h) * HEAD_DIM + offs_d, tl.sum(acc, 0))
        tl.store(VAMAX + (r * H + h) * HEAD_DIM + offs_d, tl.max(am, 0))

    @triton.jit
    def _reduce_parts(KP, VP, bh, nbh, N_PARTS, n_f, HEAD_DIM: tl.constexpr):
        """Head ``bh``'s statistics from the partials [N_PARTS, nbh, D] (:func:`kv_partial_stats`), in a fixed order:
        (mean of k, V's e4m3 scale and quant factor, max |v| per channel); from one partial the bits of
        :func:`stats_from_sums` on the CPU (see ``_e4m3_scales``)."""
        offs_d = tl.arange(0, HEAD_DIM)
        ksum = tl.zeros([HEAD_DIM], dtype=tl.float32)
        vamax = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for r in range(0, N_PARTS):
            ksum += tl.load(KP + (r * nbh + bh) * HEAD_DIM + offs_d)
            vamax = tl.maximum(vamax, tl.load(VP + (r * nbh + bh) * HEAD_DIM + offs_d))
        km = tl.math.div_rn(ksum, tl.full([HEAD_DIM], n_f, tl.float32))
        vs_p, vinv_p = _e4m3_scales(vamax)
        return km, vs_p, vinv_p, vamax

    @triton.jit
    def _store_stats(KM, VINV, VS, HMAX, bh, km, vs_p, vinv_p, vamax, HEAD_DIM: tl.constexpr):
        """What the attention kernel and the caller read: the mean of k, V's scales, the head's max |v|."""
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(KM + bh * HEAD_DIM + offs_d, km)
        tl.store(VINV + bh * HEAD_DIM + offs_d, vinv_p)
        tl.store(VS + bh * HEAD_DIM + offs_d, vs_p)
        tl.store(HMAX + bh, tl.max(vamax, 0))

    @triton.jit
    def _kv_stats_finish_kernel(KP, VP, KM, VINV, VS, HMAX, N_PARTS, n_f, HEAD_DIM: tl.constexpr):
        """One (b, h): the partials reduced once (:func:`_reduce_parts`) and stored (:func:`_store_stats`) for
        ``_quant_kv_kernel``."""
        bh = tl.program_id(0)
        km, vs_p, vinv_p, vamax = _reduce_parts(KP, VP, bh, tl.num_programs(0), N_PARTS, n_f, HEAD_DIM)
        _store_stats(KM, VINV, VS, HMAX, bh, km, vs_p, vinv_p, vamax, HEAD_DIM)

    @triton.jit
    def _quant_kv_kernel(K, V, KM, VM, VINV, K8, KS, VQ, KINV, HM,
                         skb, skh, skn, skd, svb, svh, svn, svd,
                         H, N_K, N_KPAD,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr,
                         V_MEAN: tl.constexpr, INTERP: tl.constexpr,
                         V_PERM32: tl.constexpr, ROTATE: tl.constexpr = False, BALANCE: tl.constexpr = False,
                         ROT_MMA: tl.constexpr = False):
        j = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        valid = (offs_n < N_K)[:, None]
        nb = N_KPAD // BLOCK_N
        # ---- K: smooth, per-block int8
        kp = _bhld_ptrs(K, b, h, offs_n, offs_d, skb, skh, skn, skd)
        k = tl.load(kp, mask=valid, other=0.0).to(tl.float32)
        km = tl.load(KM + bh * HEAD_DIM + offs_d)
        ksm = tl.where(valid, k - km[None, :], 0.0)
        if BALANCE:     # times 1 / l (powers of two: exact)
            ksm = ksm * tl.load(KINV + bh * HEAD_DIM + offs_d)[None, :]
        if ROTATE:      # (k - mean) H_D: padded rows stay zero
            if ROT_MMA:     # HM: H_D in bf16 [D, D]
                ksm = _hdot(ksm, tl.load(HM + offs_d[:, None] * HEAD_DIM + offs_d[None, :]), True, INTERP)
            else:
                ksm = _fwht(ksm, BLOCK_N, HEAD_DIM)
        k8, amax = _quant_i8_block(ksm)
        base = bh.to(tl.int64) * N_KPAD * HEAD_DIM
        tl.store(K8 + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], k8)
        tl.store(KS + bh * nb + j, amax / 127.0)
        # ---- V
        vp = _bhld_ptrs(V, b, h, offs_n, offs_d, svb, svh, svn, svd)
        v = tl.load(vp, mask=valid, other=0.0).to(tl.float32)
        if V_MEAN:
            vm = tl.load(VM + bh * HEAD_DIM + offs_d)
            v = tl.where(valid, v - vm[None, :], 0.0)
        if PV_FP8:
            vinv = tl.load(VINV + bh * HEAD_DIM + offs_d)
            v8 = tl.minimum(tl.maximum(v * vinv[None, :], -448.0), 448.0)
            if INTERP:
                v8 = _rne_e4m3(v8)
            v8 = v8.to(tl.float8e4nv)
            if V_PERM32:    # key c = 16h + 8i + 2t + e of each 32 at column 16h + 4t + 2i + e (int8_gluon.py), moved
                # in registers so that the store stays contiguous
                v8 = tl.reshape(tl.permute(tl.reshape(v8, [BLOCK_N // 32, 2, 2, 4, 2, HEAD_DIM]), (0, 1, 3, 2, 4, 5)),
                                [BLOCK_N, HEAD_DIM])
            tl.store(VQ + base + offs_d[None, :] * N_KPAD + offs_n[:, None], v8)      # [D, L_pad]
        else:
            if INTERP:
                v = _rne_bf16(v)
            tl.store(VQ + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], v.to(tl.bfloat16))

    @triton.jit
    def _quant_q_block(qp, row_ok, qk_scale, lam_p, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                       ROTATE: tl.constexpr, BALANCE: tl.constexpr):
        """One block of Q rows (pointers ``qp`` [BLOCK_M, D], rows with ``row_ok`` False read as 0; BALANCE: times the
        per-channel l at ``lam_p`` [D] first, ROTATE: then times H_D) -> (int8 codes with one max|q|/127 scale, the
        block's score scale ``max|q| / 127 * qk_scale``)."""
        x = tl.load(qp, mask=row_ok[:, None], other=0.0).to(tl.float32)
        if BALANCE:
            x = x * tl.load(lam_p + tl.arange(0, HEAD_DIM))[None, :]
        if ROTATE:
            x = _fwht(x, BLOCK_M, HEAD_DIM)
        q8, amax = _quant_i8_block(x)
        return q8, (amax / 127.0) * qk_scale

    @triton.jit
    def _quant_q_kernel(Q, Q8, QS, LAM, sqb, sqh, sqm, sqd, H, N_Q, N_QPAD, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, Q_ROW: tl.constexpr,
                        ROTATE: tl.constexpr = False, BALANCE: tl.constexpr = False):
        """Q per block of BLOCK_M rows -> int8 [B*H, N_QPAD, D] (rows past N_Q zero) and the block's
        score scale ``max|q| / 127 * qk_scale`` [B*H, N_QPAD / BLOCK_M]: the same float32 ops as the
        in-kernel quantization. Q_ROW: one scale per row instead, ``max|q_row| / 127`` [B*H, N_QPAD]
        (without qk_scale: the attention kernel applies it). BALANCE: q times LAM [B*H, D] first."""
        i = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        qp = _bhld_ptrs(Q, b, h, offs_m, offs_d, sqb, sqh, sqm, sqd)
        if Q_ROW:
            x = tl.load(qp, mask=(offs_m < N_Q)[:, None], other=0.0).to(tl.float32)
            if BALANCE:
                x = x * tl.load(LAM + bh * HEAD_DIM + offs_d)[None, :]
            if ROTATE:
                x = _fwht(x, BLOCK_M, HEAD_DIM)
            amax = tl.max(tl.abs(x), 1)
            q8 = _round_i8(x * tl.where(amax > 0, tl.math.div_rn(tl.zeros_like(amax) + 127.0, tl.where(amax > 0, amax, 1.0)),
                                             0.0)[:, None], 127.0)
            tl.store(QS + bh * N_QPAD + offs_m, amax / 127.0)
        else:
            q8, qc = _quant_q_block(qp, offs_m < N_Q, qk_scale, LAM + bh * HEAD_DIM, BLOCK_M, HEAD_DIM, ROTATE,
                                    BALANCE)
            tl.store(QS + bh * (N_QPAD // BLOCK_M) + i, qc)
        tl.store(Q8 + bh.to(tl.int64) * N_QPAD * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], q8)

    @triton.jit
    def _scores(q8, K8, k_ptrs, k_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAGIC: tl.constexpr,
                TMA: tl.constexpr):
        """int32 scores q8 . k8^T of one key block, as float32: exactly 12582912 + q8.k8 with MAGIC
        (the accumulator starts at the bits of 1.5 * 2^23), else converted."""
        if TMA:
            k = K8.load([k_row, 0])                          # [BLOCK_N, D] int8 (bulk tensor copy)
        else:
            k = tl.load(k_ptrs)                              # [BLOCK_N, D] int8
        if MAGIC:
            s_init = tl.full([BLOCK_M, BLOCK_N], 0x4B400000, tl.int32)
            return tl.dot(q8, tl.trans(k), s_init, out_dtype=tl.int32).to(tl.float32, bitcast=True)
        else:
            return tl.dot(q8, tl.trans(k)).to(tl.float32)

    @triton.jit
    def _update(acc, l_i, m_i, x, c, VQ, v_ptrs, v_row, start_n, N_K, ones,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                MAGIC: tl.constexpr, PV_FP8: tl.constexpr, INTERP: tl.constexpr, IMPRECISE: tl.constexpr,
                TMA: tl.constexpr, ROWSUM_MMA: tl.constexpr, Q_ROW: tl.constexpr):
        """Online-softmax update with the scores ``x`` of one key block (``c``: score scale, exp2 domain; a
        [BLOCK_M] vector with Q_ROW, else a scalar). ``l_i``: running row sum [BLOCK_M] float32 of the unrounded
        P, or with ROWSUM_MMA of the e4m3-rounded P, each block's sum taken on the tensor cores as ``P8 @ ones``."""
        if Q_ROW:
            cc = c[:, None]
        else:
            cc = c
        if MAGIC:
            off = -12582912.0 * c
            if MASK:
                valid = (start_n + tl.arange(0, BLOCK_N) < N_K)[None, :]
                x = tl.where(valid, x, 0.0)
            m_new = tl.maximum(m_i, tl.max(x, 1) * c + off)
            arg = x * cc + (off + 8.807354922057604 - m_new)[:, None]         # log2(448) = 8.807...
        else:
            s = x * cc
            if MASK:
                valid = (start_n + tl.arange(0, BLOCK_N) < N_K)[None, :]
                s = tl.where(valid, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            arg = s - (m_new - 8.807354922057604)[:, None]
        if MASK:
            arg = tl.where(valid, arg, -float("inf"))
        p = tl.math.exp2(arg)
        alpha = tl.math.exp2(m_i - m_new)
        if ROWSUM_MMA:
            l_i = l_i * alpha
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if PV_FP8:
            if TMA:
                vt = VQ.load([v_row, start_n])               # [D, BLOCK_N] e4m3
            else:
                vt = tl.load(v_ptrs)                         # [D, BLOCK_N] e4m3
            if INTERP:
                p = _rne_e4m3(tl.minimum(p, 448.0))
            p8 = p.to(tl.float8e4nv)
            acc = tl.dot(p8, tl.trans(vt), acc, max_num_imprecise_acc=IMPRECISE)
            if ROWSUM_MMA:     # ones: [16, BLOCK_N] e4m3 pointers (loop-invariant: loaded once)
                # a fresh accumulator per key block: the running sum itself stays in float32
                # registers (docs/attention.md: why not inside the MMA accumulator)
                l_i += tl.max(tl.dot(p8, tl.trans(tl.load(ones))), 1)
        else:
            if TMA:
                v = VQ.load([v_row + start_n, 0])            # [BLOCK_N, D] bf16
            else:
                v = tl.load(v_ptrs)                          # [BLOCK_N, D] bf16
            if INTERP:   # the interpreter's bf16 dot multiplies the raw bits: go through fp32
                acc = tl.dot(_rne_bf16(p), v.to(tl.float32), acc)
            else:
                acc = tl.dot(p.to(tl.bfloat16), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _attn_block(acc, l_i, m_i, q8, qc, K8, VQ, k_ptrs, v_ptrs, k_row, v_row, ks_ptr, start_n, N_K, ones,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                    MAGIC: tl.constexpr, PV_FP8: tl.constexpr, INTERP: tl.constexpr, IMPRECISE: tl.constexpr,
                    TMA: tl.constexpr, ROWSUM_MMA: tl.constexpr, Q_ROW: tl.constexpr):
        x = _scores(q8, K8, k_ptrs, k_row + start_n, BLOCK_M, BLOCK_N, MAGIC, TMA)
        return _update(acc, l_i, m_i, x, qc * tl.load(ks_ptr), VQ, v_ptrs, v_row, start_n, N_K, ones,
                       BLOCK_M, BLOCK_N, MASK, MAGIC, PV_FP8, INTERP, IMPRECISE, TMA, ROWSUM_MMA, Q_ROW)

    @triton.jit
    def _attn_fwd_kernel(Q, Q8, QS, K8, KS, VQ, VS, VM, OUT, ONES, HMAX, SX, LAM,
                         sqb, sqh, sqm, sqd, sob, soh, som, sod, sq8b, sq8h, sq8m, sqs, sqsm,
                         H, N_Q, N_QPAD, N_K, N_KPAD, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         MAGIC: tl.constexpr, PV_FP8: tl.constexpr, V_MEAN: tl.constexpr,
                         INTERP: tl.constexpr, IMPRECISE: tl.constexpr, TMA: tl.constexpr,
                         QPRE: tl.constexpr, ROWSUM_MMA: tl.constexpr, Q_ROW: tl.constexpr,
                         OUT_FP8: tl.constexpr, HP: tl.constexpr, ROTATE: tl.constexpr = False,
                         BALANCE: tl.constexpr = False):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        # ---- Q: per-block int8 with sm_scale*log2e folded into its scale (pre-kernel with QPRE)
        if QPRE:    # int8 Q at [b, h, m, d] = Q8 + b*sq8b + h*sq8h + m*sq8m + d (pre-kernel or producer layout)
            q8 = tl.load(_bhld_ptrs(Q8, b, h, offs_m, offs_d, sq8b, sq8h, sq8m, 1),
                         mask=(offs_m < N_QPAD)[:, None], other=0)
            if Q_ROW:
                qc = tl.load(QS + bh * sqs + offs_m * sqsm, mask=offs_m < N_QPAD, other=0.0) * qk_scale
            else:
                qc = tl.load(QS + bh * sqs + pid_m)
        else:
            qp = _bhld_ptrs(Q, b, h, offs_m, offs_d, sqb, sqh, sqm, sqd)
            q8, qc = _quant_q_block(qp, offs_m < N_Q, qk_scale, LAM + bh * HEAD_DIM, BLOCK_M, HEAD_DIM, ROTATE,
                                    BALANCE)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if ROWSUM_MMA:
            ones = ONES + tl.arange(0, 16)[:, None] * BLOCK_N + offs_n[None, :]
        else:
            ones = 0
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        k_row = bh * N_KPAD                                  # TMA coordinates (rows of the 2-D views)
        v_row = bh * HEAD_DIM if PV_FP8 else bh * N_KPAD
        if TMA:
            k_ptrs = 0
            v_ptrs = 0
            v_step = 0
        else:
            base = bh.to(tl.int64) * N_KPAD * HEAD_DIM
            k_ptrs = K8 + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
            if PV_FP8:
                v_ptrs = VQ + base + offs_d[:, None] * N_KPAD + offs_n[None, :]
                v_step = BLOCK_N
            else:
                v_ptrs = VQ + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
                v_step = BLOCK_N * HEAD_DIM
        ks_ptr = KS + bh * (N_KPAD // BLOCK_N)
        n_full = N_K // BLOCK_N
        for j in range(0, n_full):
            acc, l_i, m_i = _attn_block(acc, l_i, m_i, q8, qc, K8, VQ, k_ptrs + j * (BLOCK_N * HEAD_DIM),
                                        v_ptrs + j * v_step, k_row, v_row, ks_ptr + j, j * BLOCK_N, N_K, ones,
                                        BLOCK_M, BLOCK_N, False, MAGIC, PV_FP8, INTERP, IMPRECISE, TMA, ROWSUM_MMA, Q_ROW)
        if n_full * BLOCK_N < N_K:                           # ragged last key block (zero-padded buffers)
            acc, l_i, m_i = _attn_block(acc, l_i, m_i, q8, qc, K8, VQ, k_ptrs + n_full * (BLOCK_N * HEAD_DIM),
                                        v_ptrs + n_full * v_step, k_row, v_row, ks_ptr + n_full, n_full * BLOCK_N,
                                        N_K, ones, BLOCK_M, BLOCK_N, True, MAGIC, PV_FP8, INTERP, IMPRECISE, TMA, ROWSUM_MMA,
                                        Q_ROW)
        # ---- epilogue
        out = acc / l_i[:, None]
        if PV_FP8:
            vs = tl.load(VS + bh * HEAD_DIM + offs_d)
            out = out * vs[None, :]
        if V_MEAN:
            vm = tl.load(VM + bh * HEAD_DIM + offs_d)
            out = out + vm[None, :]
        if OUT_FP8:     # e4m3 with one scale for the whole output: max|v| / 448 (HMAX: max|v| per (b, h))
            offs_h = tl.arange(0, HP)
            gmax = tl.max(tl.load(HMAX + offs_h, mask=offs_h < tl.num_programs(1), other=0.0), 0)
            gs, ginv = _e4m3_scales(tl.full([BLOCK_M], gmax, tl.float32))
            out = tl.minimum(tl.maximum(out * ginv[:, None], -448.0), 448.0)
            if INTERP:
                out = _rne_e4m3(out)
            if bh == 0:   # the row scales of the out_proj's fp8 input (1/448 for an all-zero v)
                tl.store(SX + offs_m, tl.where(gs > 0, gs, 1.0 / 448.0), mask=offs_m < N_Q)
        elif INTERP:
            if OUT.dtype.element_ty == tl.bfloat16:
                out = _rne_bf16(out)
            else:
                out = _rne_f16(out)
        op = _bhld_ptrs(OUT, b, h, offs_m, offs_d, sob, soh, som, sod)
        tl.store(op, out.to(OUT.dtype.element_ty), mask=(offs_m < N_Q)[:, None])


def tuned_config(device: torch.device | str | None, lk: int) -> dict:
    """The launch configuration used when none is given: :data:`DEFAULT_CONFIG`, with the
    :data:`HOPPER_CONFIGS` row for key length ``lk`` on a CUDA device of compute capability 9.x."""
    c = dict(DEFAULT_CONFIG)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability(dev)[0] == 9:
        for limit, changes in HOPPER_CONFIGS:
            if limit is None or lk <= limit:
                c.update(changes)
                break
    return c


def _cfg(config: dict | None) -> dict:
    c = dict(DEFAULT_CONFIG)
    if config:
        unknown = set(config) - set(c)
        if unknown:
            raise ValueError(f"attention_int8: unknown config keys {sorted(unknown)}; expected {sorted(c)}")
        c.update(config)
    for key in ("BLOCK_M", "BLOCK_N"):
        b = c[key]
        if not isinstance(b, int) or isinstance(b, bool) or b < 16 or b & (b - 1):
            raise ValueError(f"attention_int8: config {key}={b!r}; expected a power of two >= 16")
    if c["num_warps"] not in (4, 8):
        raise ValueError(f"attention_int8: config num_warps={c['num_warps']!r}; expected 4 or 8")
    if not isinstance(c["num_stages"], int) or isinstance(c["num_stages"], bool) or c["num_stages"] < 1:
        raise ValueError(f"attention_int8: config num_stages={c['num_stages']!r}; expected an int >= 1")
    mr = c["MAXNREG"]
    if mr is not None and (not isinstance(mr, int) or isinstance(mr, bool) or not 24 <= mr <= 255):
        raise ValueError(f"attention_int8: config MAXNREG={mr!r}; expected None or an int in [24, 255]")
    if c["ROWSUM_MMA"] and not c["PV_FP8"]:
        raise ValueError("attention_int8: ROWSUM_MMA needs PV_FP8 (the row sum runs on the e4m3 P)")
    if c["Q_ROW"] and not c["QPRE"]:
        raise ValueError("attention_int8: Q_ROW needs QPRE (the per-row Q scales come from a pre-kernel or producer)")
    if c["GLUON"]:      # the Gluon kernel (int8_gluon.py) implements exactly this configuration (measured: docs)
        need = {"TMA": True, "QPRE": True, "Q_ROW": True, "MAGIC": True, "PV_FP8": True, "ROWSUM_MMA": True,
                "V_MEAN": False, "IMPRECISE": None, "MAXNREG": None, "num_warps": 4, "BLOCK_N": 128}
        bad = {k: c[k] for k, v in need.items() if c[k] != v}
        if c["BLOCK_M"] not in (64, 128):   # 64: one warpgroup; 128: two consumer warpgroups and a TMA warp
            bad["BLOCK_M"] = c["BLOCK_M"]
        if c["BLOCK_M"] == 128 and not 2 <= c["num_stages"] <= 4:
            bad["num_stages"] = c["num_stages"]
        if bad:
            raise ValueError(f"attention_int8: config GLUON needs {need}; got {bad}")
    return c


def kv_stats(k: torch.Tensor, v: torch.Tensor, v_mean: bool = True, pv_fp8: bool = True):
    """Per-(b, h, channel) statistics over all tokens, float32 [B*H, D] each:
    ``km`` (mean of k), ``vm`` (mean of v, zeros if not ``v_mean``), ``vs`` (V dequant scale
    ``max|v - vm| / 448``) and ``vinv`` (``448 / max|v - vm|``, 0 where the max is 0). k, v: [B, H, L, D]."""
    B, H, _, D = k.shape
    km = torch.mean(k, dim=2, dtype=torch.float32).reshape(B * H, D)
    if v_mean:
        vm = torch.mean(v, dim=2, dtype=torch.float32).reshape(B * H, D)
    else:
        vm = torch.zeros(B * H, D, device=v.device, dtype=torch.float32)
    if pv_fp8:
        vmin, vmax = torch.aminmax(v, dim=2)
        vs, vinv = _v_scales(torch.maximum(vmax.reshape(B * H, D).float() - vm, vm - vmin.reshape(B * H, D).float()))
    else:
        vs = torch.ones(B * H, D, device=v.device, dtype=torch.float32)
        vinv = vs
    return km.contiguous(), vm.contiguous(), vs.contiguous(), vinv.contiguous()


def kv_partial_stats(k: torch.Tensor, v: torch.Tensor, parts: int = 16, block_l: int = 32, num_warps: int = 4):
    """One pass over k and v [L, H, D] (bf16/fp16, last stride 1, any row / head strides, e.g. the k / v columns of
    a qkv buffer): (ksum, vamax), float32 [R, H, D] each: the column sums of k and the column maxima of |v| over R
    <= ``parts`` consecutive row ranges (their sum / max over dim 0 are the statistics; a fixed order, so the same
    bits on every call). The input of :func:`sage_attention_prequantized` and ``quantize_kv(parts=...)``."""
    if triton is None:
        raise NoCapablePathError(f"attention_int8: triton unavailable ({_TRITON_ERROR})")
    if k.ndim != 3 or v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1 or k.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention_int8.kv_partial_stats: k, v must be [L, H, D] with D in {SUPPORTED_HEAD_DIMS} "
                         f"and unit last stride, got {tuple(k.shape)} {k.stride()}, {tuple(v.shape)} {v.stride()}")
    L, H, D = k.shape
    rows = triton.cdiv(triton.cdiv(max(L, 1), max(1, int(parts))), block_l) * block_l
    r = max(1, triton.cdiv(L, rows))
    ksum = torch.empty((r, H, D), device=k.device, dtype=torch.float32)
    vamax = torch.empty((r, H, D), device=k.device, dtype=torch.float32)
    _kv_colstats_kernel[(H, r)](k, v, ksum, vamax, k.stride(0), k.stride(1), v.stride(0), v.stride(1), H, L, rows,
                                HEAD_DIM=D, BLOCK_L=block_l, num_warps=num_warps)
    return ksum, vamax


def stats_from_sums(ksum: torch.Tensor, vamax: torch.Tensor, n: int):
    """:func:`kv_stats` (``V_MEAN`` off, fp8 P V) from a producer's sums: ``ksum`` [B*H, D] float32 (the sum of k
    over its ``n`` tokens), ``vamax`` [B*H, D] float32 (max |v| over the tokens) -> (km, vm, vs, vinv)."""
    km = ksum / float(n)
    vs, vinv = _v_scales(vamax)
    return km.contiguous(), torch.zeros_like(km), vs.contiguous(), vinv.contiguous()


def _v_scales(amax: torch.Tensor):
    """V's per-channel e4m3 dequant scale ``amax / 448`` and quant factor ``448 / amax`` (0 where amax is 0)."""
    return amax / FP8_MAX, torch.where(amax > 0, FP8_MAX / amax, torch.zeros_like(amax))


def quantize_kv(k: torch.Tensor, v: torch.Tensor, config: dict | None = None, stats=None, parts=None,
                num_warps: int | None = None):
    """Pre-kernel: k, v [B, H, L, D] (bf16/fp16, any strides) -> dict with ``k8`` int8 [B*H, L_pad, D]
    (smoothed, per-block of BLOCK_N keys), ``ks`` float32 [B*H, L_pad/BLOCK_N], ``vq`` (e4m3
    [B*H, D, L_pad] if PV_FP8 else bf16 [B*H, L_pad, D]; with ``GLUON`` the keys of each 32 in the order of
    :mod:`.int8_gluon`'s P registers, ``v_perm32`` True), ``km``/``vm``/``vs``/``vinv`` float32 [B*H, D],
    ``n_kpad`` = L rounded up to BLOCK_N, ``lam`` (``BALANCE``: float32 [B*H, D], the per-channel l of
    :mod:`.balance` that k was divided by and q must be multiplied by, :func:`quantize_q` ``lam``; else None). Rows
    past L are written as zeros. ``stats``: (km, vm, vs, vinv)
    already computed (e.g. :func:`stats_from_sums`), else :func:`kv_stats` here. ``parts``: (ksum, vamax) partials
    [R, B*H, D] (:func:`kv_partial_stats`; needs V_MEAN off and PV_FP8): reduced once per head by a small Triton
    launch before the pre-kernel (no torch op), ``vm`` is then None and the dict adds ``hmax`` float32 [B*H] (max |v| per (b, h));
    no balancing then (the fused route's producer balances through the norm weights). ``num_warps``: the
    launch's (default 8 for the Gluon layout, 4 otherwise; the output does not depend on it: every reduction in the
    kernel is a max or runs in a fixed order per element)."""
    c = _cfg(config)
    B, H, L, D = k.shape
    bn = c["BLOCK_N"]
    npad = triton.cdiv(L, bn) * bn
    hmax = None
    if parts is not None:
        kp, vp = parts
        if c["V_MEAN"] or not c["PV_FP8"]:
            raise ValueError("attention_int8.quantize_kv: parts need V_MEAN off and PV_FP8 on")
        if kp.ndim != 3 or tuple(kp.shape[1:]) != (B * H, D) or vp.shape != kp.shape or kp.dtype != torch.float32 \
                or vp.dtype != torch.float32 or not (kp.is_contiguous() and vp.is_contiguous()):
            raise ValueError(f"attention_int8.quantize_kv: parts must be contiguous float32 [R, {B * H}, {D}], got "
                             f"{kp.dtype} {tuple(kp.shape)}, {vp.dtype} {tuple(vp.shape)}")
        km, vm = torch.empty(B * H, D, device=k.device, dtype=torch.float32), None
        vs, vinv = torch.empty_like(km), torch.empty_like(km)
        hmax = torch.empty(B * H, device=k.device, dtype=torch.float32)
    else:
        km, vm, vs, vinv = kv_stats(k, v, c["V_MEAN"], c["PV_FP8"]) if stats is None else stats
        kp = vp = km
    lam = balance.from_k_amax(balance.k_amax(k, km)).contiguous() if c["BALANCE"] and parts is None else None
    k8 = torch.empty(B * H, npad, D, device=k.device, dtype=torch.int8)
    ks = torch.empty(B * H, npad // bn, device=k.device, dtype=torch.float32)
    if c["PV_FP8"]:
        vq = torch.empty(B * H, D, npad, device=k.device, dtype=torch.float8_e4m3fn)
    else:
        vq = torch.empty(B * H, npad, D, device=k.device, dtype=torch.bfloat16)
    if parts is not None:
        _kv_stats_finish_kernel[(B * H,)](kp, vp, km, vinv, vs, hmax, kp.shape[0], float(max(L, 1)), HEAD_DIM=D,
                                          num_warps=1 if INTERPRET else 4)
    _quant_kv_kernel[(npad // bn, B * H)](
        k, v, km, vm if vm is not None else km, vinv, k8, ks, vq, 1.0 / lam if lam is not None else km,
        hadamard_matrix(D, k.device) if c["ROTATE"] and c["ROT_MMA"] else km,
        *k.stride(), *v.stride(), H, L, npad,
        HEAD_DIM=D, BLOCK_N=bn, PV_FP8=c["PV_FP8"], V_MEAN=c["V_MEAN"], INTERP=INTERPRET, V_PERM32=c["GLUON"],
        ROTATE=c["ROTATE"], BALANCE=lam is not None, ROT_MMA=c["ROTATE"] and c["ROT_MMA"],
        num_warps=num_warps or (8 if c["GLUON"] else 4))
    out = {"k8": k8, "ks": ks, "vq": vq, "km": km, "vm": vm, "vs": vs, "vinv": vinv, "n_kpad": npad,
           "v_perm32": c["GLUON"], "lam": lam}
    if hmax is not None:
        out["hmax"] = hmax
    return out


def _check_lam(lam, g: int, d: int, device) -> None:
    if lam is not None and (not isinstance(lam, torch.Tensor) or lam.dtype != torch.float32
                            or tuple(lam.shape) != (g, d) or not lam.is_contiguous() or lam.device != device):
        raise ValueError(f"attention_int8: lam must be a contiguous float32 [{g}, {d}] tensor on {device} (quantize_kv's "
                         f"'lam'), got {getattr(lam, 'dtype', type(lam).__name__)} {tuple(getattr(lam, 'shape', ()))}")


def _ones_e4m3(device, block_n: int) -> torch.Tensor:
    """A cached [16, block_n] e4m3 tensor of ones on ``device`` (the B operand of the ROWSUM_MMA row sum;
    cache: :data:`h3_turbo.state.ATTENTION_FP8_ONES`)."""
    key = (str(device), block_n)
    ones = state.ATTENTION_FP8_ONES
    with ones.lock:
        t = ones.data.get(key)
    if t is None:
        t = torch.ones(16, block_n, device=device).to(torch.float8_e4m3fn)
        capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:   # a tensor made during CUDA-graph capture is only filled on replay: never cache it
            with ones.lock:
                ones.data[key] = t
    return t


def quantize_q(q: torch.Tensor, qk_scale: float, config: dict | None = None, *, lam: torch.Tensor | None):
    """Pre-kernel (QPRE): q [B, H, L, D] (bf16/fp16, any strides) -> (``q8`` int8 [B*H, L_pad, D] per block
    of BLOCK_M rows, rows past L zero; ``qs`` float32 [B*H, L_pad / BLOCK_M] = ``max|q| / 127 * qk_scale``;
    ``L_pad``). The same float32 math as the attention kernel's own quantization. With ``Q_ROW``: one scale
    per row, ``qs`` [B*H, L_pad] = ``max|q_row| / 127`` (qk_scale is applied by the attention kernel). ``lam``: the
    ``lam`` of the :func:`quantize_kv` call whose k8 these codes meet (q is multiplied by it first; None where that
    call did not balance): a required keyword, so a caller cannot pair balanced k8 with unbalanced q by omission."""
    if triton is None:
        raise NoCapablePathError(f"attention_int8: triton unavailable ({_TRITON_ERROR})")
    c = _cfg(config)
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[-1] not in SUPPORTED_HEAD_DIMS \
            or q.dtype not in SUPPORTED_DTYPES or q.shape[2] < 1:
        raise ValueError(f"attention_int8.quantize_q: q must be a [B, H, L>=1, D in {SUPPORTED_HEAD_DIMS}] "
                         f"bf16/fp16 tensor, got {getattr(q, 'shape', type(q).__name__)} {getattr(q, 'dtype', '')}")
    B, H, L, D = q.shape
    bm = c["BLOCK_M"]
    npad = triton.cdiv(L, bm) * bm
    _check_lam(lam, B * H, D, q.device)
    q8 = torch.empty(B * H, npad, D, device=q.device, dtype=torch.int8)
    qs = torch.empty(B * H, npad if c["Q_ROW"] else npad // bm, device=q.device, dtype=torch.float32)
    _quant_q_kernel[(npad // bm, B * H)](q, q8, qs, lam if lam is not None else qs, *q.stride(), H, L, npad, qk_scale,
                                         HEAD_DIM=D, BLOCK_M=bm, Q_ROW=c["Q_ROW"], ROTATE=c["ROTATE"],
                                         BALANCE=lam is not None, num_warps=4)
    return q8, qs, npad


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   out_layout: str = "bhld", config: dict | None = None, out: torch.Tensor | None = None):
    """8-bit attention softmax(q k^T * scale) v (see module docstring for the quantized math).

    q [B, H, Lq, D], k/v [B, H, Lk, D]: bf16 or fp16, one device, any strides, D in (64, 128).
    ``out_layout``: ``"bhld"`` -> returns [B, H, Lq, D] contiguous; ``"blhd"`` -> returns [B, Lq, H*D]
    (core's ``skip_output_reshape=False`` layout, written directly). ``out``: optional preallocated
    output of that shape (every element is written). ``config``: launch configuration (changes from
    :data:`DEFAULT_CONFIG`); None = :func:`tuned_config` for q's device and the key length.
    Raises ValueError on unsupported inputs, NoCapablePathError without Triton.
    """
    if triton is None:
        raise NoCapablePathError(f"attention_int8: triton unavailable ({_TRITON_ERROR})")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError(f"attention_int8: q, k, v must be tensors, got {type(q).__name__}, {type(k).__name__}, "
                         f"{type(v).__name__}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention_int8: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention_int8: q, k, v must be 4-D [B, H, L, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Lq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape != k.shape or k.shape[-1] != D:
        raise ValueError(f"attention_int8: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         "do not match [B, H, L, D]")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention_int8: head dim {D} not in {SUPPORTED_HEAD_DIMS}")
    if not (q.dtype == k.dtype == v.dtype and q.dtype in SUPPORTED_DTYPES):
        raise ValueError(f"attention_int8: dtypes {q.dtype}, {k.dtype}, {v.dtype}; expected one of {SUPPORTED_DTYPES}")
    Lk = k.shape[2]
    if Lq < 1 or Lk < 1:
        raise ValueError(f"attention_int8: empty sequence: q {tuple(q.shape)}, k {tuple(k.shape)} (L >= 1 expected)")
    c = _cfg(config if config is not None else tuned_config(q.device, Lk))
    if c["GLUON"]:
        raise ValueError("attention_int8: config GLUON is for sage_attention_prequantized (batch 1, Q quantized by its "
                         "producer); sage_attention runs the Triton kernel")
    sm = (D ** -0.5) if scale is None else float(scale)
    if not math.isfinite(sm):
        raise ValueError(f"attention_int8: scale {scale!r} is not finite")
    if sm < 0:   # softmax(q k^T s) = softmax((-q) k^T |s|): the kernel's max and MAGIC offset assume s >= 0
        q, sm = -q, -sm
    if out_layout == "bhld":
        shape = (B, H, Lq, D)
    elif out_layout == "blhd":
        shape = (B, Lq, H * D)
    else:
        raise ValueError(f"attention_int8: out_layout {out_layout!r} not in ('bhld', 'blhd')")
    if out is None:
        out = torch.empty(shape, device=q.device, dtype=q.dtype)
    elif tuple(out.shape) != shape or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"attention_int8: out must be a contiguous {shape} {q.dtype} tensor on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    kv = quantize_kv(k, v, c)
    if c["QPRE"]:
        q8, qs, nqpad = quantize_q(q, qk_scale(sm, c, D), c, lam=kv["lam"])
        q8_strides = (H * nqpad * D, nqpad * D, D, nqpad if c["Q_ROW"] else nqpad // c["BLOCK_M"], 1)
    else:
        q8, qs, nqpad = q, q, Lq              # unused by the kernel
        q8_strides = (0, 0, 0, 0, 0)
    _launch(q, q8, qs, q8_strides, nqpad, kv, out, out_layout, None, B, H, Lq, Lk, D, sm, c)
    return out


def _launch(q, q8, qs, q8_strides, nqpad, kv, out, out_layout, fp8_scales, B, H, Lq, Lk, D, sm, c):
    """The attention kernel's launch (shared by :func:`sage_attention` and :func:`sage_attention_prequantized`).
    ``fp8_scales``: None (output in ``out``'s dtype) or (hmax float32 [B*H] = max |v| per (b, h), sx float32 [Lq, 1]): an
    e4m3 output with the one scale max(hmax) / 448, which the kernel also writes into every row of sx."""
    if c["GLUON"]:     # sage_attention_prequantized's layout (checked there, before any launch)
        from . import int8_gluon

        return int8_gluon.launch_prequantized(q8, qs, kv, out, fp8_scales, _ones_e4m3(q.device, c["BLOCK_N"]), H, Lq, D,
                                                qk_scale(sm, c, D), c)
    if kv.get("v_perm32"):
        raise ValueError("attention_int8: V was quantized for the Gluon kernel (keys permuted, config GLUON); the "
                         "Triton kernel needs it in key order")
    if out_layout == "bhld":
        so = out.stride()
    else:
        so = (out.stride(0), D, out.stride(1), 1)
    grid = (triton.cdiv(Lq, c["BLOCK_M"]), B * H)
    k8, vq = kv["k8"], kv["vq"]
    if c["TMA"]:
        from triton.tools.tensor_descriptor import TensorDescriptor

        bn, npad = c["BLOCK_N"], kv["n_kpad"]
        k8 = TensorDescriptor(k8.view(B * H * npad, D), [B * H * npad, D], [D, 1], [bn, D])
        if c["PV_FP8"]:
            vq = TensorDescriptor(vq.view(B * H * D, npad), [B * H * D, npad], [npad, 1], [D, bn])
        else:
            vq = TensorDescriptor(vq.view(B * H * npad, D), [B * H * npad, D], [D, 1], [bn, D])
    launch = {"maxnreg": c["MAXNREG"]} if c["MAXNREG"] else {}
    ones = _ones_e4m3(q.device, c["BLOCK_N"]) if c["ROWSUM_MMA"] else q
    hmax, sx = fp8_scales if fp8_scales is not None else (kv["vs"], kv["vs"])
    lam = kv.get("lam")
    _attn_fwd_kernel[grid](
        q, q8, qs, k8, kv["ks"], vq, kv["vs"], kv["vm"] if kv["vm"] is not None else kv["vs"], out, ones, hmax, sx,
        lam if lam is not None else kv["vs"],
        *q.stride(), *so, *q8_strides, H, Lq, nqpad, Lk, kv["n_kpad"], qk_scale(sm, c, D),
        HEAD_DIM=D, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], MAGIC=c["MAGIC"], PV_FP8=c["PV_FP8"],
        V_MEAN=c["V_MEAN"], INTERP=INTERPRET, IMPRECISE=None if c["IMPRECISE"] is None else min(c["IMPRECISE"], c["BLOCK_N"]),
        TMA=c["TMA"], QPRE=c["QPRE"], ROWSUM_MMA=c["ROWSUM_MMA"], Q_ROW=c["Q_ROW"], OUT_FP8=fp8_scales is not None,
        HP=triton.next_power_of_2(B * H) if fp8_scales is not None else 1, ROTATE=c["ROTATE"],
        BALANCE=lam is not None and not c["QPRE"], num_warps=c["num_warps"], num_stages=c["num_stages"], **launch)
    return out


def sage_attention_prequantized(q8: torch.Tensor, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                ksum: torch.Tensor, vamax: torch.Tensor, scale: float | None = None,
                                config: dict | None = None, out_fp8: bool = False):
    """8-bit attention of one sequence whose Q is already quantized per row by its producer
    (:func:`h3_turbo.kernels.fused.qk_norm_rope_sage`) and whose K/V statistics it summed: the ``Q_ROW`` math of
    :func:`sage_attention` (module docstring) without the Q pre-kernel and the K/V statistics pass.

    q8 int8 [L, H, D] (token-major, contiguous); qs float32 [L, H] (``max|q_row| / 127`` per row and head);
    k, v [1, H, L, D] bf16/fp16 views (any strides); ksum / vamax float32 (sum of k, max |v| over the L
    tokens) as [R, H, D] partials (:func:`kv_partial_stats`; R = 1 for whole sums), reduced once per head before the
    K/V pre-kernel (:func:`quantize_kv`); every
    scale of the route is computed by the kernels (no torch op between the launches). ``scale`` > 0 (default D ** -0.5). ``config``: launch configuration (default
    :func:`tuned_config`); ``Q_ROW`` and ``QPRE`` are forced on, ``V_MEAN`` must be off and ``PV_FP8`` on. With
    ``ROTATE`` (the default) q8 / qs must be of the Hadamard-rotated q (``qk_norm_rope_sage(rotate=True)``); K is
    rotated here.
    Returns [1, L, H*D] in k's dtype (core's layout), or with ``out_fp8`` the out_proj input of the fp8 path:
    (e4m3 [L, H*D], row scales float32 [L, 1], all equal to ``max(vamax) / 448`` (1/448 when v is all zero):
    the output of a softmax is a convex combination of v's rows, so no element exceeds max |v|). ValueError on
    other inputs."""
    if triton is None:
        raise NoCapablePathError(f"attention_int8: triton unavailable ({_TRITON_ERROR})")
    if k.ndim != 4 or k.shape[0] != 1 or v.shape != k.shape:
        raise ValueError(f"attention_int8.prequantized: k, v must be [1, H, L, D], got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    _, H, L, D = k.shape
    if D not in SUPPORTED_HEAD_DIMS or k.dtype not in SUPPORTED_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"attention_int8.prequantized: head dim {D} / dtypes {k.dtype}, {v.dtype}; expected "
                         f"{SUPPORTED_HEAD_DIMS} and one of {SUPPORTED_DTYPES}")
    if q8.dtype != torch.int8 or tuple(q8.shape) != (L, H, D) or not q8.is_contiguous():
        raise ValueError(f"attention_int8.prequantized: q8 must be a contiguous int8 [{L}, {H}, {D}], got "
                         f"{q8.dtype} {tuple(q8.shape)}")
    r = ksum.shape[0] if ksum.ndim == 3 else -1
    for name, t, shape in (("qs", qs, (L, H)), ("ksum", ksum, (r, H, D)), ("vamax", vamax, (r, H, D))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"attention_int8.prequantized: {name} must be a contiguous float32 {list(shape)}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if not (q8.device == qs.device == k.device == v.device == ksum.device == vamax.device):
        raise ValueError("attention_int8.prequantized: all inputs must be on one device")
    sm = (D ** -0.5) if scale is None else float(scale)
    if not math.isfinite(sm) or sm <= 0:
        raise ValueError(f"attention_int8.prequantized: scale {scale!r}; expected a finite number > 0")
    c = dict(config) if config is not None else tuned_config(k.device, L)
    c.update(QPRE=True, Q_ROW=True, BALANCE=False)   # the producer's norm weights carry the balance (.balance)
    c = _cfg(c)
    if c["V_MEAN"] or not c["PV_FP8"]:
        raise ValueError("attention_int8.prequantized: needs V_MEAN off and PV_FP8 on (the producer sums max |v|)")
    if c["GLUON"]:
        from . import int8_gluon

        if D != 128:
            raise ValueError(f"attention_int8.prequantized: config GLUON needs head dim 128, got {D}")
        why = int8_gluon.available(k.device)
        if why is not None:
            raise NoCapablePathError(f"attention_int8.prequantized: config GLUON on {k.device}: {why}")
    kv = quantize_kv(k, v, c, parts=(ksum, vamax))
    if out_fp8:
        sx = torch.empty((L, 1), device=k.device, dtype=torch.float32)
        out = torch.empty((1, L, H * D), device=k.device, dtype=torch.float8_e4m3fn)
        _launch(k, q8, qs, (L * H * D, D, H * D, 1, H), L, kv, out, "blhd", (kv["hmax"], sx), 1, H, L, L, D, sm, c)
        return out[0], sx
    out = torch.empty((1, L, H * D), device=k.device, dtype=k.dtype)
    _launch(k, q8, qs, (L * H * D, D, H * D, 1, H), L, kv, out, "blhd", None, 1, H, L, L, D, sm, c)
    return out


# ------------------------------------------------------------------------------ torch reference

def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_D`` for float32 x [..., D] (D a power of two), H_D the unnormalised Sylvester Hadamard matrix (entries
    +-1; ``H_D H_D^T = D I``), by the butterfly stages of the kernels' ``_fwht`` (the same float32 ops, the same bits).
    ``(q H)(k H)^T = D q k^T``: the rotated paths divide the score scale by D (:func:`qk_scale`)."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"attention_int8.fwht: last dim {d} is not a power of two")
    h = 1
    while h < d:
        x4 = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = x4[..., 0, :], x4[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], d)
        h *= 2
    return x


def hadamard(d: int, dtype=torch.float64) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix H_D / sqrt(D) [d, d] (orthogonal, symmetric)."""
    return fwht(torch.eye(d, dtype=torch.float32)).to(dtype) / math.sqrt(d)


_HM: dict = {}


def hadamard_matrix(d: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    """The unnormalised Sylvester Hadamard matrix H_D [d, d] (entries +-1, exact in bf16 / fp16) on ``device``, made
    once per (d, device, dtype) and shared (read-only): the B operand of the kernels' tensor-core rotation
    (``ROT_MMA``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (int(d), str(dev), dtype)
    got = _HM.get(key)
    if got is None:
        got = _HM[key] = fwht(torch.eye(d, dtype=torch.float32)).to(device=dev, dtype=dtype).contiguous()
    return got


def qk_scale(sm: float, config: dict, head_dim: int) -> float:
    """The kernels' score scale in the exp2 domain: ``sm * log2(e)``, divided by ``head_dim`` when ``ROTATE`` (q and k
    multiplied by the unnormalised H_D: the dot products are D times larger; D is a power of two, so exact)."""
    s = float(sm) * LOG2E
    return s / head_dim if config["ROTATE"] else s


def _round_half_away(x: torch.Tensor, lim: float) -> torch.Tensor:
    x = x.clamp(-lim, lim)
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5))


def _block_quant(x: torch.Tensor, block: int):
    """x float32 [G, L, D] -> (int values as float32 [G, L, D], scale [G, ceil(L/block)]) with one
    max|x| per block of rows, exactly as the kernels (float32 ops in the same order)."""
    G, L, D = x.shape
    nb = -(-L // block)
    xp = torch.zeros(G, nb * block, D, dtype=torch.float32, device=x.device)
    xp[:, :L] = x
    xb = xp.view(G, nb, block * D)
    amax = xb.abs().amax(-1)                                           # [G, nb]
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = _round_half_away(xb * inv[..., None], 127.0).view(G, nb * block, D)[:, :L]
    return q, amax / 127.0


def quantize_reference(q, k, v, config: dict | None = None):
    """torch-only quantization of the kernels (float32, same formulas): dict with ``q8`` [G, Lq, D]
    (int values as float32), ``qs`` [G, nbq], ``k8`` [G, Lk, D], ``ks`` [G, nbk], ``v8`` [G, Lk, D]
    (e4m3 values as float32, or bf16 values of v - vm when not PV_FP8), ``km``, ``vm``, ``vs``,
    ``vinv`` [G, D], ``lam`` [G, D] (``BALANCE``) or None; G = B*H."""
    c = _cfg(config)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    km, vm, vs, vinv = kv_stats(k, v, c["V_MEAN"], c["PV_FP8"])
    qf = q.float().reshape(B * H, Lq, D)
    kf = k.float().reshape(B * H, Lk, D) - km[:, None, :]
    lam = None
    if c["BALANCE"]:
        lam = balance.from_k_amax(balance.k_amax(k, km))
        qf, kf = qf * lam[:, None, :], kf * (1.0 / lam)[:, None, :]
    if c["ROTATE"]:
        qf, kf = fwht(qf), fwht(kf)
    q8, qs = _block_quant(qf, 1 if c["Q_ROW"] else c["BLOCK_M"])
    k8, ks = _block_quant(kf, c["BLOCK_N"])
    vf = v.float().reshape(B * H, Lk, D)
    if c["V_MEAN"]:
        vf = vf - vm[:, None, :]
    if c["PV_FP8"]:
        v8 = (vf * vinv[:, None, :]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        v8 = vf.to(torch.bfloat16).float()
    return {"q8": q8, "qs": qs, "k8": k8, "ks": ks, "v8": v8, "km": km, "vm": vm, "vs": vs, "vinv": vinv, "lam": lam}


def sage_reference(q, k, v, scale: float | None = None, config: dict | None = None, rows=None,
                   quant: dict | None = None) -> torch.Tensor:
    """float64 model of the kernel's math (module docstring), key block by key block with the same
    running maxima, P * 448 rounded to e4m3 (or bf16) before P V, float64 everywhere else (the GPU's fp8
    MMA sums each key block with ~14-bit precision, which this model does not reproduce).
    q, k, v [B, H, L, D]; ``rows``: optional index tensor of query rows (default all).
    Returns float64 [B*H, r, D]."""
    c = _cfg(config)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    sm = (D ** -0.5) if scale is None else float(scale)
    qz = quant if quant is not None else quantize_reference(q, k, v, c)
    rows = torch.arange(Lq, device=q.device) if rows is None else rows
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    q8 = qz["q8"][:, rows].double()                                     # [G, r, D]
    qc = qz["qs"][:, rows if c["Q_ROW"] else rows // bm].double() * qk_scale(sm, c, D)     # [G, r]
    G, r = qc.shape
    m = torch.full((G, r), -math.inf, dtype=torch.float64, device=q.device)
    l = torch.zeros((G, r), dtype=torch.float64, device=q.device)
    acc = torch.zeros((G, r, D), dtype=torch.float64, device=q.device)
    for j in range(-(-Lk // bn)):
        k8 = qz["k8"][:, j * bn:(j + 1) * bn].double()
        s = (q8 @ k8.transpose(1, 2)) * (qc * qz["ks"][:, j].double()[:, None])[..., None]
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp2(s - m_new[..., None] + LOG2_FP8_MAX)
        alpha = torch.exp2(m - m_new)
        if c["PV_FP8"]:
            p8 = p.float().clamp(max=FP8_MAX).to(torch.float8_e4m3fn).double()
        else:
            p8 = p.float().to(torch.bfloat16).double()
        l = l * alpha + (p8 if c["ROWSUM_MMA"] else p).sum(-1)
        acc = acc * alpha[..., None] + p8 @ qz["v8"][:, j * bn:(j + 1) * bn].double()
        m = m_new
    out = acc / l[..., None]
    if c["PV_FP8"]:
        out = out * qz["vs"].double()[:, None, :]
    return out + qz["vm"].double()[:, None, :]
