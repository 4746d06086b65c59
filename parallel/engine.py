"""Ulysses sequence parallelism inside core's H3 forward, on yunchang's all-to-all. Torch only (no ComfyUI).

Contract (one sequence-parallel group of N ranks, every rank running the same forward on the same inputs):

- :class:`SequenceShard` holds the per-forward plan. Its :class:`BlockHook` objects go into core's per-block hook
  ``transformer_options["patches_replace"]["dit"][("double_block", i)]`` (``MiniMaxH3Model._forward``). At block 0
  the hook pads the packed sequence h [S, hidden] to N*L rows (L = ceil(S/N), zero rows at the end) and keeps rows
  [rank*L, (rank+1)*L); ``mod_segments`` are cut to the local rows (a per-token row tensor of a newer core with them)
  and ``rope_freqs`` [1, S, 1, r, 2, 2] sliced (zero rows for the padding). Each block then runs on the local rows
  only (core's own block, or the hook that was there before: it is called with the shard, never replaced). After the last block the hook all-gathers the rows and trims
  the padding, so core's final layer sees the full sequence [S, hidden] on every rank.
- :class:`UlyssesAttention` is the attention override (``transformer_options["optimized_attention_override"]``). While a
  block runs sharded it takes core's call (q, k, v [1, H, L, D], ``skip_reshape``), stacks q/k/v and exchanges them with
  yunchang's ``all_to_all_5D`` (local rows of all heads -> all rows of H/N heads), drops the padding rows, calls the
  attention that was installed before it (the pack's backend, e.g. ``exact``; core's own when none) on the full
  sequence for its H/N heads, pads, and sends the result back with ``all_to_all_4D``. Outside the sharded blocks (the
  token refiner) it hands the call on unchanged.
- The padding rows are never attended to (they are cut before attention) and belong to no modulation segment; they stay
  zero and are dropped at the gather, so padding changes no value.

Exactness: every op of a block except attention is per row (norms, modulation, projections, Turbo branch, SwiGLU); with
the same kernels a row's result does not depend on which other rows share the call, except through the GEMM kernel's
choice for another row count (the measured agreement is in ``docs/multigpu.md``). Attention sees the same full q/k/v
per head as on one device.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..errors import SequenceParallelError

YUNCHANG_VERSION = "0.6.4"
INSTALL_HINT = ("install the pack's [multigpu] extra into the Python that runs ComfyUI: "
                "pip install \"h3-turbo[multigpu]\" from PyPI, or `pip install -e \".[multigpu]\"` in the pack's folder "
                f"(it is yunchang=={YUNCHANG_VERSION})")


def yunchang_missing() -> str | None:
    """Why yunchang's all-to-all cannot be imported here (None when it can)."""
    try:
        from yunchang.comm.all_to_all import all_to_all_4D, all_to_all_5D  # noqa: F401
        import yunchang.globals  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"yunchang is not importable ({type(e).__name__}: {e})"
    return None


def require_yunchang() -> None:
    """Raise :class:`SequenceParallelError` with the install command when yunchang is missing."""
    why = yunchang_missing()
    if why:
        raise SequenceParallelError(f"H3 Turbo Multi-GPU needs yunchang (Ulysses all-to-all): {why}; {INSTALL_HINT}")


def ulysses_degrees(heads: int, limit: int) -> list[int]:
    """The Ulysses degrees >= 2 and <= ``limit`` that divide ``heads`` (H3's 56 heads: 2, 4, 7, 8, 14, ...)."""
    return [n for n in range(2, int(limit) + 1) if heads % n == 0]


def check_degree(world: int, heads: int) -> None:
    """Refuse a group size that does not divide the head count (Ulysses splits the heads between the ranks)."""
    if world < 1:
        raise SequenceParallelError(f"H3 Turbo Multi-GPU: {world} workers (expected >= 1)")
    if heads % world:
        ok = ", ".join(map(str, ulysses_degrees(heads, max(heads, 8)))) or "none"
        raise SequenceParallelError(
            f"H3 Turbo Multi-GPU: {world} GPUs do not divide the model's {heads} attention heads (Ulysses gives each GPU "
            f"heads/{world} heads); use a GPU count that divides {heads}: {ok}. Ring attention for other counts is not "
            "offered by this pack (docs/multigpu.md)")


def core_hook_missing() -> str | None:
    """Why core's H3 lacks what the shard relies on (None when it has it): the per-block hook
    ``patches_replace["dit"][("double_block", i)]`` with ``img``/``mod_segments``/``rope_freqs``/``original_block``, and the
    attention call through ``optimized_attention`` with ``skip_reshape=True``. Needs ComfyUI importable."""
    import inspect

    try:
        import comfy.ldm.minimax.model as m
        src_f = inspect.getsource(m.MiniMaxH3Model._forward)
        src_a = inspect.getsource(m.Attention.forward)
    except Exception as e:  # noqa: BLE001
        return f"core's H3 model code cannot be read ({type(e).__name__}: {e})"
    need_f = ('("double_block", i)', '"img"', '"mod_segments"', '"rope_freqs"', '"original_block"', '"t_emb"')
    miss = [s for s in need_f if s not in src_f]
    if miss:
        return f"MiniMaxH3Model._forward has no per-block hook patches_replace['dit'][('double_block', i)] with {miss}"
    if "optimized_attention(" not in src_a or "skip_reshape=True" not in src_a:
        return "H3 Attention.forward does not call optimized_attention(q, k, v, heads, skip_reshape=True)"
    return None


@dataclass
class ShardPlan:
    """The rows of one forward: ``seq_len`` S, ``local_len`` L = ceil(S/N), this rank's rows [lo, hi) of the padded
    sequence, the local ``segments`` (core's ``mod_segments`` cut to [lo, hi), local coordinates) and ``rope``."""

    seq_len: int
    local_len: int
    lo: int
    hi: int
    segments: list
    rope: torch.Tensor | None

    @property
    def padded_len(self) -> int:
        return self.hi - self.lo


def local_segments(segments, lo: int, hi: int) -> list:
    """Core's ``mod_segments`` [(a, b, row)] (absolute rows) cut to the rows [lo, hi), in local coordinates. A row is
    an int, or (newer cores, a latent denoise mask) an index tensor with one entry per row of the segment, cut with
    the rows. Another kind of row is a SequenceParallelError naming it and the ComfyUI version."""
    from ..runtime.core_compat import check_mod_row

    out = []
    for a, b, row in segments:
        a, b = int(a), int(b)
        try:
            row = check_mod_row(row, b - a, "H3 Turbo Multi-GPU (mod_segments of the per-block hook)")
        except ValueError as e:
            raise SequenceParallelError(str(e)) from None
        a2, b2 = max(a, lo), min(b, hi)
        if a2 < b2:
            if isinstance(row, torch.Tensor):
                row = row[a2 - a:b2 - a]
            out.append((a2 - lo, b2 - lo, row))
    return out


def pad_rows(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t`` with ``n`` zero rows appended along ``dim`` (``t`` itself when n == 0)."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat((t, t.new_zeros(shape)), dim=dim)


@dataclass
class ShardStats:
    """Counters of one worker: forwards, sharded attention calls, and (with ``profile``) seconds spent in the
    all-to-all exchanges and the final gather (device-synchronized around each collective)."""

    forwards: int = 0
    attention_calls: int = 0
    passthrough_calls: int = 0
    all_to_all_s: float = 0.0
    gather_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"forwards": self.forwards, "attention_calls": self.attention_calls,
                "passthrough_calls": self.passthrough_calls, "all_to_all_s": self.all_to_all_s,
                "gather_s": self.gather_s}


class SequenceShard:
    """The sequence-parallel state of one worker: its group (yunchang's Ulysses group), the block count, the per-forward
    :class:`ShardPlan` and whether a sharded block is running (``active``: the attention override only exchanges then).

    ``cancelled``: optional callable -> bool, read at block 0 of every forward; the flags of all ranks are combined
    (all-reduce max) so that every rank stops at the same forward (:class:`Interrupted`).
    """

    def __init__(self, group, num_blocks: int, heads: int, cancelled=None, profile: bool = False):
        import torch.distributed as dist

        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_blocks = int(num_blocks)
        self.heads = int(heads)
        check_degree(self.world, self.heads)
        self.cancelled = cancelled
        self.profile = bool(profile)
        self.plan: ShardPlan | None = None
        self.active = False
        self.stats = ShardStats()

    # ---- timing --------------------------------------------------------------------------------------------------
    def _sync(self, device) -> None:
        if self.profile and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    def _timed(self, what: str, device, fn):
        if not self.profile:
            return fn()
        self._sync(device)
        t0 = time.perf_counter()
        out = fn()
        self._sync(device)
        setattr(self.stats, what, getattr(self.stats, what) + time.perf_counter() - t0)
        return out

    # ---- rows ----------------------------------------------------------------------------------------------------
    def check_cancel(self, device) -> None:
        if self.cancelled is None:
            return
        import torch.distributed as dist

        flag = torch.tensor([1 if self.cancelled() else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()):
            self.plan = None
            raise Interrupted("interrupted")

    def begin(self, h: torch.Tensor, mod_segments, rope_freqs) -> torch.Tensor:
        """Block 0: make the plan for ``h`` [S, hidden] and return this rank's rows [L, hidden]."""
        if h.ndim != 2:
            raise SequenceParallelError(f"H3 Turbo Multi-GPU: block 0 got img of shape {tuple(h.shape)} "
                                        "(expected core's packed sequence [S, hidden])")
        s = int(h.shape[0])
        n = self.world
        lq = math.ceil(s / n)
        lo, hi = self.rank * lq, (self.rank + 1) * lq
        rope = None
        if rope_freqs is not None:
            if rope_freqs.shape[1] != s:
                raise SequenceParallelError(f"H3 Turbo Multi-GPU: rope_freqs has {rope_freqs.shape[1]} rows for a "
                                            f"sequence of {s} (expected core's [1, S, 1, r, 2, 2] table)")
            rope = pad_rows(rope_freqs, 1, n * lq - s)[:, lo:hi]
        self.plan = ShardPlan(s, lq, lo, hi, local_segments(mod_segments, lo, hi), rope)
        self.stats.forwards += 1
        return pad_rows(h, 0, n * lq - s)[lo:hi]

    def gather(self, h_local: torch.Tensor) -> torch.Tensor:
        """After the last block: all ranks' rows, padding dropped: [S, hidden] (the same on every rank)."""
        import torch.distributed as dist

        plan = self.plan
        out = torch.empty((plan.local_len * self.world,) + tuple(h_local.shape[1:]), dtype=h_local.dtype,
                          device=h_local.device)
        # torch >= 2.14 names it all_gather_single (all_gather_into_tensor is deprecated there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._timed("gather_s", h_local.device, lambda: gather(out, h_local.contiguous(), group=self.group))
        self.plan = None
        return out[:plan.seq_len]

    # ---- installation --------------------------------------------------------------------------------------------
    def install(self, model_patcher) -> int:
        """Put a :class:`BlockHook` on every DiT block of ``model_patcher`` (a clone; chaining any hook already there)
        and the :class:`UlyssesAttention` override (wrapping the installed one). Returns the number of hooks chained."""
        to = model_patcher.model_options.setdefault("transformer_options", {})
        existing = dict((to.get("patches_replace") or {}).get("dit") or {})
        chained = 0
        for i in range(self.num_blocks):
            prev = existing.get(("double_block", i))
            chained += prev is not None
            model_patcher.set_model_patch_replace(BlockHook(self, i, prev), "dit", "double_block", i)
        to = model_patcher.model_options["transformer_options"]
        to["optimized_attention_override"] = UlyssesAttention(self, to.get("optimized_attention_override"))
        return chained


class Interrupted(SequenceParallelError):
    """Every rank stopped at the same forward because the main process asked (ComfyUI's interrupt)."""


class BlockHook:
    """Core's ``patches_replace["dit"][("double_block", index)]`` entry: runs block ``index`` on the local rows
    (block 0 shards, the last block gathers). ``prev``: the hook that was installed before (called with the shard)."""

    def __init__(self, shard: SequenceShard, index: int, prev=None):
        self.shard, self.index, self.prev = shard, int(index), prev

    def __call__(self, args: dict, extra: dict) -> dict:
        sh = self.shard
        h = args["img"]
        if self.index == 0:
            sh.check_cancel(h.device)
            h = sh.begin(h, args["mod_segments"], args.get("rope_freqs"))
        elif sh.plan is None or h.shape[0] != sh.plan.local_len:
            raise SequenceParallelError(
                f"H3 Turbo Multi-GPU: block {self.index} got {h.shape[0]} rows, expected this rank's "
                f"{sh.plan.local_len if sh.plan else '?'} (the blocks did not run in order from block 0)")
        local = dict(args)
        local["img"], local["mod_segments"], local["rope_freqs"] = h, sh.plan.segments, sh.plan.rope
        sh.active = True
        try:
            out = self.prev(local, extra) if self.prev is not None else extra["original_block"](local)
        finally:
            sh.active = False
        h = out["img"]
        if self.index == sh.num_blocks - 1:
            h = sh.gather(h)
        return {**out, "img": h}


class UlyssesAttention:
    """The attention override of a sharded worker (see the module docstring). ``inner``: the override installed before
    it (``override(func, q, k, v, heads, **kwargs)``, e.g. the pack's ``exact``), or None for core's own ``func``."""

    backend = "ulysses"

    def __init__(self, shard: SequenceShard, inner=None):
        self.shard, self.inner = shard, inner

    def _run(self, func, *args, **kwargs):
        if self.inner is not None:
            return self.inner(func, *args, **kwargs)
        return func(*args, **kwargs)

    def __call__(self, func, *args, **kwargs):
        sh = self.shard
        if not sh.active:
            sh.stats.passthrough_calls += 1
            return self._run(func, *args, **kwargs)
        from yunchang.comm.all_to_all import all_to_all_4D, all_to_all_5D

        q, k, v, heads = args[:4]
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if not kwargs.get("skip_reshape", False) or q.ndim != 4 or q.shape[0] != 1 or mask is not None:
            raise SequenceParallelError(
                "H3 Turbo Multi-GPU: a sharded block called attention with q of shape "
                f"{tuple(q.shape)}, skip_reshape={kwargs.get('skip_reshape', False)}, mask={'set' if mask is not None else None}"
                " (expected core's H3 call: q/k/v [1, heads, rows, head_dim], skip_reshape=True, no mask)")
        plan, n = sh.plan, sh.world
        h_all, lq = int(q.shape[1]), int(q.shape[2])
        if h_all % n or lq != plan.local_len:
            raise SequenceParallelError(f"H3 Turbo Multi-GPU: attention got {h_all} heads x {lq} rows; expected heads "
                                        f"divisible by {n} and {plan.local_len} local rows")
        qkv = torch.stack((q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), dim=2)   # [1, L, 3, H, D]
        qkv = sh._timed("all_to_all_s", q.device,
                        lambda: all_to_all_5D(qkv, scatter_idx=3, gather_idx=1, group=sh.group))   # [1, N*L, 3, H/N, D]
        s = plan.seq_len
        q2, k2, v2 = (qkv[:, :s, i].transpose(1, 2) for i in range(3))                        # [1, H/N, S, D]
        kw = dict(kwargs)
        out = self._run(func, q2, k2, v2, h_all // n, *args[4:], **kw)
        d = q.shape[-1]
        if kw.get("skip_output_reshape", False):
            o4 = out.transpose(1, 2)                                                           # [1, S, H/N, D]
        else:
            o4 = out.reshape(1, s, h_all // n, d)
        o4 = pad_rows(o4, 1, n * lq - s).contiguous()
        o = sh._timed("all_to_all_s", q.device,
                      lambda: all_to_all_4D(o4, scatter_idx=1, gather_idx=2, group=sh.group))      # [1, L, H, D]
        sh.stats.attention_calls += 1
        if kw.get("skip_output_reshape", False):
            return o.transpose(1, 2)
        return o.reshape(1, lq, h_all * d)
