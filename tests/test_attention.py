"""Issue 9: per-model attention backend (H3TurboAttention) and the exact-SDPA override (CPU tests)."""
from __future__ import annotations

import copy
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from corpus import euler_av_prompt  # noqa: E402  (tests/ is on sys.path)

from h3_turbo import state
from h3_turbo.kernels import attention as R
from h3_turbo.kernels.attention import exact as A
from h3_turbo.kernels.attention import int8_sage
from h3_turbo.kernels.attention.reference import reference_attention, rel_l2
from h3_turbo.kernels.attention import cudnn_fp8 as _cudnn_fp8

#: the node's combo: cudnn_fp8 only where nvidia-cudnn-frontend imports (issue 21)
EXPECTED_CHOICES = ["auto", "exact", "sdpa_core", "int8_sage"] + (["cudnn_fp8"] if _cudnn_fp8.frontend() else []) \
    + ["auto8"]


# ---------------------------------------------------------------- pure helpers

def test_resolve_backend_and_buckets():
    assert R.resolve("auto") == "exact"
    assert R.resolve("exact") == "exact"
    assert R.resolve("sdpa_core") == "sdpa_core"
    assert R.resolve("int8_sage") == "int8_sage"
    with pytest.raises(ValueError, match=r"unknown backend 'sage'.*" + re.escape(str(EXPECTED_CHOICES))):
        R.resolve("sage")
    assert [A.length_bucket(n) for n in (1, 2, 3, 300, 19584, 32768, 32769, 37632, 109000)] == \
        [1, 2, 4, 512, 32768, 32768, 65536, 65536, 131072]
    with pytest.raises(ValueError):
        A.length_bucket(0)
    q = torch.empty(1, 56, 19584, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 56, 300, 128, dtype=torch.bfloat16)
    assert A.shape_key(q, k) == ("cpu", torch.bfloat16, 56, 128, 32768, 512)


# ---------------------------------------------------------------- measuring and caching

class FakeBench:
    """run(c) records c (or raises for names in ``broken``); timer(fn) calls fn once and returns the
    preset time of the candidate that fn ran."""

    def __init__(self, times, broken=()):
        self.times, self.broken = times, set(broken)
        self.runs: list[str] = []

    def run(self, c):
        self.runs.append(c)
        if c in self.broken:
            raise RuntimeError(f"No available kernel for {c}")
        return c

    def timer(self, fn):
        fn()
        return self.times[self.runs[-1]]


def test_chooser_measures_once_per_key_and_picks_fastest(caplog):
    fb = FakeBench({"CUDNN": 0.0178, "FLASH": 0.0307, "EFFICIENT": 0.0604})
    ch = A.BackendChooser(fb.timer)
    cands = ("FLASH", "CUDNN", "EFFICIENT")
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        assert ch.choose("k1", cands, fb.run) == "CUDNN"
        # warm-up + one timed call per candidate, in order
        assert fb.runs == ["FLASH", "FLASH", "CUDNN", "CUDNN", "EFFICIENT", "EFFICIENT"]
        for _ in range(3):
            assert ch.choose("k1", cands, fb.run) == "CUDNN"
        assert len(fb.runs) == 6                      # cached: nothing re-run
        fb.times["FLASH"] = 0.001                     # a new key is measured afresh
        assert ch.choose("k2", cands, fb.run) == "FLASH"
        assert len(fb.runs) == 12
    lines = [r.getMessage() for r in caplog.records if "exact backend for" in r.getMessage()]
    assert len(lines) == 2                            # logged once per key
    assert "k1: CUDNN (FLASH 30.70 ms, CUDNN 17.80 ms, EFFICIENT 60.40 ms)" in lines[0]
    assert ch.choices["k1"].seconds == {"FLASH": 0.0307, "CUDNN": 0.0178, "EFFICIENT": 0.0604}


def test_chooser_skips_broken_candidates_and_breaks_ties_by_order(caplog):
    fb = FakeBench({"A": 0.5, "B": 0.2, "C": 0.2}, broken={"B"})
    ch = A.BackendChooser(fb.timer)
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        assert ch.choose("k", ("A", "B", "C"), fb.run) == "C"
    assert fb.runs == ["A", "A", "B", "C", "C"]       # B failed its warm-up and was not timed
    assert ch.choices["k"].errors == {"B": "RuntimeError: No available kernel for B"}
    assert "B unusable (RuntimeError: No available kernel for B)" in caplog.text
    fb2 = FakeBench({"A": 0.3, "C": 0.3})
    assert A.BackendChooser(fb2.timer).choose("k", ("C", "A"), fb2.run) == "C"   # tie -> first listed
    fb3 = FakeBench({}, broken={"A", "C"})
    ch3 = A.BackendChooser(fb3.timer)
    assert ch3.choose("k", ("A", "C"), fb3.run) is None
    assert ch3.choose("k", ("A", "C"), fb3.run) is None and fb3.runs == ["A", "C"]   # cached failure


def _timer_by_output(outs, times, timed):
    """timer(fn): runs fn and returns the preset time of the candidate whose output it returned."""
    def timer(fn):
        o = fn()
        timed.append(o)
        return times[next(k for k, v in outs.items() if v is o)]
    return timer


def test_chooser_rejects_a_candidate_with_non_finite_output():
    """A backend that returns NaN or inf is never chosen, however fast."""
    outs = {"FAST_NAN": torch.tensor([[1.0, float("nan")]]), "SLOW": torch.ones(1, 2),
            "INF": torch.tensor([[float("inf"), 0.0]])}
    timed = []
    ch = A.BackendChooser(_timer_by_output(outs, {"FAST_NAN": 0.1, "INF": 0.1, "SLOW": 2.0}, timed))
    assert ch.choose("k", ("FAST_NAN", "INF", "SLOW"), lambda c: outs[c]) == "SLOW"
    assert ch.choices["k"].errors == {"FAST_NAN": "FloatingPointError: non-finite output",
                                      "INF": "FloatingPointError: non-finite output"}
    assert len(timed) == 1 and ch.choices["k"].distance == {}   # one usable output: nothing to compare


def test_chooser_rejects_a_fast_but_wrong_candidate(caplog):
    """As PyTorch's EFFICIENT_ATTENTION at S = 109 000 on the H200: finite, fast here, 0.24 off in every row."""
    g = torch.Generator().manual_seed(0)
    good = torch.randn(1, 4, 3000, 16, generator=g)
    outs = {"CUDNN": good + 1e-3 * torch.randn(good.shape, generator=g),
            "FLASH": good + 1e-3 * torch.randn(good.shape, generator=g),
            "EFFICIENT": good + 0.24 * torch.randn(good.shape, generator=g)}
    outs["LATE_WRONG"] = outs["CUDNN"].clone()
    outs["LATE_WRONG"][..., 2000:, :] += 1.0                      # only rows past 2000 wrong
    times = {"CUDNN": 0.02, "FLASH": 0.03, "EFFICIENT": 0.001, "LATE_WRONG": 0.0005}
    ch = A.BackendChooser(_timer_by_output(outs, times, []))
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        assert ch.choose("k", ("CUDNN", "FLASH", "EFFICIENT", "LATE_WRONG"), lambda c: outs[c]) == "CUDNN"
    c = ch.choices["k"]
    assert set(c.seconds) == {"CUDNN", "FLASH"}
    assert c.distance["CUDNN"] == pytest.approx(math.sqrt(2) * 1e-3, rel=0.05)
    assert c.distance["EFFICIENT"] == pytest.approx(0.24, rel=0.05)
    assert c.distance["LATE_WRONG"] == pytest.approx(math.sqrt(1000 / 3000), rel=0.05)   # ||1|| over 1/3 of rows
    assert c.errors["EFFICIENT"].startswith("wrong result: rel. L2 0.2") and c.errors["EFFICIENT"].endswith("(tolerance 0.02; 1.00 ms)")
    assert any(r.levelno == logging.WARNING and "EFFICIENT unusable (wrong result" in r.getMessage()
               for r in caplog.records)
    # two candidates that disagree: neither can be trusted -> None (the override then uses core's path)
    two = {"A": good, "B": good + 1.0}
    ch2 = A.BackendChooser(_timer_by_output(two, {"A": 1.0, "B": 2.0}, []))
    assert ch2.choose("k", ("A", "B"), lambda c: two[c]) is None
    assert set(ch2.choices["k"].errors) == {"A", "B"}


def test_output_sample_and_rel_l2():
    x = torch.arange(2 * 3 * 5000 * 2, dtype=torch.bfloat16).reshape(2, 3, 5000, 2)
    smp = A.output_sample(x, rows=1000)
    assert smp.dtype == torch.float32 and smp.shape == (2, 3, 1000, 2)        # stride 5
    assert torch.equal(smp, x[..., ::5, :].float())
    assert A.output_sample(torch.ones(1, 1, 10, 4)).shape == (1, 1, 10, 4)  # short: every row
    assert rel_l2(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])) == math.inf
    assert rel_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_l2(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == 1.0


# ---------------------------------------------------------------- the override on the CPU

def _h3_qkv(s=40, heads=3, d=32, dtype=torch.float32, seed=0):
    """q, k, v as H3 builds them: strided [1, heads, s, d] views of one qkv buffer (v cloned), q/k rows
    RMS-normalised."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, 3 * heads * d, generator=g, dtype=dtype)
    q, k, v = qkv.split(heads * d, dim=-1)
    q, k = (t.view(s, heads, d) for t in (q, k))
    q = q / q.pow(2).mean(-1, keepdim=True).sqrt()
    k = k / k.pow(2).mean(-1, keepdim=True).sqrt()
    v = v.reshape(s, heads, d).clone()
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


def _cpu_exact():
    """The SDPA path forced onto the CPU with the MATH backend (the only one PyTorch has there)."""
    ex = A.cpu_exact()
    assert ex.candidates == ("MATH",) and ex.devices == ("cpu",) and ex.chooser is not A.exact_override().chooser
    return ex


def _never(*a, **k):
    raise AssertionError("core's function must not be called on the SDPA path")


def test_exact_sdpa_path_matches_float64_reference_on_cpu():
    q, k, v = _h3_qkv(s=50, heads=3, d=32)
    ex = _cpu_exact()
    out = ex(_never, q, k, v, 3, mask=None, skip_reshape=True, _inside_attn_wrapper=True)
    assert out.shape == (1, 50, 96) and out.dtype == torch.float32
    ref = reference_attention(q, k, v, dtype=torch.float64)            # [3, 50, 32]
    ref = ref.transpose(0, 1).reshape(1, 50, 96)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-6, rel
    # skip_output_reshape keeps [B, heads, L, D]; [B, L, heads*D] inputs (skip_reshape=False) give the same
    out4 = ex(_never, q, k, v, 3, skip_reshape=True, skip_output_reshape=True)
    assert torch.equal(out4.transpose(1, 2).reshape(1, 50, 96), out)
    flat = [t.transpose(1, 2).reshape(1, 50, 96) for t in (q, k, v)]
    assert torch.equal(ex(_never, *flat, 3), out)
    assert ex.calls == 3 and ex.delegated == 0


def test_exact_delegates_to_core_where_it_does_not_apply():
    q, k, v = _h3_qkv()
    seen = []

    def core(*args, **kwargs):
        seen.append((args, kwargs))
        return "core-result"

    ex = A.ExactAttention(chooser=A.BackendChooser(lambda fn: _never()))   # default: cuda only
    kw = dict(mask=None, skip_reshape=True, transformer_options={"x": 1}, _inside_attn_wrapper=True)
    assert ex(core, q, k, v, 3, **kw) == "core-result"                     # CPU tensors
    assert seen[-1][0][3] == 3 and seen[-1][0][0] is q and seen[-1][1] == kw  # passed through unchanged
    cpu = _cpu_exact()
    mask = torch.zeros(40, 40)
    assert cpu(core, q, k, v, 3, mask=mask, skip_reshape=True) == "core-result"
    assert cpu(core, q, k, v, 3, skip_reshape=True, enable_gqa=True) == "core-result"
    assert cpu(core, q, k.double(), v, 3, skip_reshape=True) == "core-result"
    assert ex.delegated == 1 and cpu.delegated == 3 and cpu.calls == 0


def test_exact_override_is_process_wide():
    assert A.exact_override() is A.exact_override()
    assert A.exact_override().devices == ("cuda",)
    assert A.exact_override().candidates == ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def test_process_state_lives_in_named_stores():
    """The chooser and the process-wide overrides are h3_turbo.state stores: clear() forgets them (a new
    object, measured afresh, on next use), snapshot() reports them."""
    ex, ch = A.exact_override(), A.exact_override().chooser
    assert state.store("attention_exact").data["value"] is ex and state.store("attention_chooser").data["value"] is ch
    assert state.store("attention_chooser").snapshot() == {"measured": len(ch.choices)}
    try:
        state.ATTENTION_EXACT.clear()
        state.ATTENTION_CHOOSER.clear()
        assert state.ATTENTION_CHOOSER.snapshot() == {"measured": 0}
        ex2 = A.exact_override()
        assert ex2 is not ex and ex2.chooser is not ch and ex2.chooser is A.exact_override().chooser
        assert {"attention_chooser", "attention_exact", "attention_int8_sage", "attention_fp8_ones"} <= \
            set(state.stores_snapshot())
    finally:   # later tests compare against the objects already installed on models
        state.ATTENTION_EXACT.data["value"], state.ATTENTION_CHOOSER.data["value"] = ex, ch


# ---------------------------------------------------------------- the registry, over every backend

OLD_NODE_DESCRIPTION = (
    "Attention backend for this model only. auto = exact: exact SDPA with the backend measured fastest on this "
    "GPU at first use (cuDNN on Hopper); core's path on CPU. sdpa_core: core's PyTorch attention (FA2 first), "
    "for comparison. int8_sage: 8-bit attention (INT8 Q.K with q/k balanced per channel and Hadamard-rotated, FP8 "
    "P.V; approximate, ~4% relative error per call; each layer checked once, a failing layer runs exact; faster than exact on Hopper, "
    "docs/attention.md); needs a GPU with FP8 (sm_89+), else exact.")
#: issue 21 appended the new backends' sentences (their summaries) after the old description
OLD_NODE_DESCRIPTION += "".join(f" {n}: {R.get(n).summary}" for n in EXPECTED_CHOICES[4:])
WITH_FALLBACK = [b.name for b in R.backends() if b.fallback is not None]
WITHOUT_FALLBACK = [b.name for b in R.backends() if b.fallback is None]


def _param(name):
    """A registry name as a test parameter; backends whose override needs ComfyUI are marked comfyui."""
    return pytest.param(name, marks=pytest.mark.comfyui) if R.get(name).needs_comfy else name


def _holder():
    """The part of a ComfyUI ModelPatcher that AttentionBackend.apply writes (exact, int8_sage)."""
    from types import SimpleNamespace

    return SimpleNamespace(model_options={})


from test_attention_int8 import _Core  # noqa: E402  (one stand-in for core's attention function)


def test_registry_names_order_and_resolve():
    # saved workflows store these strings: the order and the names are part of the node's interface
    assert R.choices() == EXPECTED_CHOICES
    assert R.choices() == [R.AUTO, *R.names()] and R.names() == tuple(b.name for b in R.backends())
    assert R.get("auto") is R.get("exact") is A.BACKEND and R.get("int8_sage") is int8_sage.BACKEND
    assert [b.approximate for b in R.backends()] == [False, False] + [True] * (len(EXPECTED_CHOICES) - 3)
    assert not R.get(R.resolve(R.AUTO)).approximate                  # auto never picks an approximate backend
    with pytest.raises(ValueError, match=r"^H3TurboAttention: unknown backend 'int8'; expected one of "
                                         + re.escape(str(EXPECTED_CHOICES)) + "$"):
        R.get("int8")
    assert R.description() == OLD_NODE_DESCRIPTION


def test_register_extends_the_combo_and_checks_the_backend():
    from h3_turbo.kernels.attention.base import AttentionBackend

    class Fake(AttentionBackend):
        name, summary, fallback = "fake_test", "a test backend.", "exact"

        def supports(self, device):
            return False, "never"

        def override(self):
            return _never

    fake = R.register(Fake())
    try:
        assert R.choices()[-1] == "fake_test" and R.get("fake_test") is fake and R.resolve("fake_test") == "fake_test"
        assert R.description().endswith(" fake_test: a test backend.")
        h = _holder()
        fake.apply(h)
        assert h.model_options["transformer_options"]["optimized_attention_override"] is _never
        for bad in (Fake(), type("Auto", (Fake,), {"name": "auto"})(), type("E", (Fake,), {"name": ""})(),
                    type("F", (Fake,), {"name": "fake2", "fallback": "nowhere"})(), object()):
            with pytest.raises(ValueError, match="attention registry"):
                R.register(bad)
    finally:
        R.unregister("fake_test")
    assert R.choices() == EXPECTED_CHOICES
    with pytest.raises(ValueError, match="unknown backend 'fake_test'"):
        R.resolve("fake_test")


def test_supports_names_the_fallback_reason(monkeypatch):
    """supports(device) says whether the installed override takes its own path there, with the reason its
    fallback log gives otherwise."""
    assert R.get("exact").supports("cpu") == (False, "device type 'cpu'")
    assert R.get("exact").supports(torch.device("cuda", 1)) == (True, "")
    assert R.get("sdpa_core").supports("cpu") == (True, "") and R.get("sdpa_core").supports("cuda") == (True, "")
    i8 = R.get("int8_sage")
    assert i8.supports("cpu") == (False, "device type 'cpu'")
    from h3_turbo.kernels.attention import int8_kernels as K

    if K.triton is not None:
        cap = {"v": (8, 6)}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap["v"])
        assert i8.supports("cuda") == (False, "GPU compute capability 8.6 has no FP8 tensor cores")
        cap["v"] = (9, 0)
        assert i8.supports("cuda:0") == (True, "")
    monkeypatch.setattr(K, "triton", None)
    monkeypatch.setattr(K, "_TRITON_ERROR", "ImportError: no triton here")
    assert i8.supports("cuda") == (False, "triton unavailable (ImportError: no triton here)")


@pytest.mark.parametrize("name", WITH_FALLBACK)
def test_backend_fallback_on_cpu_is_logged_once_and_bit_identical_to_exact(name, caplog):
    """The override a backend installs hands CPU inputs to its declared fallback: the result is
    bit-identical to the exact path's (on the CPU: core's own function), one log line names the reason."""
    b = R.get(name)
    ok, reason = b.supports("cpu")
    assert not ok and reason
    h = _holder()
    b.apply(h)
    ov = h.model_options["transformer_options"]["optimized_attention_override"]
    assert ov is b.override() and ov.backend == name                  # one process-wide override per backend
    q, k, v = _h3_qkv(s=40, heads=2, d=64, dtype=torch.bfloat16, seed=5)
    core = _Core()
    kw = dict(mask=None, skip_reshape=True, _inside_attn_wrapper=True)
    want = core(q, k, v, 2, **kw)
    exact_out = R.get("exact").override()(core, q, k, v, 2, **kw)
    state.LOGGED.clear()
    c0, n0 = core.calls, ov.calls
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        outs = [ov(core, q, k, v, 2, **kw) for _ in range(3)]
    for o in outs:
        assert o.shape == (1, 40, 128) and torch.equal(o, want) and torch.equal(o, exact_out)
    assert core.calls == c0 + 3 and ov.calls == n0                    # every call reached core's function
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"H3 Turbo attention '{name}': ")]
    assert len(msgs) == 1, msgs                                       # logged once
    target = {"core": "core's attention path", "exact": "exact attention"}[b.fallback]
    assert msgs[0].startswith(f"H3 Turbo attention '{name}': {reason} -> {target}"), msgs


@pytest.mark.comfyui
@pytest.mark.parametrize("name", WITHOUT_FALLBACK)
def test_backend_without_fallback_takes_every_input(name, comfy):
    """A backend that declares no fallback runs every call itself, masks included: on the CPU the same
    numbers as core's PyTorch attention, and core's ``func`` is never called."""
    import comfy.ldm.modules.attention as core
    import comfy.model_patcher

    b = R.get(name)
    assert b.supports("cpu") == (True, "")
    m = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cpu"))
    b.apply(m)
    ov = m.model_options["transformer_options"]["optimized_attention_override"]
    q, k, v = _h3_qkv(s=48, heads=2, d=32, seed=6)
    mask = torch.zeros(48, 48)
    mask[:, 40:] = -float("inf")
    for extra in ({}, {"mask": mask}):
        got = ov(_never, q, k, v, 2, skip_reshape=True, _inside_attn_wrapper=True, **extra)
        want = core.attention_pytorch(q, k, v, 2, skip_reshape=True, **extra)
        assert torch.equal(got, want)
        assert torch.equal(b.override()(_never, q, k, v, 2, skip_reshape=True, _inside_attn_wrapper=True, **extra), want)


@pytest.mark.parametrize("name", [_param(n) for n in R.names()])
def test_backend_matches_its_reference_on_cpu(name, request):
    """Each backend's own path on CPU tensors (its ``cpu_override``) against its eager reference, within its
    stated tolerance. A backend whose CPU path needs environment variables (``cpu_env``: the Triton
    interpreter) is re-run here in a subprocess with them."""
    b = R.get(name)
    missing = {k: v for k, v in b.cpu_env.items() if os.environ.get(k) != v}
    if missing:
        if "TRITON_INTERPRET" in missing:
            pytest.importorskip("triton")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **missing)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"{os.path.abspath(__file__)}::test_backend_matches_its_reference_on_cpu[{name}]"],
                              env=env, capture_output=True, text=True, timeout=600)
        tail = proc.stdout[-4000:] + proc.stderr[-2000:]
        assert proc.returncode == 0 and re.search(r"\b1 passed\b", proc.stdout), tail
        assert "skipped" not in proc.stdout.splitlines()[-1], tail
        return
    if b.needs_comfy:
        request.getfixturevalue("comfy")
    tol = b.tolerance
    q, k, v = _h3_qkv(s=130, heads=2, d=64, dtype=tol.dtype, seed=7)
    ov = b.cpu_override()
    out = ov(_never, q, k, v, 2, mask=None, skip_reshape=True, skip_output_reshape=True, _inside_attn_wrapper=True)
    assert out.shape == (1, 2, 130, 64) and out.dtype == tol.dtype
    if b.fallback is not None:
        assert ov.calls == 1                                          # its own path ran, not its fallback
    res = b.check(out, q, k, v)
    assert res["ok"], (res, tol)
    if b.approximate:                                                 # it is not exact attention in disguise
        assert res["rel_l2"] > 1e-3, res
    else:
        assert res["rel_l2"] < 1e-5, res


# ---------------------------------------------------------------- real ComfyUI

@pytest.mark.comfyui
def test_exact_matches_core_attention_through_wrap_attn(comfy):
    """Core's own call convention (containers, skip_reshape, override lookup in wrap_attn): our SDPA path
    equals core's attention functions on the CPU within fp32 rounding."""
    import comfy.ldm.modules.attention as core

    q, k, v = _h3_qkv(s=64, heads=4, d=32, seed=3)
    ex = _cpu_exact()

    def call(fn, override=None):
        to = {} if override is None else {"optimized_attention_override": override}
        c = [core.AttentionTensorContainer(t) for t in (q, k, v)]
        return fn(*c, 4, mask=None, skip_reshape=True, transformer_options=to)

    ours = call(core.optimized_attention, ex)
    assert ex.calls == 1
    for fn in (core.optimized_attention, core.attention_basic, core.attention_pytorch, core.attention_sub_quad):
        theirs = call(fn)
        assert theirs.shape == ours.shape == (1, 64, 128)
        rel = ((ours - theirs).norm() / theirs.norm()).item()
        assert rel < 1e-6, (fn.__name__, rel)
    # the default (CUDA-only) exact override hands CPU calls to core's function: bit-identical
    assert torch.equal(call(core.optimized_attention, A.ExactAttention()), call(core.optimized_attention))


@pytest.mark.comfyui
def test_node_sets_override_per_model(comfy, fixtures_dir):
    import nodes
    from h3_turbo.nodes.attention import H3TurboAttention

    (model,) = nodes.UNETLoader().load_unet(os.path.basename(fixtures_dir["bf16"]), "default")
    before = copy.copy(model.model_options["transformer_options"])
    exact = H3TurboAttention.execute(model=model, backend="auto").result[0]
    core_sdpa = H3TurboAttention.execute(model=model, backend="sdpa_core").result[0]
    assert exact is not model and core_sdpa is not model
    assert exact.model_options["transformer_options"]["optimized_attention_override"] is A.exact_override()
    ov = core_sdpa.model_options["transformer_options"]["optimized_attention_override"]
    assert ov is not A.exact_override() and callable(ov)
    # the input model (and so any other branch of the graph using it) is untouched
    assert "optimized_attention_override" not in model.model_options["transformer_options"]
    assert model.model_options["transformer_options"] == before
    # a model passed through the node twice keeps one override (the last one)
    again = H3TurboAttention.execute(model=core_sdpa, backend="exact").result[0]
    assert again.model_options["transformer_options"]["optimized_attention_override"] is A.exact_override()
    assert core_sdpa.model_options["transformer_options"]["optimized_attention_override"] is ov
    with pytest.raises(ValueError, match="unknown backend"):
        H3TurboAttention.execute(model=model, backend="int8")
    eight = H3TurboAttention.execute(model=model, backend="int8_sage").result[0]
    assert eight.model_options["transformer_options"]["optimized_attention_override"] is int8_sage.int8_override()
    assert "optimized_attention_override" not in model.model_options["transformer_options"]


@pytest.mark.comfyui
def test_node_schema_comes_from_the_registry(comfy):
    """Node id, display name, inputs and defaults as saved workflows expect; the combo is the registry's
    choices (a newly registered backend appears in it) and execute applies the chosen backend."""
    from h3_turbo.kernels.attention.base import AttentionBackend
    from h3_turbo.nodes.attention import H3TurboAttention

    sch = H3TurboAttention.define_schema()
    assert (sch.node_id, sch.display_name, sch.category) == ("H3TurboAttention", "H3 Turbo Attention", "H3 Turbo")
    assert [i.id for i in sch.inputs] == ["model", "backend"]
    combo = sch.inputs[1]
    assert combo.options == R.choices() == EXPECTED_CHOICES and combo.default == "auto"
    assert sch.description == OLD_NODE_DESCRIPTION

    applied = []

    class Probe(AttentionBackend):
        name, summary, fallback = "probe_test", "probe.", None

        def supports(self, device):
            return True, ""

        def apply(self, patcher):
            applied.append(patcher)

    R.register(Probe())
    try:
        assert H3TurboAttention.define_schema().inputs[1].options[-1] == "probe_test"
        model = _holder()
        model.clone = lambda: _holder()
        out = H3TurboAttention.execute(model=model, backend="probe_test").result[0]
        assert applied == [out] and out is not model
    finally:
        R.unregister("probe_test")


def _prompt(prefix, with_node, backend="auto"):
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "h3_tiny_bf16.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "h3_tiny_turbo_4step_comfyui_bf16.safetensors", "strength_model": 1.0}},
        **euler_av_prompt(["2", 0], steps=4, tokens=16, size=(128, 96, 22),
                          prefixes=(f"{prefix}/video", f"{prefix}/audio")),
    }
    if with_node:
        p["20"] = {"class_type": "H3TurboAttention", "inputs": {"model": ["1", 0], "backend": backend}}
        p["2"]["inputs"]["model"] = ["20", 0]
    return p


@pytest.mark.comfyui
def test_node_in_real_graph_is_bit_identical_on_cpu(comfy):
    """UNETLoader -> H3TurboAttention(auto) -> ... sampled on the CPU: the override is really consulted
    for every attention call of the 50 DiT blocks, hands each to core's path, and the latents are
    bit-identical to the same graph without the node."""
    import folder_paths
    from safetensors.torch import load_file

    ov = A.exact_override()
    d0 = ov.delegated
    comfy.run(_prompt("h3attn_without", False))
    assert ov.delegated == d0                                   # the graph without the node never reaches it
    comfy.run(_prompt("h3attn_with", True))
    n = ov.delegated - d0
    # 4 euler steps x 50 DiT blocks. The 2 text-refiner blocks run in extra_conds (once per sampling run)
    # without the model's transformer_options, so core's attention serves them, override or not.
    assert n == 4 * 50, n
    assert ov.calls == 0
    out = folder_paths.get_output_directory()
    for part in ("video", "audio"):
        a = load_file(os.path.join(out, "h3attn_without", f"{part}_00001_.latent"))["latent_tensor"]
        b = load_file(os.path.join(out, "h3attn_with", f"{part}_00001_.latent"))["latent_tensor"]
        assert a.shape == b.shape and torch.isfinite(a).all() and a.float().std() > 0.01
        assert torch.equal(a, b), part


@pytest.mark.comfyui
def test_int8_backend_on_cpu_runs_exact_and_is_bit_identical(comfy, caplog):
    """backend=int8_sage in a real graph on the CPU: every DiT attention call is handed to the exact override
    (which on the CPU is core's own path) and the latents are bit-identical to the
    graph without the node. (The 8-bit kernel itself: tests/test_attention_int8.py, interpreted.)"""
    import logging

    import folder_paths
    from safetensors.torch import load_file

    ov = int8_sage.int8_override()
    f0, c0 = ov.fallbacks, ov.calls
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        comfy.run(_prompt("h3attn8_with", True, backend="int8_sage"))
    assert ov.fallbacks - f0 == 4 * 50 and ov.calls == c0
    comfy.run(_prompt("h3attn8_without", False))
    out = folder_paths.get_output_directory()
    for part in ("video", "audio"):
        a = load_file(os.path.join(out, "h3attn8_without", f"{part}_00001_.latent"))["latent_tensor"]
        b = load_file(os.path.join(out, "h3attn8_with", f"{part}_00001_.latent"))["latent_tensor"]
        assert torch.equal(a, b), part
