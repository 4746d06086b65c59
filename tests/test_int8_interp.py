"""Triton W8A8 kernels (kernels/int8_triton.py) on the CPU under TRITON_INTERPRET=1: the block quantizer equals
the torch recipe bit for bit, the GEMM is within fp32-accumulation + output rounding of the float64 recipe at ragged
shapes (K % 128 != 0), with 128-row and per-row weight scales. Run through
tests/test_int8_path.py::test_triton_int8_kernels_interpreted_on_cpu; collected without the variable it skips."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: run via "
                "tests/test_int8_path.py::test_triton_int8_kernels_interpreted_on_cpu", allow_module_level=True)

import torch  # noqa: E402

from h3_turbo.kernels import int8_block as ib  # noqa: E402
from h3_turbo.kernels import int8_triton as it  # noqa: E402
from h3_turbo.kernels.paths.int8 import PATH  # noqa: E402


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("m,k", [(5, 64), (130, 300), (1, 129)])
def test_quantizer_bit_exact(m, k):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(torch.bfloat16)
    x[0, 0] = x.float().abs().max() * 1                   # a +amax element: saturates to 127
    q, s = it.quantize_blocks(x)
    q0, s0 = ib.quantize_blocks(x)
    assert torch.equal(q, q0) and torch.equal(s, s0)


@pytest.mark.parametrize("m,n,k", [(5, 48, 64), (37, 70, 300), (40, 96, 256)])
@pytest.mark.parametrize("split", [False, True], ids=["blocks128", "per_row"])
def test_gemm_vs_float64_recipe(m, n, k, split):
    g = torch.Generator().manual_seed(m + n)
    if split:
        w = ib.fuse_rows([ib.quantize_weight(torch.randn(n // 2, k, generator=g) * 0.02) for _ in range(2)])
        assert w.row_group == 1
    else:
        w = ib.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    it.FORCED["config"] = {"BM": 32, "BN": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
    try:
        y = it.gemm(x, w)
    finally:
        it.FORCED["config"] = None
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.isfinite(y).all()
    assert rel(y, ib.recipe_fp64(x, w)) < 4e-3                  # bf16 output rounding only
    y32 = it.gemm(x, w, out_dtype=torch.float32)                # autotune path (one config under the interpreter)
    assert rel(y32, ib.recipe_fp64(x, w)) < 1e-6
    assert rel(y32, ib.int_mm_linear(x, w, torch.float32)) < 1e-6


def test_path_triton_backend_on_cpu_tensors():
    w = ib.quantize_weight(torch.randn(64, 200) * 0.02)
    x = torch.randn(9, 200).to(torch.bfloat16)
    PATH.settings.backend = "triton"
    try:
        y = PATH.linear(x, PATH.prepare(w))
    finally:
        PATH.settings.backend = "auto"
    assert rel(y, x.double() @ ib.dequantize(w, torch.float64).t()) < PATH.error_bound


@pytest.mark.parametrize("cfg", [
    {"BM": 32, "BN": 32, "PIPE": True},
    {"BM": 32, "BN": 64, "TMA": True},
    {"BM": 32, "BN": 64, "TMA": True, "PIPE": True},
    {"BM": 32, "BN": 32, "TMA": True, "WS": True},
    {"BM": 256, "BN": 32},                  # the tile spans two 128-row activation blocks: per-row scales
    {"BM": 32, "BN": 256},                  # and two 128-row weight groups: per-column scales
], ids=["pipe", "tma", "tma_pipe", "tma_ws", "bm256", "bn256"])
@pytest.mark.parametrize("split", [False, True], ids=["blocks128", "per_row"])
def test_gemm_launch_variants_equal_the_recipe(cfg, split):
    """Every launch variant of the sweep (benchmarks/bench_int8.py SWEEP_CONFIGS' switches) computes the recipe:
    within fp32 accumulation of the float64 recipe, ragged M/N, K % 128 != 0 (TMA: K % 16 == 0)."""
    m, n, k = 300, 272, (256 + 48 if cfg.get("TMA") else 300)
    g = torch.Generator().manual_seed(n + k)
    if split:
        w = ib.fuse_rows([ib.quantize_weight(torch.randn(n // 2, k, generator=g) * 0.02) for _ in range(2)])
    else:
        w = ib.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    it.FORCED["config"] = dict({"GROUP_M": 2, "num_warps": 4, "num_stages": 1}, **cfg)
    try:
        y = it.gemm(x, w, out_dtype=torch.float32)
    finally:
        it.FORCED["config"] = None
    assert rel(y, ib.recipe_fp64(x, w)) < 1e-6
