"""Issue 9: the 8-bit attention kernels (kernels/attention/int8_kernels.py) and the int8_sage override
(kernels/attention/int8_sage.py) on the CPU.

The Triton kernels run under TRITON_INTERPRET=1, which must be set before triton is first imported:
``test_interpreted_kernels_in_subprocess`` re-runs this file's ``test_interp_*`` tests in a fresh
interpreter with it. The torch-only reference and the override's fallback path run in-process.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import tempfile

import pytest
import torch

INTERP = os.environ.get("TRITON_INTERPRET") == "1"

from h3_turbo import state  # noqa: E402
from h3_turbo.kernels import attention as R  # noqa: E402
from h3_turbo.kernels.attention import exact as A  # noqa: E402
from h3_turbo.kernels.attention import int8_kernels as Q  # noqa: E402
from h3_turbo.kernels.attention import int8_sage as S  # noqa: E402
from h3_turbo.kernels.attention.reference import accuracy, reference_attention, rel_l2  # noqa: E402

interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (run by test_interpreted_kernels_in_subprocess)")


def h3_like(S, H=2, D=128, seed=0, v_offset=0.0):
    """q, k, v [1, H, S, D] bf16 as core builds them for H3: strided views of one [S, 3*H*D] buffer,
    q/k RMS-normalised per head times a gain in [1, 1.5); v cloned (plus an optional channel offset)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, 3 * H * D, generator=g).to(torch.bfloat16)
    q, k, v = qkv.split(H * D, dim=-1)
    for t in (q, k):
        tv = t.view(S, H, D)
        gain = 1.0 + 0.5 * torch.rand(H, D, generator=g)
        tv.copy_((tv.float() * torch.rsqrt(tv.float().pow(2).mean(-1, keepdim=True) + 1e-6) * gain).to(tv.dtype))
    vv = (v.view(S, H, D).float() + v_offset).to(torch.bfloat16)
    return qkv, tuple(t.transpose(0, 1).unsqueeze(0) for t in (q.view(S, H, D), k.view(S, H, D), vv))


# ------------------------------------------------------------------ torch-only (in process)

def test_reference_quantization_rules():
    _, (q, k, v) = h3_like(70, H=1, seed=1)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32}
    z = Q.quantize_reference(q, k, v, cfg)
    # int8 codes are integers in [-127, 127]; each block's largest |value| maps to +-127
    for key, scale, blk in (("q8", "qs", 32), ("k8", "ks", 32)):
        x = z[key]
        assert torch.equal(x, x.round()) and x.abs().max() <= 127
        for b in range(z[scale].shape[1]):
            assert x[:, b * blk:(b + 1) * blk].abs().max() == 127
    # K is smoothed and rotated: dequantized k8 ~ (k - mean_tokens(k)) H_D (unnormalised Hadamard), to half a step
    kd = z["k8"] * z["ks"].repeat_interleave(32, 1)[:, :70, None]
    km = k.float()[0].mean(1)
    h = Q.hadamard(128).float() * 128 ** 0.5
    assert (kd - (k.float()[0] - km[:, None]) @ h).abs().max() <= z["ks"].max() / 2 + 1e-4
    # unrotated (ROTATE off): k - mean_tokens(k) itself
    z0 = Q.quantize_reference(q, k, v, {**cfg, "ROTATE": False})
    kd0 = z0["k8"] * z0["ks"].repeat_interleave(32, 1)[:, :70, None]
    assert (kd0 - (k.float()[0] - km[:, None])).abs().max() <= z0["ks"].max() / 2 + 1e-6
    # V: e4m3 values within +-448, max |v - mean| per channel maps to 448
    assert z["v8"].abs().max() == 448.0
    assert torch.equal(z["v8"], z["v8"].to(torch.float8_e4m3fn).float())
    vd = z["v8"] * z["vs"][:, None] + z["vm"][:, None]
    assert rel_l2(vd, v.float()[0]) < 0.04


def test_reference_model_is_attention():
    """The float64 model of the quantized math is softmax attention up to 8-bit error, and with
    V_MEAN the result does not depend on a constant channel offset of v beyond that error."""
    _, (q, k, v) = h3_like(300, H=2, seed=2)
    ref = reference_attention(q, k, v, dtype=torch.float64)
    m = Q.sage_reference(q, k, v, config={"BLOCK_M": 64, "BLOCK_N": 64})
    acc = accuracy(m, ref)
    assert acc["rel_l2"] < 0.06 and acc["cos_min"] > 0.998, acc
    mb = Q.sage_reference(q, k, v, config={"BLOCK_M": 64, "BLOCK_N": 64, "PV_FP8": False})
    assert accuracy(mb, ref)["rel_l2"] < 0.04
    # a large channel offset of v: mean subtraction keeps the fp8 error relative to v - mean
    _, (q, k, v2) = h3_like(300, H=2, seed=2, v_offset=20.0)
    ref2 = reference_attention(q, k, v2, dtype=torch.float64)
    m2 = Q.sage_reference(q, k, v2, config={"BLOCK_M": 64, "BLOCK_N": 64, "V_MEAN": True})
    assert (m2 - ref2).norm() / (ref2 - 20.0).norm() < 0.08
    m3 = Q.sage_reference(q, k, v2, config={"BLOCK_M": 64, "BLOCK_N": 64, "V_MEAN": False})
    assert (m3 - ref2).norm() > 3 * (m2 - ref2).norm()   # the offset costs accuracy without V_MEAN


class _Core:
    """Stands in for core's attention function: records calls, computes plain softmax attention."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kw):
        self.calls += 1
        if not skip_reshape:
            b, _, hd = q.shape
            q, k, v = (t.view(b, -1, heads, hd // heads).transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)
        return o if skip_output_reshape else o.transpose(1, 2).reshape(o.shape[0], -1, o.shape[1] * o.shape[3])


def _fallback_exact():
    return A.ExactAttention(chooser=A.BackendChooser(lambda fn: (fn(), 1.0)[1]), candidates=("MATH",),
                            devices=("cpu",))


@pytest.mark.parametrize("case", ["device", "mask", "dtype", "head_dim", "kernel_error", "heads", "empty"])
def test_fallback_logs_once_and_returns_exact(case, caplog):
    if case == "kernel_error" and (INTERP or Q.triton is None):
        pytest.skip("needs compiled (not interpreted) Triton: a launch on CPU tensors raises")
    state.LOGGED.clear()
    ov = S.Int8SageAttention(fallback=_fallback_exact())            # devices=("cuda",): CPU falls back
    _, (q, k, v) = h3_like(40, H=2, seed=3)
    kw = {"skip_reshape": True}
    mask = None
    if case != "device":
        ov.devices = ("cpu",)
    if case == "mask":
        mask = torch.zeros(40, 40)
    elif case == "dtype":
        q, k, v = (t.float() for t in (q, k, v))
    elif case == "head_dim":
        q, k, v = (t[..., :32] for t in (q, k, v))
    elif case == "empty":
        q = q[:, :, :0]
    core = _Core()
    if case in ("heads", "empty"):   # declined before any kernel: handed to the fallback as given
        seen = []
        ov.fallback = lambda func, *a, **kw2: seen.append((func, a[4:5], kw2)) or "fallback"
        with caplog.at_level(logging.INFO, logger="h3_turbo"):
            for _ in range(2):
                assert ov(core, q, k, v, 0 if case == "heads" else 2, None, **kw) == "fallback"
        assert len(seen) == 2 and seen[0][0] is core and seen[0][2] == kw
        msgs = [r.getMessage() for r in caplog.records if "int8_sage" in r.getMessage()]
        assert len(msgs) == 1 and ("heads=0 (expected >= 1)" if case == "heads" else "empty sequence") in msgs[0], msgs
        assert ov.fallbacks == 2 and ov.calls == 0
        return
    want = A.sdpa_with("MATH", q, k, v) if mask is None else None
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        out1 = ov(core, q, k, v, 2, mask, **kw)
        out2 = ov(core, q, k, v, 2, mask, **kw)
    msgs = [r.getMessage() for r in caplog.records if "int8_sage" in r.getMessage()]
    assert len(msgs) == 1, msgs                                         # logged once, with the reason
    reason = {"device": "device type 'cpu'", "mask": "attention mask given", "dtype": "dtype torch.float32",
              "head_dim": "head dim 32", "kernel_error": "8-bit kernel failed"}[case]
    assert (reason if Q.triton is not None else "triton unavailable") in msgs[0]
    assert ov.fallbacks == 2 and ov.calls == 0
    if mask is None:   # exact's result (SDPA MATH here), in core's [B, L, heads*D] layout
        assert torch.equal(out1, want.transpose(1, 2).reshape(1, 40, 2 * want.shape[-1]))
        assert core.calls == 0
    else:              # exact hands masked calls on to core's function
        assert core.calls == 2 and out1.shape == (1, 40, 256)
    assert torch.equal(out1, out2)


def test_backend_names_unchanged_when_not_shipped():
    # int8_sage is only offered by the node once it meets issue 9's targets (see the module/report)
    assert R.resolve("auto") == "exact"


def test_tuned_config_per_device(monkeypatch):
    """No config given: DEFAULT_CONFIG off Hopper (CPU, Ada, Blackwell), the measured HOPPER_CONFIGS row on
    compute capability 9.x; bad combinations raise."""
    assert Q.tuned_config("cpu", 19584) == Q.DEFAULT_CONFIG and Q.tuned_config(None, 10) == Q.DEFAULT_CONFIG
    caps = {"cap": (8, 9), "asked": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: caps["asked"].append(d) or caps["cap"])
    assert Q.tuned_config("cuda:0", 19584) == Q.DEFAULT_CONFIG            # Ada: FP8 but no TMA
    caps["cap"] = (10, 0)
    assert Q.tuned_config("cuda", 19584) == Q.DEFAULT_CONFIG              # not measured there
    caps["cap"] = (9, 0)
    caps["asked"].clear()
    Q.tuned_config("cuda:1", 100)
    assert caps["asked"] == [torch.device("cuda:1")]                      # the tensor's own GPU is asked
    for lk in (1, 19584, 37632, 109000):
        c = Q.tuned_config("cuda", lk)
        assert c == {**Q.DEFAULT_CONFIG, "TMA": True, "QPRE": True, "ROWSUM_MMA": True, "num_stages": 2,
                     "MAXNREG": 168, "Q_ROW": True}, c
        assert c["ROTATE"]                                                # Hadamard-rotated Q/K (issue 38)
    assert S.Int8SageAttention(fallback=_fallback_exact()).config is None   # tuned per call
    assert S.Int8SageAttention(fallback=_fallback_exact(), config={"BLOCK_N": 64}).config["BLOCK_N"] == 64
    with pytest.raises(ValueError, match="ROWSUM_MMA needs PV_FP8"):
        Q._cfg({"ROWSUM_MMA": True, "PV_FP8": False})
    with pytest.raises(ValueError, match="Q_ROW needs QPRE"):
        Q._cfg({"Q_ROW": True})
    with pytest.raises(ValueError, match="unknown config keys"):
        Q._cfg({"ROWSUM": True})


def test_bad_inputs_named_before_any_kernel():
    """sage_attention / _cfg refuse what they cannot run with a ValueError naming it (no kernel is launched)."""
    _, (q, k, v) = h3_like(40, H=2, seed=3)
    cases = [
        (lambda: Q._cfg({"BLOCK_M": 48}), "BLOCK_M=48; expected a power of two >= 16"),
        (lambda: Q._cfg({"BLOCK_N": 0}), "BLOCK_N=0"),
        (lambda: Q._cfg({"BLOCK_M": "64"}), "BLOCK_M='64'"),
        (lambda: Q._cfg({"num_warps": 3}), "num_warps=3; expected 4 or 8"),
        (lambda: Q._cfg({"num_stages": 0}), "num_stages=0"),
        (lambda: Q._cfg({"MAXNREG": 300}), "MAXNREG=300"),
        (lambda: Q.sage_attention([1], k, v), "must be tensors, got list"),
        (lambda: Q.sage_attention(q, k.to("meta"), v), "must be on one device"),
        (lambda: Q.sage_attention(q[:, :, :0], k, v), "empty sequence: q (1, 2, 0, 128)"),
        (lambda: Q.sage_attention(q, k, v, scale=float("nan")), "scale nan is not finite"),
        (lambda: Q.sage_attention(q, k, v, out=torch.empty(1, 2, 40, 128, dtype=torch.bfloat16, device="meta")),
         "on cpu, got (1, 2, 40, 128) torch.bfloat16 on meta"),
        (lambda: Q.sage_attention(q, k, v, out=torch.empty(1, 2, 40, 64, dtype=torch.bfloat16)),
         "got (1, 2, 40, 64)"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError) as e:
            fn()
        assert msg in str(e.value), (msg, str(e.value))


def test_without_triton_kernels_raise_no_capable_path_and_override_runs_exact(monkeypatch, caplog):
    """No Triton: the kernel entry points raise NoCapablePathError (still a RuntimeError, same message), the
    override hands every call to exact with the reason logged once."""
    from h3_turbo.errors import NoCapablePathError

    monkeypatch.setattr(Q, "triton", None)
    monkeypatch.setattr(Q, "_TRITON_ERROR", "ImportError: no triton here")
    _, (q, k, v) = h3_like(40, H=2, seed=3)
    for fn in (lambda: Q.sage_attention(q, k, v), lambda: Q.quantize_q(q, 0.1, lam=None)):
        with pytest.raises(NoCapablePathError, match=r"^attention_int8: triton unavailable \(ImportError: no triton here\)$") as e:
            fn()
        assert isinstance(e.value, RuntimeError)
    with pytest.raises(TypeError, match="lam"):      # lam is required: balanced k8 cannot meet unbalanced q by omission
        Q.quantize_q(q, 0.1)
    state.LOGGED.clear()
    ov = S.Int8SageAttention(fallback=_fallback_exact(), devices=("cpu",))
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        out = [ov(_Core(), q, k, v, 2, None, skip_reshape=True) for _ in range(2)]
    assert torch.equal(out[0], out[1]) and ov.fallbacks == 2 and ov.calls == 0
    msgs = [r.getMessage() for r in caplog.records if "int8_sage" in r.getMessage()]
    assert msgs == ["H3 Turbo attention 'int8_sage': triton unavailable (ImportError: no triton here) -> exact attention"]


def test_ones_tile_cached_in_a_state_store():
    t = Q._ones_e4m3("cpu", 64)
    assert t.shape == (16, 64) and t.dtype == torch.float8_e4m3fn and bool((t.float() == 1).all())
    assert Q._ones_e4m3("cpu", 64) is t and state.store("attention_fp8_ones").data[("cpu", 64)] is t
    assert Q._ones_e4m3("cpu", 32) is not t
    state.ATTENTION_FP8_ONES.clear()
    assert state.ATTENTION_FP8_ONES.snapshot() == {"entries": 0} and Q._ones_e4m3("cpu", 64) is not t


def test_reference_rowsum_of_rounded_p():
    """ROWSUM_MMA's model normalises by the sum of the e4m3-rounded P: a different, equally accurate
    function (rel. L2 to float32 attention within 2 % of the unrounded-sum model's)."""
    _, (q, k, v) = h3_like(300, H=2, seed=5)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64}
    m0 = Q.sage_reference(q, k, v, config=cfg)
    m1 = Q.sage_reference(q, k, v, config={**cfg, "ROWSUM_MMA": True})
    ref = reference_attention(q, k, v).double()
    e0, e1 = rel_l2(m0, ref), rel_l2(m1, ref)
    assert 0 < rel_l2(m1, m0) < 0.01 and e1 < e0 * 1.02 and e1 < 0.06, (e0, e1)


# ------------------------------------------------------------------ Triton kernels (interpreter)

@interp
@pytest.mark.parametrize("S,cfg", [
    (200, {"BLOCK_M": 64, "BLOCK_N": 64}),                      # ragged: 200 = 3*64 + 8
    (200, {"BLOCK_M": 64, "BLOCK_N": 64, "MAGIC": False}),
    (130, {"BLOCK_M": 32, "BLOCK_N": 64, "PV_FP8": False}),     # bf16 P V
    (128, {"BLOCK_M": 64, "BLOCK_N": 32, "V_MEAN": True}),      # exact multiple of both blocks
    (150, {"BLOCK_M": 64, "BLOCK_N": 64, "TMA": True}),         # K/V through tensor descriptors
    (200, {"BLOCK_M": 64, "BLOCK_N": 64, "QPRE": True}),        # Q quantized by its pre-kernel
    (150, {"BLOCK_M": 64, "BLOCK_N": 64, "QPRE": True, "ROWSUM_MMA": True, "TMA": True}),  # row sum on tensor cores
    (200, {"BLOCK_M": 64, "BLOCK_N": 64, "QPRE": True, "Q_ROW": True}),                     # one Q scale per row
    (150, {"BLOCK_M": 64, "BLOCK_N": 64, "QPRE": True, "ROWSUM_MMA": True, "TMA": True, "Q_ROW": True}),
])
def test_interp_kernel_matches_model_and_attention(S, cfg):
    _, (q, k, v) = h3_like(S, H=2, seed=S)
    assert not q.is_contiguous() and q.stride(2) == 3 * 2 * 128     # core's strided views
    # pre-kernel: bit-identical to the torch quantization, zero padding past S
    kv = Q.quantize_kv(k, v, cfg)
    z = Q.quantize_reference(q, k, v, cfg)
    assert torch.equal(kv["k8"][:, :S].float(), z["k8"]) and torch.equal(kv["ks"], z["ks"])
    assert not kv["k8"][:, S:].any()
    if Q._cfg(cfg)["PV_FP8"]:
        assert torch.equal(kv["vq"][:, :, :S].float().transpose(1, 2), z["v8"])
        assert not kv["vq"][:, :, S:].float().any()
    else:
        assert torch.equal(kv["vq"][:, :S].float(), z["v8"])
    if Q._cfg(cfg)["QPRE"]:      # Q pre-kernel: the same codes and score scales as the torch model
        q8, qs, npad = Q.quantize_q(q, 128 ** -0.5 * Q.LOG2E, cfg, lam=kv["lam"])
        assert npad % 64 == 0 and npad >= S and not q8[:, S:].any()
        # the same codes as the torch model (both divide 127 / amax with IEEE rounding: div_rn, tensor / tensor)
        assert torch.equal(q8[:, :S].float(), z["q8"])
        q_row = Q._cfg(cfg)["Q_ROW"]
        if q_row:    # raw per-row scales (the attention kernel applies qk_scale)
            assert qs.shape == (2, npad) and torch.equal(qs[:, :S], z["qs"]) and not qs[:, S:].any()
        else:
            assert torch.equal(qs, z["qs"] * (128 ** -0.5 * Q.LOG2E))
    # attention, into a NaN-poisoned output: every element written
    out = torch.full((1, 2, S, 128), float("nan"), dtype=torch.bfloat16)
    got = Q.sage_attention(q, k, v, config=cfg, out=out)
    assert got is out and torch.isfinite(out).all()
    model = Q.sage_reference(q, k, v, config=cfg, quant=z).view(1, 2, S, 128)
    # same quantized math: only fp32-vs-fp64 arithmetic and the bf16 output rounding differ
    # (MAGIC's one-FMA score moves P by ~1e-4 relative, so a few P's round to the other e4m3 neighbour)
    e_model = rel_l2(out.double(), model)
    e_round = rel_l2(out.double(), model.to(torch.bfloat16).double())
    if Q._cfg(cfg)["ROWSUM_MMA"]:   # it is the rounded-P row sum that ran: the plain-sum model is clearly farther
        plain = Q.sage_reference(q, k, v, config={**cfg, "ROWSUM_MMA": False}, quant=z).view(1, 2, S, 128)
        assert e_model < 0.7 * rel_l2(out.double(), plain), (e_model, rel_l2(out.double(), plain))
    assert e_model < 4e-3, e_model
    assert e_round < (3e-3 if Q._cfg(cfg)["MAGIC"] else 1e-3), e_round
    # against true float32 attention: 8-bit error (fp8 P V ~4%, bf16 P V ~3% on H3-like inputs)
    acc = accuracy(out[0].float(), reference_attention(q, k, v))
    bound = 0.06 if Q._cfg(cfg)["PV_FP8"] else 0.04
    assert acc["rel_l2"] < bound and acc["cos_min"] > 0.998, acc
    # [B, L, H*D] output layout (core's skip_output_reshape=False) holds the same numbers
    o2 = Q.sage_attention(q, k, v, config=cfg, out_layout="blhd")
    assert o2.shape == (1, S, 256) and torch.equal(o2.view(1, S, 2, 128).transpose(1, 2), out)


@interp
@pytest.mark.parametrize("hopper", [False, True])
def test_interp_cross_lengths_batch_scale_fp16_d64(hopper):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 50, 64, generator=g).half()
    k = torch.randn(2, 3, 90, 64, generator=g).half()
    v = torch.randn(2, 3, 90, 64, generator=g).half()
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32}
    if hopper:   # the tuned Hopper row (TMA, QPRE, ROWSUM_MMA, 2 stages, MAXNREG) at small blocks
        cfg = {**Q.HOPPER_CONFIGS[0][1], **cfg}
    out = Q.sage_attention(q, k, v, scale=0.2, config=cfg)
    assert out.dtype == torch.float16 and out.shape == (2, 3, 50, 64)
    model = Q.sage_reference(q, k, v, scale=0.2, config=cfg).view(2, 3, 50, 64)
    assert rel_l2(out.double(), model) < 4e-3
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.2, -1) @ v.double()
    assert rel_l2(out.double(), ref) < 0.06


@interp
def test_interp_negative_scale():
    """softmax(q k^T s) with s < 0 (the kernel runs it as (-q, |s|): its row max and MAGIC offset assume s >= 0)."""
    _, (q, k, v) = h3_like(130, H=2, seed=9)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64}
    for s in (-0.05, -(128 ** -0.5)):
        out = Q.sage_attention(q, k, v, scale=s, config=cfg)
        ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * s, -1) @ v.double()
        model = Q.sage_reference(-q, k, v, scale=-s, config=cfg).view(1, 2, 130, 128)
        assert rel_l2(out.double(), model) < 4e-3 and rel_l2(out.double(), ref) < 0.06


@interp
def test_interp_override_runs_kernel_in_core_layouts():
    _, (q, k, v) = h3_like(100, H=2, seed=11)
    ov = S.Int8SageAttention(fallback=_fallback_exact(), devices=("cpu",), config={"BLOCK_M": 64, "BLOCK_N": 64})
    core = _Core()
    out = ov(core, q, k, v, 2, None, skip_reshape=True)                       # H3's call
    assert out.shape == (1, 100, 256) and ov.calls == 1 and ov.fallbacks == 0 and core.calls == 0
    want = Q.sage_attention(q, k, v, config={"BLOCK_M": 64, "BLOCK_N": 64})
    assert torch.equal(out.view(1, 100, 2, 128).transpose(1, 2), want)
    out4 = ov(core, q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(out4, want)
    q3, k3, v3 = (t.transpose(1, 2).reshape(1, 100, 256) for t in (q, k, v))    # [B, L, heads*D] inputs
    assert torch.equal(ov(core, q3, k3, v3, 2), out)
    ref = reference_attention(q, k, v)
    assert accuracy(out.view(1, 100, 2, 128).transpose(1, 2)[0].float(), ref)["cos_min"] > 0.998


@interp
@pytest.mark.parametrize("S,d", [(150, 128), (77, 64)])
def test_interp_prequantized_is_the_q_row_kernel(S, d, monkeypatch):
    """``sage_attention_prequantized`` on ``fused.qk_norm_rope_sage``'s outputs = ``sage_attention`` with ``Q_ROW``
    on the rotated q / k and v, bit for bit (bf16 output); its e4m3 output is that output quantized with one scale
    max|v| / 448 (every e4m3 code within one step of the float64 quantization of the bf16 output, except where the
    bf16 rounding moved a value across a code boundary)."""
    from h3_turbo.kernels import fused as fk

    g = torch.Generator().manual_seed(S)
    H, r2 = 2, d * 3 // 8
    qkv = (torch.randn(S, 3 * H * d, generator=g) * 2.0).to(torch.bfloat16)
    ang = torch.randn(S, r2, generator=g) * 3.0
    c, sn = torch.cos(ang), torch.sin(ang)
    table = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, S, 1, r2, 2, 2)
    qw, kw = ((1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16) for _ in range(2))
    rot = qkv.clone()
    fk.qk_norm_rope(rot, H, d, table, qw, kw, 1e-6)
    x = qkv.clone()
    prep_pass = fk.qk_norm_rope_sage(x.clone(), H, d, table, qw, kw, 1e-6)     # default: partial sums of one pass
    prep = fk.qk_norm_rope_sage(x, H, d, table, qw, kw, 1e-6)
    prep["ksum"], prep["vamax"] = fk.kv_stats_ref(x, H, d)                     # one torch sum: kv_stats's bits
    inner = H * d
    view = lambda t: t.view(S, H, d).transpose(0, 1).unsqueeze(0)    # noqa: E731
    k4, v4 = view(x[:, inner:2 * inner]), view(x[:, 2 * inner:])
    assert torch.equal(x[:, inner:], rot[:, inner:])                  # k rotated in place as qk_norm_rope, v as given
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64}
    got = Q.sage_attention_prequantized(prep["q8"], prep["qs"], k4, v4, prep["ksum"], prep["vamax"], config=cfg)
    want = Q.sage_attention(view(rot[:, :inner]), k4, v4, config={**cfg, "QPRE": True, "Q_ROW": True},
                            out_layout="blhd")
    assert got.shape == (1, S, inner) and torch.equal(got, want)
    # from the partial sums: the same function (k's mean summed in another order may flip an int8 K code)
    got_pass = Q.sage_attention_prequantized(prep_pass["q8"], prep_pass["qs"], k4, v4, prep_pass["ksum"],
                                             prep_pass["vamax"], config=cfg)
    assert prep_pass["ksum"].shape[0] > 1 or S < 64
    assert rel_l2(got_pass.double(), got.double()) < 2e-3
    acc = accuracy(got.view(S, H, d).transpose(0, 1).float(), reference_attention(view(rot[:, :inner]), k4, v4))
    assert acc["rel_l2"] < 0.06 and acc["cos_min"] > 0.998, acc
    o8, sx = Q.sage_attention_prequantized(prep["q8"], prep["qs"], k4, v4, prep["ksum"], prep["vamax"], config=cfg,
                                           out_fp8=True)
    assert o8.dtype == torch.float8_e4m3fn and o8.shape == (S, inner) and sx.shape == (S, 1)
    assert torch.equal(sx, (prep["vamax"].amax() / 448.0).expand(S, 1))
    exp = (got[0].double() / sx.double()).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    steps = (o8.view(torch.uint8).int() - exp.view(torch.uint8).int()).abs()
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.05
    deq = o8.double() * sx.double()
    assert 1e-3 < rel_l2(deq, got[0].double()) < 0.035
    for bad, match in (({"q8": prep["q8"].float()}, "q8"), ({"qs": prep["qs"].t().contiguous()}, "qs"),
                       ({"ksum": prep["ksum"][..., :1].contiguous()}, "ksum"), ({"vamax": prep["vamax"][0]}, "vamax"),
                       ({"scale": -0.1}, "scale")):
        a = dict(q8=prep["q8"], qs=prep["qs"], k=k4, v=v4, ksum=prep["ksum"], vamax=prep["vamax"], config=cfg)
        a.update(bad)
        with pytest.raises(ValueError, match=match):
            Q.sage_attention_prequantized(**a)


@interp
@pytest.mark.parametrize("L,H,d,parts", [(150, 2, 128, 16), (77, 3, 64, 2), (5, 1, 64, 16)])
def test_interp_kv_partial_stats_feed_quantize_kv(L, H, d, parts):
    """``kv_partial_stats`` on the strided k / v columns of a qkv buffer: the partial sums add up to the float64
    column sums of k (within fp32 summation error), their maxima are max |v| exactly; ``quantize_kv(parts=...)``
    (the reduction inside the pre-kernel) = ``quantize_kv(stats=...)`` from the same partials summed in the kernel's
    order, bit for bit, plus ``hmax`` = max |v| per head; bad partials are refused naming them."""
    g = torch.Generator().manual_seed(L + d)
    inner = H * d
    qkv = (torch.randn(L, 3 * inner, generator=g) * 2.0).to(torch.bfloat16)
    k, v = qkv[:, inner:2 * inner].view(L, H, d), qkv[:, 2 * inner:].view(L, H, d)
    ks, va = Q.kv_partial_stats(k, v, parts=parts)
    r = ks.shape[0]
    assert ks.shape == va.shape == (r, H, d) and 1 <= r <= parts and (r > 1 or L <= 32 or parts == 1)
    kd = k.double()
    assert bool(((ks.double().sum(0) - kd.sum(0)).abs() <= 1e-6 * kd.abs().sum(0) + 1e-30).all())
    assert torch.equal(va.amax(0), v.float().abs().amax(0))
    k4, v4 = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BALANCE": False}     # the parts path (fused route) applies no balance
    a = Q.quantize_kv(k4, v4, cfg, parts=(ks, va))
    assert a["lam"] is None and Q.quantize_kv(k4, v4, {**cfg, "BALANCE": True}, parts=(ks, va))["lam"] is None
    total = torch.zeros(H, d)
    for i in range(r):
        total = total + ks[i]
    b = Q.quantize_kv(k4, v4, cfg, stats=Q.stats_from_sums(total, va.amax(0), L))
    for key in ("k8", "ks", "km", "vs", "vinv"):
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a["vq"].view(torch.uint8), b["vq"].view(torch.uint8)) and a["vm"] is None
    assert torch.equal(a["hmax"], va.amax(0).amax(-1))
    # a batch of two sequences: partials [R, B*H, D] in (b, h) order
    k2, v2 = torch.cat([k4, k4.flip(2) * 0.5]), torch.cat([v4, -v4.flip(2) * 2.0])
    ps = [Q.kv_partial_stats(k2[i].transpose(0, 1), v2[i].transpose(0, 1), parts=parts) for i in range(2)]
    kp2, vp2 = torch.cat([p[0] for p in ps], 1), torch.cat([p[1] for p in ps], 1)
    a2 = Q.quantize_kv(k2, v2, cfg, parts=(kp2, vp2))
    tot2 = torch.zeros(2 * H, d)
    for i in range(r):
        tot2 = tot2 + kp2[i]
    b2 = Q.quantize_kv(k2, v2, cfg, stats=Q.stats_from_sums(tot2, vp2.amax(0), L))
    for key in ("k8", "ks", "km", "vs", "vinv"):
        assert torch.equal(a2[key], b2[key]), key
    assert torch.equal(a2["vq"].view(torch.uint8), b2["vq"].view(torch.uint8))
    assert torch.equal(a2["hmax"], vp2.amax(0).amax(-1)) and torch.equal(a2["hmax"][H:], 2.0 * a["hmax"])
    with pytest.raises(ValueError, match="parts"):
        Q.quantize_kv(k4, v4, cfg, parts=(ks[..., :1].contiguous(), va[..., :1].contiguous()))
    with pytest.raises(ValueError, match="kv_partial_stats"):
        Q.kv_partial_stats(k.reshape(L, inner), v.reshape(L, inner))


GLUON_CFG = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "GLUON": True, "TMA": True, "QPRE": True, "Q_ROW": True,
             "ROWSUM_MMA": True}


def _v_perm32(n: int) -> torch.Tensor:
    from h3_turbo.kernels.attention.int8_gluon import v_key_columns

    return v_key_columns(n)


def test_gluon_key_order_is_a_permutation_within_each_32():
    """The Gluon kernel's V key order moves keys only within their 32, and puts the accumulator columns that thread t
    of a quad holds ({2t, 2t+1, 8+2t, 9+2t} and the same + 16) at the A-operand positions it holds (4t .. 4t+3, + 16)."""
    p = _v_perm32(128)
    assert sorted(p.tolist()) == list(range(128))
    assert bool(((p // 32) == (torch.arange(128) // 32)).all())
    # thread t of a quad holds accumulator columns {2t, 2t+1, 8+2t, 9+2t}: A-operand positions 4t .. 4t+3
    for t in range(4):
        assert p[[2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t]].tolist() == [4 * t + j for j in range(4)]
        assert p[[16 + 2 * t, 17 + 2 * t, 24 + 2 * t, 25 + 2 * t]].tolist() == [16 + 4 * t + j for j in range(4)]


@interp
def test_interp_quantize_kv_for_the_gluon_kernel_permutes_only_v_keys():
    """``quantize_kv`` with config GLUON: the same K codes and scales, and V's e4m3 [D, L_pad] with each 32 keys in
    the Gluon kernel's order (``_v_perm32``), bit for bit the plain V with its columns moved; ``v_perm32`` says so."""
    g = torch.Generator().manual_seed(9)
    L, H, d = 150, 2, 64
    k = (torch.randn(1, H, L, d, generator=g) * 2).to(torch.bfloat16)
    v = (torch.randn(1, H, L, d, generator=g) * 3).to(torch.bfloat16)
    ks, va = Q.kv_partial_stats(k[0].transpose(0, 1), v[0].transpose(0, 1))
    plain = dict(GLUON_CFG, GLUON=False)
    a = Q.quantize_kv(k, v, plain, parts=(ks, va))
    b = Q.quantize_kv(k, v, GLUON_CFG, parts=(ks, va))
    assert a["v_perm32"] is False and b["v_perm32"] is True and a["n_kpad"] == b["n_kpad"] == 256
    for key in ("k8", "ks", "km", "vs", "vinv", "hmax"):
        assert torch.equal(a[key], b[key]), key
    moved = torch.empty_like(a["vq"].view(torch.uint8))
    moved[..., _v_perm32(256)] = a["vq"].view(torch.uint8)
    assert not torch.equal(b["vq"].view(torch.uint8), a["vq"].view(torch.uint8))
    assert torch.equal(b["vq"].view(torch.uint8), moved)


def test_gluon_config_is_refused_where_it_does_not_apply():
    """GLUON implements one configuration (prequantized Q per row, TMA, MAGIC, e4m3 P V, row sums on the tensor cores,
    BLOCK_M = 16 * num_warps): other combinations, ``sage_attention`` and a device without it are refused by name."""
    from h3_turbo.errors import NoCapablePathError
    from h3_turbo.kernels.attention import int8_gluon

    Q._cfg(GLUON_CFG)
    Q._cfg(dict(GLUON_CFG, BLOCK_M=128, num_stages=3))        # the warp-specialized form
    for bad in ({"ROWSUM_MMA": False}, {"num_warps": 8}, {"BLOCK_M": 32}, {"BLOCK_M": 256}, {"BLOCK_N": 64},
                {"Q_ROW": False}, {"MAXNREG": 168}):
        with pytest.raises(ValueError, match=re.escape(f"got {bad}")):
            Q._cfg(dict(GLUON_CFG, **bad))
    for st in (1, 5):       # the warp-specialized form keeps 2..4 K/V slots in shared memory
        with pytest.raises(ValueError, match=re.escape(f"got {{'num_stages': {st}}}")):
            Q._cfg(dict(GLUON_CFG, BLOCK_M=128, num_stages=st))
    with pytest.raises(ValueError, match="not an override configuration"):
        from h3_turbo.kernels.attention import int8_sage

        int8_sage.Int8SageAttention(config=GLUON_CFG)
    q = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="GLUON is for sage_attention_prequantized"):
        Q.sage_attention(q, q, q, config=GLUON_CFG)
    assert "not CUDA" in int8_gluon.available("cpu") or "not importable" in int8_gluon.available("cpu")
    L, H = 16, 2
    for d, err, match in ((128, NoCapablePathError, "config GLUON on cpu"), (64, ValueError, "head dim 128, got 64")):
        k = torch.zeros(1, H, L, d, dtype=torch.bfloat16)
        with pytest.raises(err, match=match):
            Q.sage_attention_prequantized(torch.zeros(L, H, d, dtype=torch.int8), torch.zeros(L, H), k, k,
                                          torch.zeros(1, H, d), torch.zeros(1, H, d), config=GLUON_CFG)
    # a V quantized for the Gluon kernel never reaches the Triton kernel (its launch refuses it before compiling)
    kv = {"v_perm32": True, "k8": None, "vq": None, "n_kpad": 128}
    with pytest.raises(ValueError, match="quantized for the Gluon kernel"):
        Q._launch(q, q, q, (0, 0, 0, 0, 0), 16, kv, q, "bhld", None, 1, 2, 16, 16, 64, 0.1, Q._cfg(None))


@interp
def test_interp_prequantized_fp8_output_of_an_all_zero_v():
    """v all zero: the e4m3 output is all zero and every row scale is 1/448 (the kernel's own branch for max |v| = 0),
    not a division by zero."""
    from h3_turbo.kernels import fused as fk

    g = torch.Generator().manual_seed(5)
    S, H, d = 70, 2, 64
    qkv = (torch.randn(S, 3 * H * d, generator=g) * 2.0).to(torch.bfloat16)
    qkv[:, 2 * H * d:] = 0
    ang = torch.randn(S, 8, generator=g)
    c, sn = torch.cos(ang), torch.sin(ang)
    table = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, S, 1, 8, 2, 2)
    w = torch.ones(d, dtype=torch.bfloat16)
    prep = fk.qk_norm_rope_sage(qkv, H, d, table, w, w, 1e-6)
    view = lambda t: t.view(S, H, d).transpose(0, 1).unsqueeze(0)    # noqa: E731
    o8, sx = Q.sage_attention_prequantized(prep["q8"], prep["qs"], view(qkv[:, H * d:2 * H * d]),
                                           view(qkv[:, 2 * H * d:]), prep["ksum"], prep["vamax"],
                                           config={"BLOCK_M": 64, "BLOCK_N": 64}, out_fp8=True)
    assert not bool(o8.float().any()) and torch.equal(sx, torch.full((S, 1), 1.0 / 448.0))


# ------------------------------------------------------------------ runner

@pytest.mark.skipif(INTERP, reason="already interpreted")
def test_interpreted_kernels_in_subprocess():
    """Runs this file's ``test_interp_*`` tests in a fresh interpreter with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from interp_runner import run_interp_tests

    run_interp_tests(__file__, 20)


def _compile_gluon_for_hopper(out_fp8: bool, ws: bool = False):
    """The Gluon kernel (``ws``: its warp-specialized form, 2 K/V slots) compiled for sm_90a with this Triton (no GPU
    needed) -> (PTX, ``ptxas -v`` report)."""
    triton = pytest.importorskip("triton")
    from h3_turbo.kernels.attention import int8_gluon as G

    if G.gluon is None:
        pytest.skip(f"no Gluon in this Triton: {G._GLUON_ERROR}")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    gl = G.gl
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.isfile(ptxas):
        pytest.skip(f"this Triton has no bundled ptxas ({ptxas})")

    def desc(dt, shape, ty):
        return f"tensordesc<{dt}[{shape[0]}, {shape[1]}],{gl.NVMMASharedLayout.get_default_for(shape, ty)!r}>"

    fn = G._attn_fwd_gluon_ws if ws else G._attn_fwd_gluon
    sig = {"q_desc": desc("i8", [64, 128], gl.int8), "k_desc": desc("i8", [128, 128], gl.int8),
           "v_desc": desc("fp8e4nv", [128, 128], gl.float8e4nv), "QS": "*fp32", "KS": "*fp32", "VS": "*fp32",
           "OUT": "*fp8e4nv" if out_fp8 else "*bf16", "HMAX": "*fp32", "SX": "*fp32", "ONES": "*fp8e4nv",
           "H": "i32", "N_Q": "i32", "N_K": "i32", "N_KPAD": "i32", "qk_scale": "fp32"}
    consts = {"HEAD_DIM": 128, "BLOCK_M": 64, "BLOCK_N": 128, "OUT_FP8": out_fp8, "HP": 64 if out_fp8 else 1,
              "ONES_SWIZZLE": 128, "num_warps": 4}
    options = {"num_warps": 4, "num_stages": 1}
    if ws:
        consts = {"HEAD_DIM": 128, "BLOCK_N": 128, "STAGES": 2, "OUT_FP8": out_fp8, "ONES_SWIZZLE": 128,
                  "SKIP_EMPTY": True, "num_warps": 4}
        options["maxnreg"] = G.WS_MAXNREG
    sig.update({k: "constexpr" for k in consts})
    assert list(sig) == list(fn.arg_names), (list(sig), fn.arg_names)
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()},
                         {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
                          for k in ("QS", "KS", "VS", "OUT", "HMAX", "SX", "ONES")})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-2000:]
    return k.asm["ptx"], rep.stdout + rep.stderr


@pytest.mark.parametrize("out_fp8", [True, False])
def test_gluon_kernel_compiles_for_hopper_with_its_wgmma_pipelined(out_fp8):
    """There is no CPU interpreter for Gluon, so the kernel is compiled here for sm_90a with this Triton: it must
    compile (the trivial layout conversion of P included), keep every wgmma asynchronous (ptxas serialises them,
    with a "Potential Performance Loss" note, when the pipeline is ill-formed or registers run out), not spill, and
    stay at <= 255 registers (2 CTAs per SM). Its output is checked on the GPU (benchmarks/bench_attention_gluon.py:
    the Triton kernel's bits)."""
    ptx, report = _compile_gluon_for_hopper(out_fp8)
    assert "serialized" not in report, report
    m = re.search(r"Used (\d+) registers", report)
    assert m and int(m.group(1)) <= 255, report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert ptx.count("wgmma.wait_group.sync.aligned 0;") >= 2 and "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32 lo" in ptx        # the packing of P (inline PTX)


@pytest.mark.parametrize("out_fp8", [True, False])
def test_gluon_ws_kernel_compiles_for_hopper_within_its_register_split(out_fp8):
    """The warp-specialized form (two 64-row consumer warpgroups in ping-pong and a TMA warp) compiled for sm_90a:
    no wgmma serialised, no spill, at the launch's cap of 168 registers (12 warps: 65 536 / (12 x 32) = 170), its
    consumers raised to 240 and the TMA warp lowered to 24 by setmaxnreg, the same P packing as the 4-warp form,
    with the protocol-only path of a consumer with no query row compiled in (``SKIP_EMPTY`` is a run-time switch of
    it: no constexpr passes warp_specialize). The path's barrier protocol is checked on the GPU only (a length with
    a last query tile of <= 64 rows, e.g. 19 077 in benchmarks/bench_attention_gluon.py, hangs if it is wrong).
    Its output is checked on the GPU (benchmarks/bench_attention_gluon.py: the Triton kernel's bits)."""
    ptx, report = _compile_gluon_for_hopper(out_fp8, ws=True)
    assert "serialized" not in report, report
    m = re.search(r"Used (\d+) registers", report)
    assert m and int(m.group(1)) <= 168, report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx), "consumers not raised to 240 registers"
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx), "TMA warp not lowered to 24 registers"
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8") >= 2
    assert "cvt.rn.satfinite.e4m3x2.f32 lo" in ptx
