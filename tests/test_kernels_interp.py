"""Triton kernels of kernels/triton_nvfp4.py on the CPU (TRITON_INTERPRET=1): bit-exact dequant, fused
dequant-GEMM vs float64 (ragged M, K multiple of 128 as in H3 and not), both MMA operand orders, fused
LoRA epilogue and the tiled strategy with LoRA folded into the weight tiles, NaN-poisoned outputs.

Run through tests/test_kernels.py::test_triton_kernels_interpreted_on_cpu (a fresh process with
TRITON_INTERPRET=1); collected in-process without that variable, the module skips itself."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: run via "
                "tests/test_kernels.py::test_triton_kernels_interpreted_on_cpu", allow_module_level=True)

import torch  # noqa: E402

from h3_turbo.kernels import dispatch as dsp  # noqa: E402
from h3_turbo.kernels import nvfp4_ref as ref  # noqa: E402
from h3_turbo.kernels import triton_nvfp4 as _tk  # noqa: E402

from test_kernels import make_packed, rel  # noqa: E402  (tests/ is on sys.path: rootdir conftest)


@pytest.fixture(scope="module")
def tk():
    assert _tk.INTERPRET
    _tk.FORCED_CONFIG = None
    return _tk


# ------------------------------------------------------------------------------------ Triton (interpreter)

# (N, K): K multiple of 128 as all H3 projections (5376 = 42*128, 7168, 14336) and K % 128 != 0
SHAPES = [(64, 384), (40, 128), (96, 176), (48, 16)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_triton_dequant_bit_exact_and_poison_overwritten(tk, n, k):
    p = make_packed(n, k, seed=k, dist="t3")
    pr = dsp.prepare(p, "exact")
    want = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
    got = tk.dequant(pr.qs, pr.scales, pr.gs, n, k, out=out)
    assert torch.isfinite(got).all()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    got32 = tk.dequant(pr.qs, pr.scales, pr.gs, n, k, out_dtype=torch.float32)
    assert torch.equal(got32, ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k, torch.float32))


@pytest.fixture(params=[False, True], ids=["x_by_wT", "swapped_w_by_xT"])
def swap(request, tk):
    """Both kernel variants: W via shared memory, and W as the register operand (SWAP)."""
    tk.FORCED_CONFIG = {"BM": 16, "BN": 32, "GROUP_M": 4, "SWAP": request.param, "num_warps": 4,
                        "num_stages": 1}
    yield request.param
    tk.FORCED_CONFIG = None


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 17, 40])
def test_triton_gemm_exact_vs_float64(tk, swap, n, k, m):
    p = make_packed(n, k, seed=m * 7 + n)
    pr = dsp.prepare(p, "exact")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    want = x.double() @ w.double().t()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = tk.gemm_exact(x, pr.qs, pr.scales, pr.gs, n, k, out=out)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    e = rel(got, want)
    assert e < 1e-2, e
    # the only rounding is the bf16 output (fp32 accumulation of exact products): ~1e-3
    assert e < 3e-3, e
    # same numbers as the reference path up to summation order / output rounding
    assert rel(got, dsp.linear(x, dsp.prepare(p, "reference"), "reference")) < 1e-2


def test_triton_gemm_strided_input_and_3d(tk):
    n, k = 64, 256
    p = make_packed(n, k, seed=3)
    pr = dsp.prepare(p, "exact")
    big = torch.randn(9, k + 32).to(torch.bfloat16)
    x = big[:, 16:16 + k]  # row stride k+32
    got = tk.gemm_exact(x, pr.qs, pr.scales, pr.gs, n, k)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    assert rel(got, x.double() @ w.double().t()) < 3e-3


@pytest.mark.parametrize("blocks,r", [(3, 4), (1, 20)])
def test_triton_fused_lora_equals_unfused_branch(tk, swap, blocks, r):
    n, k, m = 192, 256, 19
    p = make_packed(n, k, seed=11)
    pr = dsp.prepare(p, "exact")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    A = (torch.randn(blocks * r, k, generator=g) * 0.05).to(torch.bfloat16)
    Bc = (torch.randn(n, r, generator=g) * 0.05).to(torch.bfloat16)
    scale = 0.75
    h = torch.nn.functional.linear(x, A)
    got = tk.gemm_exact(x, pr.qs, pr.scales, pr.gs, n, k, lora=(h, Bc, scale, n // blocks))
    want = dsp.lora_reference(x, p, A, Bc, scale, blocks)
    assert rel(got, want) < 1e-2
    # the unfused branch (reference base + scale * B(A(x)) per block, bf16 ops) agrees too
    unf = dsp.linear_with_lora(x, dsp.prepare(p, "reference"), "reference", A, Bc, scale, blocks)
    assert rel(got, unf) < 1e-2
    # and the LoRA contribution is really there (not a test that cannot fail)
    base = tk.gemm_exact(x, pr.qs, pr.scales, pr.gs, n, k)
    assert rel(got, base) > 5e-2


@pytest.mark.parametrize("blocks,r,tile", [(3, 4, 40), (1, 8, 64)])
def test_exact_tiled_strategy_with_merged_lora_tiles(tk, monkeypatch, blocks, r, tile):
    """The tiled exact strategy (row tiles of W dequantized, rank-r LoRA update applied to each transient
    tile, GEMM per tile into output column slices), run on the CPU: tiles of 40 rows cross the qkv block
    boundaries at 64 and 128."""
    n, k, m = 192, 256, 21
    p = make_packed(n, k, seed=13)
    pr = dsp.prepare(p, "exact")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    A = (torch.randn(blocks * r, k, generator=g) * 0.05).to(torch.bfloat16)
    Bc = (torch.randn(n, r, generator=g) * 0.05).to(torch.bfloat16)
    monkeypatch.setattr(dsp, "TILE_ROWS", tile)
    monkeypatch.setattr(dsp, "_TILE_BUFS", {})
    base = dsp._exact_tiled(x, pr)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    assert torch.equal(base, torch.nn.functional.linear(x, w))  # same bf16 weight, same GEMM per tile
    got = dsp._exact_tiled(x, pr, lora=(A, Bc, 0.5, n // blocks))
    want = dsp.lora_reference(x, p, A, Bc, 0.5, blocks)
    assert rel(got, want) < 1e-2
    unf = dsp.linear_with_lora(x, dsp.prepare(p, "reference"), "reference", A, Bc, 0.5, blocks)
    assert rel(got, unf) < 1e-2
    assert rel(got, base) > 5e-2
