"""Issue 21: fused fp8 producers and the fused DiT block (CPU tests).

The Triton kernels themselves run interpreted in a subprocess (tests/test_fused_interp.py). Here: the launch
wrappers' argument checks, the segment table, the GEMM on a pre-quantized input, and the fused block on the tiny H3
fixture loaded by the pack on compute=fp8 with the eager ops (kernels.fused.EAGER: the kernels' formulas in torch),
against core's own block (bounds below), plus every path that must hand the call to core's block.

Bounds of the fused block (tiny H3, bf16 stream, relative L2 of one block's update out - x) against core's block
with bf16 activations into the same e4m3 weights (no activation quantization): <= 0.15 (four e4m3 activation
quantizations, ~2.6% each, measured 8.8-9.0% on blocks 3/10/30), and at most 1.25x the distance of core's block on
the unfused fp8 path emulated on the CPU (per-row e4m3 of its bf16 inputs; measured 8.4-9.1%): the fused block is as
accurate as the path it replaces. (The two fp8 runs are ~8% from each other: their rounding errors are about as
large as each one's error and not correlated.)
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from h3_turbo.kernels import fused as fk
from h3_turbo.kernels import nvfp4_ref as ref


def test_fused_kernels_interpreted_on_cpu():
    """tests/test_fused_interp.py in a fresh process with TRITON_INTERPRET=1 (set before triton is imported)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join(here, "test_fused_interp.py")], env=env, capture_output=True, text=True,
                          timeout=900)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    from conftest import _comfyui_path     # the one ComfyUI test in it skips (loudly) without ComfyUI

    have_comfy = _comfyui_path() is not None
    assert m and int(m.group(1)) == (69 if have_comfy else 68), tail
    assert "skipped" not in proc.stdout.splitlines()[-1] or not have_comfy, tail


def test_segment_rows_validates_and_caches():
    rows = fk.segment_rows([(0, 2, 1), (2, 5, 0)], 5, "cpu")
    assert rows.dtype == torch.int32 and rows.tolist() == [1, 1, 0, 0, 0]
    assert fk.segment_rows([(0, 2, 1), (2, 5, 0)], 5, "cpu") is rows
    with pytest.raises(ValueError, match=r"mod_segments\[1\] = \(3, 5, 0\).*expected a start of 2"):
        fk.segment_rows([(0, 2, 1), (3, 5, 0)], 5, "cpu")
    with pytest.raises(ValueError, match="cover rows 0..4, but the activation has 5 rows"):
        fk.segment_rows([(0, 4, 0)], 5, "cpu")


@pytest.mark.skipif(fk.INTERPRET, reason="checks the non-interpreted launch guard")
def test_triton_wrappers_refuse_cpu_tensors_outside_the_interpreter():
    x = torch.randn(4, 64).to(torch.bfloat16)
    rows = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        fk.norm_mod(x, torch.ones(64), 1e-5, x, x, rows)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        fk.swiglu(x)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        fk.gate_residual_(x, x, x, rows)


def test_fp8_gemm_on_prequantized_input_matches_its_emulation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 64, generator=g)
    w8, sw = ref.fp8_rowwise_from_weight(torch.cat([w, torch.zeros(8, 64)]))     # Npad = 48 > n = 40
    x8, sx = fk.quantize_rows(x)
    got = fk.fp8_gemm(x8, sx, w8, sw.reshape(1, -1), 40)
    want = fk.fp8_gemm_ref(x8, sx, w8, sw.reshape(1, -1), 40)
    assert got.shape == (19, 40) and got.dtype == torch.bfloat16
    assert float((got.double() - want.double()).norm() / want.double().norm()) < 4e-3    # bf16 output rounding
    with pytest.raises(ValueError, match="scales"):
        fk.fp8_gemm(x8, sx.reshape(-1), w8, sw.reshape(1, -1), 40)


def test_eager_ops_follow_the_kernel_formulas():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 32, generator=g).to(torch.bfloat16)
    ada = torch.randn(3, 6 * 32, generator=g).to(torch.bfloat16) * 0.3
    sh, sc, gt = ada[:, :32], ada[:, 32:64], ada[:, 64:96]
    rows = fk.segment_rows([(0, 4, 2), (4, 10, 0)], 10, "cpu")
    w = torch.ones(32)
    y8, sy = fk.EAGER.norm_mod(x, w, 1e-5, sh, sc, rows)
    h64, _ = fk.norm_mod_ref(x, w, 1e-5, sh, sc, rows)
    assert float((y8.double() * sy - h64).norm() / h64.norm()) < 0.035
    x2 = x.clone()
    fk.EAGER.gate_residual_(x2, x, gt, rows)
    assert torch.equal(x2, fk.gate_residual_ref(x, x, gt, rows))


# ------------------------------------------------------------------------------------ the fused block (ComfyUI)

@pytest.fixture(scope="module")
def fp8_model(comfy, fixtures_dir):
    if "nvfp4" not in fixtures_dir:
        pytest.skip("comfy-kitchen missing: no NVFP4 fixture")
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.runtime.ops import install_compute

    mp = load_h3_model(fixtures_dir["nvfp4"], "reference")
    assert install_compute(mp, "fp8") == 208
    return mp


def _block_args(mp, i=3):
    """The real arguments core hands block i (recorded through the double_block hook on a tiny forward), the stream,
    t_emb and rope in bf16; the block's norm / AdaLN parameters cast to bf16 (as on a GPU load)."""
    import comfy.patcher_extension as pe

    rec = {}

    def recorder(args, extra):
        rec.setdefault("a", {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()})
        return extra["original_block"](args)

    m2 = mp.clone()
    m2.set_model_patch_replace(recorder, "dit", "double_block", i)
    to = pe.copy_nested_dicts(m2.model_options.get("transformer_options", {}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m2.model.diffusion_model([torch.randn(1, 24, 7, 8, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g)],
                                 torch.tensor([800.0]), torch.randn(1, 9, 48, generator=g), transformer_options=to)
    b = mp.model.diffusion_model.blocks[i]
    for mod in (b.norm1, b.norm2, b.attn.q_norm, b.attn.k_norm, b.adaln_proj.linear):
        for _, p in mod.named_parameters(recurse=False):
            p.data = p.data.to(torch.bfloat16)
    a = rec["a"]
    return b, {"img": a["img"].to(torch.bfloat16), "t_emb": a["t_emb"].to(torch.bfloat16),
               "mod_segments": a["mod_segments"], "rope_freqs": a["rope_freqs"].to(torch.bfloat16),
               "transformer_options": {}}


def _core(b):
    return lambda a: {"img": b(a["img"], a["t_emb"], a["mod_segments"], a["rope_freqs"],
                               transformer_options=a["transformer_options"])}


def _run(patch, b, args):
    with torch.no_grad():
        return patch(dict(args, img=args["img"].clone()), {"original_block": _core(b)})["img"]


def _rel_update(got, want, x):
    d = want.double() - x.double()
    return float(((got.double() - x.double()) - d).norm() / d.norm())


@pytest.fixture
def emulated_unfused_fp8(monkeypatch):
    """The fp8 path's own GEMM (per-row e4m3 activations, e4m3 weight) emulated on the CPU for core's block."""
    from h3_turbo.kernels.paths import fp8

    monkeypatch.setattr(fp8.FP8Path, "takes", lambda self, x2d: True)
    monkeypatch.setattr(fp8.FP8Path, "kernel_linear",
                        lambda self, x2d, p: ref.fp8_linear_emulated(x2d, p.w8[:p.out_features],
                                                                     p.sw[:, :p.out_features], x2d.dtype))
    return monkeypatch


def test_fused_block_matches_core_block_on_fp8(fp8_model):
    from h3_turbo.runtime import fused_block as fb

    b, args = _block_args(fp8_model)
    assert fb.structure_problem(b) is None
    with torch.no_grad():
        want_bf16 = _core(b)(dict(args, img=args["img"].clone()))["img"]      # bf16 activations into the GEMMs
    patch = fb.FusedBlockPatch(b, 3, ops=fk.EAGER, devices=("cpu",))
    got = _run(patch, b, args)
    assert patch.calls == 1 and patch.delegated == 0 and patch.routes == {"fp8": 4}
    assert torch.isfinite(got).all() and not torch.equal(got, args["img"])
    r = _rel_update(got, want_bf16, args["img"])
    assert 5e-3 < r < 0.15, r


def test_fused_block_matches_the_unfused_fp8_path(fp8_model, emulated_unfused_fp8):
    from h3_turbo.runtime import fused_block as fb

    from h3_turbo.kernels.paths import fp8

    b, args = _block_args(fp8_model)
    with torch.no_grad():
        unfused = _core(b)(dict(args, img=args["img"].clone()))["img"]
    got = _run(fb.FusedBlockPatch(b, 3, ops=fk.EAGER, devices=("cpu",)), b, args)
    emulated_unfused_fp8.undo()
    assert not fp8.FP8Path.takes(fp8.PATH, args["img"])             # back to the CPU reference: bf16 activations
    with torch.no_grad():
        bf16 = _core(b)(dict(args, img=args["img"].clone()))["img"]
    r_fused, r_unfused = _rel_update(got, bf16, args["img"]), _rel_update(unfused, bf16, args["img"])
    assert 5e-3 < r_unfused < 0.15 and r_fused <= 1.25 * r_unfused, (r_fused, r_unfused)


def _two_blocks(mp, defer: bool, monkeypatch, p4_devices=("cpu",)):
    """Blocks 3 and 4 as core's loop runs them: fused-block patches at ("double_block", 3 / 4) of the call's
    transformer_options, block 3's output handed to block 4's entry. Returns (patches, block 3's output as returned,
    block 4's output, (block 3, block 4, the call's arguments with block 3's input))."""
    from h3_turbo.runtime import fused_block as fb

    b3, args = _block_args(mp, 3)
    b4, _ = _block_args(mp, 4)
    p3 = fb.FusedBlockPatch(b3, 3, ops=fk.EAGER, devices=("cpu",))
    p4 = fb.FusedBlockPatch(b4, 4, ops=fk.EAGER, devices=p4_devices)
    # without deferral: block 4's entry not in the call's patches, so block 3 cannot leave its residual to it
    dit = {("double_block", 3): p3, ("double_block", 4): p4} if defer else {("double_block", 3): p3}
    to = {"patches_replace": {"dit": dit}}
    a = dict(args, transformer_options=to)          # a["img"]: block 3's input (the blocks update a clone in place)
    with torch.no_grad():
        y = p3(dict(a, img=a["img"].clone()), {"original_block": _core(b3)})["img"]
        y_returned = y.clone()
        z = p4(dict(a, img=y), {"original_block": _core(b4)})["img"]
    return (p3, p4), y_returned, z, (b3, b4, a)


def _left(a):
    from h3_turbo.runtime import fused_block as fb

    return a["transformer_options"].get(fb._PENDING_KEY)


def test_cross_block_residual_is_the_same_bits(fp8_model, monkeypatch):
    """Block 3 returns the stream without its final gated residual
    and leaves it in the forward's transformer_options, where block 4's entry takes it and its first producer applies
    it: block 4's output is bit for bit the one of the two blocks run one after the other without it; a block 4 that
    cannot serve the call applies it first and runs core's block (the same bits as core's block on the updated
    stream)."""
    (q3, q4), y_off, z_off, (b3, b4, a0) = _two_blocks(fp8_model, False, monkeypatch)
    assert q3.deferred == 0 and _left(a0) is None
    calls = []
    monkeypatch.setattr(fk.EAGER, "gate_residual_", lambda *a, _f=fk.EAGER.gate_residual_: calls.append(1) or _f(*a))
    (p3, p4), y_on, z_on, a1 = _two_blocks(fp8_model, True, monkeypatch)
    assert calls == [1]         # block 4's own last update only: block 3's was applied by block 4's first producer
    assert p3.deferred == 1 and p4.deferred == 0 and _left(a1[2]) is None and p3.calls == p4.calls == 1
    assert not torch.equal(y_on, y_off)              # block 3's output left without its last update...
    assert torch.equal(z_on, z_off)                  # ...which block 4 applied: the same bits
    # block 4 cannot serve (CUDA-only patch, CPU stream): the update first, then core's block 4
    (r3, r4), _, z_core, (b3, b4, a) = _two_blocks(fp8_model, True, monkeypatch, p4_devices=("cuda",))
    assert r3.deferred == 1 and r4.delegated == 1 and _left(a) is None
    with torch.no_grad():
        y_whole = q3(dict(a, img=a["img"].clone(), transformer_options={}), {"original_block": _core(b3)})["img"]
        want = _core(b4)(dict(a, img=y_whole.clone()))["img"]         # core's block updates its input in place
    assert torch.equal(y_whole, y_off) and torch.equal(z_core, want)


def test_cross_block_residual_guards(fp8_model, monkeypatch):
    """Within one forward, a residual left for one stream tensor and another one handed to the next block is a
    RuntimeError naming the hook (deferral then off for the process); one left in the dict by an earlier forward
    (another t_emb) is dropped and the new forward's output is the one without it; two forwards interleaved, each
    with its own transformer_options (CFG halves on two GPUs), each get their own; a block whose entry core does not
    call directly (wrapped by another entry) or a chained next entry gets no residual left."""
    from h3_turbo.runtime import fused_block as fb

    monkeypatch.setattr(fb, "_DEFER_OFF", [])
    (p3, p4), _, z_ref, (b3, b4, a) = _two_blocks(fp8_model, True, monkeypatch)
    core = {"original_block": _core(b3)}, {"original_block": _core(b4)}

    def fresh(**kw):        # a new forward: its own transformer_options and t_emb, block 3's input
        to = {"patches_replace": {"dit": dict(a["transformer_options"]["patches_replace"]["dit"])}}
        return dict(a, img=a["img"].clone(), t_emb=a["t_emb"].clone(), transformer_options=to, **kw)

    with torch.no_grad():
        # two forwards interleaved (A block 3, B block 3, B block 4, A block 4): each takes its own residual
        fa, fb_ = fresh(), fresh()
        ya = p3(fa, core[0])["img"]
        yb = p3(fb_, core[0])["img"]
        zb = p4(dict(fb_, img=yb), core[1])["img"]
        za = p4(dict(fa, img=ya), core[1])["img"]
        assert torch.equal(za, z_ref) and torch.equal(zb, z_ref)
        # a residual left by a forward that stopped after block 3, with the same dict: dropped by the next forward
        f1 = fresh()
        p3(f1, core[0])
        assert _left(f1) is not None and _left(f1).x is not None
        f2 = dict(fresh(), transformer_options=f1["transformer_options"])
        y2 = p3(f2, core[0])["img"]                       # takes (drops) the stale one, leaves its own
        z2 = p4(dict(f2, img=y2), core[1])["img"]
        assert torch.equal(z2, z_ref) and _left(f2) is None and not fb._DEFER_OFF
        # another stream tensor handed to block 4 within the forward: an error, deferral off
        f3 = fresh()
        y3 = p3(f3, core[0])["img"]
        with pytest.raises(RuntimeError, match=r"another stream tensor.*double_block"):
            p4(dict(f3, img=y3.clone()), core[1])
        assert fb._DEFER_OFF and _left(f3) is None
        f4 = fresh()
        p3(f4, core[0])
        assert _left(f4) is None                        # off for the process now
    fb._DEFER_OFF.clear()
    deferred = p3.deferred
    with torch.no_grad():
        # block 3's entry is another override that calls our patch: core does not call p3 directly
        f5 = fresh()
        f5["transformer_options"]["patches_replace"]["dit"][("double_block", 3)] = lambda args, extra: p3(args, extra)
        p3(f5, core[0])
        assert _left(f5) is None
        # block 4's entry chains another override around our patch
        f6 = fresh()
        f6["transformer_options"]["patches_replace"]["dit"][("double_block", 4)] = fb.FusedBlockPatch(
            b4, 4, prev=lambda args, extra: extra["original_block"](args), ops=fk.EAGER, devices=("cpu",))
        p3(f6, core[0])
        assert _left(f6) is None and p3.deferred == deferred


def test_fused_block_hands_unserved_calls_to_core_bit_identically(fp8_model, caplog):
    from h3_turbo.runtime import fused_block as fb

    b, args = _block_args(fp8_model)
    patch = fb.FusedBlockPatch(b, 3, ops=fk.EAGER, devices=("cpu",))
    f32 = dict(args, img=args["img"].float())
    caplog.set_level(logging.INFO, logger="h3_turbo")
    cases = []
    # 1) an fp32 stream (core's CPU compute dtype)
    cases.append(("stream dtype torch.float32", f32, None))
    # 2) a projection on another compute path
    cases.append(("mlp.fc1 is not on compute=fp8", args, lambda: setattr(b.mlp.fc1, "_h3_path", "exact")))
    # 3) a weight patch on a projection
    cases.append(("attn.out_proj: a weight patch", args, lambda: b.attn.out_proj.weight_function.append(lambda w: w)))
    for reason, a, setup in cases:
        if setup is not None:
            setup()
        try:
            caplog.clear()
            d0 = patch.delegated
            with torch.no_grad():
                got = patch(dict(a, img=a["img"].clone()), {"original_block": _core(b)})["img"]
                got2 = patch(dict(a, img=a["img"].clone()), {"original_block": _core(b)})["img"]
                want = _core(b)(dict(a, img=a["img"].clone()))["img"]
            assert patch.delegated == d0 + 2 and torch.equal(got, want) and torch.equal(got2, want), reason
            msgs = [r.getMessage() for r in caplog.records if "fused block" in r.getMessage()]
            assert len([m for m in msgs if reason in m]) <= 1, msgs      # logged once per reason
        finally:
            b.mlp.fc1._h3_path = "fp8"
            b.attn.out_proj.weight_function.clear()
    # 4) the default device list (CUDA only): a CPU stream goes to core's block
    cuda_only = fb.FusedBlockPatch(b, 3, ops=fk.EAGER)
    with torch.no_grad():
        got = cuda_only(dict(args, img=args["img"].clone()), {"original_block": _core(b)})["img"]
        want = _core(b)(dict(args, img=args["img"].clone()))["img"]
    assert cuda_only.delegated == 1 and torch.equal(got, want)


def test_wrapped_projection_gets_a_bf16_input_through_its_forward(fp8_model):
    from h3_turbo.runtime import fused_block as fb

    b, args = _block_args(fp8_model)
    seen = []
    base = b.mlp.fc2.forward

    def foreign(x, *a, **k):
        seen.append(x.dtype)
        return base(x, *a, **k)

    b.mlp.fc2.forward = foreign
    try:
        patch = fb.FusedBlockPatch(b, 3, ops=fk.EAGER, devices=("cpu",))
        got = _run(patch, b, args)
    finally:
        del b.mlp.fc2.forward
    assert seen == [torch.bfloat16] and patch.routes == {"fp8": 3, "module": 1}
    with torch.no_grad():
        want = _core(b)(dict(args, img=args["img"].clone()))["img"]
    assert _rel_update(got, want, args["img"]) < 0.15


def test_install_chains_an_existing_entry_and_checks_the_structure(fp8_model, monkeypatch):
    import comfy.ops

    from h3_turbo.runtime import fused_block as fb

    m = fp8_model.clone()
    seen = []

    def sharding(args, extra):          # another override installed first (e.g. multi-GPU sharding)
        seen.append(extra["original_block"])
        return extra["original_block"](args)

    m.set_model_patch_replace(sharding, "dit", "double_block", 0)
    n = fb.install(m, ops=fk.EAGER, devices=("cpu",))
    entries = m.model_options["transformer_options"]["patches_replace"]["dit"]
    assert n == 50 and all(isinstance(entries[("double_block", i)], fb.FusedBlockPatch) for i in range(50))
    assert entries[("double_block", 0)].prev is sharding and entries[("double_block", 1)].prev is None
    assert fb.install(m, ops=fk.EAGER, devices=("cpu",)) == 50                 # re-install keeps the chain
    assert m.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 0)].prev is sharding
    b, args = _block_args(fp8_model, 0)
    with torch.no_grad():
        entries[("double_block", 0)](dict(args, img=args["img"].clone()), {"original_block": _core(b)})
    assert len(seen) == 1 and seen[0].__name__ == "inner"       # the earlier entry got our fused block as original
    # a core whose SwiGLU takes (up, gate): refused at install, naming core's version and the hook
    monkeypatch.setitem(comfy.ops.INPUT_ACT_EAGER, "swiglu",
                        lambda x: torch.nn.functional.silu(x.chunk(2, -1)[1]) * x.chunk(2, -1)[0])
    with pytest.raises(RuntimeError, match=r"blocks\.0 differs.*INPUT_ACT_EAGER\['swiglu'\].*ComfyUI 0\.33.*double_block"):
        fb.install(fp8_model.clone(), ops=fk.EAGER, devices=("cpu",))


def test_structure_problem_names_the_difference(fp8_model):
    from h3_turbo.runtime import fused_block as fb

    b = fp8_model.model.diffusion_model.blocks[0]

    class NoMlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2, self.attn, self.adaln_proj = b.norm1, b.norm2, b.attn, b.adaln_proj

    assert fb.structure_problem(NoMlp()) == "NoMlp has no attribute 'mlp'"


def test_apply_on_a_cpu_model_installs_nothing(fp8_model, caplog):
    from h3_turbo.runtime import fused_block as fb

    caplog.set_level(logging.WARNING, logger="h3_turbo")
    m = fb.apply(fp8_model, "fp8")
    assert m is not fp8_model
    assert not m.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit")
    assert fb.apply(fp8_model, "off").model_options.get("transformer_options", {}).get("patches_replace") is None
    with pytest.raises(ValueError, match="expected one of off, fp8"):
        fb.apply(fp8_model, "on")
    assert fb.resolve("fp8", "cpu") == (False, "device cpu is not CUDA (the fused block runs Triton kernels and "
                                                "torch._scaled_mm)")


def test_turbo_branch_wrapper_offers_its_fused_operands():
    """adapters.branch: a target wrapper on a fusable layer exposes h3turbo_lora_operands (None unless the fused route
    serves x; else the operands the layer's own fused call would get) and h3turbo_count (counts the execution)."""
    from h3_turbo.adapters.branch import TargetParams, TurboBranch

    class Layer:
        served = False

        def h3turbo_fusable(self, x):
            return self.served

        def h3turbo_lora_forward(self, *a):
            raise AssertionError("not called here")

    layer = Layer()
    br = TurboBranch.__new__(TurboBranch)
    br.counts, br.run_counts, br.fused_calls = [0], [0], 0
    p = TargetParams(torch.randn(6, 16), [torch.randn(8, 2) for _ in range(3)], 0.5, 24)
    fn = br._make_fn(lambda x: x, p, 0, 0.5 * 1.0, None, [True], layer.h3turbo_fusable)
    x = torch.randn(3, 16).to(torch.bfloat16)
    assert fn.h3turbo_lora_operands(x) is None                       # not fusable: the caller runs the forward
    layer.served = True
    a, bc, coef, blocks, amax_a, key = fn.h3turbo_lora_operands(x)
    assert a.shape == (6, 16) and bc.shape == (24, 2) and coef == 0.5 and blocks == 3 and a.dtype == torch.bfloat16
    assert torch.equal(amax_a, a.abs().amax(dim=1).float()) and key is not None
    fn.h3turbo_count()
    assert br.counts == [1] and br.run_counts == [1] and br.fused_calls == 1
    # an MLP-level capture slot (fc1 feeding an fc2 branch) keeps the plain wrapper: nothing offered
    assert not hasattr(br._make_fn(lambda x: x, p, 0, 0.5, {}, [True], layer.h3turbo_fusable), "h3turbo_lora_operands")


def test_fused_blocks_node_through_the_real_graph_on_cpu(comfy, fixtures_dir, caplog):
    """The node in a real prompt: on the CPU the fused block cannot serve, so the node returns an unchanged clone,
    says why once, and the prompt samples bit-identically to the same prompt without the node; mode=off installs
    nothing either. An unknown mode is refused by the node."""
    if "nvfp4" not in fixtures_dir:
        pytest.skip("comfy-kitchen missing: no NVFP4 fixture")
    from corpus import euler_av_prompt
    from h3_turbo.harness import PromptFailed

    loader = {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": "h3_tiny_nvfp4.safetensors",
                                                            "compute": "reference"}}

    def run(mode, prefix):
        p = {"1": loader, **euler_av_prompt(["2", 0] if mode else ["1", 0], prefixes=(prefix + "_v", prefix + "_a"))}
        if mode:
            p["2"] = {"class_type": "H3TurboFusedBlocks", "inputs": {"model": ["1", 0], "mode": mode}}
        return comfy.run_latents(p, ("12", "13"))

    from h3_turbo import state

    plain = run(None, "h3t/fz0")
    state.LOGGED.clear()                        # the reason is logged once per process: earlier tests may have
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        fused = run("fp8", "h3t/fz1")
    assert all(torch.equal(a, b) for a, b in zip(plain, fused)) and float(plain[0].std()) > 0.1
    assert "not installed" in caplog.text and "not CUDA" in caplog.text
    off = run("off", "h3t/fz2")
    assert all(torch.equal(a, b) for a, b in zip(plain, off))
    with pytest.raises(PromptFailed):
        run("fp16", "h3t/fz3")


def test_attention_wrapper_follows_cores_forward(comfy):
    """ComfyUI 0.33's Attention.forward wraps q/k/v in AttentionTensorContainer; a core whose forward passes plain
    tensors (and drops the v.clone()) gets plain tensors from the fused block, and its structure check still passes."""
    from comfy.ldm.minimax import model as h3
    from comfy.ldm.modules.attention import AttentionTensorContainer

    from h3_turbo.runtime import fused_block as fb

    assert fb._attention_wrapper(h3.Attention.__new__(h3.Attention)) is AttentionTensorContainer

    class PlainAttention(h3.Attention):
        def forward(self, x, rope_freqs=None, transformer_options={}):   # the names core's newer forward uses
            q, k, v = self.qkv_proj(x).split(self.heads * self.head_dim, dim=-1)
            comfy.quant_ops.ck.rms_rope_split_half_(q, k, rope_freqs, None, None)  # noqa: F821 - never run
            return self.out_proj(optimized_attention(q, k, v, self.heads))          # noqa: F821

    t = torch.ones(2, 3)
    assert fb._attention_wrapper(PlainAttention.__new__(PlainAttention))(t) is t
    assert not (fb._ATTN_NAMES - fb._names(PlainAttention.forward))


def test_sage_gluon_setting_falls_back_to_the_triton_kernel_with_its_reason_logged(caplog, monkeypatch):
    """``SETTINGS["sage_gluon"]`` where the Gluon kernel cannot run (here: a CPU device; then a configuration it does
    not implement; then a device where it failed before) keeps the route's Triton configuration unchanged and logs
    why once per reason, as a WARNING; where it can run, the configuration it implements."""
    from h3_turbo import state
    from h3_turbo.kernels.attention import int8_gluon
    from h3_turbo.kernels.attention import int8_kernels as K
    from h3_turbo.runtime import fused_block as fb

    assert fk.SETTINGS["sage_gluon"] == "auto"        # the default: where it can run
    state.LOGGED.clear()
    c = dict(K.tuned_config("cpu", 1024), TMA=True, QPRE=True, ROWSUM_MMA=True, MAXNREG=168)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="h3_turbo"):       # "auto" where it cannot run: INFO, once
        assert fb._gluon_config(c, cpu) is c
        fb._gluon_config(c, cpu)
    auto = [r for r in caplog.records if "sage_gluon" in r.getMessage()]
    assert len(auto) == 1 and auto[0].levelno == logging.INFO and "'auto'" in auto[0].getMessage()
    caplog.clear()
    state.LOGGED.clear()
    monkeypatch.setitem(fk.SETTINGS, "sage_gluon", True)      # asked for: a WARNING
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        assert fb._gluon_config(c, cpu) is c
        fb._gluon_config(c, cpu)
        monkeypatch.setattr(int8_gluon, "available", lambda device: None)      # as on a Hopper GPU
        g = fb._gluon_config(c, cpu)
        assert g is not c and g["GLUON"] and g["MAXNREG"] is None and g["Q_ROW"] and K._cfg(g) == g
        assert g["BLOCK_M"] == 64          # below GLUON_WS_TOKENS: the 4-warp form
        n = fk.GLUON_WS_TOKENS
        assert fb._gluon_config(c, cpu, n - 1)["BLOCK_M"] == 64
        w = fb._gluon_config(c, cpu, n)     # from there on: the warp-specialized form
        assert (w["BLOCK_M"], w["num_stages"], w["num_warps"]) == (128, fk.GLUON_WS_STAGES, 4)
        assert K._cfg(w) == w
        assert fb._gluon_config(dict(c, TMA=False), cpu)["GLUON"] is False
        monkeypatch.setitem(fb._GLUON_OFF, "cpu", "RuntimeError: boom")
        assert fb._gluon_config(c, cpu)["GLUON"] is False
    recs = [r for r in caplog.records if "sage_gluon" in r.getMessage()]
    msgs = [r.getMessage() for r in recs]
    assert len(msgs) == 3 and all("-> the Triton kernel" in m for m in msgs), msgs
    assert all(r.levelno == logging.WARNING for r in recs)
    assert "not CUDA" in msgs[0] or "not importable" in msgs[0]
    assert "got {'TMA': False}" in msgs[1] and "RuntimeError: boom" in msgs[2]
    assert c["GLUON"] is False and c["MAXNREG"] == 168
