"""NVFP4 (E2M1 codes + e4m3 block scales per 16 + fp32 tensor scale) in pure torch.

The ComfyUI-native layout (comfy-kitchen 0.2.31 ``TensorCoreNVFP4Layout``, github.com/Comfy-Org/comfy-kitchen;
``docs/h3-facts.md``, ``docs/formats.md``) for a logical weight W [N, K]:

- ``qdata`` uint8 [roundup(N,16), roundup(K,16)/2]: two 4-bit E2M1 codes per byte, element 2j in the
  HIGH nibble ("hi_first"), 2j+1 in the low nibble. Code bit 3 is the sign, bits 0-2 index
  {0, .5, 1, 1.5, 2, 3, 4, 6}.
- ``block_scale`` float8_e4m3fn [roundup(N,128), roundup(K/16,4)] in the cuBLAS block-scaling
  ("to_blocked", 128x4 tiles) layout.
- ``scale`` (``weight_scale_2``) fp32 scalar = amax(|W|) / (448 * 6).

Dequantization: ``W = E2M1[q] * block_scale * scale``. Foreign exporters (ModelOpt, vLLM-style kernels)
pack element 2j in the LOW nibble and may store block scales as a plain [N, K/16] matrix; see
:func:`swap_nibbles`, :func:`to_blocked`.

Everything here is bit-identical to comfy-kitchen's eager backend (``comfy_kitchen.backends.eager.
quantization.quantize_nvfp4`` / ``dequantize_nvfp4``, ``float_utils.to_blocked`` / ``from_blocked``);
tests/test_nvfp4_format.py compares bit for bit.
"""
from __future__ import annotations

import torch

from .. import state

F4_E2M1_MAX = 6.0
F8_E4M3_MAX = 448.0
BLOCK = 16

#: E2M1 values by 4-bit code (bit 3 = sign). Codes 8 is -0.0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def packed_shape(n: int, k: int) -> tuple[int, int]:
    """Storage shape of ``qdata`` for a logical [n, k] weight: [roundup(n,16), roundup(k,16)/2]."""
    return roundup(n, 16), roundup(k, 16) // 2


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """Swizzled block-scale shape for a logical [n, k] weight: [roundup(n,128), roundup(ceil(k/16),4)]."""
    return roundup(roundup(n, 16), 128), roundup(roundup(k, 16) // BLOCK, 4)


def linear_scale_shape(n: int, k: int) -> tuple[int, int]:
    """Plain (ModelOpt-style) block-scale shape: [n, k/16] (k padded to 16)."""
    return n, roundup(k, 16) // BLOCK


# ----------------------------------------------------------------------------- packing

def pack_nibbles(codes: torch.Tensor, hi_first: bool = True) -> torch.Tensor:
    """uint8 codes [..., 2m] (values 0..15) -> packed uint8 [..., m]. hi_first: element 2j -> high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8)
    a, b = c[..., 0::2], c[..., 1::2]
    return ((a << 4) | b) if hi_first else ((b << 4) | a)


def unpack_nibbles(packed: torch.Tensor, hi_first: bool = True) -> torch.Tensor:
    """Packed uint8 [..., m] -> codes uint8 [..., 2m] (inverse of :func:`pack_nibbles`)."""
    hi, lo = packed >> 4, packed & 0x0F
    pair = (hi, lo) if hi_first else (lo, hi)
    return torch.stack(pair, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Exchange high and low nibble of every byte (lo_first <-> hi_first), bit-preserving."""
    return ((packed << 4) | (packed >> 4)).to(torch.uint8)


# ----------------------------------------------------------------------------- scale layout

def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Plain block scales [R, C] -> cuBLAS "to_blocked" layout [roundup(R,128), roundup(C,4)] (zero padded).

    Tiles of 128 rows x 4 columns; inside a tile, row r = 32*i + j goes to (j, 4*i .. 4*i+3)
    (cuBLAS docs, "1D block scaling factors layout").
    """
    r, c = scales.shape
    pr, pc = roundup(r, 128), roundup(c, 4)
    if (pr, pc) != (r, c):
        p = torch.zeros((pr, pc), dtype=scales.dtype, device=scales.device)
        p[:r, :c] = scales
        scales = p
    nrb, ncb = pr // 128, pc // 4
    t = scales.reshape(nrb, 128, ncb, 4).permute(0, 2, 1, 3)          # [nrb, ncb, 128, 4]
    t = t.reshape(nrb, ncb, 4, 32, 4).transpose(2, 3)                  # [nrb, ncb, 32, 4, 4]
    return t.reshape(pr, pc).contiguous()


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: [roundup(rows,128), roundup(cols,4)] -> plain [rows, cols]."""
    pr, pc = roundup(rows, 128), roundup(cols, 4)
    if tuple(blocked.shape) != (pr, pc):
        raise ValueError(f"from_blocked: shape {tuple(blocked.shape)} != expected {(pr, pc)}")
    nrb, ncb = pr // 128, pc // 4
    t = blocked.reshape(nrb, ncb, 32, 4, 4).transpose(2, 3)            # [nrb, ncb, 4, 32, 4]
    t = t.reshape(nrb, ncb, 128, 4).permute(0, 2, 1, 3).reshape(pr, pc)
    return t[:rows, :cols]


# ----------------------------------------------------------------------------- E2M1

def _lut(device, dtype) -> torch.Tensor:
    """The 16 E2M1 values as a ``dtype`` tensor on ``device``, built once per (device, dtype) and kept in
    ``state.NVFP4_LUT`` (``state.clear_all()`` drops them)."""
    key = (device, dtype)
    with state.NVFP4_LUT.lock:
        t = state.NVFP4_LUT.data.get(key)
        if t is None:
            t = state.NVFP4_LUT.data[key] = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return t


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (|x| <= 6 after clamp) -> E2M1 codes uint8 with round-half-to-even and saturation.

    Ties go to the even code (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4). The sign
    bit is copied from the float's sign bit (so -0.0 and tiny negatives give code 8), as in
    comfy-kitchen's ``_f32_to_floatx_unpacked``.
    """
    a = x.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0)).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code | sign


def quantize(w: torch.Tensor, scale: torch.Tensor | None = None, chunk_rows: int = 4096
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to ComfyUI-native NVFP4, bit-identical to comfy-kitchen 0.2.31
    ``TensorCoreNVFP4Layout.quantize(w)`` (eager backend).

    w: [N, K] float (bf16/fp16/fp32). scale: optional fp32 scalar tensor scale; default
    ``amax(|w|) / 2688`` computed in ``w.dtype`` (as comfy-kitchen does) then cast to fp32.
    Raises ValueError for non-2-D or non-finite weights. Returns ``(qdata uint8 [roundup(N,16), roundup(K,16)/2], block_scale float8_e4m3fn
    [roundup(N,128), roundup(K/16,4)] swizzled, scale fp32 [])``. Rows are processed in chunks of
    ``chunk_rows`` (a multiple of 128) to bound temporary fp32 memory; the result does not depend on it.
    """
    if w.dim() != 2:
        raise ValueError(f"NVFP4 quantize needs a 2-D weight, got shape {tuple(w.shape)}")
    if chunk_rows % 128:
        raise ValueError("chunk_rows must be a multiple of 128")
    lo, hi = torch.aminmax(w) if w.numel() else (torch.zeros(()), torch.zeros(()))
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise ValueError("NVFP4 quantize: the weight has NaN or Inf values")
    if scale is None:
        scale = torch.amax(w.abs()) / (F8_E4M3_MAX * F4_E2M1_MAX)
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale)
    scale = scale.to(device=w.device, dtype=torch.float32).reshape(())
    n, k = w.shape
    pn, pk = roundup(n, 16), roundup(k, 16)
    if (pn, pk) != (n, k):
        w = torch.nn.functional.pad(w, (0, pk - k, 0, pn - n))
    qs, ss = [], []
    for r0 in range(0, pn, chunk_rows):
        x = w[r0:r0 + chunk_rows]
        rows = x.shape[0]
        xb = x.reshape(rows, -1, BLOCK)
        max_abs = torch.amax(torch.abs(xb), dim=-1)
        bs = max_abs.to(torch.float32) / F4_E2M1_MAX
        bs = bs / scale
        bs8 = torch.clamp(bs, max=F8_E4M3_MAX)
        bs32 = bs8.to(torch.float8_e4m3fn).to(torch.float32)
        total = scale * bs32
        zero = total == 0
        total_safe = torch.where(zero, torch.ones_like(total), total)
        ds = xb.float() / total_safe.unsqueeze(-1)
        ds = torch.where(zero.unsqueeze(-1), torch.zeros_like(ds), ds)
        ds = torch.clamp(ds, -F4_E2M1_MAX, F4_E2M1_MAX).reshape(rows, pk)
        qs.append(pack_nibbles(e2m1_round(ds), hi_first=True))
        ss.append(bs8.to(torch.float8_e4m3fn))
    qdata = torch.cat(qs, 0) if len(qs) > 1 else qs[0]
    plain = torch.cat(ss, 0) if len(ss) > 1 else ss[0]
    # to_blocked on uint8 view (cat/pad of float8 is fine, but keep byte semantics explicit)
    block = to_blocked(plain.view(torch.uint8)).view(torch.float8_e4m3fn)
    return qdata.contiguous(), block, scale


def dequantize(qdata: torch.Tensor, scale: torch.Tensor, block_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, hi_first: bool = True,
               orig_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Reference dequantization, bit-identical to comfy-kitchen eager ``dequantize_nvfp4``.

    qdata uint8 [Np, Kp/2]; scale fp32 scalar; block_scale e4m3 (or uint8 bytes) swizzled
    [roundup(Np,128), roundup(Kp/16,4)]. Computes in ``out_dtype`` exactly as comfy-kitchen:
    ``LUT[q] * (scale.to(out) * block.to(out))``. Returns [Np, Kp] (or ``orig_shape`` cropped).
    """
    if block_scale.dtype == torch.uint8:
        block_scale = block_scale.view(torch.float8_e4m3fn)
    codes = unpack_nibbles(qdata, hi_first=hi_first)
    vals = _lut(qdata.device, out_dtype)[codes.long()]
    rows, cols = vals.shape
    vals = vals.reshape(rows, -1, BLOCK)
    bs = from_blocked(block_scale, rows, cols // BLOCK)
    total = scale.to(out_dtype) * bs.to(out_dtype)
    out = (vals * total.unsqueeze(-1)).view(rows, cols).to(out_dtype)
    if orig_shape is not None:
        out = out[:orig_shape[0], :orig_shape[1]]
    return out


def dequantize_fp64(qdata: torch.Tensor, scale: torch.Tensor, block_scale: torch.Tensor,
                    hi_first: bool = True) -> torch.Tensor:
    """Exact float64 dequantization (no rounding anywhere: every product is exact in fp64)."""
    return dequantize(qdata, scale.double(), block_scale, torch.float64, hi_first)


def bad_scale_counts(block_scale: torch.Tensor) -> tuple[int, int]:
    """(NaN, negative) counts among e4m3 block scales given as float8_e4m3fn or uint8 bytes: NaN is the
    byte 0x7F/0xFF, negative has the sign bit set (a negative zero counts as negative)."""
    u = block_scale.contiguous().view(-1).view(torch.uint8)
    return int(((u & 0x7F) == 0x7F).sum()), int(((u & 0x80) != 0).sum())
