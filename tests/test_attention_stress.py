"""Issue 38: the attention stress corpus (kernels/attention/stress.py), the rotated INT8 Q/K of int8_sage
(kernels/attention/int8_kernels.py ROTATE, the fused route's producer) and the per-layer accuracy guard
(kernels/attention/guard.py), on the CPU.

The Triton kernels run under TRITON_INTERPRET=1 (set before triton is imported): ``test_interpreted_in_subprocess``
re-runs this file's ``test_interp_*`` tests in a fresh interpreter with it. Bounds: the issue's targets for every
8-bit backend run by default or in auto8 (relative L2 <= 8 %, min per-head cosine >= 0.997 against float32
attention) at small shapes.
"""
from __future__ import annotations

import logging
import math
import os
import warnings

import pytest
import torch

INTERP = os.environ.get("TRITON_INTERPRET") == "1"

from h3_turbo.kernels.attention import cudnn_fp8 as C  # noqa: E402
from h3_turbo.kernels.attention import guard as G  # noqa: E402
from h3_turbo.kernels.attention import int8_kernels as Q  # noqa: E402
from h3_turbo.kernels.attention import stress  # noqa: E402
from h3_turbo.kernels.attention.reference import accuracy, reference_attention  # noqa: E402

interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (run by test_interpreted_in_subprocess)")
REL_MAX, COS_MIN = 0.08, 0.997
#: the SageAttention-2 quantization without this issue's remedies (no rotation, no q / k balance): the negative control
PLAIN = {"ROTATE": False, "BALANCE": False}
#: the Hopper configuration int8_sage runs by default (tuned_config on compute capability 9.x) at small blocks
HOPPER = {**Q.HOPPER_CONFIGS[0][1], "BLOCK_M": 64, "BLOCK_N": 128}


def _call(case, S=256, H=2, D=128, seed=0):
    return stress.bhld(*stress.make(case, S, H, D, seed=seed))


# ------------------------------------------------------------------ torch only (in process)

def test_cases_are_deterministic_views_of_one_qkv_buffer_with_their_statistics():
    assert list(stress.CASES) == ["rand", "k_outlier", "qk_outlier", "k_bias", "massive", "sharp"]
    for case in stress.CASES:
        q, k, v = stress.make(case, 50, 3, 64, seed=5)
        assert q.shape == (1, 50, 3, 64) and q.dtype == torch.bfloat16
        assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() and q.stride(1) == 3 * 3 * 64
        q2, k2, v2 = stress.make(case, 50, 3, 64, seed=5)
        assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
        assert stress.bhld(q).shape == (1, 3, 50, 64)
    _, k0, _ = stress.rand(400, 2, 128, seed=1)
    q1, k1, _ = stress.k_outlier(400, 2, 128, seed=1)
    amax = k1.float().abs().amax(dim=1)[0]                          # [H, D]
    ratio = amax / amax.median(dim=-1, keepdim=True).values
    assert ((ratio > 8).sum(-1) == stress.N_CHANNELS).all()          # 4 channels per head x 24
    _, kb, _ = stress.k_bias(400, 2, 128, seed=1)
    assert ((kb.float().mean(1)[0] > 10).sum(-1) == stress.N_CHANNELS).all()
    _, km, vm = stress.massive(400, 2, 128, seed=1)
    norms = vm.float().norm(dim=-1)[0, :, 0]
    assert set(norms.topk(stress.N_MASSIVE).indices.tolist()) == set(stress.massive_rows(400).tolist())
    with pytest.raises(ValueError, match="unknown case"):
        stress.make("nope", 10, 1, 64)


def test_fwht_is_the_hadamard_product_and_keeps_q_dot_k():
    x = torch.randn(5, 3, 128)
    h = Q.hadamard(128)
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert (Q.fwht(x).double() / math.sqrt(128) - x.double() @ h).abs().max() < 1e-5
    q, k, _ = _call("k_outlier", S=64)
    s0 = q[0].double() @ k[0].double().transpose(-1, -2)
    s1 = (q[0].double() @ h) @ (k[0].double() @ h).transpose(-1, -2)       # the eager reference: q.k unchanged
    assert (s1 - s0).abs().max() < 1e-9 * s0.abs().max()
    # the kernels' unnormalised transform: scores D times larger, folded into the score scale
    assert Q.qk_scale(0.5, {"ROTATE": True}, 128) == 0.5 * Q.LOG2E / 128
    with pytest.raises(ValueError, match="power of two"):
        Q.fwht(torch.zeros(2, 48))


def test_rotation_in_the_quantization_model_fixes_k_outlier_and_its_absence_fails():
    """The torch model of the kernels (quantize_reference + sage_reference, the bits the kernels are tested against):
    balanced and rotated (the defaults) within the bound on every case, each remedy alone too; without both, far
    outside it on k_outlier (negative control). The balance takes k_outlier from the rotation's margin to the other
    cases' level."""
    got = {}
    for case in stress.CASES:
        q, k, v = _call(case, seed=3)
        ref = reference_attention(q, k, v)
        for name, cfg in (("both", HOPPER), ("rotate", {**HOPPER, "BALANCE": False}),
                          ("balance", {**HOPPER, "ROTATE": False})):
            got[case, name] = accuracy(Q.sage_reference(q, k, v, config=cfg).view(2, 256, 128).float(), ref)
            assert got[case, name]["rel_l2"] <= REL_MAX and got[case, name]["cos_min"] >= COS_MIN, (case, name, got)
        if case == "k_outlier":
            assert got[case, "both"]["rel_l2"] < 0.8 * got[case, "rotate"]["rel_l2"], got
            assert got[case, "both"]["rel_l2"] < 1.2 * got["rand", "both"]["rel_l2"], got
            plain = accuracy(Q.sage_reference(q, k, v, config={**HOPPER, **PLAIN}).view(2, 256, 128).float(),
                             ref)
            assert plain["rel_l2"] > 0.15 and plain["cos_min"] < 0.99, plain


def test_cudnn_fp8_model_on_the_corpus():
    """cudnn_fp8's eager model (per-tensor e4m3 scales): robust to k_outlier, outside the bound on qk_outlier and
    sharp (why it is not offered by default; the GPU benchmark measures cuDNN itself)."""
    got = {}
    for case in stress.CASES:
        q, k, v = _call(case)
        o8, d = C.emulate_sdpa_fp8(q, k, v)
        got[case] = accuracy((o8.float() * d)[0], reference_attention(q, k, v))
    assert got["k_outlier"]["rel_l2"] < REL_MAX
    assert got["qk_outlier"]["rel_l2"] > 0.12 and got["sharp"]["cos_min"] < COS_MIN, got


class _Approx:
    """A stand-in 8-bit attention for the guard: int8_sage's torch model, unrotated (fails k_outlier)."""

    def __call__(self, q, k, v):
        return Q.sage_reference(q, k, v, config={**HOPPER, **PLAIN}).view(q.shape).to(q.dtype)


def test_guard_runs_exact_only_for_the_layer_that_fails(caplog):
    """Four layers (calls of one forward), layer 2 with k_outlier inputs: only layer 2 fails (logged once with its
    numbers) and runs exact from then on; the next forward's first call logs the summary; nothing is re-checked."""
    g = G.LayerGuard("test8", rows=64)
    layers = [_call("k_outlier" if i == 2 else "rand", S=256, seed=i) for i in range(4)]
    approx = _Approx()

    def forward(sig):
        to = {"sigmas": sig}
        outs = []
        for q, k, v in layers:
            lay = g.layer(to)
            if g.runs_exact(lay):
                outs.append(("exact", lay))
                continue
            out = approx(q, k, v)
            key = ("shape", q.shape)
            if g.needs_check(lay, key):
                rows = g.sample(q.shape[2])
                if not g.check(lay, key, q[:, :, rows], k, v, out[:, :, rows]):
                    outs.append(("exact", lay))
                    continue
            outs.append(("8bit", lay))
        return outs

    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        first = forward(torch.tensor([1.0]))
        assert first == [("8bit", ("call", 0)), ("8bit", ("call", 1)), ("exact", ("call", 2)), ("8bit", ("call", 3))]
        assert g.checks == 4 and set(g.exact) == {("call", 2)}
        vd = g.exact[("call", 2)]
        assert vd.cos_min < COS_MIN or vd.rel_l2 > 0.10
        fails = [r.getMessage() for r in caplog.records if "fails" in r.getMessage()]
        assert len(fails) == 1 and "layer call 2" in fails[0] and f"{vd.cos_min:.5f}" in fails[0]
        second = forward(torch.tensor([0.5]))
        assert second == first and g.checks == 4                       # checked once per (layer, shape)
    summ = [r.getMessage() for r in caplog.records if "checked attention layers" in r.getMessage()]
    assert len(summ) == 1 and "3 of 4 checked attention layers run 8-bit; exact: call 2" in summ[0], summ
    assert g.layer({"sigmas": torch.tensor([0.1]), "block_index": 7}) == ("block", 7)
    assert g.layer(None) == ("call", None)
    # a forward = one transformer_options dict with its sigmas (cond / uncond as two model calls share the sigmas)
    sig = torch.tensor([0.2])
    a, b = {"sigmas": sig}, {"sigmas": sig}
    assert [g.layer(a), g.layer(a), g.layer(b), g.layer(a)] == [("call", 0), ("call", 1), ("call", 0), ("call", 0)]
    tagged = g.block_options(a, 5)                  # the fused block's copy: its block, the forward's count untouched
    assert g.layer(tagged) == ("block", 5) and g.layer(a) == ("call", 1) and "sigmas" in tagged


def test_cudnn_fp8_override_guard_on_its_model(caplog):
    """cudnn_fp8's override with a guard, on its eager model (CPU): a qk_outlier layer fails and runs exact, a rand
    layer keeps FP8; the auto8 chooser's copy of a guarded override has no guard of its own."""
    from h3_turbo.kernels.attention import auto8
    from h3_turbo.kernels.attention import exact as A

    ov = C.CudnnFP8Attention(fallback=A.cpu_exact(), devices=("cpu",), emulate=True, guard=G.LayerGuard("cudnn_fp8"))
    core = lambda *a, **k: (_ for _ in ()).throw(AssertionError("core called"))   # noqa: E731
    to = {"sigmas": torch.tensor([1.0])}
    outs = []
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        for case in ("rand", "qk_outlier"):
            q, k, v = _call(case)
            outs.append((ov(core, q, k, v, 2, skip_reshape=True, transformer_options=to), q, k, v))
    assert ov.calls == 1 and set(ov.guard.exact) == {("call", 1)}
    o, q, k, v = outs[1]
    assert torch.equal(o, A.cpu_exact()(core, q, k, v, 2, skip_reshape=True))
    assert any("layer call 1 fails" in r.getMessage() for r in caplog.records)


def test_auto8_runs_unguarded_copies_of_guarded_candidates(monkeypatch):
    """auto8 checks each layer with its own guard: its candidates are copies of the process-wide overrides without
    theirs (one copy per candidate, the originals keep their guards)."""
    from types import SimpleNamespace

    from h3_turbo.kernels.attention import auto8, registry
    from h3_turbo.kernels.attention import exact as A

    orig = C.CudnnFP8Attention(fallback=A.cpu_exact(), devices=("cpu",), emulate=True, guard=G.LayerGuard("x"))
    fake = SimpleNamespace(supports=lambda d: (True, ""), override=lambda: orig)
    monkeypatch.setattr(registry, "names", lambda: ("int8_sage",))
    monkeypatch.setattr(registry, "get", lambda n: fake)
    a8 = auto8.Auto8Attention(exact_override=A.cpu_exact(), devices=("cpu",), guard=G.LayerGuard("auto8"))
    c1 = a8.candidates("cpu")["int8_sage"]
    c2 = a8.candidates("cpu")["int8_sage"]
    assert c1 is c2 and c1 is not orig and c1.guard is None and orig.guard is not None and c1.emulate


def test_guard_measure_against_sampled_exact_rows():
    q, k, v = _call("rand", S=300, H=3, D=64)
    rows = G.sample_rows(300, 64)
    assert rows.numel() == 64 and rows[0] == 0 and rows[-1] == 299
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    cos, rel = G.measure(exact[:, :, rows], q[:, :, rows], k, v)
    assert cos > 0.99999 and rel < 1e-6
    cos, rel = G.measure(exact[:, :, rows] * 1.2, q[:, :, rows], k, v)
    assert abs(rel - 0.2) < 1e-3 and cos > 0.99999                   # a scaled output: cosine blind, L2 not
    bad = exact[:, :, rows].clone()
    bad[0, 1] = torch.flip(bad[0, 1], dims=[0])                     # one head's rows shuffled
    cos, _ = G.measure(bad, q[:, :, rows], k, v)
    assert cos < 0.9
    bad[0, 0, 0, 0] = float("nan")
    assert G.measure(bad, q[:, :, rows], k, v) == (pytest.approx(float("nan"), nan_ok=True), math.inf)
    # blhd output layout -> [B, H, r, D]
    o = exact.transpose(1, 2).reshape(1, 300, 3 * 64)
    assert torch.equal(G.out_rows(o, rows, 3, False), exact[:, :, rows])


# ------------------------------------------------------------------ interpreted kernels

@interp
@pytest.mark.parametrize("case", list(stress.CASES))
def test_interp_int8_sage_default_hopper_config_on_every_case(case):
    """int8_sage's kernel with the Hopper configuration it runs by default (rotated, one Q scale per row) within the
    bound on every case; its quantized K equals the torch model bit for bit; without the rotation k_outlier fails."""
    q, k, v = _call(case)
    ref = reference_attention(q, k, v)
    out = Q.sage_attention(q, k, v, config=HOPPER)
    acc = accuracy(out[0].float(), ref)
    assert acc["rel_l2"] <= REL_MAX and acc["cos_min"] >= COS_MIN, acc
    kv = Q.quantize_kv(k, v, HOPPER)
    z = Q.quantize_reference(q, k, v, HOPPER)
    assert torch.equal(kv["k8"][:, :256].float(), z["k8"]) and torch.equal(kv["ks"], z["ks"])
    if case == "k_outlier":   # negative control: the unrotated kernel
        plain = accuracy(Q.sage_attention(q, k, v, config={**HOPPER, **PLAIN})[0].float(), ref)
        assert plain["rel_l2"] > 0.15 and plain["cos_min"] < 0.99, plain


@interp
def test_interp_int8_sage_off_hopper_config_balances_in_kernel():
    """The configuration off Hopper (Q quantized inside the attention kernel, one scale per 64 rows): the kernel
    multiplies q by quantize_kv's l itself; k_outlier within the bound, and clearly better than without the balance."""
    q, k, v = _call("k_outlier")
    ref = reference_attention(q, k, v)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 128}
    assert not Q._cfg(cfg)["QPRE"] and Q.quantize_kv(k, v, cfg)["lam"].max() >= 4
    got = accuracy(Q.sage_attention(q, k, v, config=cfg)[0].float(), ref)
    off = accuracy(Q.sage_attention(q, k, v, config={**cfg, "BALANCE": False})[0].float(), ref)
    assert got["rel_l2"] <= REL_MAX and got["cos_min"] >= COS_MIN, got
    assert got["rel_l2"] < 0.8 * off["rel_l2"], (got, off)


def _producer_inputs(case: str, S=128, H=2, d=128, seed=0, rope_pairs=False):
    """qkv / rope table / norm weights whose RMSNorm + RoPE output has ``case``'s channel statistics (the outlier
    gains carried by the norm weights, as a trained k_norm would); ``rope_pairs``: the outliers on both channels of
    two RoPE pairs (mixed by the rotation) instead of four pass-through channels."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, 3 * H * d, generator=g).to(torch.bfloat16)
    r2 = d * 3 // 8
    ang = torch.randn(S, r2, generator=g) * 3.0
    c, sn = torch.cos(ang), torch.sin(ang)
    table = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, S, 1, r2, 2, 2)
    qw = 1.0 + 0.5 * torch.rand(d, generator=g)
    kw = 1.0 + 0.5 * torch.rand(d, generator=g)
    if rope_pairs:
        p = torch.randperm(r2, generator=g)[:2]
        ch = torch.cat([p, p + r2])                                       # split-half pairs (c, c + r2)
    else:
        ch = torch.randperm(d - 2 * r2, generator=g)[:4] + 2 * r2          # pass-through channels (no RoPE mixing)
    if case == "k_outlier":
        kw[ch] *= 24.0
        qw[ch] *= 0.05
    elif case == "qk_outlier":
        kw[ch] *= 6.0
        qw[ch] *= 6.0
    return qkv, table, qw.to(torch.bfloat16), kw.to(torch.bfloat16)


@interp
@pytest.mark.parametrize("case,rope_pairs", [("k_outlier", False), ("k_outlier", True), ("qk_outlier", False)])
def test_interp_fused_route_producer_and_kernel(case, rope_pairs):
    """The fused route (qk_norm_rope_sage balancing the norm weights in its launch, rotating q after RoPE,
    sage_attention_prequantized) within the bound on outlier channels made by the norm weights; the launch's balance
    equals passing :func:`balance.fold_into_norm_weights`' float32 weights bit for bit (q8, qs, the stored k); the
    route's output is the standalone kernel's (Q_ROW, no balance of its own) on qk_norm_rope's q / k with the balanced
    weights bit for bit (the balance is exact: q.k is unchanged, so the reference is the unbalanced attention); the
    route without the balance and the rotation fails k_outlier (run for that case only)."""
    from h3_turbo.kernels import fused as fk
    from h3_turbo.kernels.attention import balance

    S, H, d = 128, 2, 128
    qkv, table, qw, kw = _producer_inputs(case, S, H, d, rope_pairs=rope_pairs)
    inner = H * d
    view = lambda t: t.reshape(S, H, d).transpose(0, 1).unsqueeze(0)    # noqa: E731

    def rope(wq, wk):
        x = qkv.clone()
        fk.qk_norm_rope(x, H, d, table, wq, wk, 1e-6)
        return view(x[:, :inner]), view(x[:, inner:2 * inner]), view(x[:, 2 * inner:])

    ref = reference_attention(*rope(qw, kw))
    qwb, kwb, lam = balance.fold_into_norm_weights(qw, kw, 2 * table.shape[-3])
    if case == "k_outlier":
        assert lam.max() / lam.min() >= 8, lam                       # sqrt(24 / 0.05) ~ 22 -> a power of two
    else:
        assert torch.equal(lam, torch.ones(d)), lam                  # q and k x 6: nothing to move
    qb, kb, _ = rope(qwb, kwb)
    sb = qb[0].double() @ kb[0].double().transpose(-1, -2)
    q0, k0, _ = rope(qw, kw)
    s0 = q0[0].double() @ k0[0].double().transpose(-1, -2)
    assert (sb - s0).abs().max() <= 2e-2 * s0.abs().max()            # q.k kept (up to RoPE's bf16 roundings)
    res = {}
    for bal, rot in ((True, True), (False, False)) if case == "k_outlier" else ((True, True),):
        x = qkv.clone()
        prep = fk.qk_norm_rope_sage(x, H, d, table, qw, kw, 1e-6, rotate=rot, balance=bal)
        if bal:
            x_f = qkv.clone()
            prep_f = fk.qk_norm_rope_sage(x_f, H, d, table, qwb, kwb, 1e-6, rotate=rot)
            assert torch.equal(x, x_f) and all(torch.equal(prep[n], prep_f[n]) for n in ("q8", "qs")), case
        kc, vc = x[:, inner:2 * inner].view(S, H, d), x[:, 2 * inner:].view(S, H, d)
        prep["ksum"] = kc.sum(dim=0, dtype=torch.float32, keepdim=True)    # one torch sum: the standalone kernel's
        prep["vamax"] = vc.abs().amax(dim=0, keepdim=True).float()         # statistics (kv_stats)
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "ROTATE": rot}
        out = Q.sage_attention_prequantized(prep["q8"], prep["qs"], view(x[:, inner:2 * inner]),
                                            view(x[:, 2 * inner:]), prep["ksum"], prep["vamax"], config=cfg)
        q4, k4, v4 = rope(*((qwb, kwb) if bal else (qw, kw)))
        want = Q.sage_attention(q4, k4, v4, config={**cfg, "QPRE": True, "Q_ROW": True, "BALANCE": False},
                                out_layout="blhd")
        assert torch.equal(out, want), (bal, rot)
        res[bal] = accuracy(out[0].view(S, H, d).transpose(0, 1).float(), ref)
    assert res[True]["rel_l2"] <= REL_MAX and res[True]["cos_min"] >= COS_MIN, res
    if case == "k_outlier":
        assert res[False]["rel_l2"] > 0.15 and res[False]["cos_min"] < 0.99, res


@interp
@pytest.mark.parametrize("case,producer_case", [("k_outlier", "k_outlier"), ("k_bias", "qk_outlier")])
def test_interp_rot_mma_is_the_butterfly_up_to_float32_rounding(case, producer_case):
    """``ROT_MMA`` (the Hadamard rotation as a tensor-core product: k's float32 values as bf16 plus their bf16
    remainder, q already bf16 in the RoPE launch) against the butterfly: the K codes equal but for one step on <= 0.1 %,
    the block scales within 1e-5, the attention within the bound; the fused route's
    launch gives the butterfly's q codes but for one step on <= 0.1 % and its stored k bit for bit; an infinite k gives
    an infinite block scale in both forms. (The attention
    within 1e-2 of the butterfly's and with its error against float32 attention within 0.2 points.)"""
    from h3_turbo.kernels import fused as fk

    q, k, v = _call(case)
    ref = reference_attention(q, k, v)
    mma = {**HOPPER, "ROT_MMA": True}
    a, b = Q.quantize_kv(k, v, HOPPER), Q.quantize_kv(k, v, mma)
    d = (a["k8"].int() - b["k8"].int()).abs()
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= 1e-3, int(d.sum())
    assert torch.allclose(a["ks"], b["ks"], rtol=1e-5, atol=0)
    out_a = Q.sage_attention(q, k, v, config=HOPPER)[0].float()
    out_b = Q.sage_attention(q, k, v, config=mma)[0].float()
    acc, acc_a = accuracy(out_b, ref), accuracy(out_a, ref)
    assert acc["rel_l2"] <= REL_MAX and acc["cos_min"] >= COS_MIN, acc
    # a code one step off moves some e4m3 P and bf16 output roundings: the same error against float32 attention
    assert abs(acc["rel_l2"] - acc_a["rel_l2"]) <= 2e-3 and float((out_b - out_a).norm() / out_a.norm()) <= 1e-2
    S, H, d_ = 128, 2, 128
    qkv, table, qw, kw = _producer_inputs(producer_case, S, H, d_)
    xa, xb = qkv.clone(), qkv.clone()
    pa = fk.qk_norm_rope_sage(xa, H, d_, table, qw, kw, 1e-6, balance=True)
    pb = fk.qk_norm_rope_sage(xb, H, d_, table, qw, kw, 1e-6, balance=True, rot_mma=True)
    dq = (pa["q8"].int() - pb["q8"].int()).abs()
    assert int(dq.max()) <= 1 and float((dq > 0).float().mean()) <= 1e-3
    assert torch.allclose(pa["qs"], pb["qs"], rtol=1e-6, atol=0) and torch.equal(xa, xb)
    assert torch.equal(pa["ksum"], pb["ksum"]) and torch.equal(pa["vamax"], pb["vamax"])
    # an infinite k stays visible: its block's scale is inf in both forms (the bf16 remainder of inf is taken as 0,
    # not inf - inf = NaN, which the block maximum would drop to a finite, wrong scale)
    k_inf = k.clone()
    k_inf[0, 0, 5, 7] = float("inf")
    with warnings.catch_warnings():     # the interpreter's numpy warns on the inf arithmetic this feeds it
        warnings.simplefilter("ignore", RuntimeWarning)
        assert bool(torch.isinf(Q.quantize_kv(k_inf, v, HOPPER)["ks"][0, 0]))
        assert bool(torch.isinf(Q.quantize_kv(k_inf, v, mma)["ks"][0, 0]))


@interp
def test_interp_launch_balance_matches_the_torch_exponents_on_odd_weights():
    """qk_norm_rope_sage(balance=True)'s in-launch l equals norm_weight_exponents' on weights with zeros, bf16
    subnormals (float32 exponent field 0: l = 1), negative values, ratios past the clamp and RoPE pairs; fp16 qkv
    with balance is refused by name."""
    from h3_turbo.kernels import fused as fk
    from h3_turbo.kernels.attention import balance

    S, H, d = 16, 2, 64
    qkv, table, _, _ = _producer_inputs("rand", S, H, d)
    g = torch.Generator().manual_seed(3)
    qw = (torch.rand(d, generator=g) * 4 - 2).to(torch.bfloat16)
    kw = (torch.rand(d, generator=g) * 4 - 2).to(torch.bfloat16)
    qw[0], kw[0] = 0.0, 5.0                     # zero q weight (and its RoPE partner shares the pair's max)
    qw[40], kw[40] = 1e-39, 1.0                 # bf16 subnormal: field 0 -> l = 1
    qw[50], kw[50] = 1e-30, 1e30                # past the clamp: 2^MAX_EXP
    qw[60], kw[60] = -0.05, -24.0               # signs do not matter: l = 16
    qb, kb, lam = balance.fold_into_norm_weights(qw, kw, 2 * table.shape[-3])
    assert lam[50] == 2.0 ** balance.MAX_EXP and lam[60] == 16 and lam[40] == 1, lam
    assert (lam != 1).sum() >= 4, lam
    x, x_f = qkv.clone(), qkv.clone()
    prep = fk.qk_norm_rope_sage(x, H, d, table, qw, kw, 1e-6, balance=True)
    prep_f = fk.qk_norm_rope_sage(x_f, H, d, table, qb, kb, 1e-6)
    assert torch.equal(x, x_f) and torch.equal(prep["q8"], prep_f["q8"]) and torch.equal(prep["qs"], prep_f["qs"])
    ref = fk.qk_norm_rope_sage_ref(qkv, H, d, table, qw, kw, 1e-6, balance=True)
    assert torch.equal(ref["new"][:, H * d:2 * H * d].to(x.dtype), x[:, H * d:2 * H * d])
    # float32 weights (the interpreter converts bf16 subnormals inexactly, so the subnormal case is passed in float32):
    # a float32 subnormal (field 0: l = 1) and a NaN beside a normal partner in a RoPE pair (the NaN's field 255 wins
    # the pair: l = 1 on both channels, as norm_weight_exponents)
    q32, k32 = qw.float(), kw.float()
    q32[45], k32[45] = 1e-40, 1.0
    k32[3] = float("nan")                       # pairs with channel 3 + 24 = 27
    k32[27], q32[27] = 16.0, 1.0
    qb, kb, lam = balance.fold_into_norm_weights(q32, k32, 2 * table.shape[-3])
    assert lam[45] == 1 and lam[3] == lam[27] == 1, lam
    x, x_f = qkv.clone(), qkv.clone()
    prep = fk.qk_norm_rope_sage(x, H, d, table, q32, k32, 1e-6, balance=True)
    prep_f = fk.qk_norm_rope_sage(x_f, H, d, table, qb, kb, 1e-6)
    assert torch.equal(x.isnan(), x_f.isnan()) and torch.equal(x.nan_to_num(), x_f.nan_to_num())
    assert torch.equal(prep["q8"], prep_f["q8"]) and torch.equal(prep["qs"], prep_f["qs"])
    with pytest.raises(ValueError, match="balance=True needs bf16"):
        fk.qk_norm_rope_sage(qkv.to(torch.float16), H, d, table, qw, kw, 1e-6, balance=True)
    for bad in (qw.to(torch.int32), qw.bool()):              # not float: refused by name before any launch
        with pytest.raises(ValueError, match="q_weight must be a bf16"):
            fk.qk_norm_rope_sage(qkv.clone(), H, d, table, bad, kw, 1e-6, balance=True)
    small = qkv[:, :3 * H * 16].contiguous()                 # head_dim 16: refused before k is written
    before = small.clone()
    with pytest.raises(ValueError, match="head_dim 16"):
        fk.qk_norm_rope_sage(small, H, 16, table[:, :, :, :4].contiguous(), qw[:16], kw[:16], 1e-6, balance=True)
    assert torch.equal(small, before)


def test_norm_weight_balance_is_exact_powers_of_two_per_rope_pair():
    """fold_into_norm_weights / norm_weight_exponents: l a power of two per channel, equal on the two channels of each
    split-half RoPE pair, 2^trunc((E_k - E_q) / 2) from the exponent fields (within a factor 2 of sqrt(|w_k| / |w_q|)),
    1 for equal weights and where a field is 0 or 255, clamped at 2^MAX_EXP; float32 products exact; bad input refused
    by name."""
    from h3_turbo.kernels.attention import balance

    d, rot = 128, 96
    qw = torch.ones(d, dtype=torch.bfloat16)
    kw = torch.ones(d, dtype=torch.bfloat16)
    kw[5] = 24.0            # RoPE channel 5 pairs with 53
    qw[100] = 0.05          # pass-through channel
    kw[100] = 24.0
    qb, kb, lam = balance.fold_into_norm_weights(qw, kw, rot)
    assert qb.dtype == kb.dtype == lam.dtype == torch.float32
    assert torch.equal(torch.log2(lam), torch.log2(lam).round())
    assert lam[5] == lam[53] == 4.0 and lam[100] == 16.0 and (lam[[0, 1, 52, 99, 127]] == 1).all(), lam
    assert torch.equal(qb, qw.float() * lam) and torch.equal(kb, kw.float() / lam)
    assert torch.equal(qb.double() * kb.double(), qw.double() * kw.double())
    _, _, one = balance.fold_into_norm_weights(qw, qw, rot)
    assert torch.equal(one, torch.ones(d))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):         # within a factor 2 of sqrt(ratio) where no clamp applies
        a, b = torch.exp(torch.randn(2, d, generator=g, dtype=torch.float64) * 4)
        lam = balance.fold_into_norm_weights(a.float(), b.float(), 0)[2].double()
        r = (b.float().double() / a.float().double()).sqrt()
        inside = r.log2().abs() < balance.MAX_EXP - 1
        assert ((lam / r)[inside] <= 2.0).all() and ((lam / r)[inside] >= 0.5).all()
    specials = torch.tensor([0.0, 1e-40, float("inf"), float("nan"), 1e-30, 3.0])
    n = balance.norm_weight_exponents(torch.ones(6), specials, 0)
    assert n.tolist() == [0, 0, 0, 0, -balance.MAX_EXP, 0], n    # zero, fp32 subnormal, inf, NaN: l = 1; 3 / 1: 2^0
    assert balance.norm_weight_exponents(specials, torch.ones(6), 0).tolist() == [0, 0, 0, 0, balance.MAX_EXP, 0]
    nan_pair = balance.norm_weight_exponents(torch.ones(4), torch.tensor([float("nan"), 1.0, 16.0, 1.0]), 4)
    assert nan_pair.tolist() == [0, 0, 0, 0], nan_pair      # a NaN's field wins its RoPE pair: l = 1 on both
    ratio = balance.fold_into_norm_weights(torch.tensor([1.0, 1.9, 1.0]), torch.tensor([2.0, 0.95, 0.26]), 0)[2]
    assert ratio.tolist() == [1.0, 1.0, 0.5], ratio         # ratios 2 and 1/2: l = 1; 0.26: l = 1/2
    with pytest.raises(ValueError, match="one device"):
        balance.norm_weight_exponents(torch.ones(4), torch.ones(4, device="meta"), 2)
    with pytest.raises(ValueError, match="rot_dim"):
        balance.fold_into_norm_weights(qw, kw, 7)
    for bad_rot in (4.0, None, True):
        with pytest.raises(ValueError, match="rot_dim"):
            balance.fold_into_norm_weights(qw, kw, bad_rot)
    with pytest.raises(ValueError, match=r"two \[D\]"):
        balance.fold_into_norm_weights(qw, kw[:64], 0)
    with pytest.raises(ValueError, match=r"D >= 1"):
        balance.fold_into_norm_weights(qw[:0], kw[:0], 0)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        balance.fold_into_norm_weights(qw.to(torch.float8_e4m3fn), kw.to(torch.float8_e4m3fn), 0)
    with pytest.raises(ValueError, match="floating-point tensor"):
        balance.pow2_sqrt(16.0)
    for r in (0.25, 1.0, 3.0, 480.0, 1e9, 0.0, float("inf"), float("nan")):      # pow2_sqrt: from_k_amax's l
        l2 = balance.pow2_sqrt(torch.tensor([r]))[0].item()
        if 0 < r < float("inf") and r < 2 ** (2 * balance.MAX_EXP):
            assert 2 ** -0.5 <= l2 / math.sqrt(r) <= 2 ** 0.5, (r, l2)
        elif not 0 < r < float("inf"):
            assert l2 == 1.0, (r, l2)
    big = balance.pow2_sqrt(torch.tensor([1e300, 3.4e38, 1e-300], dtype=torch.float64))
    assert big.tolist() == [2.0 ** balance.MAX_EXP, 2.0 ** balance.MAX_EXP, 2.0 ** -balance.MAX_EXP]


@interp
def test_interp_int8_override_guard_runs_a_failing_layer_exact(caplog):
    """The int8_sage override with a guard: an unrotated kernel (the negative control) on a k_outlier layer is caught
    on its first call and that layer returns exact attention, while a rand layer keeps the kernel."""
    from h3_turbo.kernels.attention import exact as A
    from h3_turbo.kernels.attention import int8_sage as S8

    ov = S8.Int8SageAttention(fallback=A.cpu_exact(), devices=("cpu",), config={**HOPPER, **PLAIN},
                              guard=G.LayerGuard("int8_sage", rows=64))
    core = lambda *a, **k: (_ for _ in ()).throw(AssertionError("core called"))   # noqa: E731
    to = {"sigmas": torch.tensor([1.0])}
    q0, k0, v0 = _call("rand", seed=1)
    q1, k1, v1 = _call("k_outlier", seed=2)
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        o0 = ov(core, q0, k0, v0, 2, skip_reshape=True, skip_output_reshape=True, transformer_options=to)
        o1 = ov(core, q1, k1, v1, 2, skip_reshape=True, skip_output_reshape=True, transformer_options=to)
    assert ov.calls == 1 and set(ov.guard.exact) == {("call", 1)}
    exact1 = A.cpu_exact()(core, q1, k1, v1, 2, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(o1, exact1)
    assert accuracy(o0[0].float(), reference_attention(q0, k0, v0))["cos_min"] > 0.998
    assert any("layer call 1 fails" in r.getMessage() for r in caplog.records)


@interp
def test_interp_auto8_with_its_guard_on_every_case(caplog):
    """auto8 (CPU candidate: int8_sage interpreted) over one forward whose six attention layers see
    the six cases at one shape: its per-bucket choice is made on the first layer only; the guard checks every layer,
    and every layer's output is within the bound (a layer the choice does not serve runs exact)."""
    from h3_turbo.kernels.attention import auto8

    ov = auto8.BACKEND.cpu_override()
    core = lambda *a, **k: (_ for _ in ()).throw(AssertionError("core called"))   # noqa: E731
    to = {"sigmas": torch.tensor([1.0])}
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        for case in stress.CASES:
            q, k, v = _call(case, S=128)
            out = ov(core, q, k, v, 2, skip_reshape=True, skip_output_reshape=True, transformer_options=to)
            acc = accuracy(out[0].float(), reference_attention(q, k, v))
            assert acc["rel_l2"] <= REL_MAX and acc["cos_min"] >= COS_MIN, (case, acc)
    assert len(ov.choices) == 1 and ov.guard.checks == len(stress.CASES)
    assert {lay for lay, _ in ov.guard.verdicts} == {("call", i) for i in range(len(stress.CASES))}
    assert sum(ov.by_backend.values()) == len(stress.CASES)


@pytest.fixture
def comfy_modules():
    """ComfyUI's modules importable (first on sys.path, ``--cpu``) without booting it or building the fixture models:
    the fused block test needs only core's DiTBlock."""
    from h3_turbo import harness

    harness.comfyui_first_on_path(harness.find_comfyui())
    from comfy.cli_args import args

    args.cpu = True
    return True


@interp
@pytest.mark.comfyui
def test_interp_fused_route_guard_reruns_a_failing_block_exact(comfy_modules):
    """The fused block's int8_sage route with the override's guard: a passing block keeps the route (checked once, as
    ("block", 0)); a block that fails (a guard that cannot pass: the control) is rerun without the route and its
    attention runs exact (the override's guard sees the block index): the same bits as the block with the exact
    override."""
    import importlib.util

    from h3_turbo.kernels.attention import exact, int8_sage
    from h3_turbo.runtime import fused_block as fb

    spec = importlib.util.spec_from_file_location("_p38_fused_interp",
                                                  os.path.join(os.path.dirname(__file__), "test_fused_interp.py"))
    fi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fi)
    blk, args = fi._sage_block(comfy_modules)
    cfg = int8_sage._kernels()._cfg({"BLOCK_M": 64, "BLOCK_N": 64})
    with torch.inference_mode():    # the q / k norm weights as ComfyUI leaves them: inference tensors (no version
        for n in ("q_norm", "k_norm"):  # counter; the route's balance once read it and failed on the GPU)
            mod = getattr(blk.attn, n)
            mod.weight = torch.nn.Parameter(mod.weight.detach().clone() * 1.5, requires_grad=False)

    def run(ov):
        for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            m = blk.get_submodule(name)
            m._h3_path, m._h3_cache = "fp8", None
        patch = fb.FusedBlockPatch(blk, 0, ops=fi._CpuTritonOps(), devices=("cpu",))
        a = dict(args, img=args["img"].clone(), transformer_options={"optimized_attention_override": ov,
                                                                     "sigmas": torch.tensor([1.0])})
        with torch.inference_mode():
            return patch(a, {"original_block": None})["img"], patch

    def int8(guard):
        return int8_sage.Int8SageAttention(fallback=exact.cpu_exact(), devices=("cpu",), config=cfg, guard=guard)

    ok = int8(G.LayerGuard("t", rows=32))                      # the real bounds: this block passes
    out_ok, p_ok = run(ok)
    assert p_ok.routes.get("sage") == 1 and ok.calls == 1 and list(ok.guard.verdicts) == \
        [(("block", 0), ("cpu", torch.bfloat16, 2, 64, 256, 256))] and not ok.guard.exact
    bad = int8(G.LayerGuard("t", rows=32, cos_min=2.0))        # cannot pass
    ref, _ = run(exact.cpu_exact())
    out_bad, p_bad = run(bad)
    assert "sage" not in p_bad.routes and bad.calls == 0 and set(bad.guard.exact) == {("block", 0)}
    assert torch.equal(out_bad, ref) and bad.guard.checks == 1
    assert 0 < float((out_ok.double() - ref.double()).norm() / ref.double().norm()) < 0.05


# ------------------------------------------------------------------ runner

@pytest.mark.skipif(INTERP, reason="already interpreted")
def test_interpreted_in_subprocess():
    """Runs this file's ``test_interp_*`` tests in a fresh interpreter with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from interp_runner import run_interp_tests

    from h3_turbo import harness

    try:                 # the fused-block test needs ComfyUI (skipped loudly by conftest where it is absent)
        harness.find_comfyui()
        n = 16
    except harness.ComfyUINotFound:
        n = 15
    run_interp_tests(__file__, n, timeout=900, allow_skips=n == 15)
