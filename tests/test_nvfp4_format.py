"""Issue 3: NVFP4 math of formats/nvfp4.py against comfy-kitchen 0.2.31 (bit for bit) and float64."""
from __future__ import annotations

import pytest
import torch

from h3_turbo.formats import nvfp4 as nv

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.float_utils import (  # noqa: E402
    _f32_to_floatx_unpacked, from_blocked as ck_from_blocked, pack_uint4, to_blocked as ck_to_blocked)
from comfy_kitchen.tensor import TensorCoreNVFP4Layout  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _weights(kind: str, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        w = torch.randn(shape, generator=g) * 0.02
    elif kind == "heavy":   # lognormal magnitudes spanning ~6 decades + random signs + outlier rows
        w = torch.randn(shape, generator=g).sign() * torch.exp(torch.randn(shape, generator=g) * 2.5) * 1e-3
        w[3] *= 300.0
    elif kind == "sparse":  # zero blocks, -0.0, exact E2M1 ties after scaling
        w = torch.randn(shape, generator=g)
        w[:, :16] = 0.0
        w[1, 20] = -0.0
        w[2, 16:32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75,
                                    -2.5, -3.5, -5.0, -6.0])
    else:
        raise ValueError(kind)
    return w.to(dtype)


def test_e2m1_table_and_rounding():
    assert nv.E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert [v == -nv.E2M1_VALUES[i] for i, v in enumerate(nv.E2M1_VALUES[8:])] == [True] * 8
    # ties go to the even code; saturation at 6; sign bit from the float sign (-0.0 -> code 8)
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.0, -0.1, 0.26, 4.99, 5.01])
    assert nv.e2m1_round(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 1, 6, 7]
    # dense sweep (every fp32 step region incl. all midpoints) vs comfy-kitchen's converter
    g = torch.linspace(-6.0, 6.0, 200001)
    g = torch.cat([g, torch.tensor(nv.E2M1_VALUES), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * -1])
    assert torch.equal(nv.e2m1_round(g), _f32_to_floatx_unpacked(g.clone(), 2, 1))


def test_pack_unpack_hi_first_and_swap():
    codes = torch.tensor([[1, 2, 0xF, 0x8]], dtype=torch.uint8)
    assert nv.pack_nibbles(codes).tolist() == [[0x12, 0xF8]]             # element 2j in the HIGH nibble
    assert nv.pack_nibbles(codes, hi_first=False).tolist() == [[0x21, 0x8F]]
    r = torch.randint(0, 16, (37, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(nv.pack_nibbles(r), pack_uint4(r, hi_first=True))
    assert torch.equal(nv.unpack_nibbles(nv.pack_nibbles(r)), r)
    assert torch.equal(nv.unpack_nibbles(nv.pack_nibbles(r, False), False), r)
    assert torch.equal(nv.swap_nibbles(nv.pack_nibbles(r, False)), nv.pack_nibbles(r, True))


@pytest.mark.parametrize("rows,cols", [(128, 4), (192, 4), (64, 8), (300, 7), (256, 336 // 16)])
def test_to_blocked_matches_ck_and_inverts(rows, cols):
    s = torch.randint(0, 127, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    b = nv.to_blocked(s)
    assert tuple(b.shape) == (nv.roundup(rows, 128), nv.roundup(cols, 4))
    assert torch.equal(b, ck_to_blocked(s, flatten=False))
    assert torch.equal(nv.from_blocked(b, rows, cols), s)
    assert torch.equal(nv.from_blocked(b, rows, cols), ck_from_blocked(b, rows, cols))


def test_to_blocked_position_map():
    # cuBLAS 128x4 tile seen as [32, 16]: row r = 32*i + j, column c -> (j, 4*i + c)
    s = torch.zeros(128, 4, dtype=torch.uint8)
    s[33, 1] = 7
    s[127, 3] = 9
    b = nv.to_blocked(s).reshape(32, 16)
    assert b[1, 5] == 7 and b[31, 15] == 9 and int(b.sum()) == 16


@pytest.mark.parametrize("kind", ["normal", "heavy", "sparse"])
@pytest.mark.parametrize("shape,dtype", [((192, 64), torch.bfloat16), ((256, 128), torch.float32),
                                         ((100, 40), torch.bfloat16), ((384, 256), torch.float16)])
def test_quantize_bit_identical_to_comfy_kitchen(kind, shape, dtype):
    w = _weights(kind, shape, dtype)
    q_ck, p = TensorCoreNVFP4Layout.quantize(w)
    q, bs, s = nv.quantize(w, chunk_rows=128)
    assert q.dtype == torch.uint8 and bs.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0
    assert tuple(q.shape) == nv.packed_shape(*shape) and tuple(bs.shape) == nv.scale_shape(*shape)
    assert torch.equal(q, q_ck)
    assert torch.equal(bs.view(torch.uint8), p.block_scale.view(torch.uint8))
    assert torch.equal(_bits(s), _bits(p.scale))
    # chunking never changes the result
    q2, bs2, _ = nv.quantize(w, chunk_rows=4096)
    assert torch.equal(q, q2) and torch.equal(bs.view(torch.uint8), bs2.view(torch.uint8))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_dequantize_bit_identical_to_comfy_kitchen(out_dtype, kind):
    w = _weights(kind, (256, 128), torch.bfloat16, seed=3)
    q, bs, s = nv.quantize(w)
    ref = ck.dequantize_nvfp4(q, s, bs, out_dtype)
    got = nv.dequantize(q, s, bs, out_dtype)
    assert got.dtype == out_dtype and torch.equal(_bits(got), _bits(ref))


def test_error_bounds_vs_float64():
    w = _weights("normal", (512, 256), torch.float32, seed=5)
    q, bs, s = nv.quantize(w)
    d = nv.dequantize_fp64(q, s, bs)
    w64 = w.double()
    # per element: |err| <= half the E2M1 gap at that magnitude, times the block's total scale
    scale = nv.from_blocked(bs.view(torch.uint8), 512, 16).view(torch.float8_e4m3fn).double() * float(s)
    scale = scale.repeat_interleave(16, dim=1)
    gap = torch.where(d.abs() / scale >= 4 - 1e-9, 1.0, torch.where(d.abs() / scale >= 2 - 1e-9, 0.5, 0.25))
    assert bool(((d - w64).abs() <= gap * scale + 1e-12).all())
    rel = float((d - w64).norm() / w64.norm())
    assert 0.05 < rel < 0.12, rel  # NVFP4 on Gaussian weights: ~0.09 (research §4.4 [T] 0.093)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        nv.quantize(torch.zeros(4, 4, 16))
    w = torch.randn(32, 32)
    w[3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        nv.quantize(w)
