"""Triton kernels for NVFP4 weights on GPUs without FP4 tensor cores (Hopper, Ada, Ampere).

- :func:`gemm_exact`: fused dequant-GEMM (W4A16). Reads ComfyUI's native NVFP4 storage as it is (packed E2M1
  codes, swizzled e4m3 block scales, fp32 global scale), dequantizes each [BN, 128] weight tile in registers to
  the activation dtype with the reference formula ``(E2M1[q] * bs) * gs`` (fp32, see
  :mod:`.nvfp4_ref`), and feeds a bf16/fp16 tensor-core ``tl.dot`` with fp32 accumulation. The full
  dequantized weight never exists in memory. Optional fused LoRA epilogue
  ``acc += lora_scale * h[:, blk*r:(blk+1)*r] @ Bc[n, :r]^T`` (block-diagonal qkv: ``blk = n // NB``).
- :func:`fold_weight`: the same dequantization written to a [rows, K] tensor (bf16/fp16/fp32, or e4m3 with one
  scale per row), optionally with a LoRA folded in: the "full" and tiled cuBLAS paths and the fp8 weight.
- :func:`quant_rows_fp8`: per-row FP8 e4m3 activation quantization (amax/448 scales).

The E2M1 decode puts the code's bits into an fp16 (``(c & 8) << 12 | (c & 7) << 9`` = E2M1 * 2^-14,
exact, subnormal for 0.5) and the e4m3 scale is decoded with integer ops times 2^14, so the product is
exactly ``E2M1 * bs``. Set ``TRITON_INTERPRET=1`` before importing triton to run these on a CPU.
"""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import state
from .paths.base import rows_class as m_bucket
from .triton_interp import round_to as _cast, to_e4m3 as _to_e4m3

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _e2m1_x2m14(c):
    """int32 codes 0..15 -> fp32 E2M1 value * 2^-14 (exact)."""
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_x2p14(s):
    """int32 e4m3fn bytes -> fp32 value * 2^14 (exact; NaN bytes are rejected at prepare time)."""
    e = (s >> 3) & 15
    normal = (((s & 0x7F) << 20) + (134 << 23)).to(tl.float32, bitcast=True)
    sub = (s & 7).to(tl.float32) * 32.0
    v = tl.where(e == 0, sub, normal)
    return tl.where((s & 0x80) != 0, -v, v)


@triton.jit
def _mma(a, b, acc, INTERP: tl.constexpr):
    """acc += a @ b; the interpreter's bf16 dot is broken, so it multiplies exact fp32 copies there."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _nvfp4_gemm_kernel(x_ptr, q_ptr, s_ptr, gs_ptr, out_ptr, h_ptr, b_ptr, lora_scale,
                       M, N, K, NKB, stride_xm, stride_om, stride_hm, stride_q, NCB4, R, NB,
                       M_BUCKET, INTERP: tl.constexpr,
                       HAS_LORA: tl.constexpr, BR: tl.constexpr, EVEN_K: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr):
    """SWAP=False: acc[BM, BN] = x @ W^T (W through shared memory). SWAP=True: acc[BN, BM] = W @ x^T,
    the dequantized W is the register (A) operand of the tensor-core MMA (no shared-memory round trip).
    W is read from ComfyUI's NATIVE storage: qdata byte j of a row holds elements 2j (high nibble) and 2j+1;
    block scales in the cuBLAS to_blocked layout (NCB4 = its column count / 4). Each 64-column half block is two
    K=32 MMAs in permuted K order: the high nibbles (elements 0, 2, .., 62) against x's even columns, the low
    nibbles against its odd columns (x loaded contiguous and split in registers). The weight operands are plain
    2-D [BN, 32] tiles decoded elementwise from a [BN, 32] byte tile: no join/reshape feeds a weight MMA operand
    (Triton 3.6 cannot give such a value the shared-memory layout the Hopper MMA reads, docs/kernels.md "GPU
    conformance")."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    gsize = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % gsize)
    pid_n = (pid % num_in_group) // gsize

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rm = offs_m % M
    rn = offs_n % N
    j32 = tl.arange(0, 32)
    c64 = tl.arange(0, 64)
    g4 = tl.arange(0, 4)
    # bytes [BN, 32] of one 64-column half block: byte j holds elements 2j (high nibble) and 2j + 1 (low nibble)
    q_ptrs = q_ptr + rn[:, None] * stride_q + j32[None, :]
    # swizzled scale offset of (row n, column c): tile (n//128, c//4), inside: (n%32)*16 + ((n%128)//32)*4 + c%4;
    # the 4 scale columns of half h of block kb are the tile column 2*kb + h, entries 0..3
    s_ptrs = s_ptr + ((rn // 128) * (NCB4 * 512) + (rn % 32) * 16 + ((rn % 128) // 32) * 4)[:, None] + g4[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + c64[None, :]
    gs = tl.load(gs_ptr)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, NKB):
        for h in tl.static_range(2):
            k0 = kb * 128 + h * 64
            if EVEN_K:
                p = tl.load(q_ptrs + h * 32).to(tl.int32)
                s4 = tl.load(s_ptrs + h * 512).to(tl.int32)
                xx = tl.load(x_ptrs + h * 64)
            else:
                # K % 16 == 0: a scale group of 16 columns (8 bytes) is all in or all out
                p = tl.load(q_ptrs + h * 32, mask=((k0 + 2 * j32) < K)[None, :], other=0).to(tl.int32)
                s4 = tl.load(s_ptrs + h * 512, mask=((k0 + g4 * 16) < K)[None, :], other=0).to(tl.int32)
                xx = tl.load(x_ptrs + h * 64, mask=((k0 + c64) < K)[None, :], other=0.0)
            # x's even and odd columns (contiguous load, split in registers)
            xe, xo = tl.split(tl.reshape(xx, (BM, 32, 2)))
            # the scale of byte j (group j // 8), broadcast to [BN, 32]; gs applied after, as in the reference
            sj = tl.reshape(tl.broadcast_to(_e4m3_x2p14(s4)[:, :, None], (BN, 4, 8)), (BN, 32))
            w_e = _cast((_e2m1_x2m14(p >> 4) * sj) * gs, x_ptr.dtype.element_ty, INTERP)
            w_o = _cast((_e2m1_x2m14(p & 15) * sj) * gs, x_ptr.dtype.element_ty, INTERP)
            if SWAP:
                acc = _mma(w_e, tl.trans(xe), acc, INTERP)
                acc = _mma(w_o, tl.trans(xo), acc, INTERP)
            else:
                acc = _mma(xe, tl.trans(w_e), acc, INTERP)
                acc = _mma(xo, tl.trans(w_o), acc, INTERP)
        q_ptrs += 64
        s_ptrs += 1024
        x_ptrs += 128
    if HAS_LORA:
        blk = (pid_n * BN) // NB
        ar = tl.arange(0, BR)
        if SWAP:
            lacc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            lacc = tl.zeros((BM, BN), dtype=tl.float32)
        for r0 in range(0, R, BR):
            rmask = (r0 + ar) < R
            hk = tl.load(h_ptr + rm[:, None] * stride_hm + blk * R + r0 + ar[None, :],
                         mask=rmask[None, :], other=0.0)
            bk = tl.load(b_ptr + rn[:, None] * R + r0 + ar[None, :], mask=rmask[None, :], other=0.0)
            if SWAP:
                lacc = _mma(bk, tl.trans(hk), lacc, INTERP)
            else:
                lacc = _mma(hk, tl.trans(bk), lacc, INTERP)
        acc = acc + lacc * lora_scale
    if SWAP:
        o_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        omask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(o_ptrs, _cast(acc, out_ptr.dtype.element_ty, INTERP), mask=omask)


def _gemm_configs():
    if INTERPRET:
        return [triton.Config({"BM": 16, "BN": 32, "GROUP_M": 4, "SWAP": sw}, num_warps=4, num_stages=1)
                for sw in (False, True)][:1]
    cfgs = []
    for bm, bn, w, s in [(128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4),
                         (128, 64, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4),
                         (16, 128, 4, 4), (16, 64, 4, 4)]:
        cfgs.append(triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8, "SWAP": False}, num_warps=w, num_stages=s))
    # swapped: W (dequantized in registers) is the MMA's A operand; BN = MMA M, BM = MMA N
    for bm, bn, w, s in [(128, 128, 4, 3), (256, 128, 8, 3), (128, 128, 8, 3), (256, 64, 4, 3),
                         (64, 128, 4, 4), (32, 128, 4, 4), (16, 128, 4, 4), (128, 64, 4, 4)]:
        cfgs.append(triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8, "SWAP": True}, num_warps=w, num_stages=s))
    return cfgs


def _prune(configs, named_args, **kw):
    m = named_args["M_BUCKET"]
    out = [c for c in configs if c.kwargs["BM"] <= max(16, m)]
    if kw.get("HAS_LORA", named_args.get("HAS_LORA", False)):
        # the LoRA epilogue needs every BN tile inside one qkv block (gemm_exact checks NB % 64 == 0)
        nb = named_args["NB"]
        out = [c for c in out if nb % c.kwargs["BN"] == 0]
    return out or configs


# Autotuning a new (M bucket, N, K) takes tens of seconds on first use: keep the results on disk
# (Triton's cache) where this Triton supports it, and say so once per shape.
_AUTOTUNE_DISK = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
_gemm_tuned = triton.autotune(configs=_gemm_configs(), key=["M_BUCKET", "N", "K", "HAS_LORA"],
                              prune_configs_by={"early_config_prune": _prune}, **_AUTOTUNE_DISK)(_nvfp4_gemm_kernel)
#: (M bucket, N, K, LoRA) shapes already autotuned in this process (their first use is logged)
_TUNED = state.KeySet("nvfp4_gemm_tuned")
_log = logging.getLogger("h3_turbo")


@dataclass
class GemmSettings:
    #: config forced by tests / callers (dict of BM, BN, GROUP_M, SWAP, num_warps, num_stages); None = autotune
    forced_config: dict | None = None


SETTINGS = GemmSettings()


def gemm_exact(x2d: torch.Tensor, qdata: torch.Tensor, block_scale: torch.Tensor, gs: torch.Tensor,
               n: int, k: int, lora: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused W4A16 GEMM: x2d [M, K] (bf16/fp16, row stride any, unit column stride) -> [M, N] x.dtype.

    The weight in ComfyUI's native NVFP4 storage, read as it is (no load-time copy): qdata uint8 [>=N, Kp/2]
    (element 2j in the high nibble, unit column stride), block_scale e4m3/uint8 contiguous in the cuBLAS
    to_blocked layout [roundup(Np,128), roundup(Kp/16,4)], gs fp32 [1]. ``lora``: optional
    (h [M, blocks*r] x.dtype, Bc [N, r] x.dtype contiguous, scale float, NB rows per block).
    Raises ValueError for storage that does not hold an [n, k] weight or offsets past 32 bits.
    """
    m = x2d.shape[0]
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    check_native(qdata, block_scale, n, k, "gemm_exact")
    bsu = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    nkb = triton.cdiv(k, 128)
    if out is None:
        out = torch.empty((m, n), device=x2d.device, dtype=x2d.dtype)
    if m == 0:
        return out
    if max(m * x2d.stride(0), m * out.stride(0), qdata.numel(), bsu.numel()) >= 2 ** 31:
        raise ValueError(f"gemm_exact: 32-bit offsets overflow for M={m}, N={n}, K={k}; split the rows")
    if lora is not None:
        h, bc, lscale, nb = lora
        forced = SETTINGS.forced_config
        bn = forced["BN"] if forced is not None else 64   # autotuning keeps the tiles whose BN divides nb
        if nb % bn:
            raise ValueError(f"gemm_exact: fused LoRA needs rows per block ({nb}) divisible by the tile's {bn} rows")
        r = bc.shape[1]
        if h.stride(1) != 1:
            h = h.contiguous()
        args = (h, bc, float(lscale))
        has_lora, br, stride_h = True, max(16, min(64, triton.next_power_of_2(r))), h.stride(0)
    else:
        args = (x2d, qdata, 0.0)
        has_lora, br, stride_h, r, nb = False, 16, 0, 1, n
    grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
    common = (x2d, qdata, bsu, gs, out, *args, m, n, k, nkb, x2d.stride(0), out.stride(0), stride_h,
              qdata.stride(0), bsu.shape[1] // 4, r, nb, m_bucket(m), INTERPRET)
    if SETTINGS.forced_config is not None:
        c = dict(SETTINGS.forced_config)
        c.setdefault("SWAP", False)
        nw, ns = c.pop("num_warps", 4), c.pop("num_stages", 1)
        g = (triton.cdiv(m, c["BM"]) * triton.cdiv(n, c["BN"]),)
        _nvfp4_gemm_kernel[g](*common, HAS_LORA=has_lora, BR=br, EVEN_K=(k % 128 == 0), **c,
                              num_warps=nw, num_stages=ns)
    else:
        key = (m_bucket(m), n, k, has_lora)
        if _TUNED.add_new(key):
            _log.info("H3 Turbo exact: autotuning the fused NVFP4 GEMM for rows<=%d N=%d K=%d%s "
                      "(first use of this shape; can take ~10-50 s%s)", key[0], n, k, " +LoRA" if has_lora else "",
                      ", cached on disk" if _AUTOTUNE_DISK else "")
        _gemm_tuned[grid](*common, HAS_LORA=has_lora, BR=br, EVEN_K=(k % 128 == 0))
    return out


def check_native(qdata: torch.Tensor, block_scale: torch.Tensor, n: int, k: int, who: str) -> None:
    """ValueError unless (qdata, block_scale) are ComfyUI-native storage that holds an [n, k] weight."""
    if n < 1 or k < 16 or k % 16:
        raise ValueError(f"{who}: need n >= 1 and k a positive multiple of 16, got n={n}, k={k}")
    if qdata.dtype != torch.uint8 or qdata.dim() != 2 or qdata.shape[0] < n or qdata.shape[1] * 2 < k:
        raise ValueError(f"{who}: qdata {qdata.dtype} {tuple(qdata.shape)} does not hold a [{n}, {k}] NVFP4 "
                         f"weight (expected uint8 [>={n}, >={k // 2}])")
    if block_scale.dtype not in (torch.float8_e4m3fn, torch.uint8) or block_scale.dim() != 2:
        raise ValueError(f"{who}: block_scale must be a 2-D e4m3/uint8 tensor, got {block_scale.dtype} "
                         f"{tuple(block_scale.shape)}")
    want_cols = -(-(qdata.shape[1] * 2 // 16) // 4) * 4
    if block_scale.shape[1] != want_cols or block_scale.shape[0] % 128 or block_scale.shape[0] < -(-n // 128) * 128:
        raise ValueError(f"{who}: block_scale {tuple(block_scale.shape)} is not the swizzled layout of these "
                         f"codes (expected [>= {-(-n // 128) * 128} rows, multiple of 128, {want_cols} columns])")
    if qdata.stride(1) != 1 or not block_scale.is_contiguous():
        raise ValueError(f"{who}: qdata needs unit column stride and block_scale must be contiguous "
                         "(the swizzled offsets assume ComfyUI's storage)")


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=(k0 + offs) < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    a = tl.max(amax, axis=0)
    a = tl.where(a > 0, a, 1.0)
    inv = 448.0 / a
    for k0 in range(0, K, BLOCK):
        m = (k0 + offs) < K
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=m, other=0.0).to(tl.float32)
        qv = tl.minimum(tl.maximum(v * inv, -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + k0 + offs, _to_e4m3(qv, q_ptr.dtype.element_ty, INTERP), mask=m)
    tl.store(s_ptr + row, a / 448.0)


def quant_rows_fp8(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 float8_e4m3fn [M, K] contiguous, sx fp32 [M, 1]); formula of
    :func:`.nvfp4_ref.quantize_rows_fp8`."""
    m, k = x2d.shape
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    q = torch.empty((m, k), device=x2d.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x2d.device, dtype=torch.float32)
    if m:
        block = min(4096, triton.next_power_of_2(k))
        _quant_rows_kernel[(m,)](x2d, q, s, k, x2d.stride(0), q.stride(0), BLOCK=block, INTERP=INTERPRET,
                                 num_warps=4)
    return q, s


# --------------------------------------------------------------------------- weight-side fold

@triton.jit
def _fold_kernel(q_ptr, s_ptr, gs_ptr, a_ptr, b_ptr, lora_scale, amaxw_ptr, amaxa_ptr, so_ptr, inv_ptr, out_ptr,
                 N, K, ROW0, stride_q, NCB4, stride_a, stride_o, R, NB,
                 HAS_LORA: tl.constexpr, FP8_OUT: tl.constexpr, INV_GIVEN: tl.constexpr, BR: tl.constexpr,
                 BN: tl.constexpr, KB_PER: tl.constexpr, INTERP: tl.constexpr):
    """One [BN, KB_PER*128] tile of W' = dequant(W) (+ lora_scale * Bc[n] @ A[blk]) from the NATIVE
    ComfyUI storage (qdata element 2j in the high nibble; block scales in the cuBLAS to_blocked layout,
    NCB4 = its column count / 4), rounded once to out's dtype (bf16/fp16) or, FP8_OUT, quantized per row
    as e4m3(clamp(W' * 448 / bound[n], +-448)) with bound[n] = amax_w[n] + |lora_scale| *
    sum_r |Bc[n, r]| * amax_a[blk*R + r] >= max_k |W'[n, k]| (written to so_ptr as bound/448); INV_GIVEN: the
    factor 448/bound is read from inv_ptr instead (the resident fp8 weight's own, no LoRA). Rows ROW0..ROW0+N-1 of
    the storage go to rows 0..N-1 of out (and so_ptr)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    rn = ROW0 + offs_n % N
    g8 = tl.arange(0, 8)
    j8 = tl.arange(0, 8)
    c128 = tl.arange(0, 128)
    gs = tl.load(gs_ptr)
    # swizzled scale offset of (row n, scale column c): tile (n//128, c//4), inside: (n%32)*16 + ((n%128)//32)*4 + c%4
    srow = (rn // 128) * (NCB4 * 512) + (rn % 32) * 16 + ((rn % 128) // 32) * 4
    if HAS_LORA:
        blk = (ROW0 + pid_n * BN) // NB
        ar = tl.arange(0, BR)
        bt = tl.load(b_ptr + rn[:, None] * R + ar[None, :], mask=ar[None, :] < R, other=0.0)
    if FP8_OUT:
        if INV_GIVEN:
            inv = tl.load(inv_ptr + rn)
        else:
            bound = tl.load(amaxw_ptr + rn)
            if HAS_LORA:
                am = tl.load(amaxa_ptr + blk * R + ar, mask=ar < R, other=0.0)
                bound = bound + tl.abs(lora_scale) * tl.sum(tl.abs(bt.to(tl.float32)) * am[None, :], axis=1)
            bound = tl.where(bound > 0, bound, 1.0)
            inv = 448.0 / bound
            if pid_k == 0:
                tl.store(so_ptr + offs_n, bound / 448.0, mask=nmask)
    for kk in range(0, KB_PER):
        kb = pid_k * KB_PER + kk
        k0 = kb * 128
        # bytes [BN, 8 scale groups, 8 bytes]: byte j of group g holds elements 16g+2j (high nibble), 16g+2j+1
        cm = (k0 + g8 * 16) < K                                # K % 16 == 0: a scale group is all in or all out
        p = tl.load(q_ptr + rn[:, None, None] * stride_q + kb * 64 + g8[None, :, None] * 8 + j8[None, None, :],
                    mask=cm[None, :, None], other=0).to(tl.int32)
        sc = kb * 8 + g8                                       # the 8 scale columns of this 128-column block
        s = _e4m3_x2p14(tl.load(s_ptr + srow[:, None] + (sc // 4)[None, :] * 512 + (sc % 4)[None, :],
                                mask=cm[None, :], other=0).to(tl.int32))
        w_even = (_e2m1_x2m14(p >> 4) * s[:, :, None]) * gs
        w_odd = (_e2m1_x2m14(p & 15) * s[:, :, None]) * gs
        w = tl.reshape(tl.join(w_even, w_odd), (BN, 128))
        kmask = (k0 + c128) < K
        if HAS_LORA:
            at = tl.load(a_ptr + (blk * R + ar)[:, None] * stride_a + k0 + c128[None, :],
                         mask=(ar[:, None] < R) & kmask[None, :], other=0.0)
            w = w + _mma(bt, at, tl.zeros((BN, 128), dtype=tl.float32), INTERP) * lora_scale
        o = out_ptr + offs_n[:, None] * stride_o + k0 + c128[None, :]
        om = nmask[:, None] & kmask[None, :]
        if FP8_OUT:
            qv = w * inv[:, None]
            if INTERP:  # the GPU conversion saturates (cvt.rn.satfinite); |qv| <= 448 up to fp32 rounding anyway
                qv = tl.minimum(tl.maximum(qv, -448.0), 448.0)
            tl.store(o, _to_e4m3(qv, out_ptr.dtype.element_ty, INTERP), mask=om)
        else:
            tl.store(o, _cast(w, out_ptr.dtype.element_ty, INTERP), mask=om)


#: launch settings of :func:`fold_weight` (H200 measurement: benchmarks/results/bench_fold_h200.md)
FOLD_CFG = {"warps": 4, "stages": 2, "kb_per": 4, "bn": 64}


def fold_bn(nb: int | None) -> int | None:
    """Row tile of :func:`fold_weight` for LoRA blocks of ``nb`` rows (None: no LoRA): the largest of
    64/32/16 that divides ``nb`` (a tile must not straddle two qkv blocks); None if none does."""
    if nb is None:
        return 16 if INTERPRET else FOLD_CFG["bn"]
    for bn in ((16,) if INTERPRET else tuple(b for b in (128, 64, 32, 16) if b <= FOLD_CFG["bn"])):
        if nb % bn == 0:
            return bn
    return None


def fold_weight(qdata: torch.Tensor, block_scale: torch.Tensor, gs: torch.Tensor, n: int, k: int,
                out: torch.Tensor, lora: tuple | None = None, amax_w: torch.Tensor | None = None,
                scale_out: torch.Tensor | None = None, row0: int = 0,
                inv_w: torch.Tensor | None = None) -> torch.Tensor:
    """Materialize a layer weight from its native NVFP4 storage, optionally with a LoRA folded in
    (the weight-side form of the Turbo branch: one pass over the packed weight per call instead of two
    passes over the activations and the output).

    qdata uint8 [Np, Kp/2] (element 2j in the high nibble), block_scale e4m3/uint8 in the cuBLAS to_blocked
    layout [roundup(Np,128), roundup(Kp/16,4)], gs fp32 [1] (``weight_scale_2``): docs/h3-facts.md#nvfp4-storage-layout.
    lora: (A [blocks*r, K] bf16, Bc [n, r] bf16, scale float, NB rows per block, amax_a fp32 [blocks*r] or
    None): W'[i] = W[i] + scale * Bc[i] @ A[i // NB] in fp32 (tensor-core product, fp32 accumulation).
    out: [>=n, k] bf16/fp16: W' rounded once (without lora bit-identical to :func:`nvfp4_ref.dequant_exact`);
    or float8_e4m3fn: needs ``amax_w`` fp32 [n] (max |W| per row) and ``scale_out`` fp32 [>=n]; row n is
    e4m3(clamp(W'[n] * 448 / bound[n], -448, 448)) with the upper bound bound[n] = amax_w[n] +
    |scale| * sum_r |Bc[n, r]| * amax_a[r] of max |W'[n]| (no clipping), and scale_out[n] = bound[n] / 448.
    ``inv_w`` fp32 [n] (no lora, e4m3 out): use these factors instead of 448 / amax_w (the resident fp8 weight's
    own ``448 / amax``, so the e4m3 bytes equal :func:`nvfp4_ref.fp8_rowwise_from_weight`'s bit for bit);
    ``scale_out`` is then not written. ``row0``: produce rows row0..row0+n-1 of the weight into rows 0..n-1 of
    ``out`` (no lora). Rows >= n of ``out`` are not written. Raises ValueError for a bad ``out``, an NB no row
    tile divides, or ``row0``/``inv_w`` with a lora.
    """
    if row0 < 0 or (row0 and lora is not None) or (inv_w is not None and lora is not None):
        raise ValueError(f"fold_weight: row0={row0} / inv_w need row0 >= 0 and no lora")
    check_native(qdata, block_scale, row0 + n, k, "fold_weight")
    devs = {t.device for t in (qdata, block_scale, gs, out) if t is not None}
    devs |= {t.device for t in (amax_w, scale_out, inv_w) if t is not None}
    if lora is not None:
        devs |= {t.device for t in (*lora[:2], *lora[4:5]) if isinstance(t, torch.Tensor)}
    if len(devs) != 1:
        raise ValueError(f"fold_weight: all tensors must be on one device, got {sorted(map(str, devs))}")
    if gs.numel() != 1 or gs.dtype != torch.float32:
        raise ValueError(f"fold_weight: gs (weight_scale_2) must be one fp32 value, got {gs.dtype} {tuple(gs.shape)}")
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        raise ValueError(f"fold_weight: out dtype {out.dtype} is not bf16, fp16, fp32 or float8_e4m3fn")
    if out.dim() != 2 or out.shape[0] < n or out.shape[1] != k or out.stride(1) != 1:
        raise ValueError(f"fold_weight: out {tuple(out.shape)} cannot hold a [{n}, {k}] weight (unit column stride)")
    fp8 = out.dtype == torch.float8_e4m3fn
    if fp8 and inv_w is not None:
        if inv_w.dtype != torch.float32 or inv_w.numel() < row0 + n or not inv_w.is_contiguous():
            raise ValueError(f"fold_weight: inv_w must be contiguous fp32 [>= {row0 + n}], got {inv_w.dtype} "
                             f"{tuple(inv_w.shape)}")
    elif fp8 and (amax_w is None or scale_out is None or amax_w.numel() < row0 + n or scale_out.numel() < n
                  or amax_w.dtype != torch.float32 or scale_out.dtype != torch.float32):
        raise ValueError("fold_weight: an e4m3 output needs fp32 amax_w [n] and fp32 scale_out [n] (or inv_w)")
    bsu = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    ncb4 = bsu.shape[1] // 4
    amax_a = None
    if lora is not None:
        a, bc, lscale, nb = lora[:4]
        amax_a = lora[4] if len(lora) > 4 else None
        if not isinstance(nb, int) or nb < 1:
            raise ValueError(f"fold_weight: LoRA block rows must be a positive int, got {nb!r}")
        bn = fold_bn(nb)
        if bn is None:
            raise ValueError(f"fold_weight: LoRA block rows {nb} are not a multiple of 16")
        if bc.dim() != 2:
            raise ValueError(f"fold_weight: LoRA Bc must be 2-D [n, r], got {tuple(bc.shape)}")
        r = bc.shape[1]
        blocks = -(-n // nb)
        if (a.dim() != 2 or a.shape[1] != k or a.shape[0] != blocks * r or bc.shape[0] != n
                or (amax_a is not None and (amax_a.numel() != blocks * r or amax_a.dtype != torch.float32))):
            raise ValueError(f"fold_weight: LoRA A {tuple(a.shape)} / Bc {tuple(bc.shape)} do not fit a [{n}, {k}] "
                             f"weight with {blocks} block(s) of {nb} rows (expected A [{blocks}*r, {k}], Bc [{n}, r], "
                             f"amax_a fp32 [{blocks}*r])")
        if a.stride(1) != 1:
            a = a.contiguous()
        if fp8 and amax_a is None:
            amax_a = a.abs().amax(dim=1).float()
        args = (a, bc.contiguous(), float(lscale))
        has_lora, br, stride_a = True, max(16, triton.next_power_of_2(r)), a.stride(0)
    else:
        bn = fold_bn(None)
        args = (qdata, qdata, 0.0)
        has_lora, br, stride_a, r, nb = False, 16, 0, 1, n
    nkb = triton.cdiv(k, 128)
    kb_per = 1 if INTERPRET else (FOLD_CFG["kb_per"] or nkb)   # 0: one program per row tile, the whole K
    while nkb % kb_per:
        kb_per //= 2
    dummy = gs
    grid = (triton.cdiv(n, bn), nkb // kb_per)
    inv_given = fp8 and inv_w is not None
    _fold_kernel[grid](qdata, bsu, gs, *args, amax_w if (fp8 and amax_w is not None) else dummy,
                       amax_a if amax_a is not None else dummy, scale_out if scale_out is not None else dummy,
                       inv_w if inv_given else dummy, out, n, k, row0, qdata.stride(0), ncb4, stride_a,
                       out.stride(0), r, nb,
                       HAS_LORA=has_lora, FP8_OUT=fp8, INV_GIVEN=inv_given, BR=br, BN=bn, KB_PER=kb_per,
                       INTERP=INTERPRET,
                       num_warps=FOLD_CFG["warps"] if bn > 32 else 4,
                       num_stages=FOLD_CFG["stages"])
    return out
