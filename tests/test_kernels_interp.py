"""Triton kernels of kernels/triton_nvfp4.py on the CPU (TRITON_INTERPRET=1): bit-exact dequant, fused
dequant-GEMM vs float64 (ragged M, K multiple of 128 as in H3 and not), both MMA operand orders, fused
LoRA epilogue and the tiled strategy with LoRA folded into the weight tiles, NaN-poisoned outputs; the
native-layout weight fold (``fold_weight``: bf16 / e4m3 row-bound outputs, the "full" exact strategy, the fp8
folded-weight slot) and the per-row fp8 activation quantization.

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
from h3_turbo.kernels.paths import base as paths_base  # noqa: E402
from h3_turbo.kernels.paths import fp8 as fp8_path  # noqa: E402
from h3_turbo.kernels.paths.exact import PATH as EXACT  # noqa: E402

from test_kernels import make_packed, rel  # noqa: E402  (tests/ is on sys.path: rootdir conftest)


@pytest.fixture(scope="module")
def tk():
    assert _tk.INTERPRET
    _tk.SETTINGS.forced_config = None
    return _tk


# ------------------------------------------------------------------------------------ Triton (interpreter)

# (N, K): K multiple of 128 as all H3 projections (5376 = 42*128, 7168, 14336) and K % 128 != 0
SHAPES = [(64, 384), (40, 128), (96, 176), (48, 16)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_triton_fold_rows_bit_exact_and_poison_overwritten(tk, n, k):
    """fold_weight's row window (row0, the tiled strategy's tiles) equals the reference dequant's rows bit for bit
    (bf16 and fp32), whatever row0 is (the swizzled scales are addressed by the global row)."""
    p = make_packed(n, k, seed=k, dist="t3")
    gs = p.global_scale.float().reshape(1)
    want = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    want32 = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k, torch.float32)
    for r0, r1 in [(0, n), (5, n), (16, min(n, 37)), (n - 3, n)]:
        out = torch.full((r1 - r0, k), float("nan"), dtype=torch.bfloat16)
        got = tk.fold_weight(p.qdata, p.block_scale, gs, r1 - r0, k, out, row0=r0)
        assert torch.isfinite(got).all()
        assert torch.equal(got.view(torch.int16), want[r0:r1].view(torch.int16))
        got32 = tk.fold_weight(p.qdata, p.block_scale, gs, r1 - r0, k, torch.empty(r1 - r0, k), row0=r0)
        assert torch.equal(got32, want32[r0:r1])
    with pytest.raises(ValueError, match="does not hold"):
        tk.fold_weight(p.qdata, p.block_scale, gs, n, k, torch.empty(n, k), row0=n + 16)


@pytest.fixture(params=[False, True], ids=["x_by_wT", "swapped_w_by_xT"])
def swap(request, tk):
    """Both kernel variants: W via shared memory, and W as the register operand (SWAP)."""
    tk.SETTINGS.forced_config = {"BM": 16, "BN": 32, "GROUP_M": 4, "SWAP": request.param, "num_warps": 4,
                        "num_stages": 1}
    yield request.param
    tk.SETTINGS.forced_config = None


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 17, 40])
def test_triton_gemm_exact_vs_float64(tk, swap, n, k, m):
    p = make_packed(n, k, seed=m * 7 + n)
    pr = dsp.prepare(p, "exact")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    want = x.double() @ w.double().t()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = tk.gemm_exact(x, p.qdata, p.block_scale, pr.gs, n, k, out=out)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    e = rel(got, want)
    assert e < 1e-2, e
    # the only rounding is the bf16 output (fp32 accumulation of exact products): ~1e-3
    assert e < 3e-3, e
    # same numbers as the reference path up to summation order / output rounding
    assert rel(got, dsp.linear(x, dsp.prepare(p, "reference"), "reference")) < 1e-2


@pytest.mark.parametrize("bm,bn,swap", [(64, 64, False), (64, 64, True), (32, 128, False)])
@pytest.mark.parametrize("k", [256, 176])
def test_triton_gemm_exact_hopper_tile_sizes_vs_float64(tk, bm, bn, swap, k):
    """The tile sizes the GPU autotuner picks for 33-256 rows (64-row x @ W^T tiles: the ones Triton 3.6 could not
    build for Hopper before the weight tile became two plain nibble operands, issue 42), run by the interpreter at
    row counts around the tile edge, K a multiple of 128 and not, with the fused LoRA epilogue: within the bf16
    bound of the float64 product. The K permutation (high nibbles x even columns, low x odd) is checked by the
    same comparison: pairing them the other way round is ~100% off."""
    n = 3 * max(64, bn)                    # qkv blocks of n / 3 rows: each BN tile inside one block
    p = make_packed(n, k, seed=bm + bn + k)
    pr = dsp.prepare(p, "exact")
    w64 = ref.dequant_fp64(p.qdata, p.block_scale, p.global_scale, n, k)
    g = torch.Generator().manual_seed(k)
    tk.SETTINGS.forced_config = {"BM": bm, "BN": bn, "GROUP_M": 4, "SWAP": swap, "num_warps": 4, "num_stages": 1}
    try:
        for m in (bm - 1, bm + 1):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            want = x.double() @ w64.t()
            assert rel(tk.gemm_exact(x, p.qdata, p.block_scale, pr.gs, n, k), want) < 3e-3
            xs = x.view(m, k // 2, 2).flip(-1).reshape(m, k)          # even/odd columns swapped: must not match
            assert rel(tk.gemm_exact(xs, p.qdata, p.block_scale, pr.gs, n, k), want) > 0.5
        A, Bc = _lora_ab(g, 3 * 4, n, 4, k)
        h = torch.nn.functional.linear(x, A)
        got = tk.gemm_exact(x, p.qdata, p.block_scale, pr.gs, n, k, lora=(h, Bc, 0.75, n // 3))
        assert rel(got, dsp.lora_reference(x, p, A, Bc, 0.75, 3)) < 3e-3
        if bn > 64:                        # a tile across two blocks would read the wrong h columns: refused
            with pytest.raises(ValueError, match="divisible by the tile's"):
                tk.gemm_exact(x, p.qdata, p.block_scale, pr.gs, n, k, lora=(h, Bc, 0.75, 64))
    finally:
        tk.SETTINGS.forced_config = None


def test_triton_gemm_strided_input_and_3d(tk):
    n, k = 64, 256
    p = make_packed(n, k, seed=3)
    pr = dsp.prepare(p, "exact")
    big = torch.randn(9, k + 32).to(torch.bfloat16)
    x = big[:, 16:16 + k]  # row stride k+32
    got = tk.gemm_exact(x, p.qdata, p.block_scale, pr.gs, n, k)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    assert rel(got, x.double() @ w.double().t()) < 3e-3


@pytest.mark.parametrize("blocks,r", [(3, 4), (1, 20)])
def test_triton_fused_lora_equals_unfused_branch(tk, swap, blocks, r):
    n, k, m = 192, 256, 19
    p = make_packed(n, k, seed=11)
    pr = dsp.prepare(p, "exact")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    A, Bc = _lora_ab(g, blocks * r, n, r, k)
    scale = 0.75
    h = torch.nn.functional.linear(x, A)
    got = tk.gemm_exact(x, p.qdata, p.block_scale, pr.gs, n, k, lora=(h, Bc, scale, n // blocks))
    want = dsp.lora_reference(x, p, A, Bc, scale, blocks)
    assert rel(got, want) < 1e-2
    # the unfused branch (reference base + scale * B(A(x)) per block, bf16 ops) agrees too
    unf = dsp.linear_with_lora(x, dsp.prepare(p, "reference"), "reference", A, Bc, scale, blocks)
    assert rel(got, unf) < 1e-2
    # and the LoRA contribution is really there (not a test that cannot fail)
    base = tk.gemm_exact(x, p.qdata, p.block_scale, pr.gs, n, k)
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
    A, Bc = _lora_ab(g, blocks * r, n, r, k)
    monkeypatch.setattr(EXACT.settings, "tile_rows", tile)
    paths_base.WORK_BUFFERS.clear()
    base = EXACT.tiled(x, pr)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    assert torch.equal(base, torch.nn.functional.linear(x, w))  # same bf16 weight, same GEMM per tile
    got = EXACT.tiled(x, pr, lora=(A, Bc, 0.5, n // blocks))
    want = dsp.lora_reference(x, p, A, Bc, 0.5, blocks)
    assert rel(got, want) < 1e-2
    unf = dsp.linear_with_lora(x, dsp.prepare(p, "reference"), "reference", A, Bc, 0.5, blocks)
    assert rel(got, unf) < 1e-2
    assert rel(got, base) > 5e-2


# ------------------------------------------------------------------------------------ weight-side fold

def _lora_ab(g, rows_a, n, r, k):
    """LoRA operands drawn from ``g`` (A first): A [rows_a, k] and Bc [n, r], bf16, values ~0.05."""
    A = (torch.randn(rows_a, k, generator=g) * 0.05).to(torch.bfloat16)
    Bc = (torch.randn(n, r, generator=g) * 0.05).to(torch.bfloat16)
    return A, Bc


def _merged64(p, A, Bc, scale, blocks):
    """float64 W + scale * Bc[i] @ A[blk(i)] (the Turbo branch folded into the weight, no rounding)."""
    n, k = p.out_features, p.in_features
    w = ref.dequant_fp64(p.qdata, p.block_scale, p.global_scale, n, k)
    r, nb = A.shape[0] // blocks, n // blocks
    for i in range(blocks):
        w[i * nb:(i + 1) * nb] += scale * (Bc[i * nb:(i + 1) * nb].double() @ A[i * r:(i + 1) * r].double())
    return w


@pytest.mark.parametrize("n,k", SHAPES)
def test_fold_weight_without_lora_is_the_reference_dequant(tk, n, k):
    """The native-layout dequant (swizzled scales read in place, nibbles interleaved in registers) equals
    nvfp4_ref.dequant_exact bit for bit; every element of a NaN-poisoned output is written."""
    p = make_packed(n, k, seed=k + 1, dist="t3")
    want = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
    tk.fold_weight(p.qdata, p.block_scale, p.global_scale.float().reshape(1), n, k, out)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("blocks,r", [(3, 4), (1, 20)])
def test_fold_weight_bf16_lora_vs_float64(tk, blocks, r):
    n, k = 192, 272                       # K % 128 != 0: the last 128-column block is partial
    p = make_packed(n, k, seed=21)
    g = torch.Generator().manual_seed(2)
    A, Bc = _lora_ab(g, blocks * r, n, r, k)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
    tk.fold_weight(p.qdata, p.block_scale, p.global_scale.float().reshape(1), n, k, out,
                   lora=(A, Bc, 0.75, n // blocks))
    want = _merged64(p, A, Bc, 0.75, blocks)
    assert torch.isfinite(out).all()
    # one rounding to bf16 of an fp32 sum: <= 2^-9 per element, ~1.6e-3 in norm
    assert rel(out, want) < 2.5e-3
    assert ((out.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-30).all()
    assert rel(out, ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)) > 5e-2  # LoRA is there


@pytest.mark.parametrize("blocks,r,dist", [(3, 4, "gauss"), (1, 20, "t3")])
def test_fold_weight_fp8_rowwise_bound_and_bytes(tk, blocks, r, dist):
    """e4m3 output: the row scale is an upper bound of max |W'| (nothing clips), and the bytes are e4m3 (RNE) of
    W' * 448 / bound (compared with torch's own conversion of the float64 W')."""
    n, k = 96, 384
    p = make_packed(n, k, seed=5, dist=dist)
    g = torch.Generator().manual_seed(9)
    A, Bc = _lora_ab(g, blocks * r, n, r, k)
    w0 = ref.dequant_fp64(p.qdata, p.block_scale, p.global_scale, n, k)
    amax_w = w0.abs().amax(dim=1).float()
    out = torch.zeros((n + 16, k), dtype=torch.float8_e4m3fn)
    so = torch.full((n + 16,), 7.0)
    tk.fold_weight(p.qdata, p.block_scale, p.global_scale.float().reshape(1), n, k, out,
                   lora=(A, Bc, -0.6, n // blocks), amax_w=amax_w, scale_out=so)
    want = _merged64(p, A, Bc, -0.6, blocks)
    assert (so[n:] == 7.0).all() and (out[n:].float() == 0).all()          # pad rows untouched
    bound = so[:n].double() * 448
    assert (bound >= want.abs().amax(dim=1) * (1 - 1e-6)).all()              # no clipping
    amax_a = A.abs().amax(dim=1).double()
    expect = amax_w.double() + 0.6 * torch.stack([
        Bc[i].abs().double() @ amax_a[(i // (n // blocks)) * r:((i // (n // blocks)) + 1) * r] for i in range(n)])
    assert torch.allclose(bound, expect, rtol=1e-5)
    q_want = (want * (448 / bound)[:, None]).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    mism = (out[:n].view(torch.uint8) != q_want.view(torch.uint8))
    assert mism.float().mean() < 2e-3                                        # fp32 vs fp64 ties only
    # the re-expressed weight is e4m3-close to W' (3 mantissa bits: <= 2^-4 per normal element)
    deq = out[:n].double() * so[:n, None].double()
    assert 5e-3 < rel(deq, want) < 4e-2


def test_exact_full_and_fp8_fold_paths_on_cpu(tk, monkeypatch):
    """dispatch._exact_full / _fp8_fold (the large-M Turbo paths) computed on the CPU: base equals F.linear on the
    exact weight; with LoRA they match the float64 branch within bf16 (exact) / fp8 (<= 5%) bounds."""
    paths_base.WORK_BUFFERS.clear()
    n, k, m, blocks, r = 192, 256, 33, 3, 4
    p = make_packed(n, k, seed=17)
    pe, p8 = dsp.prepare(p, "exact"), dsp.prepare(p, "fp8")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    A, Bc = _lora_ab(g, blocks * r, n, r, k)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    assert torch.equal(EXACT.full(x, pe), torch.nn.functional.linear(x, w))
    want = dsp.lora_reference(x, p, A, Bc, 0.5, blocks)
    got = EXACT.full(x, pe, lora=(A, Bc, 0.5, n // blocks))
    assert rel(got, want) < 4e-3
    unf = dsp.linear_with_lora(x, pe, "exact", A, Bc, 0.5, blocks)   # CPU: the unfused branch
    assert rel(got, unf) < 6e-3 and rel(got, EXACT.full(x, pe)) > 5e-2
    got8 = fp8_path.fold_per_call(x, p8, (A, Bc, 0.5, n // blocks, None))
    e8 = rel(got8, want)
    assert 5e-3 < e8 < 5e-2, e8
    # folding the branch in adds no error class of its own: as far from the float64 branch as the base fp8 GEMM
    # is from the float64 base GEMM
    w64 = ref.dequant_fp64(p.qdata, p.block_scale, p.global_scale, n, k)
    e_base = rel(ref.fp8_linear_emulated(x, p8.w8[:n], p8.sw[0, :n], torch.bfloat16), x.double() @ w64.t())
    assert e8 < 1.15 * e_base, (e8, e_base)
    # a second layer of another shape reuses (and grows) the same buffers; the first result is unaffected
    p2 = make_packed(64, 384, seed=3)
    before = got.clone()
    EXACT.full(torch.randn(5, 384).to(torch.bfloat16), dsp.prepare(p2, "exact"))
    assert torch.equal(before, got)


@pytest.mark.parametrize("m,k", [(7, 300), (33, 5376)])
def test_quant_rows_fp8_bytes_equal_the_reference(tk, m, k):
    """Per-row activation quantization: scales and e4m3 bytes equal nvfp4_ref.quantize_rows_fp8 (RNE, incl.
    values that round up into the next binade: the interpreter's own cast halves those), zero rows get scale
    1/448."""
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]).to(torch.bfloat16)
    x[2] = 0
    q, s = tk.quant_rows_fp8(x)
    qr, sr = ref.quantize_rows_fp8(x)
    assert torch.equal(s, sr) and float(s[2]) == float(torch.tensor(1 / 448, dtype=torch.float32))
    # equal bytes, except where x * 448/amax lands within an fp32 ulp of an e4m3 rounding tie (the interpreter
    # forms 448/amax in float64): those differ by one e4m3 step (adjacent codes), never more
    d = (q.view(torch.uint8).int() - qr.view(torch.uint8).int()).abs()
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) < 5e-3


def test_fp8_folded_weight_slot_switches_and_restores_base_bit_identically(tk):
    """fp8 + runtime Turbo LoRA keeps the fold in the layer's one e4m3 weight slot: switching to a key folds W + s*Bc@A
    in place; another strength refolds; the base (Turbo off, or any plain call) is re-derived bit-identical to what
    prepare() made; a failure mid-fold leaves the slot marked invalid, so the next call re-derives it."""
    n, k, blocks, r = 96, 256, 3, 4
    p = make_packed(n, k, seed=31, dist="t3")
    p8 = dsp.prepare(p, "fp8")
    w8_0, sw_0 = p8.w8.clone(), p8.sw.clone()
    g = torch.Generator().manual_seed(6)
    A, Bc = _lora_ab(g, blocks * r, n, r, k)
    lt = (A, Bc, 0.5, n // blocks, None)
    fp8_path.set_state(p8, ("t", 0.5), lt)
    assert p8.state == ("t", 0.5) and p8.refolds == 1
    want = _merged64(p, A, Bc, 0.5, blocks)
    assert rel(p8.w8[:n].double() * p8.sw[0, :n, None].double(), want) < 4e-2
    assert not torch.equal(p8.w8, w8_0)
    fp8_path.set_state(p8, ("t", 0.5), lt)          # same key: nothing to do
    assert p8.refolds == 1
    fp8_path.set_state(p8, ("t", 0.25), (A, Bc, 0.25, n // blocks, None))
    assert p8.refolds == 2
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    dsp.linear(x, p8, "fp8")                        # a plain call puts the base back (CPU: reference on it)
    assert p8.state is None and p8.refolds == 3
    assert torch.equal(p8.w8.view(torch.uint8), w8_0.view(torch.uint8)) and torch.equal(p8.sw, sw_0)
    with pytest.raises(ValueError):
        fp8_path.set_state(p8, ("t", 1.0), (A[:, :8], Bc, 1.0, n // blocks, None))  # broken operands
    assert p8.state is fp8_path._INVALID
    dsp.linear(x, p8, "fp8")
    assert p8.state is None and torch.equal(p8.w8.view(torch.uint8), w8_0.view(torch.uint8))


@pytest.mark.parametrize("seed", range(24))
def test_fp8_base_restored_bit_identically_over_seeds(tk, seed):
    """After any fold, the base e4m3 weight and its row scales come back bit for bit: the restore runs the very
    function prepare() used. (Seeds with e4m3 rounding ties broke an earlier restore that recomputed 448/amax in
    the kernel.)"""
    n, k = 96, 256
    p = make_packed(n, k, seed=seed, dist="t3")
    p8 = dsp.prepare(p, "fp8")
    w8_0, sw_0, am_0 = p8.w8.clone(), p8.sw.clone(), p8.amax_w.clone()
    g = torch.Generator().manual_seed(seed)
    A, Bc = _lora_ab(g, 12, n, 4, k)
    fp8_path.set_state(p8, ("k", 1.0), (A, Bc, 1.0, n // 3, None))
    assert not torch.equal(p8.w8.view(torch.uint8), w8_0.view(torch.uint8))
    fp8_path.set_state(p8, None, None)
    assert torch.equal(p8.w8.view(torch.uint8), w8_0.view(torch.uint8))
    assert torch.equal(p8.sw, sw_0) and torch.equal(p8.amax_w, am_0)


def _bad_fold_cases():
    n, k = 96, 256
    p = make_packed(n, k, seed=2)
    q, bs, gs = p.qdata, p.block_scale, p.global_scale.float().reshape(1)
    A = torch.zeros(12, k, dtype=torch.bfloat16)
    Bc = torch.zeros(n, 4, dtype=torch.bfloat16)
    ob = torch.empty(n, k, dtype=torch.bfloat16)
    o8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    f32 = torch.ones(n)
    return {
        "rank_mismatch": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=ob,
                               lora=(A, Bc[:, :2], 1.0, 32)), "do not fit"),
        "A_wrong_k": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=ob, lora=(A[:, :128], Bc, 1.0, 32)),
                      "do not fit"),
        "Bc_short": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=ob, lora=(A, Bc[:64], 1.0, 32)), "do not fit"),
        "n_past_storage": (dict(qdata=q, block_scale=bs, gs=gs, n=160, k=k, out=torch.empty(160, k, dtype=torch.bfloat16)),
                           "does not hold"),
        "k_past_storage": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=512, out=torch.empty(n, 512, dtype=torch.bfloat16)),
                           "does not hold"),
        "k_not_16": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=250, out=torch.empty(n, 250, dtype=torch.bfloat16)),
                     "multiple of 16"),
        "scales_truncated": (dict(qdata=q, block_scale=bs[:, :8], gs=gs, n=n, k=k, out=ob), "swizzled layout"),
        "nb_zero": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=ob, lora=(A, Bc, 1.0, 0)), "positive int"),
        "nb_negative": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=ob, lora=(A, Bc, 1.0, -32)), "positive int"),
        "int_out": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=torch.empty(n, k, dtype=torch.int32)),
                    "out dtype"),
        "bf16_amax": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=o8, lora=(A, Bc, 1.0, 32),
                           amax_w=f32.bfloat16(), scale_out=f32.clone()), "fp32 amax_w"),
        "no_scale_out": (dict(qdata=q, block_scale=bs, gs=gs, n=n, k=k, out=o8, amax_w=f32), "fp32 amax_w"),
        "gs_not_scalar": (dict(qdata=q, block_scale=bs, gs=torch.ones(2), n=n, k=k, out=ob), "one fp32 value"),
    }


@pytest.mark.parametrize("case", sorted(_bad_fold_cases()))
def test_fold_weight_refuses_inputs_it_would_misread(tk, case):
    """fold_weight is public: every shape/dtype it would otherwise misread (or read out of bounds) raises
    ValueError naming what was expected, and the output is left unwritten."""
    kw, msg = _bad_fold_cases()[case]
    before = kw["out"].clone()
    with pytest.raises(ValueError, match=msg):
        tk.fold_weight(**kw)
    assert torch.equal(kw["out"].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("n,k", [(300, 208), (96, 384)])
def test_fp8_base_from_kernel_dequant_equals_torch_path(tk, n, k):
    """The fp8 base on a GPU dequantizes with fold_weight (fp32 output) in 128-row-aligned chunks; on the CPU with
    nvfp4_ref. Both give the same bytes (also with chunks that end inside a 128-row scale tile)."""
    p = make_packed(n, k, seed=n + k, dist="t3")
    out = torch.full((n, k), float("nan"))
    tk.fold_weight(p.qdata, p.block_scale, p.global_scale.float().reshape(1), n, k, out)
    assert torch.equal(out, ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k, torch.float32))
    res = []
    for use_triton in (False, True):
        w8 = torch.zeros(ref.fmt.roundup(n, 16), k, dtype=torch.float8_e4m3fn)
        sw = torch.ones(ref.fmt.roundup(n, 16))
        am = torch.zeros(n)
        fp8_path.base_into(p, w8, sw, am, step=128, use_triton=use_triton)
        res.append((w8.view(torch.uint8), sw, am))
    assert all(torch.equal(a, b) for a, b in zip(*res))
    assert torch.equal(res[0][0], dsp.prepare(p, "fp8").w8.view(torch.uint8))


def test_fp8_slot_switches_outside_inference_mode_for_a_weight_prepared_inside(tk):
    """ComfyUI prepares weights under torch.inference_mode (inference tensors); a later caller outside it (a script,
    a no_grad node) can still fold and restore the slot, and the restored base is the prepared one."""
    n, k = 96, 256
    p = make_packed(n, k, seed=4)
    with torch.inference_mode():
        p8 = dsp.prepare(p, "fp8")
        w8_0 = p8.w8.clone()
    assert p8.w8.is_inference()
    A = (torch.randn(12, k) * 0.05).to(torch.bfloat16)
    Bc = (torch.randn(n, 4) * 0.05).to(torch.bfloat16)
    with torch.no_grad():
        fp8_path.set_state(p8, ("k", 1.0), (A, Bc, 1.0, n // 3, None))
        dsp.linear(torch.randn(3, k).to(torch.bfloat16), p8, "fp8")
    assert p8.state is None and torch.equal(p8.w8.view(torch.uint8), w8_0.view(torch.uint8))


# ------------------------------------------------------------------------------------ every registered path

@pytest.mark.parametrize("name", [n for n, p in __import__("h3_turbo.kernels.registry", fromlist=["PATHS"]).PATHS.items()
                                  if p.kernel and p.weight_format == "nvfp4"])
@pytest.mark.parametrize("m", [5, 300])
def test_registered_path_kernel_within_bound(tk, name, m):
    """Each kernel path of the registry, run by its own kernel_linear on CPU tensors under the interpreter, is
    within its declared error_bound of the float64 product with the exact NVFP4 weight (ragged K = 176)."""
    from h3_turbo.kernels import registry

    path = registry.get(name)
    n, k = 96, 176
    p = make_packed(n, k, seed=11)
    prepared = dsp.prepare(p, name)
    x = torch.randn(m, k).to(torch.bfloat16)
    got = path.kernel_linear(x, prepared)
    want = x.double() @ ref.dequant_fp64(p.qdata, p.block_scale, p.global_scale, n, k).t()
    assert got.shape == (m, n) and torch.isfinite(got).all()
    assert rel(got, want) < path.error_bound


# ------------------------------------------------------------------------------------ lean weights (issue 17)

@pytest.mark.parametrize("n,k,dist", [(96, 256, "t3"), (40, 176, "normal"), (48, 384, "t3")])
def test_fp8_lean_weight_is_the_resident_copy_bit_for_bit(tk, n, k, dist):
    """weights=lean: the e4m3 weight derived per call (fold_weight with the stored 448/amax factors) has the bytes
    of the resident copy prepare() makes, and the same row scales; a zero row keeps scale 1/448. The lean prepared
    object holds no [N, K] tensor."""
    p = make_packed(n, k, seed=n + k, dist=dist)
    p.qdata[3] = 0                                   # a zero row (codes 0 = +0)
    resident = dsp.prepare(p, "fp8")
    lean = dsp.prepare(p, "fp8", lean=True)
    assert lean.lean and lean.w8 is None and not resident.lean
    assert all(t.numel() <= lean.sw.numel() for t in (lean.amax_w, lean.inv_w))
    w8, sw = fp8_path.PATH.weight_operands(lean, "cpu")
    assert torch.equal(w8[:n].view(torch.uint8), resident.w8[:n].view(torch.uint8))
    assert torch.equal(sw, resident.sw) and float(sw[0, 3]) == float(torch.tensor(1 / 448))
    assert torch.equal(lean.amax_w, resident.amax_w)
    # the reference weight of both modes is the same tensor of values
    assert torch.equal(fp8_path.PATH.reference_weight(lean, torch.float32),
                       fp8_path.PATH.reference_weight(resident, torch.float32))


@pytest.mark.parametrize("m", [5, 70])
def test_fp8_lean_and_resident_outputs_bit_identical_with_and_without_turbo(tk, m):
    """The same layer in both modes: plain calls, and Turbo LoRA calls with a fold key (resident: the weight slot;
    lean: the per-call fold into the shared buffer) give the same output bit for bit; switching back to the base
    (Turbo off) too. Shared buffers are reused by another layer in between (the lean weight is per call)."""
    paths_base.WORK_BUFFERS.clear()
    n, k, blocks, r = 96, 256, 3, 4
    p = make_packed(n, k, seed=41, dist="t3")
    res, lean = dsp.prepare(p, "fp8"), dsp.prepare(p, "fp8", lean=True)
    other = dsp.prepare(make_packed(64, 384, seed=2), "fp8", lean=True)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    A, Bc = _lora_ab(g, blocks * r, n, r, k)
    path = fp8_path.PATH

    def same(a, b):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    assert same(path.kernel_linear(x, res), path.kernel_linear(x, lean))
    path.kernel_linear(torch.randn(3, 384).to(torch.bfloat16), other)      # another layer uses the buffer
    lo = paths_base.LoRAOperands(A, Bc.contiguous(), 0.5, n // blocks, None, fold_key=("turbo", "qkv"))
    y_res, route_res = path.lora(x, res, lo)
    y_lean, route_lean = path.lora(x, lean, lo)
    assert (route_res, route_lean) == ("fp8_slot", "fp8_lean_fold")
    assert same(y_res, y_lean)
    assert rel(y_res, path.kernel_linear(x, lean)) > 5e-2                  # the LoRA is really in there
    # the operands a fused caller takes (weight_operands): the same bytes in both modes, with and without the LoRA
    w_r, s_r = path.weight_operands(res, "cpu", lo)
    w_l, s_l = path.weight_operands(lean, "cpu", lo)
    assert torch.equal(w_r[:n].view(torch.uint8), w_l[:n].view(torch.uint8)) and torch.equal(s_r[:, :n], s_l[:, :n])
    with pytest.raises(ValueError, match="fold_key"):
        path.weight_operands(lean, "cpu", paths_base.LoRAOperands(A, Bc.contiguous(), 0.5, n // blocks))
    fp8_path.set_state(res, None, None)                                    # Turbo off: the base again
    assert same(path.kernel_linear(x, res), path.kernel_linear(x, lean))
    w_r, s_r = path.weight_operands(res, "cpu")
    w_l, s_l = path.weight_operands(lean, "cpu")
    assert torch.equal(w_r[:n].view(torch.uint8), w_l[:n].view(torch.uint8)) and torch.equal(s_r, s_l)
    assert lean.refolds == 0 and res.refolds == 2      # one fold, one restore: the same key needs no refold


def test_exact_prepares_no_copy_and_reads_the_native_storage(tk):
    """exact keeps no per-layer copy: its prepared object shares the packed tensors, and every strategy (fused,
    tiled with row windows, full) gives the fused kernel's numbers on the native storage."""
    n, k = 200, 384
    p = make_packed(n, k, seed=5)
    pe = dsp.prepare(p, "exact")
    assert pe.packed.qdata is p.qdata and pe.packed.block_scale is p.block_scale
    x = torch.randn(9, k).to(torch.bfloat16)
    w = ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, n, k)
    want = torch.nn.functional.linear(x, w)
    assert torch.equal(EXACT.full(x, pe), want)
    import dataclasses
    old = dataclasses.replace(EXACT.settings)
    try:
        EXACT.settings.tile_rows = 48                                        # tiles start at rows 48, 96, ... 192
        assert torch.equal(EXACT.tiled(x, pe), want)
    finally:
        EXACT.settings = old
    assert rel(EXACT.kernel_linear(x, pe), x.double() @ w.double().t()) < 3e-3
