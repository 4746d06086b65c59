"""TurboDiffusion's W8A8 recipe (``Int8Linear``) in torch: 128x128 block quantization, the block-scaled GEMM on
``torch._int_mm`` and its float64 reference.

Recipe (thu-ml/TurboDiffusion ``turbodiffusion/ops/core.py`` and ``ops/quant/quant.hpp``; docs/h3-facts.md,
"W8A8 Int8Linear"): per 128x128 tile ``amax = max(1e-8, max|x|)``, ``q = saturate(round_half_even(x * (128 /
amax)))`` in int8 (so +amax saturates to 127), ``scale = amax / 128`` in fp32. Weights are quantized once (export),
activations per call with the same tiling (128 rows x 128 input channels). The GEMM is

    y[m, n] = sum_kb  sx[m // 128, kb] * sw[n // g, kb] * sum_{k in slice kb} qx[m, k] * qw[n, k]

with one int32 product per 128-wide K slice and an fp32 accumulator (TurboDiffusion's kernel does the same; it
requires K % 128 == 0, here a ragged last slice is zero-padded). ``g`` is the weight's row-group size: 128 for a
file's own blocks, 1 when row-split layers (``to_q``/``to_k``/``to_v`` with N % 128 != 0) were fused into one
weight (their scales expanded per row, so fusing is exact).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 128
INT8_MAX = 128.0
AMAX_FLOOR = 1e-8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Int8Weight:
    """One W8A8 linear weight: ``qdata`` int8 [N, K], ``scale`` fp32 [ceil(N / row_group), ceil(K / 128)]."""

    qdata: torch.Tensor
    scale: torch.Tensor
    row_group: int = BLOCK

    @property
    def out_features(self) -> int:
        return self.qdata.shape[0]

    @property
    def in_features(self) -> int:
        return self.qdata.shape[1]

    def validate(self, where: str = "Int8Weight") -> None:
        """ValueError naming the field and the expected dtype/shape."""
        q, s = self.qdata, self.scale
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"{where}: int8_weight must be a 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
        want = (cdiv(q.shape[0], self.row_group), cdiv(q.shape[1], BLOCK))
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(f"{where}: scale is {s.dtype} {tuple(s.shape)} (expected float32 {list(want)}: one "
                             f"scale per {self.row_group} rows x {BLOCK} input channels of a {list(q.shape)} weight)")
        if not torch.isfinite(s).all() or bool((s <= 0).any()):
            raise ValueError(f"{where}: scale holds non-finite or non-positive values (expected amax/128 > 0)")

    def row_scales(self) -> torch.Tensor:
        """fp32 [N, ceil(K/128)]: the scale of every weight row per K slice."""
        return self.scale.repeat_interleave(self.row_group, 0)[: self.out_features]

    @staticmethod
    def row_group_of(n: int, scale_rows: int) -> int:
        """The row group a stored scale of ``scale_rows`` rows implies for N = ``n`` rows (128, or 1 per row);
        ValueError when it is neither."""
        if scale_rows == cdiv(n, BLOCK):
            return BLOCK
        if scale_rows == n:
            return 1
        raise ValueError(f"{scale_rows} scale rows fit neither 128-row blocks ({cdiv(n, BLOCK)}) nor single rows "
                         f"({n}) of a weight with {n} rows")


def quantize_blocks(x2d: torch.Tensor, rows: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboDiffusion's block quantization of a 2-D tensor: (int8 [M, K], fp32 scales [ceil(M/rows), ceil(K/128)]).

    Math in fp32 on x's device; partial edge tiles take the amax of the elements they hold.
    """
    if x2d.dim() != 2:
        raise ValueError(f"quantize_blocks: expected a 2-D tensor, got {tuple(x2d.shape)}")
    m, k = x2d.shape
    mb, kb = cdiv(m, rows), cdiv(k, BLOCK)
    xf = F.pad(x2d.float(), (0, kb * BLOCK - k, 0, mb * rows - m))
    t = xf.view(mb, rows, kb, BLOCK)
    amax = t.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    q = torch.round(t * (INT8_MAX / amax)[:, None, :, None]).clamp_(-128, 127).to(torch.int8)
    return q.view(mb * rows, kb * BLOCK)[:m, :k].contiguous(), (amax / INT8_MAX).contiguous()


def quantize_weight(w: torch.Tensor) -> Int8Weight:
    """A float weight [N, K] quantized with the recipe (128x128 blocks)."""
    q, s = quantize_blocks(w)
    return Int8Weight(q, s, BLOCK)


def dequantize(w: Int8Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * scale`` per block in fp32, rounded once to ``dtype`` ([N, K])."""
    s = w.row_scales().repeat_interleave(BLOCK, 1)[:, : w.in_features]
    return (w.qdata.float() * s.to(w.qdata.device)).to(dtype)


def fuse_rows(parts: list[Int8Weight]) -> Int8Weight:
    """Row-concatenation of W8A8 weights with the same K (e.g. to_q, to_k, to_v -> one qkv weight), exact: the
    block scales are concatenated when every part's rows fill whole 128-row blocks, else expanded per row."""
    k = {p.in_features for p in parts}
    if len(k) != 1:
        raise ValueError(f"fuse_rows: parts have different in_features {sorted(k)}")
    q = torch.cat([p.qdata for p in parts], 0)
    if all(p.row_group == BLOCK and p.out_features % BLOCK == 0 for p in parts):
        return Int8Weight(q, torch.cat([p.scale for p in parts], 0), BLOCK)
    return Int8Weight(q, torch.cat([p.row_scales() for p in parts], 0).contiguous(), 1)


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0])) if tuple(t.shape) != (rows, cols) else t


def int_mm_linear(x2d: torch.Tensor, w: Int8Weight, out_dtype: torch.dtype | None = None,
                  row_scales: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 ``x @ W^T`` with ``torch._int_mm``: x block-quantized per call, one exact int32 product per K slice,
    fp32 epilogue ``acc += (part * sx) * sw`` in K order. Returns [M, N] in ``out_dtype`` (default x's dtype).
    ``row_scales``: ``w.row_scales()`` precomputed (optional)."""
    m, k = x2d.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"int_mm_linear: input has {k} features, weight {w.in_features}")
    kb = cdiv(k, BLOCK)
    xq, sx = quantize_blocks(x2d)
    sxr = sx.repeat_interleave(BLOCK, 0)[:m]
    swr = (w.row_scales() if row_scales is None else row_scales).to(x2d.device)
    cuda = x2d.device.type == "cuda"
    mp = max(m, 17) if cuda else m                      # cuBLASLt int8 needs M > 16, K and N multiples of 8
    np_ = cdiv(n, 8) * 8 if cuda else n
    xq = _padded(xq, mp, kb * BLOCK)
    wq = _padded(w.qdata.to(x2d.device), np_, kb * BLOCK)
    acc = torch.zeros(m, n, dtype=torch.float32, device=x2d.device)
    for b in range(kb):
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        part = torch._int_mm(xq[:, sl].contiguous(), wq[:, sl].t().contiguous())[:m, :n]
        acc += (part.float() * sxr[:, b:b + 1]) * swr[:, b]
    return acc.to(out_dtype or x2d.dtype)


def recipe_fp64(x2d: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """float64 value of the W8A8 recipe: x quantized exactly as the kernels do, every product and sum in float64
    ([M, N]); the reference the kernels are held to (their only roundings: fp32 accumulation, the output dtype)."""
    m, k = x2d.shape
    xq, sx = quantize_blocks(x2d)
    xd = xq.double() * sx.double().repeat_interleave(BLOCK, 0)[:m].repeat_interleave(BLOCK, 1)[:, :k]
    wd = w.qdata.double() * w.row_scales().double().repeat_interleave(BLOCK, 1)[:, :k]
    return xd @ wd.t()


def w8a8_bytes(n: int, k: int, row_group: int = BLOCK) -> int:
    """Bytes one W8A8 weight keeps (int8 data + fp32 scales)."""
    return n * k + 4 * cdiv(n, row_group) * math.ceil(k / BLOCK)
