"""The ``int8`` compute path (W8A8, TurboDiffusion's 128x128 block recipe; kernels/int8_block.py,
kernels/paths/int8.py) on the CPU: the quantizer's rules, torch._int_mm GEMM vs the float64 recipe and vs the
float64 product with the dequantized weight at ragged shapes (K not a multiple of 128), exact row fusion of split
q/k/v, the registry; the Triton kernels under TRITON_INTERPRET=1 in a subprocess (tests/test_int8_interp.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from h3_turbo.errors import NoCapablePathError
from h3_turbo.kernels import int8_block as ib
from h3_turbo.kernels import registry
from h3_turbo.kernels.paths import base
from h3_turbo.kernels.paths.int8 import PATH, reference_linear

# (M, N, K): ragged rows, K % 128 != 0 and == 0, N below / above one 128-row block
SHAPES = [(5, 48, 64), (37, 200, 300), (130, 96, 256), (1, 130, 129)]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_quantizer_rules_saturate_round_half_even_and_floor():
    x = torch.zeros(2, 130)
    x[0, 0], x[0, 1], x[0, 2] = 2.0, -2.0, 2.0 * 0.5 / 128   # +amax -> 128 saturates to 127; -amax -> -128
    x[1, 129] = 3.0 * 2.5 / 128                               # second K tile, amax 3/128*2.5: exact .5 -> even
    x[1, 128] = 3.0
    q, s = ib.quantize_blocks(x)
    assert q.dtype == torch.int8 and s.shape == (1, 2) and s.dtype == torch.float32
    assert q[0, 0] == 127 and q[0, 1] == -128 and q[0, 2] == 0      # 0.5 rounds to even (0)
    assert q[1, 128] == 127 and q[1, 129] == 2                       # 2.5 rounds to even (2)
    assert torch.equal(s, torch.tensor([[2.0 / 128, 3.0 / 128]]))
    q0, s0 = ib.quantize_blocks(torch.zeros(3, 5))                   # all-zero tile: amax floor 1e-8
    assert torch.equal(q0, torch.zeros(3, 5, dtype=torch.int8)) and float(s0) == pytest.approx(1e-8 / 128)


def test_quantizer_is_per_128_rows_and_channels():
    x = torch.ones(200, 300)
    x[150, 10] = 64.0                        # row block 1, K block 0 only
    _, s = ib.quantize_blocks(x)
    assert s.shape == (2, 3)
    assert torch.equal(s, torch.tensor([[1, 1, 1], [64, 1, 1]], dtype=torch.float32) / 128)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int_mm_gemm_within_bounds_of_float64(m, n, k, dtype):
    w = ib.quantize_weight(_w(n, k, seed=n))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = ib.int_mm_linear(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    recipe = ib.recipe_fp64(x, w)
    # same algorithm: only fp32 accumulation and the output rounding differ from the float64 recipe
    assert rel(y, recipe) < (4e-3 if dtype == torch.bfloat16 else 1e-6)
    # vs the float64 product with the dequantized weight: the activation quantization error
    exact = x.double() @ ib.dequantize(w, torch.float64).t()
    e = rel(y, exact)
    assert 1e-4 < e < PATH.error_bound, e


def test_path_registry_cpu_linear_and_reference():
    assert registry.choices("int8_block128") == ("auto", "int8", "reference")
    assert "int8" not in registry.choices()                      # not offered by the NVFP4 loader
    assert registry.resolve("int8", "cpu", "int8_block128")[0] == "int8"
    assert registry.resolve("auto", "cpu", "int8_block128")[0] == "reference"
    with pytest.raises(NoCapablePathError, match="expected one of auto, exact"):
        registry.resolve("int8", "cpu")
    with pytest.raises(NoCapablePathError, match="expected one of auto, int8, reference"):
        registry.resolve("fp8", "cpu", "int8_block128")
    w = ib.quantize_weight(_w(96, 176, 1))
    pr = PATH.prepare(w)
    x = torch.randn(9, 176).to(torch.bfloat16)
    assert torch.equal(PATH.linear(x, pr), ib.int_mm_linear(x, w))
    ref = reference_linear(x, pr)
    assert torch.equal(ref, torch.nn.functional.linear(x, ib.dequantize(w, torch.bfloat16)))
    assert rel(PATH.linear(x, pr), ref) < PATH.error_bound


def test_auto_on_cuda_picks_int8_from_sm80_and_says_why(monkeypatch):
    from h3_turbo import state

    monkeypatch.setattr(base, "has_triton", lambda: True)
    monkeypatch.setattr(base, "capability", lambda d: (7, 5))
    state.LOGGED.clear()
    path, why = registry.resolve("auto", torch.device("cuda", 0), "int8_block128")
    assert path == "reference" and "int8: int8 tensor cores need sm_80" in why
    with pytest.raises(NoCapablePathError, match="sm_80"):
        registry.resolve("int8", torch.device("cuda", 0), "int8_block128")
    monkeypatch.setattr(base, "capability", lambda d: (9, 0))
    assert registry.resolve("auto", torch.device("cuda", 0), "int8_block128")[0] == "int8"
    monkeypatch.setattr(base, "has_triton", lambda: False)
    state.LOGGED.clear()
    path, why = registry.resolve("auto", torch.device("cuda", 0), "int8_block128")
    assert path == "reference" and "needs Triton" in why


def test_fuse_rows_is_exact_for_split_qkv():
    parts = [ib.quantize_weight(_w(64, 200, s)) for s in range(3)]      # N % 128 != 0: per-row scales
    fused = ib.fuse_rows(parts)
    assert fused.row_group == 1 and fused.scale.shape == (192, 2)
    fused.validate()
    x = torch.randn(7, 200)
    want = torch.cat([ib.recipe_fp64(x, p) for p in parts], 1)
    assert rel(ib.recipe_fp64(x, fused), want) < 1e-12
    assert torch.equal(ib.dequantize(fused, torch.float32), torch.cat([ib.dequantize(p, torch.float32) for p in parts]))
    big = ib.fuse_rows([ib.quantize_weight(_w(128, 64, s)) for s in range(3)])
    assert big.row_group == 128 and big.scale.shape == (3, 1)


def test_validate_names_the_field():
    w = ib.quantize_weight(_w(64, 64))
    with pytest.raises(ValueError, match=r"scale is torch.float32 \(2, 1\) \(expected float32 \[1, 1\]"):
        ib.Int8Weight(w.qdata, torch.ones(2, 1)).validate()
    with pytest.raises(ValueError, match="non-positive"):
        ib.Int8Weight(w.qdata, torch.zeros(1, 1)).validate()
    assert ib.Int8Weight.row_group_of(200, 2) == 128 and ib.Int8Weight.row_group_of(200, 200) == 1
    with pytest.raises(ValueError, match="fit neither"):
        ib.Int8Weight.row_group_of(200, 3)


def test_triton_int8_kernels_interpreted_on_cpu():
    """tests/test_int8_interp.py in a fresh process with TRITON_INTERPRET=1 (set before triton is imported)."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(here, "test_int8_interp.py")], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-1000:]


def test_benchmark_dry_run_on_cpu(tmp_path):
    """benchmarks/bench_int8.py with DRY=1 (tiny shapes on the CPU) writes its JSON and markdown."""
    import json

    here = os.path.dirname(__file__)
    env = dict(os.environ, DRY="1", S_LIST="64", OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(here), "benchmarks", "bench_int8.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "bench_int8_h200_dry.json").read_text())
    assert [r["shape"] for r in res["results"]] == ["qkv", "out", "fc1", "fc2"]
    assert set(res["results"][0]["ms"]) == {"bf16", "int8", "fp8"}
    e = res["results"][0]["err"]["w_gauss/x_gauss"]
    assert e["int8_vs_recipe_fp64"] < 4e-3 and 1e-4 < e["int8_vs_bf16"] < 0.03
    assert (tmp_path / "bench_int8_h200_dry.md").read_text().startswith("# W8A8 int8 vs bf16 vs fp8")
