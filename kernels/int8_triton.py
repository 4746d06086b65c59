"""Triton kernels of the W8A8 block recipe (:mod:`.int8_block`), for GPUs with int8 tensor cores (sm_80+).

- :func:`quantize_blocks`: activations -> int8 + one fp32 scale per 128x128 tile (one program per tile), the
  recipe of :func:`.int8_block.quantize_blocks` (round half to even via the 1.5 * 2^23 trick, saturate to 127);
- :func:`gemm`: ``y = sum_kb sx * sw * (qx_kb @ qw_kb^T)``: an int8 ``tl.dot`` with int32 accumulation per
  128-wide K slice, scaled into an fp32 accumulator (per-row weight scales when ``row_group`` is 1), one rounding
  to the output dtype. K need not be a multiple of 128 (the last slice is masked to zero).

Set ``TRITON_INTERPRET=1`` before importing triton to run them on a CPU (the tests): there the int8 dot runs as an
fp32 dot of the integer values, which is exact (|sum| <= 2^21 < 2^24).
"""
from __future__ import annotations

import inspect
import logging
import os

import torch
import triton
import triton.language as tl

from .. import state
from .int8_block import BLOCK, Int8Weight, cdiv
from .triton_interp import rne_bf16

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_log = logging.getLogger("h3_turbo")


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, KB, stride_xm, stride_qm, TILE: tl.constexpr):
    mb = tl.program_id(0)
    kb = tl.program_id(1)
    rows = mb * TILE + tl.arange(0, TILE)
    cols = kb * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-8)
    v = x * (128.0 / amax)
    v = (v + 12582912.0) - 12582912.0            # round half to even (|v| <= 128 < 2^22)
    v = tl.minimum(tl.maximum(v, -128.0), 127.0)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], v.to(tl.int8), mask=mask)
    tl.store(s_ptr + mb * KB + kb, amax / 128.0)


def quantize_blocks(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 [ceil(M/128), ceil(K/128)]) of a 2-D bf16/fp16/fp32 tensor (the recipe)."""
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    mb, kb = cdiv(m, BLOCK), cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=torch.int8, device=x2d.device)
    s = torch.empty((mb, kb), dtype=torch.float32, device=x2d.device)
    if m and k:
        _quant_kernel[(mb, kb)](x2d, q, s, m, k, kb, x2d.stride(0), q.stride(0), TILE=BLOCK, num_warps=8)
    return q, s


@triton.jit
def _tiles(xq_ptr, wq_ptr, kb, pid_m, pid_n, offs_m, offs_n, offs_k, m_ok, n_ok, K, stride_xm, stride_wn,
           EVEN_K: tl.constexpr, TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The int8 operands of K block ``kb``: a [BM, 128] activations, b [128, BN] weights (K-major)."""
    if TMA:
        a = xq_ptr.load([pid_m * BM, kb * 128])
        b = wq_ptr.load([pid_n * BN, kb * 128]).T
    else:
        k = kb * 128 + offs_k
        if EVEN_K:
            a = tl.load(xq_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0)
            b = tl.load(wq_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=n_ok[None, :], other=0)
        else:
            k_ok = k < K
            a = tl.load(xq_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0)
            b = tl.load(wq_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                        other=0)
    return a, b


@triton.jit
def _int_dot(a, b, INTERP: tl.constexpr):
    """Exact fp32 value of the int8 dot a @ b (|a.b| <= 128 * 127 * 127 < 2^22)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    # int32 -> fp32 exactly without the slow I2F conversion: adding the bits of 2^23 + 2^22 and subtracting
    # that float is exact (as SageAttention does)
    ip = tl.dot(a, b, out_dtype=tl.int32)
    return (ip + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _kb_scale(sx_ptr, sw_ptr, kb, pid_m, pid_n, offs_m, offs_n, m_ok, n_ok, stride_sxm, stride_swn,
              SW_GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """sx * sw of K block kb for the tile: a scalar, a row or column vector, or the full outer product, whichever the
    tile's position in the 128-row activation blocks and SW_GROUP-row weight groups allows."""
    if 128 % BM == 0:
        sx = tl.load(sx_ptr + ((pid_m * BM) // 128) * stride_sxm + kb)
    else:
        sx = tl.load(sx_ptr + (offs_m // 128) * stride_sxm + kb, mask=m_ok, other=0.0)[:, None]
    if SW_GROUP % BN == 0:
        sw = tl.load(sw_ptr + ((pid_n * BN) // SW_GROUP) * stride_swn + kb)
    else:
        sw = tl.load(sw_ptr + (offs_n // SW_GROUP) * stride_swn + kb, mask=n_ok, other=0.0)[None, :]
    return sx * sw


@triton.jit
def _w8a8_kernel(xq_ptr, sx_ptr, wq_ptr, sw_ptr, out_ptr, M, N, K, KB, stride_xm, stride_wn, stride_om,
                 stride_sxm, stride_swn, SW_GROUP: tl.constexpr, M_BUCKET, INTERP: tl.constexpr, EVEN_K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, PIPE: tl.constexpr = False,
                 TMA: tl.constexpr = False, WS: tl.constexpr = False):
    """PIPE: the int32 product of K block kb+1 is issued before block kb's fp32 rescale (software pipelining);
    TMA: xq_ptr / wq_ptr are tensor descriptors (blocks [BM, 128] / [BN, 128]) read by bulk copies; WS: Triton's
    warp specialisation of the K loop (producer / consumer warps; with TMA, not with PIPE)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PIPE:
        a, b = _tiles(xq_ptr, wq_ptr, 0, pid_m, pid_n, offs_m, offs_n, offs_k, m_ok, n_ok, K, stride_xm, stride_wn,
                      EVEN_K, TMA, BM, BN)
        part = _int_dot(a, b, INTERP)
        for kb in range(1, KB):
            a, b = _tiles(xq_ptr, wq_ptr, kb, pid_m, pid_n, offs_m, offs_n, offs_k, m_ok, n_ok, K, stride_xm,
                          stride_wn, EVEN_K, TMA, BM, BN)
            nxt = _int_dot(a, b, INTERP)
            acc += part * _kb_scale(sx_ptr, sw_ptr, kb - 1, pid_m, pid_n, offs_m, offs_n, m_ok, n_ok, stride_sxm,
                                    stride_swn, SW_GROUP, BM, BN)
            part = nxt
        acc += part * _kb_scale(sx_ptr, sw_ptr, KB - 1, pid_m, pid_n, offs_m, offs_n, m_ok, n_ok, stride_sxm,
                                stride_swn, SW_GROUP, BM, BN)
    else:
        for kb in tl.range(0, KB, warp_specialize=WS):
            a, b = _tiles(xq_ptr, wq_ptr, kb, pid_m, pid_n, offs_m, offs_n, offs_k, m_ok, n_ok, K, stride_xm,
                          stride_wn, EVEN_K, TMA, BM, BN)
            acc += _int_dot(a, b, INTERP) * _kb_scale(sx_ptr, sw_ptr, kb, pid_m, pid_n, offs_m, offs_n, m_ok, n_ok,
                                                      stride_sxm, stride_swn, SW_GROUP, BM, BN)
    if INTERP:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            acc = rne_bf16(acc)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _configs():
    if INTERPRET:
        return [triton.Config({"BM": 32, "BN": 32, "GROUP_M": 4}, num_warps=4, num_stages=1)]
    cfgs = []
    for bm, bn, w, s in [(128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4), (128, 256, 8, 4), (256, 128, 8, 3),
                         (128, 128, 8, 4), (128, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3), (32, 128, 4, 4),
                         (16, 128, 4, 4)]:
        cfgs.append(triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8}, num_warps=w, num_stages=s))
    return cfgs


def _prune(configs, named_args, **kw):
    m = named_args["M_BUCKET"]
    return [c for c in configs if c.kwargs["BM"] <= max(16, m)] or configs


_AUTOTUNE_DISK = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
_tuned = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K", "SW_GROUP"],
                         prune_configs_by={"early_config_prune": _prune}, **_AUTOTUNE_DISK)(_w8a8_kernel)
_TUNED = state.KeySet("int8_gemm_tuned")
#: a config forced by tests / benchmarks (dict of BM, BN, GROUP_M, num_warps, num_stages); None = autotune
FORCED: dict = {"config": None}


def _bucket(m: int) -> int:
    b = 16
    while b < m and b < 8192:
        b *= 2
    return b


def gemm(x2d: torch.Tensor, w: Int8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W8A8 ``x @ W^T``: x2d [M, K] (quantized per call by :func:`quantize_blocks`) -> [M, N] in ``out_dtype``
    (default x's dtype; bf16/fp16/fp32)."""
    if x2d.shape[1] != w.in_features:
        raise ValueError(f"int8 gemm: input has {x2d.shape[1]} features, weight {w.in_features}")
    xq, sx = quantize_blocks(x2d)
    return gemm_quantized(xq, sx, w, out_dtype or x2d.dtype)


def _tma_args(args: tuple, xq: torch.Tensor, w: Int8Weight, m: int, n: int, k: int, bm: int, bn: int) -> tuple:
    """``args`` with the activation and weight pointers replaced by tensor descriptors of [bm, 128] / [bn, 128]
    blocks (rows / K beyond the tensor read as zeros). Needs 16-byte aligned row strides (K % 16 == 0)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if (xq.stride(0) % 16) or (w.qdata.stride(0) % 16):
        raise ValueError(f"int8 gemm: TMA needs 16-byte aligned rows, got strides {xq.stride(0)} / {w.qdata.stride(0)}")
    xd = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [bm, 128])
    wd = TensorDescriptor(w.qdata, [n, k], [w.qdata.stride(0), 1], [bn, 128])
    return (xd, args[1], wd) + tuple(args[3:])


def gemm_quantized(xq: torch.Tensor, sx: torch.Tensor, w: Int8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM of :func:`gemm` on activations already quantized by :func:`quantize_blocks` (benchmarks)."""
    m, k = xq.shape
    n = w.out_features
    out = torch.empty((m, n), device=xq.device, dtype=out_dtype)
    if m == 0:
        return out
    if max(m * k, n * k, m * n) >= 2 ** 31:
        raise ValueError(f"int8 gemm: 32-bit offsets overflow for M={m}, N={n}, K={k}; split the rows")
    sw = w.scale
    args = (xq, sx, w.qdata, sw, out, m, n, k, sx.shape[1], xq.stride(0), w.qdata.stride(0), out.stride(0),
            sx.stride(0), sw.stride(0), w.row_group, _bucket(m), INTERPRET, k % 128 == 0)
    if FORCED["config"] is not None:
        c = dict(FORCED["config"])
        nw, ns = c.pop("num_warps", 4), c.pop("num_stages", 1)
        launch = {"maxnreg": c.pop("maxnreg")} if c.get("maxnreg") else {}
        c.pop("maxnreg", None)
        if c.get("TMA"):
            args = _tma_args(args, xq, w, m, n, k, c["BM"], c["BN"])
        _w8a8_kernel[(triton.cdiv(m, c["BM"]) * triton.cdiv(n, c["BN"]),)](*args, **c, num_warps=nw, num_stages=ns,
                                                                          **launch)
    else:
        key = (_bucket(m), n, k, w.row_group)
        if _TUNED.add_new(key):
            _log.info("H3 Turbo int8: autotuning the W8A8 GEMM for rows<=%d N=%d K=%d (first use of this shape)",
                      key[0], n, k)
        _tuned[lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)](*args)
    return out
