"""Issue 22: H3 Turbo Multi-GPU (Ulysses sequence parallelism on yunchang) on the CPU with 2 gloo worker processes.

- the shard itself (torch only): 2 gloo processes run blocks with attention on an uneven sequence (padding), through
  the real BlockHook / UlyssesAttention / yunchang all-to-all, against the full sequence in one process;
- through the real ComfyUI on the tiny model: the Turbo 4-step graph (NVFP4, Turbo LoRA branch, H3 Turbo Sampler) and
  the base path (core's UNETLoader, ModelSamplingMiniMaxH3, the pack's attention backend, res_multistep + beta), each
  sharded on 2 workers against the one-process result (bit-identical on the CPU: asserted);
- refusals (head count, missing yunchang, one device = the MODEL itself), a worker crash (execution error with the
  worker's message, then clean workers), an interrupt (every worker stops, the pool stays), a timeout.

Skipped loudly (conftest) when yunchang is not installed: it is the pack's [multigpu] extra, which scripts/env.sh installs.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from corpus import model_node  # tests/ is on sys.path

pytestmark = pytest.mark.multigpu

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- torch only (no ComfyUI)
def test_local_segments_cut_to_the_shard_rows():
    from h3_turbo.parallel.engine import local_segments, pad_rows

    segs = [(0, 5, 3), (5, 12, 0), (12, 13, 6)]
    assert local_segments(segs, 0, 7) == [(0, 5, 3), (5, 7, 0)]
    assert local_segments(segs, 7, 14) == [(0, 5, 0), (5, 6, 6)]          # row 13 is padding: in no segment
    assert local_segments(segs, 14, 21) == []
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(pad_rows(t, 0, 2), torch.tensor([[0., 1], [2, 3], [4, 5], [0, 0], [0, 0]]))
    assert pad_rows(t, 0, 0) is t


def _sdpa(q, k, v, heads, skip_reshape=False, skip_output_reshape=False, **kw):
    """Stand-in for core's attention function: [1, H, S, D] in, [1, S, H*D] out."""
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return o if skip_output_reshape else o.transpose(1, 2).reshape(1, q.shape[2], -1)


class _Block:
    """A DiT-like block: per-row modulation by segment, per-row projection, attention over all rows, gated residual."""

    def __init__(self, seed, hidden=16, heads=4):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(3 * hidden, hidden, generator=g) / hidden ** 0.5
        self.o = torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
        self.scale = torch.randn(8, hidden, generator=g)
        self.heads, self.hidden = heads, hidden

    def __call__(self, h, segments, rope, override):
        x = h.clone()
        for a, b, row in segments:
            x[a:b] = x[a:b] * (1 + self.scale[row])
        s = x.shape[0]
        q, k, v = (x @ self.w.T).split(self.hidden, dim=-1)
        q = q * rope[0, :, 0, 0, 0, :1].reshape(s, 1)                      # a per-row factor from the rope table
        dh = self.hidden // self.heads
        q, k, v = (t.reshape(s, self.heads, dh).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        att = override(_sdpa, q, k, v, self.heads, skip_reshape=True) if override else _sdpa(q, k, v, self.heads,
                                                                                              skip_reshape=True)
        out = h.clone()
        y = att.squeeze(0) @ self.o.T
        for a, b, row in segments:
            out[a:b] += y[a:b] * self.scale[row + 1]
        return out


def _engine_check(ctx):
    """``call`` job in the pool's workers: 3 blocks on an uneven sequence, sharded through BlockHook /
    UlyssesAttention / yunchang's all-to-all (a chained hook on block 1), against the full sequence in one process.
    Returns every rank's (max |sharded - full|, rows the chained hook saw, stats)."""
    import torch.distributed as dist

    from h3_turbo.parallel.engine import BlockHook, SequenceShard, UlyssesAttention

    g = torch.Generator().manual_seed(0)
    seq, hidden = 37, 16                                                   # 37 rows: 2 ranks of 19, one padding row
    h0 = torch.randn(seq, hidden, generator=g)
    segs = [(0, 9, 1), (9, 30, 0), (30, 37, 2)]
    rope = torch.rand(1, seq, 1, 4, 2, 2, generator=g) + 0.5
    blocks = [_Block(i) for i in range(3)]
    full = h0
    for b in blocks:
        full = b(full, segs, rope, None)
    shard = SequenceShard(ctx.group, len(blocks), 4, cancelled=lambda: False)
    seen = []

    def prev_hook(args, extra):                                            # a hook that was there before: chained
        seen.append(args["img"].shape[0])
        return extra["original_block"](args)

    hooks = [BlockHook(shard, i, prev_hook if i == 1 else None) for i in range(3)]
    override = UlyssesAttention(shard, None)
    h = h0
    for i, b in enumerate(blocks):
        def original(args, b=b):
            return {"img": b(args["img"], args["mod_segments"], args["rope_freqs"], override)}
        h = hooks[i]({"img": h, "mod_segments": segs, "rope_freqs": rope}, {"original_block": original})["img"]
    mine = (tuple(h.shape), (h - full).abs().max().item(), seen, shard.stats.as_dict())
    every = [None] * ctx.world
    dist.all_gather_object(every, mine, group=ctx.group)
    return every


@pytest.mark.comfyui
def test_shard_and_ulysses_attention_equal_the_full_sequence_in_2_workers(rt):
    from h3_turbo.parallel import pool

    ranks, _ = pool.get_pool(2, "cpu").run({"kind": "call", "fn": _engine_check})
    assert len(ranks) == 2
    for rank, (shape, err, seen, stats) in enumerate(ranks):
        assert shape == (37, 16)
        assert err <= 1e-6, f"rank {rank}: max |sharded - full| = {err}"
        assert seen == [19]                                                 # the chained hook got this rank's rows
        assert stats["attention_calls"] == 3 and stats["forwards"] == 1


def test_degree_must_divide_the_heads():
    from h3_turbo.errors import SequenceParallelError
    from h3_turbo.parallel import engine

    assert engine.ulysses_degrees(56, 8) == [2, 4, 7, 8]
    engine.check_degree(7, 56)
    with pytest.raises(SequenceParallelError, match=r"3 GPUs do not divide the model's 56 attention heads.*2, 4, 7, 8"):
        engine.check_degree(3, 56)


# ------------------------------------------------------------------------------------------------ through ComfyUI
def _turbo_graph(seed=42, sp=None):
    wf = json.loads((REPO / "example_workflows" / "api" / "h3turbo_tiny_demo.json").read_text())
    del wf["13"]                                                           # the mp4 preview: not compared
    wf["7"]["inputs"]["noise_seed"] = seed
    wf["8"]["inputs"].update({"width": 96, "height": 64, "length": 22})
    if sp is not None:
        wf["20"] = {"class_type": "H3TurboSequenceParallel", "inputs": {"model": ["2", 0], "gpus": sp}}
        for n in ("3", "4", "5"):
            wf[n]["inputs"]["model"] = ["20", 0]
    return wf


def _base_graph(seed=7, sp=None, steps=2, extra=None):
    """Core's base path: UNETLoader (BF16) -> ModelSamplingMiniMaxH3 -> H3 Turbo Attention (exact) -> [Multi-GPU] ->
    BasicGuider, res_multistep + beta."""
    model = ["3", 0]
    wf = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "h3_tiny_bf16.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["1", 0], "shift_video": 12.0, "shift_audio": 3.0}},
        "3": {"class_type": "H3TurboAttention", "inputs": {"model": ["2", 0], "backend": "exact"}},
        "5": {"class_type": "H3TurboTestConditioning", "inputs": {"model": ["3", 0], "seed": 0, "tokens": 12}},
        "7": {"class_type": "BasicScheduler", "inputs": {"model": ["3", 0], "scheduler": "beta", "steps": steps,
                                                           "denoise": 1.0}},
        "8": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "res_multistep"}},
        "9": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "10": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 22}},
        "11": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["9", 0], "guider": ["6", 0], "sampler": ["8", 0],
                                                                 "sigmas": ["7", 0], "latent_image": ["10", 0]}},
        "12": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["11", 0]}},
        "13": {"class_type": "SaveLatent", "inputs": {"samples": ["12", 0], "filename_prefix": "h3turbo/sp_video"}},
        "14": {"class_type": "SaveLatent", "inputs": {"samples": ["12", 1], "filename_prefix": "h3turbo/sp_audio"}},
    }
    if extra is not None:
        wf["4"] = {"class_type": extra, "inputs": {"model": model}}
        model = ["4", 0]
    if sp is not None:
        wf["20"] = {"class_type": "H3TurboSequenceParallel", "inputs": {"model": model, "gpus": sp}}
        model = ["20", 0]
    wf["6"] = {"class_type": "BasicGuider", "inputs": {"model": model, "conditioning": ["5", 0]}}
    return wf


def _boom_on_rank1(executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper (module level, so it pickles into the workers): worker 1 fails in its first forward."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1 (test)")
    return executor(*args, **kwargs)


def _add_boom(m):
    import comfy.patcher_extension as pe

    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "h3turbo_test_boom", _boom_on_rank1)


_Boom = model_node(_add_boom, "Test-only: a DIFFUSION_MODEL wrapper that raises on rank 1.")


@pytest.fixture(scope="module")
def rt(comfy):
    import nodes

    nodes.NODE_CLASS_MAPPINGS["H3TurboTestBoom"] = _Boom
    yield comfy
    nodes.NODE_CLASS_MAPPINGS.pop("H3TurboTestBoom", None)
    from h3_turbo.parallel import pool

    pool.shutdown()


_ONE: dict = {}


def _one_process(rt, kind, seed):
    """The one-process result of graph ``kind`` ("turbo" / "base") at ``seed`` (computed once per session)."""
    if (kind, seed) not in _ONE:
        wf, outs = (_turbo_graph(seed), ("11", "12")) if kind == "turbo" else (_base_graph(seed), ("13", "14"))
        _ONE[(kind, seed)] = rt.run_latents(wf, outs)
    return _ONE[(kind, seed)]


def _agree(one, many, what):
    for name, a, b in zip(("video", "audio"), one, many):
        assert a.shape == b.shape
        assert torch.isfinite(a).all()
        err = (a - b).abs().max().item()
        assert torch.equal(a, b), f"{what} {name}: sharded != one process (max |diff| {err:.3e}, max |x| " \
                                  f"{a.abs().max().item():.3e})"


@pytest.mark.comfyui
def test_turbo_4step_nvfp4_on_2_workers_is_bit_identical_to_one_process(rt):
    from h3_turbo.parallel import pool

    one = _one_process(rt, "turbo", 42)
    many = rt.run_latents(_turbo_graph(sp=2), ("11", "12"))
    _agree(one, many, "Turbo 4-step")
    run = pool.LAST_RUN
    assert run["world"] == 2 and len(run["ranks"]) == 2
    for r in run["ranks"]:
        assert r["forwards"] == 4                      # the 4-step contract: 4 model calls, each sharded
        assert r["attention_calls"] == 4 * 50          # every DiT block's attention went through the all-to-all
        assert r["chained_hooks"] == 0


@pytest.mark.comfyui
def test_base_path_core_loader_res_multistep_beta_on_2_workers_is_bit_identical(rt):
    from h3_turbo.parallel import pool

    one = _one_process(rt, "base", 7)
    pids = [p.pid for p in pool._POOL.procs] if pool._POOL is not None else None
    many = rt.run_latents(_base_graph(sp=2), ("13", "14"))
    _agree(one, many, "base res_multistep+beta")
    assert all(r["forwards"] == 2 for r in pool.LAST_RUN["ranks"])       # res_multistep: one model call per step
    if pids is not None:                                                 # the workers are kept between requests
        assert [p.pid for p in pool._POOL.procs] == pids


@pytest.mark.comfyui
def test_node_plain_path_and_refusals(rt, fixtures_dir, monkeypatch):
    import nodes

    from h3_turbo.errors import SequenceParallelError
    from h3_turbo.parallel import apply as sp
    from h3_turbo.parallel import engine

    model = nodes.NODE_CLASS_MAPPINGS["UNETLoader"]().load_unet("h3_tiny_bf16.safetensors", "default")[0]
    assert sp.apply(model, 0) is model                                   # CPU: one device visible -> plain path
    assert sp.apply(model, 1) is model
    with pytest.raises(SequenceParallelError, match="3 GPUs do not divide the model's 2 attention heads"):
        sp.apply(model, 3)
    monkeypatch.setattr(engine, "yunchang_missing", lambda: "yunchang is not importable (test)")
    with pytest.raises(SequenceParallelError, match=r"needs yunchang.*pip install \"h3-turbo\[multigpu\]\""):
        sp.apply(model, 2)
    monkeypatch.undo()
    assert engine.core_hook_missing() is None                            # this core has the per-block hook
    monkeypatch.setattr(engine, "core_hook_missing", lambda: "MiniMaxH3Model._forward has no per-block hook (test)")
    import comfyui_version

    with pytest.raises(SequenceParallelError, match=rf"this ComfyUI \({re.escape(comfyui_version.__version__)}\) "
                                                    r"cannot be sharded: MiniMaxH3Model._forward has no per-block hook"):
        sp.apply(model, 2)
    monkeypatch.undo()
    m2 = sp.apply(model, 2)
    assert m2 is not model and m2.model_options["h3_turbo_sp"]["world"] == 2
    assert list(m2.model_options["transformer_options"]["wrappers"]["outer_sample"])[0] == "h3turbo_multigpu"
    assert "h3_turbo_sp" not in model.model_options                      # the input MODEL is untouched


@pytest.mark.comfyui
def test_worker_crash_is_an_execution_error_and_the_next_run_starts_clean_workers(rt):
    from h3_turbo.harness import PromptFailed
    from h3_turbo.parallel import pool

    old = list(pool.get_pool(2, "cpu").procs)                            # a pool is running
    with pytest.raises(PromptFailed, match=r"worker 1 .*failed: RuntimeError: boom on rank 1 \(test\)"):
        rt.run_latents(_base_graph(seed=9, sp=2, extra="H3TurboTestBoom"), ("13", "14"))
    assert all(not p.is_alive() for p in old)                            # every worker of the failed pool stopped
    one = _one_process(rt, "base", 7)
    many = rt.run_latents(_base_graph(seed=7, sp=2, steps=2), ("13", "14"))
    _agree(one, many, "after a crash")
    assert {p.pid for p in pool._POOL.procs}.isdisjoint({p.pid for p in old})


@pytest.mark.comfyui
def test_ui_interrupt_during_sharded_sampling_stops_the_workers_cleanly(rt):
    """ComfyUI's interrupt reaches a sampling run through its progress hook (main.py's hook raises
    InterruptProcessingException once the user pressed Stop): the workers stop at their next forward, the prompt ends
    interrupted, the pool stays up, and the next run is exact."""
    import comfy.model_management as mm
    import comfy.utils

    from h3_turbo.harness import PromptFailed
    from h3_turbo.parallel import pool

    pids = [p.pid for p in pool.get_pool(2, "cpu").procs]
    calls = []

    def hook(value, total, preview_image, prompt_id=None, node_id=None):
        calls.append(value)
        mm.interrupt_current_processing(True)          # the user pressed Stop after the first step
        mm.throw_exception_if_processing_interrupted()

    old = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(hook)
    try:
        with pytest.raises(PromptFailed):
            rt.run_latents(_turbo_graph(seed=11, sp=2), ("11", "12"))
    finally:
        comfy.utils.set_progress_bar_global_hook(old)
        mm.interrupt_current_processing(False)
    assert calls == [1]                                 # rank 0's first step reached the UI, then it stopped
    assert rt.executor.status_messages[-1][0] == "execution_interrupted"
    assert [p.pid for p in pool._POOL.procs] == pids and pool._POOL.alive()
    _agree(_one_process(rt, "turbo", 42), rt.run_latents(_turbo_graph(sp=2), ("11", "12")), "after an interrupt")


def _wait_for_cancel(ctx):
    """``call`` job: the shard's cancel check (an all-reduce of every rank's flag) every 20 ms, for at most 60 s."""
    from h3_turbo.parallel.engine import SequenceShard

    shard = SequenceShard(ctx.group, 1, 2, cancelled=ctx.cancelled)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        shard.check_cancel(torch.device("cpu"))
        time.sleep(0.02)
    return "not cancelled"


def _sleep(ctx, seconds):
    time.sleep(seconds)
    return ctx.rank


@pytest.mark.comfyui
def test_interrupt_stops_every_worker_and_a_silent_pool_times_out(rt, monkeypatch):
    from h3_turbo.errors import SequenceParallelError
    from h3_turbo.parallel import pool

    p = pool.get_pool(2, "cpu")
    t0 = time.monotonic()
    with pytest.raises(pool.Interrupted):
        p.run({"kind": "call", "fn": _wait_for_cancel}, interrupted=lambda: time.monotonic() - t0 > 1.0)
    assert time.monotonic() - t0 < 20 and p.alive()                      # stopped by the workers themselves
    assert p.run({"kind": "call", "fn": _sleep, "kwargs": {"seconds": 0}})[0] == 0
    monkeypatch.setenv("H3T_SP_TIMEOUT_S", "2")
    with pytest.raises(SequenceParallelError, match=r"no message from the workers for 2 s"):
        p.run({"kind": "call", "fn": _sleep, "kwargs": {"seconds": 30}})
    assert not p.alive() and not p.procs


def test_a_worker_exits_when_the_process_that_started_it_is_killed(tmp_path):
    """A server killed without its exit handlers (SIGKILL here; SIGTERM skips ``atexit`` too) must not leave its
    workers running: ``parallel.worker.watch_parent`` ends a process once it is re-parented. A child process that
    watches its parent outlives a killed parent by about the watch period, not forever."""
    import os
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "child.pid"
    child = ("import os, time; from h3_turbo.parallel.worker import watch_parent; "
             f"watch_parent(os.getppid(), 0.2); open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"])
    try:
        t0 = time.monotonic()
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() - t0 < 60, "the child did not start"
            time.sleep(0.1)
        cpid = int(pid_file.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            try:
                os.kill(cpid, 0)
            except ProcessLookupError:
                break
            try:
                with open(f"/proc/{cpid}/stat") as f:   # a zombie re-parented to init counts as gone
                    if f.read().split(")")[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            os.kill(cpid, signal.SIGKILL)
            pytest.fail("the child kept running after its parent was killed")
        assert time.monotonic() - t0 < 10
    finally:
        if parent.poll() is None:
            parent.kill()
