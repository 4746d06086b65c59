"""Issue 21's Triton kernels (kernels/fused.py) on the CPU under TRITON_INTERPRET=1, against float64 references at
ragged shapes. Bounds (METHOD.md: relative L2 of the dequantized output vs float64):

- e4m3 outputs (norm_mod fp8, swiglu): every e4m3 code equals the float64 result quantized by the fp8 path's own
  formula (nvfp4_ref.quantize_rows_fp8) except where the two differ by fp32 rounding at a rounding boundary: at
  most 0.2% of the codes, each by one e4m3 step; row scales to 1e-6 relative; relative L2 of the dequantized output
  vs float64 < 0.035 (e4m3 keeps 3 mantissa bits: <= 2^-4 relative per element, ~2.6% in L2 on Gaussian rows).
- bf16 output of norm_mod: the float64 result rounded to bf16 except at ties (<= 0.2% of elements, one bf16 ulp).
- the gated residual (gate_residual_, norm_mod's residual): bit-identical to core's per-segment addcmul_.
- qk_norm_rope: q / k = the float64 reference rounded once except <= 0.1% of elements, each by <= one ulp of its
  row's largest value (a norm on a float64 vs fp32 rounding boundary); v copied bit for bit; bit-identical to
  comfy-kitchen's own eager rms_rope_split_half with an fp32 table (bf16), within 0.4% relative L2 with a bf16 table
  (kitchen's eager op rotates in the table's dtype).

Run through tests/test_fused.py::test_fused_kernels_interpreted_on_cpu (fresh process with TRITON_INTERPRET=1).
"""
from __future__ import annotations

import logging
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: run via "
                "tests/test_fused.py::test_fused_kernels_interpreted_on_cpu", allow_module_level=True)

import torch  # noqa: E402

from h3_turbo.kernels import fused as fk  # noqa: E402

# (rows, width, segments): ragged widths (not powers of two, one the real hidden 5376), one-row and
# many-segment cases; segments as core's mod_segments (start, stop, mod_row)
CASES = [
    (37, 96, [(0, 5, 1), (5, 30, 0), (30, 37, 4)]),
    (1, 64, [(0, 1, 2)]),
    (23, 5376, [(0, 3, 1), (3, 9, 5), (9, 23, 0)]),
    (50, 176, [(0, 7, 1), (7, 8, 3), (8, 21, 1), (21, 50, 0)]),
]


def _e4m3_steps(a8: torch.Tensor, b8: torch.Tensor) -> torch.Tensor:
    """|difference| in e4m3 code steps (same sign: byte distance of the magnitudes)."""
    ai = a8.view(torch.uint8).int()
    bi = b8.view(torch.uint8).int()
    sa, sb = ai >> 7, bi >> 7
    ma, mb = ai & 0x7F, bi & 0x7F
    return torch.where(sa == sb, (ma - mb).abs(), ma + mb)


def _check_fp8(y8, sy, h64):
    q, s = fk.quantize_rows(h64)
    steps = _e4m3_steps(y8, q)
    assert int(steps.max()) <= 1, int(steps.max())
    assert float((steps > 0).float().mean()) <= 2e-3
    assert float(((sy - s) / s).abs().max()) <= 1e-6
    deq = y8.double() * sy.double()
    r = float((deq - h64).norm() / h64.norm())
    assert 1e-3 < r < 0.035, r          # e4m3 rounding happened, and no more than that
    return r


def _inputs(m, k, seed, dtype=torch.bfloat16, ada_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2.0).to(dtype)
    w = (1.0 + 0.3 * torch.randn(k, generator=g)).to(dtype)
    ada = (torch.randn(6, 6 * k, generator=g) * 0.4).to(ada_dtype)    # core's [R, 6K]: chunks are column slices
    other = torch.randn(m, k, generator=g).to(dtype)
    return x, w, ada[:, :k], ada[:, k:2 * k], ada[:, 2 * k:3 * k], other


@pytest.mark.parametrize("m,k,segs", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_mod_fp8_matches_float64(m, k, segs, dtype):
    x, w, sh, sc, _, _ = _inputs(m, k, seed=m * k, dtype=dtype)
    rows = fk.segment_rows(segs, m, "cpu")
    x0 = x.clone()
    y8, sy = fk.norm_mod(x, w, 1e-5, sh, sc, rows)
    assert torch.equal(x, x0)                                       # no residual: x untouched
    assert y8.dtype == torch.float8_e4m3fn and y8.shape == (m, k) and sy.shape == (m, 1)
    h64, _ = fk.norm_mod_ref(x, w, 1e-5, sh, sc, rows)
    _check_fp8(y8, sy, h64)


@pytest.mark.parametrize("m,k,segs", CASES)
@pytest.mark.parametrize("ada_dtype", [torch.bfloat16, torch.float32])
def test_norm_mod_residual_bit_identical_update_and_fp8(m, k, segs, ada_dtype):
    """residual=(other, gate): x += other * gate per segment exactly as core's addcmul_, then the norm of the new x."""
    x, w, sh, sc, gate, other = _inputs(m, k, seed=7 + m, ada_dtype=ada_dtype)
    rows = fk.segment_rows(segs, m, "cpu")
    want = x.clone()
    for a, b, r in segs:                                            # core's _mod_gate
        want[a:b].addcmul_(other[a:b], gate[r].to(want.dtype))
    y8, sy = fk.norm_mod(x, w, 1e-5, sh, sc, rows, residual=(other, gate))
    assert torch.equal(x.view(torch.int16), want.view(torch.int16))
    h64, _ = fk.norm_mod_ref(want, w, 1e-5, sh, sc, rows)
    _check_fp8(y8, sy, h64)


@pytest.mark.parametrize("m,k,segs", CASES)
@pytest.mark.parametrize("out", ["fp8", "bf16"])
def test_norm_mod_residual_is_gate_residual_then_norm_mod(m, k, segs, out):
    """The fused block's cross-block form: norm_mod(residual=(y, gate)) = the
    previous block's gate_residual_ followed by this block's norm_mod, bit for bit (stream, codes, row scales)."""
    x, w, sh, sc, gate, other = _inputs(m, k, seed=5 * m + k)
    rows = fk.segment_rows(segs, m, "cpu")
    x2 = x.clone()
    got = fk.norm_mod(x, w, 1e-5, sh, sc, rows, out=out, residual=(other, gate))
    fk.gate_residual_(x2, other, gate, rows)
    want = fk.norm_mod(x2, w, 1e-5, sh, sc, rows, out=out)
    assert torch.equal(x.view(torch.int16), x2.view(torch.int16))
    if out == "fp8":
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    else:
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("m,k,segs", CASES)
def test_norm_mod_bf16_output_is_the_rounded_float64(m, k, segs):
    x, w, sh, sc, _, _ = _inputs(m, k, seed=3 * m + k)
    rows = fk.segment_rows(segs, m, "cpu")
    y = fk.norm_mod(x, w, 1e-5, sh, sc, rows, out="bf16")
    h64, _ = fk.norm_mod_ref(x, w, 1e-5, sh, sc, rows)
    want = h64.to(torch.bfloat16)
    diff = (y.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert y.dtype == torch.bfloat16 and int(diff.max()) <= 1
    assert float((diff > 0).float().mean()) <= 2e-3


@pytest.mark.parametrize("m,f", [(37, 80), (1, 16), (9, 14336 // 4), (21, 200)])
def test_swiglu_fp8_matches_float64(m, f):
    g = torch.Generator().manual_seed(m + f)
    h = (torch.randn(m, 2 * f, generator=g) * 3.0).to(torch.bfloat16)
    y8, sy = fk.swiglu(h)
    assert y8.shape == (m, f) and sy.shape == (m, 1)
    a64 = fk.swiglu_ref(h)
    # [gate; up] order: silu of the FIRST half (swapping the halves gives another function)
    assert float((fk.swiglu_ref(h.roll(f, dims=1)) - a64).abs().max()) > 0.1
    _check_fp8(y8, sy, a64)


def test_swiglu_strided_rows_and_zero_rows():
    g = torch.Generator().manual_seed(5)
    big = (torch.randn(12, 2 * 96 + 40, generator=g)).to(torch.bfloat16)
    h = big[:, :2 * 96]                                             # row stride 232, unit column stride
    h[3] = 0                                                        # a zero row: scale 1/448, codes 0
    y8, sy = fk.swiglu(h)
    assert float(sy[3]) == pytest.approx(1.0 / 448) and not y8[3].float().any()
    keep = torch.ones(12, dtype=torch.bool)
    keep[3] = False
    _check_fp8(y8[keep], sy[keep], fk.swiglu_ref(h)[keep])


@pytest.mark.parametrize("m,k,segs", CASES)
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
def test_gate_residual_bit_identical_to_core_addcmul(m, k, segs, gate_dtype):
    x, _, _, _, gate, other = _inputs(m, k, seed=11 * m + k, ada_dtype=gate_dtype)
    rows = fk.segment_rows(segs, m, "cpu")
    want = x.clone()
    for a, b, r in segs:
        want[a:b].addcmul_(other[a:b], gate[r].to(want.dtype))
    got = fk.gate_residual_(x, other, gate, rows)
    assert got is x and torch.equal(x.view(torch.int16), want.view(torch.int16))


def test_norm_mod_zero_row_and_argument_errors():
    x, w, sh, sc, gate, other = _inputs(9, 96, seed=1)
    x[4] = 0
    rows = fk.segment_rows([(0, 9, 0)], 9, "cpu")
    sh0 = torch.zeros_like(sh)
    y8, sy = fk.norm_mod(x, w, 1e-5, sh0, sc, rows)
    assert float(sy[4]) == pytest.approx(1.0 / 448) and not y8[4].float().any()
    with pytest.raises(ValueError, match="rows must be int32"):
        fk.norm_mod(x, w, 1e-5, sh, sc, rows.long())
    with pytest.raises(ValueError, match="x must be bf16 or fp16"):
        fk.norm_mod(x.float(), w, 1e-5, sh, sc, rows)
    with pytest.raises(ValueError, match="weight shape"):
        fk.norm_mod(x, w[:10], 1e-5, sh, sc, rows)
    with pytest.raises(ValueError, match="other dtype"):
        fk.norm_mod(x, w, 1e-5, sh, sc, rows, residual=(other.half(), gate))
    with pytest.raises(ValueError, match="out='int8'"):
        fk.norm_mod(x, w, 1e-5, sh, sc, rows, out="int8")
    with pytest.raises(ValueError, match="even"):
        fk.swiglu(x[:, :95])


def test_fp8_weight_slot_with_turbo_fold_feeds_the_prequantized_gemm():
    """The fused block's weight access (_fp8_weight) on the fp8 path: base, then W + s*B@A folded into the slot
    (fp8.set_state through the Triton fold kernel), then the base again bit for bit; the GEMM on the pre-quantized
    producer output stays within the fp8 path's bound of the float64 base + LoRA product."""
    from h3_turbo.kernels import dispatch as dsp
    from h3_turbo.kernels.paths.base import LoRAOperands
    from h3_turbo.runtime.fused_block import _can_fold, _fp8_weight

    from test_kernels import make_packed  # noqa: E402  (tests/ on sys.path)

    n, k, r = 96, 128, 4
    p = dsp.prepare(make_packed(n, k, seed=2), "fp8")
    w8_0, sw_0 = (t.clone() for t in _fp8_weight(p, "cpu"))
    g = torch.Generator().manual_seed(4)
    a = torch.randn(3 * r, k, generator=g) * 0.2
    b = torch.randn(n, r, generator=g) * 0.2
    lo = LoRAOperands(a, b.contiguous(), 0.7, n // 3, a.abs().amax(dim=1).float(), fold_key=("t", 1))
    assert _can_fold(p, n // 3)
    w8, sw = _fp8_weight(p, "cpu", lo)
    x = torch.randn(7, k, generator=g).to(torch.bfloat16)
    x8, sx = fk.quantize_rows(x)
    y = fk.fp8_gemm_ref(x8, sx, w8, sw, n, torch.float32)
    want = dsp.lora_reference(x, p.packed, a, torch.block_diag(*b.split(n // 3)), 0.7, qkv_blocks=3)
    assert float((y.double() - want).norm() / want.norm()) < 0.05
    w8b, swb = _fp8_weight(p, "cpu")
    assert torch.equal(w8b.view(torch.uint8), w8_0.view(torch.uint8)) and torch.equal(swb, sw_0)


def _rope_inputs(s, heads, d, r2, dtype, table_dtype, seed=0, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    big = (torch.randn(s, 3 * heads * d + row_pad, generator=g) * 3.0).to(dtype)
    qkv = big[:, :3 * heads * d]                       # the GEMM output may be a column view (padded N)
    ang = torch.randn(s, r2, generator=g) * 4.0
    c, sn = torch.cos(ang), torch.sin(ang)
    table = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, s, 1, r2, 2, 2).to(table_dtype)   # core's layout
    qw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    kw = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    return qkv, table, qw, kw


@pytest.mark.parametrize("s,heads,d,r2,row_pad", [(37, 3, 128, 48, 0), (5, 2, 64, 32, 24), (1, 1, 128, 64, 0),
                                                  (19, 2, 64, 5, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_norm_rope_matches_float64_and_leaves_v(s, heads, d, r2, row_pad, dtype):
    qkv, table, qw, kw = _rope_inputs(s, heads, d, r2, dtype, torch.bfloat16, seed=s + d, row_pad=row_pad)
    before = qkv.clone()
    want = fk.qk_norm_rope_ref(before, heads, d, table, qw, kw, 1e-6)
    v = fk.qk_norm_rope(qkv, heads, d, table, qw, kw, 1e-6)
    inner = heads * d
    assert v.shape == (s, heads, d) and v.data_ptr() == qkv[:, 2 * inner:].data_ptr()    # qkv's own v columns
    assert torch.equal(v, before[:, 2 * inner:].reshape(s, heads, d))
    assert torch.equal(qkv[:, 2 * inner:], before[:, 2 * inner:])            # v columns untouched
    got, ref64 = qkv[:, :2 * inner], want[:, :2 * inner]
    # the norm is rounded from fp32 here and from float64 in the reference: a value on a rounding boundary moves by
    # one ulp and its rotation (a sum that may cancel) by at most that ulp of the row's largest value
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    err = (got.double() - ref64.double()).abs()
    assert float((err > 0).double().mean()) <= 1e-3
    assert bool((err <= ulp * ref64.double().abs().amax(dim=1, keepdim=True)).all())
    assert not torch.equal(got, before[:, :2 * inner])                      # it did normalise and rotate


@pytest.mark.parametrize("s,heads,d,r2,seed", [(29, 2, 128, 48, 3), (17, 3, 64, 16, 11), (1, 1, 128, 64, 5),
                                             (40, 2, 128, 2, 7)])
def test_qk_norm_rope_is_comfy_kitchens_arithmetic(s, heads, d, r2, seed):
    """The op core calls (comfy-kitchen's rms_rope_split_half_, its eager backend = the documented math): bit for
    bit with an fp32 table; with a bf16 table kitchen's eager op rotates in bf16 (within 0.4%)."""
    er = pytest.importorskip("comfy_kitchen.backends.eager.rope")
    for table_dtype, bound in ((torch.float32, 0.0), (torch.bfloat16, 4e-3)):
        qkv, table, qw, kw = _rope_inputs(s, heads, d, r2, torch.bfloat16, table_dtype, seed=seed)
        inner = heads * d
        q = qkv[:, :inner].reshape(1, s, heads, d).clone()
        k = qkv[:, inner:2 * inner].reshape(1, s, heads, d).clone()
        qo, ko = er.rms_rope_split_half(q, k, table, qw, kw, 1e-6, rot_dim=2 * r2)
        ck = torch.cat([qo.reshape(s, -1), ko.reshape(s, -1)], 1).double()
        fk.qk_norm_rope(qkv, heads, d, table, qw, kw, 1e-6)
        rel = float((qkv[:, :2 * inner].double() - ck).norm() / ck.norm())
        assert rel <= bound, (table_dtype, rel)


def test_qk_norm_rope_refuses_bad_inputs():
    qkv, table, qw, kw = _rope_inputs(8, 2, 64, 16, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="freqs: rope table shape"):
        fk.qk_norm_rope(qkv, 2, 64, table[:, :4], qw, kw, 1e-6)
    with pytest.raises(ValueError, match="head_dim 48 is not a power of two"):
        fk.qk_norm_rope(torch.zeros(8, 3 * 2 * 48, dtype=torch.bfloat16), 2, 48, table, qw[:48], kw[:48], 1e-6)
    for eps in (None, -1.0, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            fk.qk_norm_rope(qkv, 2, 64, table, qw, kw, eps)
    with pytest.raises(ValueError, match="rotates 160 dims"):
        fk.qk_norm_rope(qkv, 2, 64, torch.zeros(1, 8, 1, 80, 2, 2), qw, kw, 1e-6)
    with pytest.raises(ValueError, match="columns"):
        fk.qk_norm_rope(qkv[:, :-1], 2, 64, table, qw, kw, 1e-6)
    with pytest.raises(ValueError, match="k_weight"):
        fk.qk_norm_rope(qkv, 2, 64, table, qw, kw[:32], 1e-6)


@pytest.mark.parametrize("s,heads,d,r2,row_pad", [(37, 3, 128, 48, 0), (5, 2, 64, 32, 24), (1, 1, 128, 64, 0),
                                                  (19, 2, 64, 5, 0), (0, 2, 64, 16, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_norm_rope_sage_is_qk_norm_rope_then_int8_sage_inputs(s, heads, d, r2, row_pad, dtype):
    """kernel (f): k rotated in place bit for bit as qk_norm_rope, v and q columns untouched; q8 / qs = qk_norm_rope's
    q quantized per (row, head) by the fp32 formula, bit for bit
    (but at exact .5 ties); vamax exact; ksum = the float64 column sum of
    the rotated k within fp32 summation error."""
    qkv, table, qw, kw = _rope_inputs(max(s, 1), heads, d, r2, dtype, torch.bfloat16, seed=s + 3 * d,
                                      row_pad=row_pad)
    qkv, table = qkv[:s], table[:, :s]
    rot = qkv.clone()
    if s:
        fk.qk_norm_rope(rot, heads, d, table, qw, kw, 1e-6)
    x = qkv.clone()
    got = fk.qk_norm_rope_sage(x, heads, d, table, qw, kw, 1e-6)
    inner = heads * d
    assert torch.equal(x[:, :inner], qkv[:, :inner]) and torch.equal(x[:, inner:], rot[:, inner:])
    from h3_turbo.kernels.attention.int8_kernels import fwht    # q is Hadamard-rotated before its quantization

    q = fwht(rot[:, :inner].reshape(s, heads, d).float())
    a = q.abs().amax(dim=-1, keepdim=True) if s else torch.zeros(0, heads, 1)
    t = (q * torch.where(a > 0, 127.0 / a, torch.zeros_like(a))).clamp(-127, 127)
    q8 = torch.trunc(t + torch.where(t >= 0, 0.5, -0.5)).to(torch.int8)
    # equal except at exact .5 ties (q = +-max/2 ...), where the fp32 reciprocal 127/max decides by one ulp
    diff = (got["q8"].int() - q8.int()).abs()
    tie = ((t.abs() - t.abs().floor()) - 0.5).abs() < 1e-5
    assert got["q8"].shape == (s, heads, d) and int(diff.sum()) <= diff.numel() // 500 + 2 and bool((diff <= 1).all()) and not (diff.bool() & ~tie).any()
    assert got["qs"].shape == (s, heads) and torch.equal(got["qs"], a[..., 0] / 127.0)
    k = rot[:, inner:2 * inner].reshape(s, heads, d).double()
    v = qkv[:, 2 * inner:].reshape(s, heads, d)
    r = got["ksum"].shape[0]
    assert got["ksum"].shape == got["vamax"].shape == (r, heads, d) and 1 <= r <= fk.SAGE_STATS_PARTS
    assert torch.equal(got["vamax"].amax(dim=0), v.float().abs().amax(dim=0) if s else torch.zeros(heads, d))
    ks = got["ksum"].double().sum(dim=0)
    assert bool(((ks - k.sum(dim=0)).abs() <= 1e-6 * k.abs().sum(dim=0) + 1e-30).all())
    if s:
        ref = fk.qk_norm_rope_sage_ref(qkv, heads, d, table, qw, kw, 1e-6)
        assert float((got["q8"].int() - ref["q8"].int()).abs().float().mean()) <= 2e-3   # float64-rounded q


def test_qk_norm_rope_returns_v_in_place():
    """v is returned as the qkv buffer's own (strided, untouched) columns: attention reads it like q and k."""
    qkv, table, qw, kw = _rope_inputs(21, 3, 64, 16, torch.bfloat16, torch.bfloat16, seed=4)
    b = qkv.clone()
    vb = fk.qk_norm_rope(b, 3, 64, table, qw, kw, 1e-6)
    assert vb.data_ptr() == b[:, 2 * 3 * 64:].data_ptr() and not vb.is_contiguous()
    assert torch.equal(vb, qkv[:, 2 * 3 * 64:].view(21, 3, 64)) and not torch.equal(b[:, :2 * 3 * 64], qkv[:, :2 * 3 * 64])


def test_qk_norm_rope_sage_ignores_the_padded_rows_of_its_last_program():
    """eps = 0 and S not a multiple of the rows per program: the padded rows (0 / 0 in the norm) stay out of the q
    scales, the k sums and the v maxima."""
    qkv, table, qw, kw = _rope_inputs(13, 2, 64, 16, torch.bfloat16, torch.bfloat16, seed=2)
    got = fk.qk_norm_rope_sage(qkv.clone(), 2, 64, table, qw, kw, 0.0)
    assert torch.isfinite(got["ksum"]).all() and torch.isfinite(got["vamax"]).all() and torch.isfinite(got["qs"]).all()


def _sage_block(comfy_ok):
    """A small core DiTBlock (hidden 128, 2 heads x 64, ffn 192) with NVFP4 projections on the fp8 path, its
    arguments, on the CPU."""
    import math

    import comfy.ldm.minimax.model as mm_h3

    from h3_turbo.formats import nvfp4
    from h3_turbo.runtime.ops import make_operations

    hid, heads, hd, ffn, tdim, s = 128, 2, 64, 192, 64, 150
    bf = torch.bfloat16
    blk = mm_h3.DiTBlock(hid, heads, hd, ffn, tdim, 1e-5, 1e-5, dtype=bf, device="cpu",
                         operations=make_operations("cpu", compute_dtype=bf))
    g = torch.Generator().manual_seed(1)
    sd = {}
    meta = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    quant = {"attn.qkv_proj": (3 * heads * hd, hid), "attn.out_proj": (hid, heads * hd),
             "mlp.fc1": (2 * ffn, hid), "mlp.fc2": (hid, ffn)}
    for name, (n, k) in quant.items():
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(bf)
        q, bs, sc = nvfp4.quantize(w)
        sd.update({f"{name}.weight": q, f"{name}.weight_scale": bs, f"{name}.weight_scale_2": sc,
                   f"{name}.comfy_quant": meta})
    for name, n in (("norm1", hid), ("norm2", hid), ("attn.q_norm", hd), ("attn.k_norm", hd)):
        sd[f"{name}.weight"] = (1.0 + 0.1 * torch.randn(n, generator=g)).to(bf)
    sd["adaln_proj.linear.weight"] = (torch.randn(6 * 3 * hid, tdim, generator=g) * 0.02).to(bf)
    sd["adaln_proj.linear.bias"] = (torch.randn(6 * 3 * hid, generator=g) * 0.1).to(bf)
    blk.load_state_dict(sd, strict=False)
    blk = blk.eval().requires_grad_(False)
    ang = torch.randn(s, 24, generator=g) * 3.0
    c, sn = torch.cos(ang), torch.sin(ang)
    rope = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, s, 1, 24, 2, 2).to(bf)
    args = {"img": (torch.randn(s, hid, generator=g) * 2.0).to(bf), "t_emb": torch.randn(2, tdim, generator=g).to(bf),
            "mod_segments": [(0, 100, 0), (100, s, 1)], "rope_freqs": rope}
    return blk, args


class _CpuTritonOps(fk.TritonOps):
    """The Triton kernels (interpreted) with the fp8 GEMM emulated: the fused block's CUDA route on a CPU."""
    name = "triton-cpu"
    gemm = staticmethod(fk.fp8_gemm_ref)


@pytest.mark.comfyui
def test_fused_block_runs_int8_sage_fused_on_the_producer(comfy, monkeypatch, caplog):
    """With the int8_sage override the fused block quantizes Q / takes K-V statistics in qk_norm_rope_sage, runs the
    kernel itself and feeds its e4m3 output to out_proj: the block's update is as close to exact attention as the
    unfused int8_sage route's (core's attention call with the override, per-block Q scales, bf16 output)."""
    from h3_turbo.kernels.attention import exact, int8_sage
    from h3_turbo.runtime import fused_block as fb

    blk, args = _sage_block(comfy)
    ov = int8_sage.BACKEND.cpu_override()
    ov.config = {**ov.config, "BLOCK_M": 64, "BLOCK_N": 64} if ov.config else \
        int8_sage._kernels()._cfg({"BLOCK_M": 64, "BLOCK_N": 64})

    def run(ops, to, path="fp8"):
        for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            m = blk.get_submodule(name)
            m._h3_path, m._h3_cache = path, None
        patch = fb.FusedBlockPatch(blk, 0, ops=ops, devices=("cpu",))
        a = dict(args, img=args["img"].clone(), transformer_options=to)
        core = lambda a: {"img": blk(a["img"], a["t_emb"], a["mod_segments"], a["rope_freqs"],   # noqa: E731
                                     transformer_options=a["transformer_options"])}
        with torch.no_grad():
            out = patch(a, {"original_block": core})["img"] if ops is not None else core(a)["img"]
        return out, patch

    ref, _ = run(None, {"optimized_attention_override": exact.cpu_exact()}, path="exact")
    fb._SAGE_OFF["cpu"] = "test: route off"
    try:
        off, p0 = run(_CpuTritonOps(), {"optimized_attention_override": ov})   # route off: core's attention call
    finally:
        del fb._SAGE_OFF["cpu"]
    assert p0.calls == 1 and "sage" not in p0.routes and ov.calls == 1
    fused, p1 = run(_CpuTritonOps(), {"optimized_attention_override": ov})
    assert p1.calls == 1 and p1.routes.get("sage") == 1 and p1.routes.get("fp8") == 4 and ov.calls == 2
    fb._SAGE_OFF["cpu"] = "test: route off"
    try:
        unfused, p2 = run(_CpuTritonOps(), {"optimized_attention_override": ov})
    finally:
        del fb._SAGE_OFF["cpu"]
    assert "sage" not in p2.routes and ov.calls == 3          # the override ran through core's attention call
    assert torch.equal(unfused, off)
    # a route that raises (e.g. a Triton build failure): logged, off for the process, the block rerun unfused
    from h3_turbo.kernels.attention import int8_kernels

    def boom(*a, **k):
        raise RuntimeError("simulated build failure")

    monkeypatch.setattr(int8_kernels, "sage_attention_prequantized", boom)
    try:
        failed, p3 = run(_CpuTritonOps(), {"optimized_attention_override": ov})
        assert fb._SAGE_OFF.get("cpu", "").startswith("RuntimeError: simulated build failure")
    finally:
        fb._SAGE_OFF.pop("cpu", None)
    assert torch.equal(failed, off) and p3.routes == {"fp8": 4} and p3.calls == 1
    # a producer that raises (run 29 on an H100: a Triton typing error in the RMSNorm + RoPE launch) turns the route
    # off, not the Gluon kernel (which had not run), and the log names the producer
    monkeypatch.undo()
    monkeypatch.setattr(fb, "_gluon_config", lambda c, device, tokens=0: dict(c, GLUON=True))

    def producer_boom(*a, **k):
        raise RuntimeError("simulated producer failure")

    ops = _CpuTritonOps()
    ops.qk_norm_rope_sage = producer_boom
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        try:
            failed2, p4 = run(ops, {"optimized_attention_override": ov})
            assert fb._SAGE_OFF.get("cpu", "").startswith("RuntimeError: simulated producer failure")
            assert "cpu" not in fb._GLUON_OFF
        finally:
            fb._SAGE_OFF.pop("cpu", None)
            fb._GLUON_OFF.pop("cpu", None)
    assert torch.equal(failed2, off) and "sage" not in p4.routes
    assert any("failed in its producer" in r.getMessage() for r in caplog.records), caplog.text
    x = args["img"].double()

    def rel_update(y):
        d = ref.double() - x
        return float(((y.double() - x) - d).norm() / d.norm())

    r_f, r_u = rel_update(fused), rel_update(unfused)
    assert torch.isfinite(fused).all() and 1e-3 < r_u < 0.2 and r_f <= 1.25 * r_u, (r_f, r_u)
    assert float((fused.double() - unfused.double()).norm() / (unfused.double() - x).norm()) < 0.1
