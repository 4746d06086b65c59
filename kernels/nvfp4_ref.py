"""Reference (pure torch) NVFP4 math used by the compute paths and their tests.

Storage format (docs/h3-facts.md#nvfp4-storage-layout, comfy-kitchen 0.2.31 ``TensorCoreNVFP4Layout``): ``qdata`` uint8
[Np, Kp/2] with element 2j in the HIGH nibble, block scales float8_e4m3fn in the cuBLAS "to_blocked"
layout [roundup(Np,128), roundup(Kp/16,4)], fp32 global scale ``weight_scale_2``. The layout helpers
(``unpack_nibbles``, ``from_blocked``) come from :mod:`h3_turbo.formats.nvfp4`.

**Reference dequantization of the compute paths** (:func:`dequant_exact`)::

    W[n, k] = round_to(out_dtype, fp32( fp32(E2M1[q[n,k]] * bs[n, k//16]) * weight_scale_2 ))

``E2M1[q] * bs`` is exact in fp32 (2 x 4 significant bits), so one fp32 rounding (the product with
the global scale) and one final rounding to bf16 happen. This is comfy-kitchen's GPU formula
(triton backend ``dequantize_nvfp4_kernel_tl``: ``val * scale.to(f32) * global_scale``); comfy-kitchen's
*eager* (CPU) backend instead multiplies in bf16 (``LUT[q] * (bf16(gs) * bf16(bs))``), which can differ
by about one bf16 ulp; both agree bit for bit when ``weight_scale_2`` is a power of two.
"""
from __future__ import annotations

import torch

from ..formats import nvfp4 as fmt

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0


def e2m1_lut(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16 E2M1 values by code (bit 3 = sign), as a tensor."""
    return torch.tensor(fmt.E2M1_VALUES, dtype=dtype, device=device)


def unswizzle_scales(block_scale: torch.Tensor, n_rows: int, k: int) -> torch.Tensor:
    """Swizzled e4m3 block scales -> plain uint8 bytes [n_rows, k/16] (row n, 16-element block j)."""
    b = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    return fmt.from_blocked(b, n_rows, k // 16).contiguous()


def dequant_exact(qdata: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                  n: int, k: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference dequant [n, k] in ``out_dtype`` with the fp32 formula of the module docstring.

    qdata uint8 [>=n, >=k/2]; block_scale e4m3/uint8 swizzled; global_scale fp32 scalar.
    """
    np_ = qdata.shape[0]
    kp = qdata.shape[1] * 2
    codes = fmt.unpack_nibbles(qdata, hi_first=True)[:n, :k]
    vals = e2m1_lut(qdata.device)[codes.long()]                                   # fp32 exact
    bs = unswizzle_scales(block_scale, np_, kp)[:n, : k // 16].view(E4M3).float()  # fp32 exact
    w = (vals.view(n, k // 16, 16) * bs.unsqueeze(-1)) * global_scale.float().reshape(())
    return w.view(n, k).to(out_dtype)


def dequant_fp64(qdata, block_scale, global_scale, n: int, k: int) -> torch.Tensor:
    """Exact float64 value of the NVFP4 weight [n, k] (no rounding anywhere)."""
    codes = fmt.unpack_nibbles(qdata, hi_first=True)[:n, :k]
    vals = e2m1_lut(qdata.device, torch.float64)[codes.long()]
    bs = unswizzle_scales(block_scale, qdata.shape[0], qdata.shape[1] * 2)[:n, : k // 16]
    bs = bs.view(E4M3).double()
    return (vals.view(n, k // 16, 16) * bs.unsqueeze(-1) * global_scale.double()).view(n, k)


# --------------------------------------------------------------------------- FP8 (W8A8) math

def fp8_rowwise_from_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weight [n, k] -> (w8 e4m3 [n, k], sw fp32 [n]) with ``w ~= w8 * sw[:, None]``.

    sw = amax(|row|) / 448 (rows of zeros: sw = 1/448); w8 = e4m3(w * (448 / amax)), round to nearest even.
    """
    amax, inv, sw = fp8_row_factors(w)
    return e4m3_rows(w, inv), sw


def e4m3_rows(w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(w * inv[:, None], +-448)) rounded to nearest even: a weight [n, k] re-expressed with the per-row
    factors ``inv`` [n] of :func:`fp8_row_factors`."""
    return (w.float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def fp8_row_factors(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row factors of :func:`fp8_rowwise_from_weight` for an fp32 weight [n, k]: (amax fp32 [n], the
    max |row| itself; inv = 448 / amax' fp32 [n]; sw = amax' / 448 fp32 [n]) with amax' = amax, or 1 for a zero row."""
    amax = w.abs().amax(dim=1).float()
    a = torch.where(amax > 0, amax, torch.ones_like(amax))
    return amax, FP8_MAX / a, a / FP8_MAX


def quantize_rows_fp8(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row activation quantization (the same formula as the Triton kernel): x [m, k] ->
    (x8 e4m3 [m, k], sx fp32 [m, 1]) with sx = amax/448 (zero rows: 1/448), x8 = e4m3(x * 448/amax)."""
    amax = x2d.abs().amax(dim=1, keepdim=True).float()
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    x8 = (x2d.float() * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return x8, amax / FP8_MAX


def fp8_linear_emulated(x2d: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, out_dtype) -> torch.Tensor:
    """Float emulation of ``torch._scaled_mm`` rowwise: (x8 * sx) @ (w8 * sw)^T in fp32 -> out_dtype."""
    x8, sx = quantize_rows_fp8(x2d)
    acc = x8.float() @ w8.float().t()
    return (acc * sx * sw.reshape(1, -1).float()).to(out_dtype)
