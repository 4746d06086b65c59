"""Round-to-nearest-even onto the bf16 / fp16 / e4m3 grids, in fp32, for Triton kernels run under
``TRITON_INTERPRET=1`` (the CPU tests).

The interpreter's own fp32 -> bf16/fp16/e4m3 casts truncate and drop mantissa carries (an e4m3 value that rounds
up into the next binade comes out halved, -0 loses its sign), and its bf16 dot multiplies raw bits. Kernels
therefore round onto the target grid with these helpers first, under their ``INTERP`` flag only, after which the
cast is exact; on the GPU the hardware conversions (round to nearest even, ``satfinite``) are used and this code is
compiled out. Inputs: fp32 tensors; outputs: fp32 values on the target grid (same sign, including -0).
Known limit (Triton 3.8's interpreter): bf16 subnormals (below 2^-126) are converted inexactly in both directions,
on load and on the cast after these helpers, so CPU tests pass subnormal cases as float32 values.
"""
import triton
import triton.language as tl


@triton.jit
def rne_e4m3(x):
    """fp32 (|x| <= 448) -> nearest e4m3 value (ties to even) as fp32: 3 mantissa bits; below 2^-6 the subnormal
    step 2^-9."""
    b = x.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sub = tl.where(b < 0, -sub, sub)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def rne_bf16(x):
    """fp32 -> nearest bf16 value (ties to even) as fp32."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def rne_f16(x):
    """fp32 -> nearest fp16 value in fp16's normal range (ties to even) as fp32."""
    b = x.to(tl.int32, bitcast=True)
    return ((b + 0xFFF + ((b >> 13) & 1)) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def round_to(v, dt: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> ``dt`` (bf16 / fp16 / fp32) rounded to nearest even, as ``dt``: on the GPU the hardware conversion;
    under the interpreter (``INTERP``) the value is put on the grid first (its casts truncate)."""
    if INTERP:
        if dt == tl.bfloat16:
            v = rne_bf16(v)
        elif dt == tl.float16:
            v = rne_f16(v)
    return v.to(dt)


@triton.jit
def to_e4m3(v, dt: tl.constexpr, INTERP: tl.constexpr):
    """fp32 (|v| <= 448) -> e4m3 (``dt``) rounded to nearest even (onto the grid first under the interpreter)."""
    if INTERP:
        v = rne_e4m3(v)
    return v.to(dt)


@triton.jit
def round_i8(x, LIM: tl.constexpr):
    """fp32 -> int8, rounded half away from zero, clamped to [-LIM, LIM] (the SageAttention INT8 rounding; the
    float -> int conversion truncates toward zero on the GPU and under the interpreter alike)."""
    x = tl.minimum(tl.maximum(x, -LIM), LIM)
    return (x + tl.where(x >= 0, 0.5, -0.5)).to(tl.int8)
