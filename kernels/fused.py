"""Fused elementwise producers of a DiT block for the ``fp8`` compute path (issue 21), with eager references.

The ``fp8`` path's activation format is e4m3 with one fp32 scale per row: ``sx = amax(|row|) / 448`` (rows of
zeros: ``1/448``), ``x8 = e4m3_rne(clamp(x * 448 / amax, +-448))`` (:func:`.nvfp4_ref.quantize_rows_fp8`, the
formula of ``triton_nvfp4.quant_rows_fp8``). The kernels below write that format straight from the data they
already hold, instead of writing bf16 and quantizing it in a separate pass:

- :func:`norm_mod` (a): ``h = rms_norm(x) * w * (1 + scale[seg(r)]) + shift[seg(r)]`` per row r, computed in
  fp32 from x's values (no bf16 rounding between the steps), written as e4m3 + row scales (``out="fp8"``) or
  rounded once to x's dtype (``out="bf16"``). With ``residual=(other, gate)`` it first updates the stream in
  place, ``x[r] = round(x[r] + other[r] * gate[seg(r)])`` (bit-identical to core's ``addcmul_`` on bf16, see
  :func:`gate_residual_`), and normalizes the updated row: one pass for "gated residual + next norm +
  modulation + quantization".
- :func:`swiglu` (b): ``a = silu(h[:, :F]) * h[:, F:]`` (core's ``INPUT_ACT_EAGER["swiglu"]`` convention: gate
  first, then up), in fp32, written as e4m3 + row scales for fc2.
- :func:`gate_residual_` (c): ``x[r] = round(x[r] + other[r] * gate[seg(r)])`` in place: fp32 product of two
  values of x's dtype (exact) plus x, one rounding: the arithmetic of core's per-segment
  ``x[a:b].addcmul_(other[a:b], gate[row].to(x.dtype))``; one launch for all segments.
- :func:`qk_norm_rope` (e): core's per-head q/k RMSNorm + partial split-half RoPE, in place on the qkv GEMM
  output, in one launch (v stays in the buffer; attention reads it like q and k): ``n = round(x * rsqrt(mean(x^2) + eps)
  * w)`` per head of q / k (w = q_norm / k_norm weight, the norm rounded to x's dtype as core's RMSNorm materialises
  it), then for pair i < R/2 (R = rot_dim): ``(n_i, n_{i+R/2}) <- (f00 n_i + f01 n_{i+R/2}, f10 n_i + f11 n_{i+R/2})``
  with core's rotation table ``f[s, i] = [[cos, -sin], [sin, cos]]``, in fp32, one rounding; dims >= R pass
  through normed. The arithmetic of comfy-kitchen's ``rms_rope_split_half_`` (eager reference
  :func:`qk_norm_rope_ref`), replacing its kernel.
- :func:`qk_norm_rope_sage` (f): (e) producing the ``int8_sage`` backend's inputs instead of q in place: q as INT8
  per (row, head) with ``max|q_row| / 127`` scales, k rotated in place, then k's column sums and v's column max |v|
  by one statistics pass (eager reference :func:`qk_norm_rope_sage_ref`); the fused block's producer route when the MODEL's
  attention is the pack's ``int8_sage`` (measurements: docs/kernels.md).
- :func:`fp8_gemm`: rowwise ``torch._scaled_mm`` on an already quantized input (the ``fp8`` path's GEMM without
  its quantization pass); :func:`fp8_gemm_ref` its fp32 emulation.

Segments (core's ``mod_segments``): ``[(start, stop, mod_row)]`` covering rows ``0..M`` contiguously in order, where
``mod_row`` is an int or (newer cores, a latent denoise mask: core's ``_mod_row``) an integer index tensor with one
entry per row of the segment; :func:`segment_rows` turns them into an int32 row -> modulation-row index (validated,
cached). The kernels read one modulation row per stream row either way.

Inputs: x / other / h bf16 or fp16, 2-D with unit column stride (row strides free); ``w`` [K] any float dtype;
shift / scale / gate [R, K] (row stride free: core's AdaLN chunks are column slices of one [R, 6K] tensor).
Every wrapper raises ValueError naming the argument on a shape/dtype/device mismatch. The Triton kernels run on
CUDA; on a CPU only under ``TRITON_INTERPRET=1`` (the tests). The ``*_ref`` functions are the eager references
(float64 by default), the ``EAGER`` ops (:class:`EagerOps`) their fp32 counterparts the fused block runs on a
CPU in tests. Measured bounds and GPU status: docs/kernels.md, "Fused producers".
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Sequence

import torch

from . import nvfp4_ref as ref
from .attention.balance import MAX_EXP             # the launch's clamp of the q / k balance (BALANCE)
from .attention.int8_kernels import SUPPORTED_HEAD_DIMS, hadamard_matrix

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
_ACT_DTYPES = (torch.bfloat16, torch.float16)

#: launch constants of the kernels below: the fastest of the settings benchmarks/bench_fused.py swept on an H200
#: (docs/kernels.md, "Fused fp8 DiT block")
NORM_WARPS = 4               # norm_mod: one row per program, held in registers
SWIGLU_WARPS = 8             # swiglu: one row per program, held in registers
ROPE_ROWS = 8                # qk_norm_rope(_sage): rows per program (the program loops over the heads)
ROPE_ROWS_MMA = 16           # the same with the q rotation on the tensor cores (a dot's M is at least 16)
ROPE_WARPS = 4
GATE_BLOCK = 2048            # gate_residual_: columns per program
GATE_WARPS = 4
SAGE_STATS_PARTS = 16        # row ranges of qk_norm_rope_sage's K/V statistics (int8_kernels.kv_partial_stats)
GLUON_WS_TOKENS = 16384      # from this many tokens on, the Gluon kernel's warp-specialized form (docs/attention.md)
GLUON_WS_STAGES = 2          # its K/V slots

#: the fused route's attention kernel in Gluon (kernels/attention/int8_gluon.py, the same output bits as the Triton
#: kernel; docs/attention.md): ``"auto"`` (where it can run, i.e. Hopper with a Triton that has Gluon's Hopper module;
#: elsewhere the Triton kernel, logged once at INFO), ``True`` (the same, a WARNING where it cannot run) or ``False``
#: (the Triton kernel)
SETTINGS = {"sage_gluon": "auto"}
MAX_ROW = 16384              # widest row norm_mod / gate_residual_ keep in registers (H3: 5376)

try:
    import triton
    import triton.language as tl

    from .triton_interp import round_i8 as _round_i8, round_to as _round, to_e4m3 as _e4m3
    from .attention.int8_kernels import _fwht, _hdot    # int8_sage's Hadamard rotation (qk_norm_rope_sage's q)
    _TRITON_ERROR = None
except Exception as e:  # noqa: BLE001 - no Triton: the wrappers raise, the eager ops still work
    triton = None
    _TRITON_ERROR = f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- segments

_SEG_CACHE: dict = {}


def segment_rows(segments: Sequence[tuple], m: int, device, limit: int | None = None) -> torch.Tensor:
    """int32 [m] on ``device``: entry r = the modulation row of row r.

    ``segments``: core's ``mod_segments`` [(start, stop, mod_row)], contiguous from 0 to ``m`` in order; ``mod_row``
    an int, or an integer index tensor [stop - start] (one row per token, newer cores). ``limit``: the modulation
    table's row count (every row must be below it). ValueError otherwise, naming the first bad segment. Cached per
    (segments, m, device, limit), index tensors by identity and version (at most 64 entries)."""
    from ..runtime.core_compat import check_mod_row

    parts, refs = [], []
    for i, (a, b, r) in enumerate(segments):
        a, b = int(a), int(b)
        r = check_mod_row(r, max(b - a, 0), f"mod_segments[{i}]")
        if isinstance(r, torch.Tensor):
            parts.append((a, b, ("tensor", id(r), r._version)))
            refs.append(r)
        else:
            parts.append((a, b, int(r)))
    key = (tuple(parts), int(m), str(device), limit)
    hit = _SEG_CACHE.get(key)
    if hit is not None and len(hit[1]) == len(refs) and all(w() is t for w, t in zip(hit[1], refs)):
        return hit[0]
    pos, ti = 0, 0
    hi = -1 if limit is None else int(limit)
    allowed = ">= 0" if limit is None else f"in 0..{hi - 1}"
    idx = torch.zeros(m, dtype=torch.int32)
    fills = []
    for i, (a, b, r) in enumerate(parts):
        if a != pos or b < a:
            shown = (a, b, r if not isinstance(r, tuple) else "per-token rows")
            raise ValueError(f"mod_segments[{i}] = {shown}: segments must cover rows 0..{m} contiguously in order "
                             f"(expected a start of {pos})")
        if isinstance(r, tuple):
            t = refs[ti]
            ti += 1
            lo_r, hi_r = (int(v) for v in torch.aminmax(t)) if t.numel() else (0, 0)
            if lo_r < 0 or (limit is not None and hi_r >= hi):
                raise ValueError(f"mod_segments[{i}] = ({a}, {b}, per-token rows {lo_r}..{hi_r}): modulation rows "
                                 f"must be {allowed}")
            fills.append((a, b, t))
        else:
            if r < 0 or (limit is not None and r >= hi):
                raise ValueError(f"mod_segments[{i}] = {(a, b, r)}: modulation rows must be {allowed}")
            idx[a:b] = r
        pos = b
    if pos != m:
        raise ValueError(f"mod_segments cover rows 0..{pos}, but the activation has {m} rows")
    idx = idx.to(device)
    for a, b, t in fills:
        idx[a:b] = t.to(device=idx.device, dtype=torch.int32)
    if len(_SEG_CACHE) >= 64:
        _SEG_CACHE.clear()
    _SEG_CACHE[key] = (idx, [weakref.ref(t) for t in refs])
    return idx


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:
    @triton.jit
    def _norm_mod_kernel(x_ptr, o_ptr, g_ptr, w_ptr, sh_ptr, sc_ptr, seg_ptr, y_ptr, s_ptr,
                         K, eps, stride_x, stride_o, stride_g, stride_sh, stride_sc, stride_y,
                         HAS_RES: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK: tl.constexpr,
                         INTERP: tl.constexpr):
        """One row r: [x[r] = round(x[r] + o[r] * round_x(g[seg]))]; h = x[r] * rsqrt(mean(x[r]^2) + eps) * w *
        (1 + sc[seg]) + sh[seg] in fp32; y[r] = e4m3(h * 448 / amax) with s[r] = amax / 448 (FP8_OUT) or
        y[r] = round(h) in y's dtype."""
        row = tl.program_id(0).to(tl.int64)
        seg = tl.load(seg_ptr + row).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            o = tl.load(o_ptr + row * stride_o + offs, mask=m, other=0.0).to(tl.float32)
            g = _round(tl.load(g_ptr + seg * stride_g + offs, mask=m, other=0.0).to(tl.float32),
                       x_ptr.dtype.element_ty, INTERP).to(tl.float32)
            xn = _round(x + o * g, x_ptr.dtype.element_ty, INTERP)
            tl.store(x_ptr + row * stride_x + offs, xn, mask=m)
            x = xn.to(tl.float32)
        ms = tl.sum(x * x, axis=0) / K
        rstd = 1.0 / tl.sqrt(ms + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        sc = tl.load(sc_ptr + seg * stride_sc + offs, mask=m, other=0.0).to(tl.float32)
        sh = tl.load(sh_ptr + seg * stride_sh + offs, mask=m, other=0.0).to(tl.float32)
        h = (x * rstd) * w * (1.0 + sc) + sh
        if FP8_OUT:
            a = tl.max(tl.where(m, tl.abs(h), 0.0), axis=0)
            a = tl.where(a > 0, a, 1.0)
            q = tl.minimum(tl.maximum(h * (448.0 / a), -448.0), 448.0)
            tl.store(y_ptr + row * stride_y + offs, _e4m3(q, y_ptr.dtype.element_ty, INTERP), mask=m)
            tl.store(s_ptr + row, a / 448.0)
        else:
            tl.store(y_ptr + row * stride_y + offs, _round(h, y_ptr.dtype.element_ty, INTERP), mask=m)

    @triton.jit
    def _silu_mul(g, u):
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _swiglu_kernel(h_ptr, y_ptr, s_ptr, F, stride_h, stride_y, BLOCK: tl.constexpr, INTERP: tl.constexpr):
        """One row r, held in registers (BLOCK >= F): a = silu(h[r, :F]) * h[r, F:2F] in fp32;
        y[r] = e4m3(a * 448 / amax), s[r] = amax / 448."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        base = h_ptr + row * stride_h
        m = offs < F
        g = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(base + F + offs, mask=m, other=0.0).to(tl.float32)
        act = _silu_mul(g, u)
        a = tl.max(tl.abs(act), axis=0)
        a = tl.where(a > 0, a, 1.0)
        q = tl.minimum(tl.maximum(act * (448.0 / a), -448.0), 448.0)
        tl.store(y_ptr + row * stride_y + offs, _e4m3(q, y_ptr.dtype.element_ty, INTERP), mask=m)
        tl.store(s_ptr + row, a / 448.0)

    @triton.jit
    def _gate_res_kernel(x_ptr, o_ptr, g_ptr, seg_ptr, K, stride_x, stride_o, stride_g,
                         BLOCK: tl.constexpr, INTERP: tl.constexpr):
        """x[r, c] = round(x[r, c] + o[r, c] * round_x(g[seg(r), c])) for one (row, BLOCK columns) tile."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < K
        seg = tl.load(seg_ptr + row).to(tl.int64)
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + row * stride_o + offs, mask=m, other=0.0).to(tl.float32)
        g = _round(tl.load(g_ptr + seg * stride_g + offs, mask=m, other=0.0).to(tl.float32), x_ptr.dtype.element_ty,
                   INTERP).to(tl.float32)
        tl.store(x_ptr + row * stride_x + offs, _round(x + o * g, x_ptr.dtype.element_ty, INTERP), mask=m)

    @triton.jit
    def _exp_field(w):
        """The float32 exponent field (0-255) of w (any float dtype, converted to float32 first), int32."""
        return (w.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 255

    @triton.jit
    def _qk_rope_kernel(x_ptr, w_ptr, f_ptr, q8_ptr, qs_ptr, hm_ptr, S, H, eps, stride_x, stride_fs, stride_fi,
                        stride_fr, stride_fc, D: tl.constexpr, R2: tl.constexpr, BS: tl.constexpr, SAGE: tl.constexpr,
                        HP: tl.constexpr, INTERP: tl.constexpr, ROTATE: tl.constexpr = False,
                        BALANCE: tl.constexpr = False, MAX_EXP: tl.constexpr = 12, ROT_MMA: tl.constexpr = False):
        """Rows [BS * pid0, +BS); pid1 = 0 / 1: every q / k head normed (weights w_ptr [2, D]: q's, k's) and rotated in
        place; v is not touched. Column c of a head is combined with its partner p(c) = c + R2 (c < R2), c - R2
        (R2 <= c < 2 R2), c (pass-through): out_c = A_c n_c + B_c n_p(c) with (A, B) = (f00, f01), (f11, f10), (1, 0);
        the table's A / B rows are read once for all H heads, and head h + 1's loads are issued before head h is
        computed (the same arithmetic). SAGE (int8_sage's inputs instead): q -> int8 per (row, head) into q8_ptr
        [S, H, D] with max|row| / 127 into qs_ptr [S, H] (collected over the head loop in a [BS, HP >= H] tile and
        stored once after it, so no layout conversion sits in the loop; q is not written back); k rotated in place as
        above. ROTATE (with SAGE): q times the unnormalised Hadamard matrix H_D before its quantization
        (int8_kernels._fwht; k is rotated by int8_sage's K pre-kernel). BALANCE: q's weights times l, k's divided by
        l, l = 2^n per channel from the weights' float32 exponent fields (``attention.balance.norm_weight_exponents``:
        the same integer arithmetic), so q.k is unchanged (powers of two: exact in float32). ROT_MMA (with ROTATE,
        BS >= 16): the rotation on the tensor cores, H_D [D, D] at hm_ptr in x's dtype (q is already rounded to it:
        exact products, float32 sums)."""
        part = tl.program_id(1)
        rows = tl.program_id(0) * BS + tl.arange(0, BS)
        rm = rows < S
        r64 = rows.to(tl.int64)
        cols = tl.arange(0, D)
        dt = x_ptr.dtype.element_ty
        row_base = x_ptr + r64[:, None] * stride_x
        lo = cols < R2
        rot = cols < 2 * R2
        pc = tl.where(lo, cols + R2, tl.where(rot, cols - R2, cols))
        pair = tl.where(lo, cols, cols - R2)
        a_off = tl.where(lo, 0, stride_fr + stride_fc)
        b_off = tl.where(lo, stride_fc, stride_fr)
        fb = f_ptr + r64[:, None] * stride_fs + pair[None, :] * stride_fi
        fm = rm[:, None] & rot[None, :]
        ca = tl.load(fb + a_off[None, :], mask=fm, other=1.0).to(tl.float32)
        cb = tl.load(fb + b_off[None, :], mask=fm, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + part * D + cols).to(tl.float32)
        wp = tl.load(w_ptr + part * D + pc).to(tl.float32)
        if BALANCE:
            # e2_c = clamp(trunc((E_k - E_q) / 2), +-MAX_EXP), E the larger float32 exponent field of the channel's RoPE
            # pair (0 where either field is 0 or 255); l = 2^e2 is symmetric in the pair, so wp takes l_c too
            # the larger field of the pair (NaN: 255, whatever its partner; an integer max has no NaN rule to differ)
            fq = tl.maximum(_exp_field(tl.load(w_ptr + cols)), _exp_field(tl.load(w_ptr + pc)))
            fk = tl.maximum(_exp_field(tl.load(w_ptr + D + cols)), _exp_field(tl.load(w_ptr + D + pc)))
            ok = (fq > 0) & (fq < 255) & (fk > 0) & (fk < 255)
            dd = fk - fq
            e2 = tl.where(ok, tl.where(dd >= 0, dd // 2, -((-dd) // 2)), 0)    # trunc(dd / 2), non-negative //
            e2 = tl.minimum(tl.maximum(e2, -MAX_EXP), MAX_EXP) * (1 - 2 * part)    # q: x l, k: / l
            lam = ((e2 + 127) << 23).to(tl.float32, bitcast=True)
            w = w * lam
            wp = wp * lam
        if ROTATE and ROT_MMA:
            hm = tl.load(hm_ptr + cols[:, None] * D + cols[None, :])      # loaded once for all heads
        hcols = tl.arange(0, HP)
        qsc = tl.zeros([BS, HP], dtype=tl.float32)
        base = row_base + (part * H) * D
        x_n = tl.load(base + cols[None, :], mask=rm[:, None], other=0.0)
        xp_n = tl.load(base + pc[None, :], mask=rm[:, None], other=0.0)
        for h in range(0, H):
            base = row_base + (part * H + h) * D
            x = x_n.to(tl.float32)          # head h + 1's loads in flight while head h is computed and stored
            xp = xp_n.to(tl.float32)
            nm = rm[:, None] & (h + 1 < H)
            x_n = tl.load(base + D + cols[None, :], mask=nm, other=0.0)
            xp_n = tl.load(base + D + pc[None, :], mask=nm, other=0.0)
            inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
            n = _round(x * inv[:, None] * w[None, :], dt, INTERP).to(tl.float32)
            npart = _round(xp * inv[:, None] * wp[None, :], dt, INTERP).to(tl.float32)
            y = _round(ca * n + cb * npart, dt, INTERP)
            if SAGE and part == 0:
                if ROTATE and ROT_MMA:
                    yf = _hdot(y, hm, False, INTERP)
                elif ROTATE:
                    yf = _fwht(y.to(tl.float32), BS, D)
                else:
                    yf = y.to(tl.float32)
                a = tl.max(tl.abs(yf), axis=1)
                inv_a = tl.where(a > 0, tl.math.div_rn(tl.zeros_like(a) + 127.0, tl.where(a > 0, a, 1.0)), 0.0)
                q8 = _round_i8(yf * inv_a[:, None], 127.0)
                tl.store(q8_ptr + r64[:, None] * (H * D) + h * D + cols[None, :], q8, mask=rm[:, None])
                qsc = tl.where(hcols[None, :] == h, (a / 127.0)[:, None], qsc)
            else:
                tl.store(base + cols[None, :], y, mask=rm[:, None])
        if SAGE and part == 0:
            tl.store(qs_ptr + r64[:, None] * H + hcols[None, :], qsc, mask=rm[:, None] & (hcols[None, :] < H))

def _need_triton(where: str, *ts: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"{where}: Triton is not importable ({_TRITON_ERROR})")
    for t in ts:
        if t.device.type != "cuda" and not INTERPRET:
            raise ValueError(f"{where}: the Triton kernel runs on CUDA tensors (on a CPU only under "
                             f"TRITON_INTERPRET=1); got a tensor on {t.device}")


def _check_act(where: str, name: str, t: torch.Tensor, m: int | None = None, k: int | None = None) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{where}: {name} must be 2-D with unit column stride, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if t.dtype not in _ACT_DTYPES:
        raise ValueError(f"{where}: {name} must be bf16 or fp16, got {t.dtype}")
    if (m is not None and t.shape[0] != m) or (k is not None and t.shape[1] != k):
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected [{m}, {k}]")


def _check_rows(where: str, name: str, t: torch.Tensor, k: int, nseg: int) -> None:
    if t.dim() != 2 or t.shape[1] != k or t.stride(1) != 1 or t.shape[0] < nseg:
        raise ValueError(f"{where}: {name} must be [>= {nseg}, {k}] with unit column stride, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def norm_mod(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor,
             rows: torch.Tensor, out: str = "fp8", residual: tuple[torch.Tensor, torch.Tensor] | None = None):
    """RMSNorm + per-segment AdaLN modulation (+ optional gated residual first), Triton (kernel (a)).

    x [M, K] bf16/fp16 (updated in place when ``residual`` is given); weight [K]; shift/scale [R, K];
    rows int32 [M] (:func:`segment_rows`, values < R); ``residual`` = (other [M, K] of x's dtype, gate [R, K]).
    Returns ``(y8 e4m3 [M, K], sx fp32 [M, 1])`` for ``out="fp8"`` or ``y`` [M, K] in x's dtype for ``out="bf16"``.
    Formula: module docstring; eager reference :func:`norm_mod_ref`. K <= :data:`MAX_ROW`."""
    where = "fused.norm_mod"
    _need_triton(where, x)
    _check_act(where, "x", x)
    m, k = x.shape
    if k > MAX_ROW:
        raise ValueError(f"{where}: rows of {k} elements exceed MAX_ROW={MAX_ROW}")
    if out not in ("fp8", "bf16"):
        raise ValueError(f"{where}: out={out!r}, expected 'fp8' or 'bf16'")
    if weight.shape != (k,):
        raise ValueError(f"{where}: weight shape {tuple(weight.shape)} != ({k},)")
    if rows.dtype != torch.int32 or rows.shape != (m,):
        raise ValueError(f"{where}: rows must be int32 [{m}], got {rows.dtype} {tuple(rows.shape)}")
    nseg = 1
    for name, t in (("shift", shift), ("scale", scale)):
        _check_rows(where, name, t, k, nseg)
    if residual is not None:
        other, gate = residual
        _check_act(where, "other", other, m, k)
        if other.dtype != x.dtype:
            raise ValueError(f"{where}: other dtype {other.dtype} != x dtype {x.dtype}")
        _check_rows(where, "gate", gate, k, nseg)
    else:
        other = gate = x
    weight = weight.contiguous()
    if out == "fp8":
        y = torch.empty((m, k), device=x.device, dtype=E4M3)
        s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    else:
        y = torch.empty((m, k), device=x.device, dtype=x.dtype)
        s = y
    if m:
        _norm_mod_kernel[(m,)](x, other, gate, weight, shift, scale, rows, y, s, k, float(eps),
                               x.stride(0), other.stride(0), gate.stride(0), shift.stride(0), scale.stride(0),
                               y.stride(0), HAS_RES=residual is not None, FP8_OUT=out == "fp8",
                               BLOCK=triton.next_power_of_2(k), INTERP=INTERPRET,
                               num_warps=4 if INTERPRET else NORM_WARPS)
    return (y, s) if out == "fp8" else y


def swiglu(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU -> fc2's fp8 input (kernel (b)): h [M, 2F] bf16/fp16 (gate columns first, then up) ->
    ``(a8 e4m3 [M, F], sa fp32 [M, 1])`` with a = silu(gate) * up in fp32. Eager reference :func:`swiglu_ref`."""
    where = "fused.swiglu"
    _need_triton(where, h)
    _check_act(where, "h", h)
    m, f2 = h.shape
    if f2 % 2:
        raise ValueError(f"{where}: h has {f2} columns, expected an even [gate; up] width")
    f = f2 // 2
    y = torch.empty((m, f), device=h.device, dtype=E4M3)
    s = torch.empty((m, 1), device=h.device, dtype=torch.float32)
    if m:
        _swiglu_kernel[(m,)](h, y, s, f, h.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(f), INTERP=INTERPRET,
                             num_warps=4 if INTERPRET else SWIGLU_WARPS)
    return y, s


def gate_residual_(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[r] = round(x[r] + other[r] * gate[rows[r]])`` in place, one launch for every segment (kernel (c)); returns x.

    x, other [M, K] of one dtype (bf16/fp16); gate [R, K] (rounded to x's dtype first, as core's ``.to(x.dtype)``);
    rows int32 [M]. The same arithmetic as core's per-segment ``addcmul_`` (fp32 opmath, one rounding)."""
    where = "fused.gate_residual_"
    _need_triton(where, x)
    _check_act(where, "x", x)
    m, k = x.shape
    _check_act(where, "other", other, m, k)
    if other.dtype != x.dtype:
        raise ValueError(f"{where}: other dtype {other.dtype} != x dtype {x.dtype}")
    _check_rows(where, "gate", gate, k, 1)
    if rows.dtype != torch.int32 or rows.shape != (m,):
        raise ValueError(f"{where}: rows must be int32 [{m}], got {rows.dtype} {tuple(rows.shape)}")
    if m:
        block = 64 if INTERPRET else min(GATE_BLOCK, triton.next_power_of_2(k))
        _gate_res_kernel[(m, triton.cdiv(k, block))](x, other, gate, rows, k, x.stride(0), other.stride(0),
                                                     gate.stride(0), BLOCK=block, INTERP=INTERPRET,
                                                     num_warps=4 if INTERPRET else GATE_WARPS)
    return x


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization of a bf16/fp16 [M, K] activation (kernel (d), e.g. the attention output for
    out_proj): the fp8 path's own Triton kernel ``triton_nvfp4.quant_rows_fp8``."""
    from .triton_nvfp4 import quant_rows_fp8

    return quant_rows_fp8(x)


def rope_table_problem(s: int, head_dim: int, freqs: torch.Tensor) -> str | None:
    """None if ``freqs`` is a rotation table :func:`qk_norm_rope` reads for ``s`` rows of ``head_dim``-wide heads:
    [1, S, 1, R/2, 2, 2] (core's ``rope_rotation_table``) with 0 < R <= head_dim, else what differs."""
    if freqs.dim() != 6 or freqs.shape[0] != 1 or freqs.shape[1] != s or freqs.shape[2] != 1 \
            or tuple(freqs.shape[-2:]) != (2, 2):
        return f"rope table shape {tuple(freqs.shape)}, expected [1, {s}, 1, R/2, 2, 2]"
    r2 = int(freqs.shape[3])
    if not 0 < 2 * r2 <= head_dim:
        return f"rope table rotates {2 * r2} dims of a {head_dim}-dim head"
    if freqs.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"rope table dtype {freqs.dtype}"
    return None


def qk_norm_rope(qkv: torch.Tensor, heads: int, head_dim: int, freqs: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Core's q/k RMSNorm + partial split-half RoPE in place on ``qkv`` (kernel (e)).

    qkv [S, 3 * heads * head_dim] bf16/fp16 ([q | k | v] columns, unit column stride, the qkv GEMM output);
    freqs [1, S, 1, R/2, 2, 2] (:func:`rope_table_problem`); q_weight / k_weight [head_dim]. The q and k columns of
    qkv are overwritten; returns the v columns of qkv as a strided [S, heads, head_dim] view (attention reads v like
    q and k: nothing copied). Formula: module docstring; eager reference :func:`qk_norm_rope_ref`. ValueError naming
    the argument on bad input."""
    where = "fused.qk_norm_rope"
    _qk_rope_checks(where, qkv, heads, head_dim, freqs, q_weight, k_weight, eps)
    s = qkv.shape[0]
    if s:
        _qk_rope_launch(qkv, heads, head_dim, freqs, q_weight, k_weight, eps, None)
    return qkv[:, 2 * heads * head_dim:].view(s, heads, head_dim)


def _qk_rope_checks(where, qkv, heads, head_dim, freqs, q_weight, k_weight, eps) -> None:
    _need_triton(where, qkv)
    _check_act(where, "qkv", qkv)
    s, width = qkv.shape
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"{where}: head_dim {head_dim} is not a power of two >= 2")
    if width != 3 * heads * head_dim:
        raise ValueError(f"{where}: qkv has {width} columns, expected 3 * heads * head_dim = {3 * heads * head_dim}")
    why = rope_table_problem(s, head_dim, freqs)
    if why is not None:
        raise ValueError(f"{where}: freqs: {why}")
    if freqs.device != qkv.device:
        raise ValueError(f"{where}: freqs on {freqs.device}, qkv on {qkv.device}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, torch.Tensor) or w.shape != (head_dim,) or w.device != qkv.device \
                or w.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"{where}: {name} must be a bf16 / fp16 / fp32 / fp64 [{head_dim}] tensor on {qkv.device}, "
                             f"got {getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))} on "
                             f"{getattr(w, 'device', None)}")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{where}: eps {eps!r}, expected a finite number >= 0")


def _qk_rope_launch(qkv, heads, head_dim, freqs, q_weight, k_weight, eps, sage, rotate: bool = False,
                    balance: bool = False, rot_mma: bool = False) -> None:
    """The kernel's launch: programs for q and k; ``sage`` = (q8, qs) or None; ``rot_mma``: the q rotation on the
    tensor cores (:data:`ROPE_ROWS_MMA` rows per program)."""
    s = qkv.shape[0]
    q8, qs = sage if sage is not None else (qkv, qkv)
    rotate = bool(rotate) and sage is not None
    mma = rotate and bool(rot_mma)
    hm = hadamard_matrix(head_dim, qkv.device, qkv.dtype) if mma else qs
    bs = ROPE_ROWS_MMA if mma else ROPE_ROWS
    _qk_rope_kernel[(triton.cdiv(s, bs), 2)](
        qkv, torch.cat((q_weight.reshape(-1), k_weight.reshape(-1))), freqs, q8, qs, hm, s, heads, float(eps),
        qkv.stride(0), freqs.stride(1), freqs.stride(3), freqs.stride(4), freqs.stride(5), D=head_dim,
        R2=int(freqs.shape[3]), BS=bs, SAGE=sage is not None, HP=triton.next_power_of_2(heads),
        INTERP=INTERPRET, ROTATE=rotate, BALANCE=bool(balance), MAX_EXP=MAX_EXP, ROT_MMA=mma,
        num_warps=4 if INTERPRET else ROPE_WARPS)


def qk_norm_rope_sage(qkv: torch.Tensor, heads: int, head_dim: int, freqs: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, rotate: bool = True, balance: bool = False,
                      rot_mma: bool = False) -> dict:
    """:func:`qk_norm_rope` producing the ``int8_sage`` attention's inputs (kernel (f)): q is quantized to INT8 per
    (row, head) straight from its rounded rotated values in the same launch (SageAttention's per-token Q
    quantization, ``q8 = round_half_away(q * 127 / max|q_row|)``), k is rotated in place, v is not copied; then one
    statistics pass over the k / v columns (:func:`.attention.int8_kernels.kv_partial_stats`). Arguments as
    :func:`qk_norm_rope`. Returns ``{"q8": int8 [S, heads, head_dim], "qs": float32 [S, heads] (max|q_row| / 127),
    "ksum": float32 [R, heads, head_dim] (partial sums of the rotated k over R <= :data:`SAGE_STATS_PARTS` row ranges:
    their sum over dim 0 is the column sum), "vamax": float32 [R, heads, head_dim] (partial maxima of |v|)}`` (the
    arguments of :func:`.attention.int8_kernels.sage_attention_prequantized`); qkv's q columns keep their input
    values. ``rotate`` (default): q is multiplied by the unnormalised Hadamard matrix H_D before its quantization
    (int8_sage's ``ROTATE``, which must match: :func:`.attention.int8_kernels.fwht`). ``balance``: the norm weights
    balanced in the launch, q's times l and k's divided by l (:func:`.attention.balance.fold_into_norm_weights`: the
    same outputs as passing its float32 weights), so k is stored divided by l; bf16 qkv only (fp16's exponent range
    leaves no room: ValueError). ``rot_mma``: the q rotation on the tensor cores (int8_sage's ``ROT_MMA``; the same
    values up to float32 rounding, not the butterfly's bits). Eager reference :func:`qk_norm_rope_sage_ref`. ValueError
    naming the argument on bad input."""
    where = "fused.qk_norm_rope_sage"
    _qk_rope_checks(where, qkv, heads, head_dim, freqs, q_weight, k_weight, eps)
    if balance and qkv.dtype != torch.bfloat16:
        raise ValueError(f"{where}: balance=True needs bf16 qkv (k / l is stored in qkv's dtype), got {qkv.dtype}")
    if head_dim not in SUPPORTED_HEAD_DIMS:      # before the launch writes k: the K/V statistics take these only
        raise ValueError(f"{where}: head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS} (int8_sage's head sizes)")
    s, dev = qkv.shape[0], qkv.device
    q8 = torch.empty((s, heads, head_dim), device=dev, dtype=torch.int8)
    qs = torch.empty((s, heads), device=dev, dtype=torch.float32)
    if not s:
        z = torch.zeros((1, heads, head_dim), device=dev, dtype=torch.float32)
        return {"q8": q8, "qs": qs, "ksum": z, "vamax": z.clone()}
    from .attention.int8_kernels import kv_partial_stats

    _qk_rope_launch(qkv, heads, head_dim, freqs, q_weight, k_weight, eps, (q8, qs), rotate=rotate, balance=balance,
                    rot_mma=rot_mma)
    inner = heads * head_dim
    ksum, vamax = kv_partial_stats(qkv[:, inner:2 * inner].view(s, heads, head_dim),
                                   qkv[:, 2 * inner:].view(s, heads, head_dim), parts=SAGE_STATS_PARTS)
    return {"q8": q8, "qs": qs, "ksum": ksum, "vamax": vamax}


def kv_stats_ref(qkv: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ksum, vamax) of the k / v columns of ``qkv`` as one torch reduction each (float32 [1, heads, head_dim]):
    the statistics ``int8_sage``'s standalone K/V pre-kernel computes, for comparing the fused route with it bit for
    bit (tests)."""
    s, inner = qkv.shape[0], heads * head_dim
    kc = qkv[:, inner:2 * inner].view(s, heads, head_dim)
    vmin, vmax = torch.aminmax(qkv[:, 2 * inner:].view(s, heads, head_dim), dim=0, keepdim=True)
    return kc.sum(dim=0, dtype=torch.float32, keepdim=True), torch.maximum(vmax.float(), -vmin.float())


# --------------------------------------------------------------------------- GEMM on a quantized input

def fp8_gemm(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, n: int,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(x8 * sx) @ (w8 * sw)^T`` by rowwise ``torch._scaled_mm`` (fp32 accumulation, fast accumulation as the fp8
    path): x8 e4m3 [M, K] row-major, sx fp32 [M, 1], w8 e4m3 [Npad, K], sw fp32 [1, Npad] -> [M, n] out_dtype
    (a view of the first n columns when Npad > n)."""
    if x8.dtype != E4M3 or w8.dtype != E4M3 or x8.shape[1] != w8.shape[1]:
        raise ValueError(f"fused.fp8_gemm: x8 {x8.dtype} {tuple(x8.shape)} and w8 {w8.dtype} {tuple(w8.shape)} "
                         f"must be e4m3 with the same K")
    if sx.shape != (x8.shape[0], 1) or sw.shape != (1, w8.shape[0]):
        raise ValueError(f"fused.fp8_gemm: scales {tuple(sx.shape)} / {tuple(sw.shape)}, expected "
                         f"[{x8.shape[0]}, 1] / [1, {w8.shape[0]}]")
    out = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype, use_fast_accum=True)
    return out[:, :n] if out.shape[1] != n else out


def fp8_gemm_ref(x8, sx, w8, sw, n, out_dtype=torch.bfloat16) -> torch.Tensor:
    """fp32 emulation of :func:`fp8_gemm` (CPU tests): ``((x8 * sx) @ (w8 * sw)^T)[:, :n]`` rounded to out_dtype."""
    acc = (x8.float() * sx.float()) @ (w8[:n].float() * sw[0, :n, None].float()).t()
    return acc.to(out_dtype)


# --------------------------------------------------------------------------- eager references

def norm_mod_ref(x, weight, eps, shift, scale, rows, residual=None, dtype=torch.float64):
    """Eager reference of :func:`norm_mod` before the output rounding: returns ``(h, x_new)``, h [M, K] in
    ``dtype`` (float64 default) and x_new the updated stream in x's dtype (x itself when ``residual`` is None;
    never modifies x). The residual step uses x's dtype arithmetic of core (``addcmul`` of the rounded gate)."""
    idx = rows.long().to(x.device)
    if residual is not None:
        other, gate = residual
        xn = torch.addcmul(x, other, gate[idx].to(x.dtype))
    else:
        xn = x
    xd = xn.to(dtype)
    rstd = torch.rsqrt(xd.pow(2).mean(dim=1, keepdim=True) + eps)
    h = xd * rstd * weight.to(dtype) * (1.0 + scale[idx].to(dtype)) + shift[idx].to(dtype)
    return h, xn


def swiglu_ref(h: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """silu(gate) * up in ``dtype`` for h [M, 2F] = [gate; up] (core's convention)."""
    g, u = h.to(dtype).chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def qk_norm_rope_ref(qkv: torch.Tensor, heads: int, head_dim: int, freqs: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float, dtype=torch.float64) -> torch.Tensor:
    """Eager reference of :func:`qk_norm_rope` (never modifies qkv): the new [S, 3 * heads * head_dim] tensor with
    q / k normed and rotated (the norm rounded to qkv's dtype, the rotation in ``dtype``, one final rounding)."""
    s = qkv.shape[0]
    inner = heads * head_dim
    r2 = int(freqs.shape[3])
    out = qkv.clone()
    f = freqs.reshape(s, r2, 2, 2).to(dtype)
    for c0, w in ((0, q_weight), (inner, k_weight)):
        x = qkv[:, c0:c0 + inner].reshape(s, heads, head_dim).to(dtype)
        inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        n = (x * inv * w.to(dtype)).to(qkv.dtype).to(dtype)
        a, b = n[..., :r2], n[..., r2:2 * r2]
        fa = f[:, None]
        ra = fa[..., 0, 0] * a + fa[..., 0, 1] * b
        rb = fa[..., 1, 0] * a + fa[..., 1, 1] * b
        y = torch.cat((ra, rb, n[..., 2 * r2:]), dim=-1)
        out[:, c0:c0 + inner] = y.reshape(s, inner).to(qkv.dtype)
    return out


def qk_norm_rope_sage_ref(qkv: torch.Tensor, heads: int, head_dim: int, freqs: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float, dtype=torch.float64, rotate: bool = True,
                          balance: bool = False) -> dict:
    """Eager reference of :func:`qk_norm_rope_sage` (never modifies qkv): :func:`qk_norm_rope_ref`'s rotated q / k
    (rounded to qkv's dtype; with ``balance`` from :func:`.attention.balance.fold_into_norm_weights`' weights), then
    q (times H_D with ``rotate``) quantized per (row, head) with the kernel's float32 formula; returns the kernel's
    dict (``q8`` as int8, sums / maxima in ``dtype``) plus ``new`` (the rotated [S, 3 * inner] tensor)."""
    if balance:
        from .attention.balance import fold_into_norm_weights

        q_weight, k_weight, _ = fold_into_norm_weights(q_weight, k_weight, 2 * int(freqs.shape[3]))
    s = qkv.shape[0]
    inner = heads * head_dim
    new = qk_norm_rope_ref(qkv, heads, head_dim, freqs, q_weight, k_weight, eps, dtype=dtype)
    q = new[:, :inner].reshape(s, heads, head_dim).float()
    if rotate:
        from .attention.int8_kernels import fwht

        q = fwht(q)
    a = q.abs().amax(dim=-1, keepdim=True)
    x = (q * torch.where(a > 0, torch.full_like(a, 127.0) / a, torch.zeros_like(a))).clamp(-127.0, 127.0)
    q8 = torch.trunc(x + torch.where(x >= 0, 0.5, -0.5)).to(torch.int8)
    k = new[:, inner:2 * inner].reshape(s, heads, head_dim).to(dtype)
    v = qkv[:, 2 * inner:].reshape(s, heads, head_dim).to(dtype)
    return {"q8": q8, "qs": (a[..., 0] / 127.0).contiguous(), "ksum": k.sum(dim=0, keepdim=True),
            "vamax": v.abs().amax(dim=0, keepdim=True), "new": new}


def gate_residual_ref(x, other, gate, rows) -> torch.Tensor:
    """Core's per-row arithmetic: ``torch.addcmul(x, other, gate[rows].to(x.dtype))`` (a new tensor)."""
    return torch.addcmul(x, other, gate[rows.long().to(x.device)].to(x.dtype))


def quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 path's activation format of a float tensor (:func:`.nvfp4_ref.quantize_rows_fp8`, fp32)."""
    return ref.quantize_rows_fp8(h.float())


class EagerOps:
    """The fused block's operations in eager torch (fp32 math, the kernels' formulas): what the block runs in
    CPU tests and dry benchmark runs. Same signatures and outputs as the Triton wrappers."""

    name = "eager"

    @staticmethod
    def norm_mod(x, weight, eps, shift, scale, rows, out="fp8", residual=None):
        h, xn = norm_mod_ref(x, weight, eps, shift, scale, rows, residual=residual, dtype=torch.float32)
        if residual is not None:
            x.copy_(xn)
        return quantize_rows(h) if out == "fp8" else h.to(x.dtype)

    @staticmethod
    def swiglu(h):
        return quantize_rows(swiglu_ref(h, torch.float32))

    @staticmethod
    def gate_residual_(x, other, gate, rows):
        return x.copy_(gate_residual_ref(x, other, gate, rows))

    @staticmethod
    def quant_rows(x):
        return quantize_rows(x)

    @staticmethod
    def qk_norm_rope(qkv, heads, head_dim, freqs, q_weight, k_weight, eps):
        new = qk_norm_rope_ref(qkv, heads, head_dim, freqs, q_weight, k_weight, eps, dtype=torch.float32)
        qkv.copy_(new)
        return qkv[:, 2 * heads * head_dim:].view(qkv.shape[0], heads, head_dim)

    gemm = staticmethod(fp8_gemm_ref)


class TritonOps:
    """The fused block's operations as the Triton kernels above and ``torch._scaled_mm`` (CUDA)."""

    name = "triton"
    norm_mod = staticmethod(norm_mod)
    swiglu = staticmethod(swiglu)
    gate_residual_ = staticmethod(gate_residual_)
    quant_rows = staticmethod(quant_rows)
    qk_norm_rope = staticmethod(qk_norm_rope)
    qk_norm_rope_sage = staticmethod(qk_norm_rope_sage)
    gemm = staticmethod(fp8_gemm)


EAGER = EagerOps()
TRITON = TritonOps()
