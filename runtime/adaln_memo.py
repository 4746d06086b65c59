"""AdaLN without resident weights, for any sampler and schedule (issue 17 item 2; docs/memory.md).

H3's per-block ``adaln_proj`` output and the final layer's depend on the forward's timesteps only (core
``comfy/ldm/minimax/model.py``: ``t_emb = time_embedder(t_vals).to(dtype)`` for the sorted distinct row timesteps,
then ``adaln_proj(t_emb)`` per block). :func:`install` takes core's own ``time_embedder`` and every ``adaln_proj``
module out of a built, unpruned H3 (so ComfyUI neither counts nor moves them: they stay in CPU memory) and puts
stand-ins in their place:

- :class:`MemoTimeEmbedder` keys each forward by the fp32 bits of its timestep group. A group seen before (in this
  process, or read from the on-disk cache) is a row lookup; a new group is computed once by core's own modules:
  each one runs on the forward's device with its weights copied there for the call, exactly as core runs it (fp32
  timestep MLP, ``.to(dtype)``, then ``silu`` + linear in the compute dtype), so the rows equal what resident
  weights give on that device, bit for bit (same modules, same arithmetic, same batch). On CUDA the copy is
  streamed through a small pinned ring and overlaps the compute (:func:`streamed_rows`); elsewhere, or after a
  streamed pass failed, one synchronous copy per module (:func:`plain_rows`, :func:`with_weights_on`). Each pass
  counts once in :data:`WEIGHT_READS`.
- :class:`MemoAdaLN` stands in for one ``adaln_proj``: ``rows[idx]`` viewed and chunked as core's ``AdalnProj``.
- :func:`sample_wrapper`, a ComfyUI ``WrappersMP.OUTER_SAMPLE`` wrapper (core's KSampler, SamplerCustomAdvanced and
  the pack's sampler all run through it, with the sigmas known): before sampling it reads the cache file of
  (model hash, compute dtype, device type, sigmas) if one exists, then computes the groups it predicts from the
  sigmas (:func:`predict_groups`; H3 Turbo Sampler predicts its own: :func:`prefetch_groups`) that neither holds, in
  one pass over the weights; after, if any group was computed from the weights during the run, it writes the groups
  the run used or predicted, with those the file held, to that file in the pack's table format
  (:func:`h3_turbo.runtime.adaln.write_table`). A second run of the same schedule therefore reads the table and
  never touches the weights, whichever sampler ran the schedule first.

A timestep outside a *fixed* table (``runtime/adaln.py``: the DMD loader, ``patch``) is refused there, never
interpolated; this module never interpolates either: an unknown group is computed from the weights.
Pruned checkpoints (``adaln_t_table`` curve form) are left to core (:func:`install` refuses them).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time

import torch

from .. import state
from ..errors import CheckpointError
from ..logs import log, log_once
from . import adaln as A
from . import adaln_lora

#: passes over the AdaLN weights ("passes"), timestep groups computed in them ("groups"), groups read from a
#: cache file ("cached"), cache files written ("written")
WEIGHT_READS = state.Counters("adaln_weight_reads", ("passes", "groups", "cached", "written"))
#: environment variable naming the on-disk cache folder (default: ``models/h3turbo_adaln/cache``)
CACHE_ENV = "H3_TURBO_ADALN_CACHE"
WRAPPER_KEY = "h3_turbo_adaln_memo"


def cache_dir() -> str:
    """The folder of the on-disk AdaLN caches: ``$H3_TURBO_ADALN_CACHE``, else ``<models>/h3turbo_adaln/cache``."""
    d = os.environ.get(CACHE_ENV)
    if d:
        return d
    import folder_paths

    return os.path.join(folder_paths.models_dir, "h3turbo_adaln", "cache")


def model_hash(path: str) -> str:
    """Identity of a checkpoint for the cache: SHA-256 of its safetensors header bytes, size and mtime (reading
    the 26 GB of AdaLN weights to hash them would defeat the cache; a changed file gets a new hash)."""
    st = os.stat(path)
    h = hashlib.sha256(f"{os.path.basename(path)}|{st.st_size}|{st.st_mtime_ns}|".encode())
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h.update(f.read(min(n, 1 << 28)))
    return h.hexdigest()[:32]


def adaln_bytes(diffusion_model) -> int:
    """Bytes of the AdaLN weights (``time_embedder`` + every ``adaln_proj``) of a built H3."""
    dm = diffusion_model
    mods = [dm.time_embedder, dm.final_layer.adaln_proj] + [b.adaln_proj for b in dm.blocks]
    return sum(p.nbytes for m in mods if m is not None for p in list(m.parameters()) + list(m.buffers()))


class _Holder:
    """Keeps modules out of the model tree (not a Module: ComfyUI does not see, count or move what it holds)."""

    def __init__(self, modules):
        self.modules = modules


class Memo:
    """The growing table of one model: ``groups`` (fp32 bits) -> first row; per block its row chunks. ``run_groups``:
    the groups the current sampling run used; ``computed``: whether the run computed any from the weights."""

    def __init__(self, time_embedder, blocks, final, key: str):
        self._mods = _Holder({"te": time_embedder, "blocks": list(blocks), "final": final})
        self.key = key
        self.lock = threading.Lock()
        self.index: dict[tuple[int, ...], int] = {}
        self.rows = 0
        self.blocks: list[list[torch.Tensor]] = [[] for _ in blocks]
        self.final: list[torch.Tensor] = []
        self._cat: tuple[int, list[torch.Tensor], torch.Tensor] | None = None
        self.run_groups: list[tuple[int, ...]] = []
        self.run_predicted: list[tuple[int, ...]] = []   # the groups predicted for the current run (stored or not)
        self.path_groups: dict[str, list[tuple[int, ...]]] = {}   # cache file -> the groups it holds
        self.computed = False
        self.loaded: set[str] = set()
        self._chunk: dict[tuple[int, ...], int] = {}    # group -> its entry in blocks[i] / final
        self._staged: dict[torch.device, _Staged] = {}
        self.sampling = False        # inside a sampling run (sample_wrapper): its groups were predicted or cached
        self.stream_ok = True        # False after a streamed pass failed (compute: plain from then on)
        self.last_pass: tuple[str, float] | None = None     # (mode, seconds) of the latest pass (compute)

    def _add(self, key, blocks, final) -> int:
        start = self.rows
        self.index[key] = start
        self._chunk[key] = len(self.final)
        for i, b in enumerate(blocks):
            self.blocks[i].append(b)
        self.final.append(final)
        self.rows += len(key)
        self._cat = None
        return start

    def tensors(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(per block [R, 18H], final [R, 2H]) of every stored group, concatenated once per growth."""
        if self._cat is None or self._cat[0] != self.rows:
            self._cat = (self.rows, [torch.cat(c, 0) for c in self.blocks], torch.cat(self.final, 0))
        return self._cat[1], self._cat[2]

    def slot(self, key: tuple[int, ...], device) -> int:
        """The first slot row of stored group ``key`` in the device copy of ``device``, copied there from the
        group's own rows when it is not held (caller holds ``lock``). See :class:`_Staged`."""
        dev = torch.device(device)
        c = self._chunk[key]
        st = self._staged.get(dev)
        if st is None:
            st = self._staged[dev] = _Staged(len(self.blocks), self.blocks[0][c], self.final[c], dev)
        at = st.where.get(key)
        if at is None:
            at = st.put(key, torch.stack([b[c] for b in self.blocks]), self.final[c])
        return at

    def staged(self, device) -> "_Staged":
        """The device copy of ``device`` (:meth:`slot` made it for this forward)."""
        return self._staged[device]

    def compute(self, groups: list[torch.Tensor], dtype: torch.dtype, mode: str = "auto",
                staging: tuple[int, int] | None = None) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Rows of each group (fp32 timesteps, all on one device) from core's own modules, one batch per group as
        core's forward, in one pass over the weights; returns per group (per block rows [n, 18H], final [n, 2H]) in
        CPU memory. ``mode``: ``plain`` copies each module's weights to the device once (:func:`with_weights_on`),
        ``streamed`` runs :func:`streamed_rows` (``staging``: its (bytes, buffers), default
        (:data:`STAGING_BYTES`, :data:`STAGING_BUFFERS`)), ``auto`` streams on CUDA when the weights are in CPU
        memory, else plain. Both give the same rows bit for bit (same modules, same arithmetic, same bytes). A
        streamed pass that fails is logged once (WARNING, with the error) and this memo runs plain from then on."""
        if mode not in ("auto", "plain", "streamed"):
            raise ValueError(f"AdaLN memo: mode={mode!r}: expected auto, plain or streamed")
        dev = groups[0].device
        mods = self._mods.modules
        if mode == "auto":
            mode, why = auto_mode(mods, dev)
            if why:
                log_once(("adaln-stream-off", self.key, why), "H3 Turbo AdaLN (adaln=table): %s -> this model's "
                         "first-run pass copies its weights module by module (not streamed)", why)
        out, t0 = None, time.perf_counter()
        if mode == "streamed" and self.stream_ok:
            try:
                out = streamed_rows(mods, groups, dtype, *(staging or (STAGING_BYTES, STAGING_BUFFERS)))
            except Exception as e:   # noqa: BLE001  (pinning refused, device memory, ...): today's pass instead
                self.stream_ok = False
                log_once(("adaln-stream-fallback", self.key), "H3 Turbo AdaLN (adaln=table): the streamed pass over "
                         "the AdaLN weights failed (%s: %s); this model computes its rows with one synchronous "
                         "copy per module from now on", type(e).__name__, e, level=logging.WARNING)
        if out is None:
            mode = "plain"
            out = plain_rows(mods, groups, dtype)
        self.last_pass = (mode, time.perf_counter() - t0)
        WEIGHT_READS.incr("passes")
        WEIGHT_READS.incr("groups", len(groups))
        return out

    def prefetch(self, groups: list[tuple[float, ...]], dtype: torch.dtype, device) -> int:
        """Compute the groups not stored yet in one pass (sampling start, groups predicted from the sigmas);
        returns how many were computed. Every predicted group is kept for the run's cache file."""
        with self.lock:
            keys = [A._bits(g) for g in groups]
            self.run_predicted += [k for k in dict.fromkeys(keys) if k not in self.run_predicted]
            todo = [(k, g) for k, g in zip(keys, groups) if k not in self.index]
            todo = list(dict(todo).items())
            if not todo:
                return 0
            out = self.compute([torch.tensor(g, dtype=torch.float32, device=device) for _, g in todo], dtype)
            for (k, _), (b, f) in zip(todo, out):
                self._add(k, b, f)
            self.computed = True
            return len(todo)

    def group_of(self, t_vals: torch.Tensor, dtype: torch.dtype) -> tuple[int, ...]:
        """The group key (fp32 bits) of a forward's timesteps, its rows computed from the weights on first use."""
        key = A._bits(t_vals.detach().float().cpu().tolist())
        with self.lock:
            if key not in self.index:
                if self.sampling:
                    log_once(("adaln-miss", self.key, key), "H3 Turbo AdaLN (adaln=table): timestep group %s is "
                             "neither in this schedule's cache nor among the groups predicted at sampling start; "
                             "computing it from the AdaLN weights (one more pass over them). Later runs of this "
                             "schedule read it from the cache.",
                             torch.tensor(key, dtype=torch.int32).view(torch.float32).tolist(), level=logging.WARNING)
                (blocks, final), = self.compute([t_vals], dtype)
                self._add(key, blocks, final)
                self.computed = True
            if key not in self.run_groups:
                self.run_groups.append(key)
        return key

    def load(self, table: A.AdaLNTable) -> int:
        """Add the groups of a cache table not stored yet; returns how many were added."""
        n = 0
        with self.lock:
            for g, s in zip(table.groups, table.starts):
                if g in self.index:
                    continue
                self._add(g, [b[s:s + len(g)] for b in table.blocks], table.final[s:s + len(g)])
                n += 1
        return n

    def write(self, path: str, meta: dict) -> None:
        """The groups of the current run (used or predicted) and those the file held, in the pack's table format:
        one schedule's sigmas can be run by samplers whose groups differ (H3 Turbo Sampler with and without a Turbo
        contract: their per-call audio shifts differ in the last bits), and each must find its groups there."""
        with self.lock:
            groups = list(dict.fromkeys(self.path_groups.get(path, []) + self.run_groups + self.run_predicted))
            self.path_groups[path] = groups
            blocks, final = self.tensors()
            idx = torch.cat([torch.arange(self.index[g], self.index[g] + len(g)) for g in groups])
            vals = [tuple(torch.tensor(g, dtype=torch.int32).view(torch.float32).tolist()) for g in groups]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            A.write_table(path, [b[idx] for b in blocks], final[idx], vals, meta)


class _Staged:
    """Device copies of memo groups, so that a forward's 50 block lookups are device-only (no host round trip per
    block): one buffer per device of ``rows`` rows per DiT block and for the final layer, filled as a ring (first in,
    first overwritten); a group is copied in once (when first used on that device, or again after the ring overwrote
    it) and its slot rows are what :class:`MemoTimeEmbedder` encodes. Copies and reads run in stream order, so
    overwriting a slot that an earlier forward read is safe; two forwards of one model running at once on one device
    (ComfyUI runs one prompt at a time) could overwrite each other's rows. ``rows`` (:meth:`rows_for`): 32 on
    devices with at least 48 GiB (8 groups of 4 timesteps; 32 x 50 x 18 x hidden elements, 310 MB in bf16 at H3's
    width) and on the CPU, else 8 (78 MB: a 24 GB card keeps its memory; a schedule with more rows re-copies a
    group per forward). Freed when ComfyUI unloads the model (:func:`_drop_staged_on_detach`)."""

    ROWS = 32
    SMALL_ROWS = 8

    @classmethod
    def rows_for(cls, device) -> int:
        d = torch.device(device)
        if d.type == "cuda" and torch.cuda.get_device_properties(d).total_memory < 48 * 2**30:
            return cls.SMALL_ROWS
        return cls.ROWS

    def __init__(self, n_blocks: int, block_rows: torch.Tensor, final_rows: torch.Tensor, device):
        """Buffers shaped and typed as one group's rows (``block_rows`` [n, 18H], ``final_rows`` [n, 2H])."""
        self.rows = self.rows_for(device)
        self.blocks = torch.empty(n_blocks, self.rows, block_rows.shape[1], dtype=block_rows.dtype, device=device)
        self.final = torch.empty(self.rows, final_rows.shape[1], dtype=final_rows.dtype, device=device)
        self.where: dict[tuple[int, ...], int] = {}     # group -> first slot row
        self.next = 0

    def put(self, key: tuple[int, ...], blocks: torch.Tensor, final: torch.Tensor) -> int:
        """Copy group ``key``'s rows (``blocks`` [n_blocks, n, 18H], ``final`` [n, 2H]) into the next n slot rows
        (dropping the groups they overwrite); returns the first."""
        n = len(key)
        if n > self.rows:
            raise ValueError(f"AdaLN memo: a forward with {n} distinct timesteps (at most {self.rows})")
        if self.next + n > self.rows:
            self.next = 0
        at, self.next = self.next, self.next + n
        self.where = {k: a for k, a in self.where.items() if a + len(k) <= at or a >= at + n}   # overwritten
        self.blocks[:, at:at + n].copy_(blocks)
        self.final[at:at + n].copy_(final)
        self.where[key] = at
        return at


class MemoTimeEmbedder(torch.nn.Module):
    """Stands in for core's ``time_embedder``: the forward's rows in the memo (computed on first use), encoded as
    [M, 2] floats exact in any float dtype. Core casts the result to its compute dtype; the memo needs that dtype to
    compute a new group as core does, so it is read from the base model's ``get_dtype_inference`` (``dtype_of``)."""

    def __init__(self, memo: Memo, dtype_of):
        super().__init__()
        self.memo = memo
        self._dtype_of = dtype_of

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        memo = self.memo
        key = memo.group_of(t, self._dtype_of())
        with memo.lock:
            at = memo.slot(key, t.device)
        return A._encode(torch.arange(at, at + len(key), device=t.device), t.device)   # made there: no host copy


class MemoAdaLN(torch.nn.Module):
    """Stands in for one ``AdalnProj`` (block ``index``, or the final layer when ``index`` is None)."""

    def __init__(self, memo: Memo, index: int | None, expand: int, modalities: int, hidden: int):
        super().__init__()
        self.memo, self.index = memo, index
        self.expand, self.modalities, self.hidden = expand, modalities, hidden

    def forward(self, t_emb: torch.Tensor):
        st = self.memo.staged(t_emb.device)
        rows = st.final if self.index is None else st.blocks[self.index]
        x = rows.index_select(0, A._decode(t_emb))      # t_emb: slot rows on this device (MemoTimeEmbedder)
        x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
        return x.chunk(self.expand, dim=-1)


def with_weights_on(mod: torch.nn.Module, device, force_copy: bool = False):
    """A callable that runs ``mod``'s own forward with its parameters and buffers copied to ``device`` (the module
    and its CPU tensors are left as they are: no copy back, no new CPU allocation); ``mod`` itself when they are
    already there (``force_copy``: copies anyway, for tests). The same module code on the same device and values, so
    the same numbers as ``mod.to(device)``."""
    device = torch.device(device)
    tensors = dict(mod.named_parameters())
    tensors.update(mod.named_buffers())
    if not force_copy and all(t.device == device for t in tensors.values()):
        return mod
    copies = {n: t.to(device, copy=True) for n, t in tensors.items()}
    return lambda *args, **kwargs: torch.func.functional_call(mod, copies, args, kwargs, strict=True)


#: the streamed pass (:func:`streamed_rows`): bytes of one pinned staging buffer, and how many
STAGING_BYTES = 64 << 20
STAGING_BUFFERS = 3
#: byte alignment of each tensor in a device slot (CUDA's allocator aligns to 512: the views are aligned as
#: fresh tensors are)
SLOT_ALIGN = 512


def _order(mods: dict) -> list[torch.nn.Module]:
    """The modules of a pass in their order: the time embedder, the DiT blocks', the final layer's."""
    return [mods["te"], *mods["blocks"], mods["final"]]


def _tensors_of(mod: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``mod`` by name (what ``functional_call(strict=True)`` takes)."""
    tensors = dict(mod.named_parameters())
    tensors.update(mod.named_buffers())
    return tensors


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """(byte offset of each tensor in a module's device slot, each a multiple of :data:`SLOT_ALIGN`; slot bytes)."""
    offs, at = {}, 0
    for n, t in tensors.items():
        offs[n] = at
        at += -(-t.numel() * t.element_size() // SLOT_ALIGN) * SLOT_ALIGN
    return offs, at


def _pieces(nbytes: int, size: int) -> list[tuple[int, int]]:
    """(start, length) of the consecutive pieces of at most ``size`` bytes that cover ``nbytes``."""
    return [(a, min(size, nbytes - a)) for a in range(0, nbytes, size)]


def _rows(out, n: int) -> torch.Tensor:
    """An ``AdalnProj`` output (its chunks) as [n, expand * modalities * hidden] rows, as the memo stores them."""
    return torch.cat(out, -1).reshape(n, -1)


def auto_mode(mods: dict, device) -> tuple[str, str | None]:
    """(``streamed`` or ``plain``, why not streamed where that needs saying): streamed on CUDA when every weight is in
    CPU memory and contiguous. The streamed pass computes on contiguous copies of the bytes, and a strided weight can
    sum in another order there, so such a model keeps the plain pass (the module's own layout: bit-identity to
    resident weights)."""
    ts = [t for m in _order(mods) for t in _tensors_of(m).values()]
    if torch.device(device).type != "cuda" or not all(t.device.type == "cpu" for t in ts):
        return "plain", None
    if not all(t.is_contiguous() for t in ts):
        return "plain", "a non-contiguous AdaLN weight"
    return "streamed", None


def plain_rows(mods: dict, groups: list[torch.Tensor], dtype: torch.dtype):
    """One pass, module by module: the weights copied to the groups' device (:func:`with_weights_on`: a synchronous
    copy, none when they are there), the rows computed and copied back per group. See :meth:`Memo.compute`."""
    dev = groups[0].device

    def on_device(mod, fn):
        return fn(with_weights_on(mod, dev))

    with torch.no_grad():
        # core: t_emb = time_embedder(t_vals).to(dtype)
        t_embs = on_device(mods["te"], lambda te: [te(t).to(dtype) for t in groups])
        blocks = [on_device(m, lambda m: [_rows(m(e), e.shape[0]).cpu() for e in t_embs]) for m in mods["blocks"]]
        final = on_device(mods["final"], lambda m: [_rows(m(e), e.shape[0]).cpu() for e in t_embs])
    return [([b[j] for b in blocks], final[j]) for j in range(len(groups))]


def streamed_rows(mods: dict, groups: list[torch.Tensor], dtype: torch.dtype, staging_bytes: int = STAGING_BYTES,
                  staging_buffers: int = STAGING_BUFFERS):
    """:func:`plain_rows` with the weight upload overlapped: the modules' bytes go through ``staging_buffers``
    buffers of ``staging_bytes`` (pinned on CUDA; a ring, each reused once its device copy is done) into two
    device slots (the next module is uploaded while the current one computes), on a side stream with events
    ordering copy, compute and reuse; the host copy of the next piece runs while earlier pieces are in flight. The
    rows stay on the device and come back in one copy at the end. Each module runs its own forward
    (``functional_call``) on views of its slot holding its exact bytes, aligned as fresh tensors: the same modules,
    arithmetic and values as :func:`plain_rows`. On a CPU device the same steps run synchronously (no pinning, no
    streams): the tests' check of the chunking and ordering. Device memory: two slots of the largest module (2 x
    520 MB at H3's width) and the rows; host: the staging buffers (torch keeps pinned ones cached for the next
    pass). Errors propagate (:meth:`Memo.compute` falls back)."""
    if staging_bytes < 1 or staging_buffers < 1:
        raise ValueError(f"AdaLN memo: staging of {staging_buffers} x {staging_bytes} bytes")
    dev = groups[0].device
    cuda = dev.type == "cuda"
    plan = []
    for m in _order(mods):
        tensors = {n: t.detach() for n, t in _tensors_of(m).items()}
        plan.append((m, tensors, *_layout(tensors)))
    slot_bytes = max(p[3] for p in plan)
    with torch.no_grad(), (torch.cuda.device(dev) if cuda else contextlib.nullcontext()):
        slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=dev) for _ in range(min(2, len(plan)))]
        stage = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(staging_buffers)]
        main = torch.cuda.current_stream(dev) if cuda else None
        side = torch.cuda.Stream(dev) if cuda else None
        if cuda:
            side.wait_stream(main)     # the slots' memory may still be read by earlier work queued on main
        stage_done: list = [None] * staging_buffers     # event: the device copy out of that staging buffer is done
        slot_done: list = [None] * len(slots)           # event: the compute reading that slot is done
        k = 0
        t_embs, results = None, []
        try:
            for j, (mod, tensors, offs, _) in enumerate(plan):
                slot = slots[j % len(slots)]
                if cuda and slot_done[j % len(slots)] is not None:
                    side.wait_event(slot_done[j % len(slots)])
                for n, t in tensors.items():
                    src = t.contiguous().reshape(-1).view(torch.uint8)
                    for a, size in _pieces(src.numel(), staging_bytes):
                        if stage_done[k] is not None:
                            stage_done[k].synchronize()
                        buf = stage[k][:size]
                        buf.copy_(src[a:a + size])
                        dst = slot[offs[n] + a:offs[n] + a + size]
                        if cuda:
                            with torch.cuda.stream(side):
                                dst.copy_(buf, non_blocking=True)
                                stage_done[k] = side.record_event()
                        else:
                            dst.copy_(buf)
                        k = (k + 1) % staging_buffers
                if cuda:
                    main.wait_stream(side)
                views = {n: slot[offs[n]:offs[n] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                         for n, t in tensors.items()}

                def fn(*args, mod=mod, views=views):
                    return torch.func.functional_call(mod, views, args, strict=True)

                if t_embs is None:                      # core: t_emb = time_embedder(t_vals).to(dtype)
                    t_embs = [fn(t).to(dtype) for t in groups]
                else:
                    results.append([_rows(fn(e), e.shape[0]) for e in t_embs])
                if cuda:
                    slot_done[j % len(slots)] = main.record_event()
            flat = [r for per in results for r in per]
            if len({r.dtype for r in flat}) == 1:       # one device -> host copy
                host = torch.cat([r.reshape(-1) for r in flat]).cpu()
                flat = [v.view(r.shape) for v, r in zip(host.split([r.numel() for r in flat]), flat)]
            else:
                flat = [r.cpu() for r in flat]
        finally:
            if cuda:
                main.wait_stream(side)                  # the slots go back to the allocator after the copies
    ng = len(groups)
    per = [flat[i * ng:(i + 1) * ng] for i in range(len(results))]
    blocks, final = per[:-1], per[-1]
    return [([b[j] for b in blocks], final[j]) for j in range(ng)]


def _compute_dtype(base_model) -> torch.dtype:
    """The dtype core's forward computes in (``model_base``: ``get_dtype_inference``; the context is cast to it)."""
    return base_model.get_dtype_inference()


def install(model_patcher, key: str) -> int:
    """Take the AdaLN modules out of the model of ``model_patcher`` (a built unpruned core H3) into CPU memory,
    put the memo stand-ins in their place and register :func:`sample_wrapper`. ``key``: the checkpoint identity
    (:func:`model_hash`). Returns the bytes taken off the model. CheckpointError for a pruned (curve-form) model."""
    dm = model_patcher.model.diffusion_model
    if getattr(dm, "use_adaln_curves", False):
        raise CheckpointError(key, "the model is a pruned curve-form checkpoint (adaln_t_table): its AdaLN is "
                                   "small and left to core", expected="an unpruned H3 for adaln=table")
    n = adaln_bytes(dm)
    te, final = dm.time_embedder, dm.final_layer.adaln_proj
    blocks = [b.adaln_proj for b in dm.blocks]
    for m in [te, final] + blocks:
        m.to("cpu")
    memo = Memo(te, blocks, final, key)
    base = model_patcher.model
    dm.time_embedder = MemoTimeEmbedder(memo, lambda: _compute_dtype(base))
    for i, b in enumerate(dm.blocks):
        b.adaln_proj = MemoAdaLN(memo, i, 6, 3, dm.hidden_size)
    dm.final_layer.adaln_proj = MemoAdaLN(memo, None, 2, 1, dm.hidden_size)
    dm.h3_turbo_adaln_memo = _Holder(memo)
    adaln_lora.add_key_slots(dm)     # a LoRA's AdaLN keys reach the patcher, where sample_wrapper refuses them
    import comfy.patcher_extension as pe

    model_patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, sample_wrapper)
    model_patcher.add_callback_with_key(pe.CallbacksMP.ON_DETACH, WRAPPER_KEY, _drop_staged_on_detach)
    return n


def _drop_staged_on_detach(patcher, unpatch_all=True) -> None:
    """ComfyUI ``ON_DETACH``: a real unload (``unpatch_all``) frees the memo's device copies (:class:`_Staged`); the
    rows stay in CPU memory and are copied in again at the next forward. A clone handing the model over keeps them."""
    memo = memo_of(patcher)
    if unpatch_all and memo is not None:
        with memo.lock:
            memo._staged.clear()


def memo_of(model_patcher) -> Memo | None:
    """The memo of a model loaded with ``adaln=table``, else None."""
    dm = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    h = getattr(dm, "h3_turbo_adaln_memo", None)
    return h.modules if h is not None else None


def cache_path(memo: Memo, sigmas: torch.Tensor, dtype: torch.dtype, device: torch.device) -> str:
    """``<cache_dir>/<model hash>/<schedule hash>.safetensors``; the schedule hash covers the sigmas' fp32 bits,
    the compute dtype and the device type (rows are bit-identical per device, not across devices)."""
    s = sigmas.detach().float().cpu().contiguous()
    h = hashlib.sha256(f"{dtype}|{torch.device(device).type}|".encode() + s.view(torch.int32).numpy().tobytes())
    return os.path.join(cache_dir(), memo.key, h.hexdigest()[:32] + ".safetensors")


def predict_groups(sigmas: torch.Tensor, model_options: dict, diffusion_model, device=None) -> list[tuple[float, ...]]:
    """The timestep groups core's forwards will use for ``sigmas`` with the run's shifts (``transformer_options``
    ``minimax_h3_sigma_shift_video/_audio``, else the model's), without and with visual condition rows at core's
    0.999, computed on ``device`` (the forwards' device: the same fp32 bits). A prediction only: a group it misses is
    computed on first use, one it adds is never looked up (samplers that change the shifts per call, such as H3
    Turbo Sampler's audio shift, miss some)."""
    to = model_options.get("transformer_options", {}) or {}
    sv = float(to.get("minimax_h3_sigma_shift_video", getattr(diffusion_model, "sigma_shift_video", 12.0)))
    sa = float(to.get("minimax_h3_sigma_shift_audio", getattr(diffusion_model, "sigma_shift_audio", 3.0)))
    out: list[tuple[float, ...]] = []
    for s in sigmas.detach().float().cpu().tolist():
        if s <= 0:
            continue
        for c in (None, A.VISUAL_COND_T):
            g = A.forward_timesteps(s, sv, sa, c, device)
            if g not in out:
                out.append(g)
    return out


def _log_pass(memo: Memo, n: int) -> None:
    """One INFO line per (model, group count): the groups a pass computed, its mode and its seconds."""
    mode, secs = memo.last_pass or ("?", float("nan"))
    log_once(("adaln-prefetch", memo.key, n), "H3 Turbo AdaLN: computed %d timestep groups of this schedule in one "
             "pass over the AdaLN weights (%s, %.2f s)", n, mode, secs)


#: attribute of a KSAMPLER function that predicts and prefetches its own groups (:func:`prefetch_groups`)
PREDICTS_ATTR = "h3_turbo_prefetches_adaln"


def prefetch_groups(model_patcher, groups: list[tuple[float, ...]]) -> int:
    """For samplers that know their forwards' timestep groups (H3 Turbo Sampler: per-call audio shifts): compute
    those not stored yet (in memory or in this schedule's cache file) in one pass over the AdaLN weights; none for a
    model without ``adaln=table``. Returns how many were computed."""
    memo = memo_of(model_patcher)
    if memo is None:
        return 0
    n = memo.prefetch(groups, _compute_dtype(model_patcher.model), model_patcher.load_device)
    if n:
        _log_pass(memo, n)
    return n


def sample_wrapper(executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
    """``WrappersMP.OUTER_SAMPLE``: read the cache of this schedule before sampling, write it after when the run
    computed any timestep group from the weights."""
    guider = executor.class_obj
    mp = guider.model_patcher
    memo = memo_of(mp)
    if memo is None:
        return executor(noise, latent_image, sampler, sigmas, *args, **kwargs)
    adaln_lora.refuse(mp, "adaln=table")   # before core loads or patches anything
    dtype, device = _compute_dtype(mp.model), mp.load_device
    path = cache_path(memo, sigmas, dtype, device)
    if path not in memo.loaded and os.path.isfile(path):
        try:
            table = A.read_table(path)
            added = memo.load(table)
            memo.path_groups[path] = list(table.groups)
            WEIGHT_READS.incr("cached", added)
            memo.loaded.add(path)
            log_once(("adaln-cache-read", path), "H3 Turbo AdaLN: read the cached table %s (%d timestep groups)",
                     path, added)
        except CheckpointError as e:
            log.warning("H3 Turbo AdaLN: ignoring the unreadable cache %s (%s); the rows are computed from the "
                        "weights", path, e)
    with memo.lock:
        memo.run_groups, memo.run_predicted, memo.computed = [], [], False
    # the predicted groups not stored yet (none when the cache holds this schedule) in one pass; a sampler that knows
    # its own groups (H3 Turbo Sampler) calls prefetch_groups itself
    n = 0
    if not getattr(getattr(sampler, "sampler_function", None), PREDICTS_ATTR, False):
        n = memo.prefetch(predict_groups(sigmas, guider.model_options, mp.model.diffusion_model, device), dtype, device)
    if n:
        _log_pass(memo, n)
    outer = memo.sampling
    memo.sampling = True
    try:
        out = executor(noise, latent_image, sampler, sigmas, *args, **kwargs)
    finally:
        memo.sampling = outer
    if memo.computed and memo.run_groups:
        memo.write(path, {"model_hash": memo.key, "sigmas": sigmas.detach().float().cpu().tolist(),
                          "dtype": str(dtype), "device": torch.device(device).type,
                          "computed_by": "core TimeEmbedder/AdalnProj modules (adaln=table)"})
        memo.loaded.add(path)
        WEIGHT_READS.incr("written")
        log_once(("adaln-cache-write", path), "H3 Turbo AdaLN: wrote the table of this schedule to %s", path)
    return out
