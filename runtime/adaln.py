"""AdaLN tables: H3's per-block modulation precomputed for the timesteps of one schedule (docs/turboh3.md, "AdaLN").

H3's AdaLN depends on the timestep only (core ``comfy/ldm/minimax/model.py``: ``t_emb = time_embedder(t).to(dtype)``
once per forward for the sorted distinct row timesteps, then per DiT block ``adaln_proj.linear(silu(t_emb))`` ->
[M, 18 * hidden] viewed as [M * 3, 6 * hidden], and ``final_layer.adaln_proj`` -> [M, 2 * hidden]). A table holds
those outputs for given timesteps, so the 13 B AdaLN parameters need not be loaded.

- :class:`AdaLNTable`: groups of timesteps (one group = the sorted distinct timesteps of one forward, keyed by
  their fp32 bits) with per block rows [R, 18 * hidden] and final rows [R, 2 * hidden];
  :meth:`AdaLNTable.rows_for` finds the rows of a forward's timesteps: the exact group (bit-identical to core's
  weight-driven AdaLN when computed as core computes, same batch), else each timestep from any group (logged once),
  else :class:`~h3_turbo.errors.CheckpointError` naming the table and the timestep; never an interpolation;
- readers (:func:`read_table`, by detection): the pack's own format (one safetensors file + JSON metadata, written
  by :func:`write_table`), LightX2V's ``adaln_cache.safetensors`` + ``manifest.json`` and its per-block
  ``block_XXX.safetensors`` + ``norm_out.safetensors`` + ``READY`` variant, the TurboH3 release's inferred row
  layout (``formats.dmd.read_release_rows``); anything else is refused with what was found;
- :func:`timestep_groups`: the groups a schedule's forwards use with H3 Turbo Sigmas + H3 Turbo Sampler (with and
  without the visual condition rows at 0.999), reproducing core's fp32 arithmetic;
- :func:`compute_table`: the rows from BF16 (or NVFP4-file) weights with core's own ``TimeEmbedder`` / ``AdalnProj``
  modules (fp32 timestep MLP, rows in the model's compute dtype), one group per batch as core's forward;
- :func:`install`: put a table into a built H3 (``time_embedder`` -> row lookup, every ``adaln_proj`` -> its rows;
  the DMD loader, whose model never loads the AdaLN weights); :func:`patch`: the same as ModelPatcher object
  patches on a clone (any loaded H3 keeps its weights); core's forward runs unchanged around them.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import state
from ..errors import CheckpointError
from ..logs import log, log_once

FORMAT = "h3_turbo_adaln_table"
FORMAT_VERSION = 1
#: core's ``VISUAL_COND_TIMESTEP`` (condition rows pinned at max(t_v, 0.999); docs/h3-facts.md)
VISUAL_COND_T = 0.999
_ENC = 128.0   # row index = hi * 128 + lo (both exact in bf16 / fp16)
#: forwards served by AdaLN tables, by how their rows were found: "group" (one stored batch, bit-equal keys),
#: "nearest" (one stored batch, keys within TOLERANCE) or "composed" (per timestep from several groups)
LOOKUPS = state.Counters("adaln_table_lookups", ("group", "nearest", "composed"))
#: |dt| within which a forward's timestep matches a stored key that is not bit-equal (docs/turboh3.md, "AdaLN": core
#: recomputes the audio timestep from the video sigma in fp32, 16 ulp = 1.2e-7 from fp32(1 - sigma_audio) at t = 0.1;
#: 16 ulp anywhere in [0, 1) is at most 9.5e-7; a schedule's distinct timesteps lie >= 1e-3 apart)
TOLERANCE = 2e-6


# --------------------------------------------------------------------------------------------- schedules

@dataclass(frozen=True)
class Schedule:
    """A sampling schedule: ``nfe`` model evaluations on the uniform shifted grids of ``shift_video`` /
    ``shift_audio`` (docs/h3-facts.md, "Sigma schedules")."""

    name: str
    nfe: int
    shift_video: float
    shift_audio: float

    def as_dict(self) -> dict:
        from ..samplers.schedules import shifted_grid

        return {"name": self.name, "nfe": self.nfe, "shift_video": self.shift_video, "shift_audio": self.shift_audio,
                "sigmas_video": shifted_grid(self.nfe, self.shift_video, torch.float32).tolist(),
                "sigmas_audio": shifted_grid(self.nfe, self.shift_audio).tolist()}


SCHEDULES = {"dmd": Schedule("dmd", 4, 12.0, 3.0), "4step": Schedule("4step", 4, 6.0, 3.0),
             "8step": Schedule("8step", 8, 12.0, 3.0)}


def schedule(spec: str) -> Schedule:
    """``dmd`` (TurboH3: 4 updates, 12/3), ``4step`` (6/3), ``8step`` (12/3), or ``N:SV/SA`` (e.g. ``6:12/3``)."""
    if spec in SCHEDULES:
        return SCHEDULES[spec]
    try:
        n, shifts = spec.split(":")
        sv, sa = shifts.split("/")
        return Schedule(spec, int(n), float(sv), float(sa))
    except ValueError:
        raise ValueError(f"schedule {spec!r}: expected one of {', '.join(SCHEDULES)} or N:SHIFT_VIDEO/SHIFT_AUDIO "
                         "(e.g. 6:12/3)") from None


def forward_timesteps(sigma_v: float, shift_v: float, shift_a: float, cond: float | None,
                      device=None) -> tuple[float, ...]:
    """The sorted distinct row timesteps core's H3 forward uses at video sigma ``sigma_v`` (an fp32 value, as the
    SIGMAS tensor holds it) with per-call shifts ``shift_v`` / ``shift_a`` and visual condition rows at ``cond``
    (None: no condition rows). Reproduces core's fp32 arithmetic: ``timestep = sigma * 1000`` (model_sampling),
    ``sigma_v = timestep / 1000``, ``t_v = 1 - sigma_v``, ``t_a = 1 - time_shift_sigma(sigma_v, shift_v, shift_a)``,
    on ``device`` (default CPU): the forward's device gives the forward's bits (CUDA divides a tensor by a Python
    scalar as a multiply by its reciprocal, so a CPU prediction can miss a CUDA forward's timestep by one ulp)."""
    from comfy.ldm.minimax.model import time_shift_sigma

    ts = (torch.tensor([sigma_v], dtype=torch.float32, device=device) * 1000).float()
    sv = (ts.flatten()[0] / 1000.0).float().clamp(min=1e-6)
    t_v = float(1.0 - sv)
    t_a = float(1.0 - time_shift_sigma(sv, shift_v, shift_a))
    vals = {t_v, t_a} | ({max(t_v, cond)} if cond is not None else set())
    return tuple(torch.tensor(sorted(vals), dtype=torch.float32).tolist())


def timestep_groups(sched: Schedule, conds=(None, VISUAL_COND_T), device=None) -> list[tuple[float, ...]]:
    """The timestep groups of every forward of ``sched`` run by H3 Turbo Sigmas + H3 Turbo Sampler (its per-call
    audio shift, ``samplers/training_euler.py``), for each condition level in ``conds``; distinct, in step order.
    ``device``: where the forwards run (:func:`forward_timesteps`: a CUDA forward's fp32 timesteps can differ from
    the CPU's by an ulp; e.g. the 4step schedule at its steps 2-4)."""
    from ..samplers.schedules import audio_shift_for_call, shifted_grid

    sv = [float(s) for s in shifted_grid(sched.nfe, sched.shift_video, torch.float32).double().tolist()]
    sa = shifted_grid(sched.nfe, sched.shift_audio).tolist()
    out: list[tuple[float, ...]] = []
    for c in conds:
        for i in range(sched.nfe):
            g = forward_timesteps(sv[i], sched.shift_video, audio_shift_for_call(sv[i], sa[i], sched.shift_video,
                                                                                 sched.shift_audio), c, device)
            if g not in out:
                out.append(g)
    return out


def _bits(values) -> tuple[int, ...]:
    return tuple(torch.tensor(list(values), dtype=torch.float32).view(torch.int32).tolist())


# --------------------------------------------------------------------------------------------- the table

@dataclass
class AdaLNTable:
    """Rows of the AdaLN outputs. ``groups``: per group the fp32 bits of its sorted timesteps; ``starts``: the row
    of each group's first timestep (its rows follow in order); ``blocks``: per DiT block [R, 18 * hidden];
    ``final``: [R, 2 * hidden] or None; ``layout``: which reader read it; ``meta``: its metadata."""

    path: str
    layout: str
    hidden: int
    groups: list[tuple[int, ...]]
    starts: list[int]
    blocks: list[torch.Tensor]
    final: torch.Tensor | None
    meta: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.blocks[0].shape[0] if self.blocks else 0

    def timesteps(self) -> list[float]:
        out = []
        for g in self.groups:
            out += torch.tensor(g, dtype=torch.int32).view(torch.float32).tolist()
        return out

    def describe(self) -> str:
        ts = sorted(set(self.timesteps()))
        return (f"{os.path.basename(self.path.rstrip('/'))} ({self.layout}: {len(self.blocks)} blocks, {len(self.groups)} "
                f"timestep groups, timesteps {', '.join(f'{t:.6g}' for t in ts)})")

    def check_fits(self, layers: int, hidden: int, need_final: bool) -> None:
        """CheckpointError unless the table has ``layers`` blocks of width ``hidden`` (and final rows if needed)."""
        if len(self.blocks) != layers or self.hidden != hidden:
            raise CheckpointError(self.path, f"AdaLN table for {len(self.blocks)} blocks x hidden {self.hidden}, the "
                                             f"model has {layers} x {hidden}", expected="a table made for these weights")
        if need_final and self.final is None:
            raise CheckpointError(self.path, "AdaLN table has no final-layer rows (norm_out) and the model has no "
                                             "norm_out.linear weights", expected="final rows in the table")

    def rows_for(self, t_vals: torch.Tensor) -> torch.Tensor:
        """Row indices (int64 [M], CPU) of a forward's sorted distinct timesteps ``t_vals`` (fp32). The exact group
        first; else a stored group whose timesteps each lie within :data:`TOLERANCE` of the forward's (another
        implementation's fp32 arithmetic; logged once with the distance); else every timestep from a group holding it,
        exactly or within the tolerance (logged once: equal to the weight-driven AdaLN up to the GEMM's
        batch-dependent rounding); else CheckpointError naming the table, the timestep, the nearest stored timestep
        and the distance. Never interpolated."""
        key = _bits(t_vals.detach().float().cpu().tolist())
        for g, s in zip(self.groups, self.starts):
            if g == key:
                LOOKUPS.incr("group")
                return torch.arange(s, s + len(g))
        want = _floats(key)
        for g, s in zip(self.groups, self.starts):
            if len(g) == len(key) and all(abs(a - b) <= TOLERANCE for a, b in zip(_floats(g), want)):
                LOOKUPS.incr("nearest")
                self._log_nearest(key, g)
                return torch.arange(s, s + len(g))
        rows, near = [], []
        for b, t in zip(key, want):
            hit = next((s + g.index(b) for g, s in zip(self.groups, self.starts) if b in g), None)
            if hit is None:
                hit, kb, dt = self._nearest(b, t)
                near.append(kb)
            rows.append(hit)
        LOOKUPS.incr("composed")
        if near:
            self._log_nearest(key, None)
        log_once(("adaln-compose", self.path, key), "H3 Turbo AdaLN table %s: the timestep group %s is not stored "
                 "as one batch; its rows are taken per timestep from other groups (same values up to the GEMM's "
                 "batch-dependent rounding)", os.path.basename(self.path), [round(v, 6) for v in t_vals.tolist()])
        return torch.tensor(rows)

    def _nearest(self, b: int, t: float) -> tuple[int, int, float]:
        """(row, stored bits, |dt|) of the stored timestep nearest ``t`` (fp32 bits ``b``) within :data:`TOLERANCE`;
        CheckpointError naming the nearest key and the distance otherwise."""
        best = None
        for g, s in zip(self.groups, self.starts):
            for j, (gb, gt) in enumerate(zip(g, _floats(g))):
                d = abs(gt - t)
                if best is None or d < best[2]:
                    best = (s + j, gb, d)
        if best is not None and best[2] <= TOLERANCE:
            return best
        near = "the table is empty" if best is None else \
            f"the nearest stored timestep is {_floats((best[1],))[0]!r} (fp32 bits 0x{best[1] & 0xFFFFFFFF:08x}), " \
            f"|dt| = {best[2]:.3g} > the tolerance {TOLERANCE:g}"
        raise CheckpointError(self.path, f"timestep {t!r} (fp32 bits 0x{b & 0xFFFFFFFF:08x}) of this forward is not in "
                                         f"the AdaLN table {self.describe()}: {near}; tables hold only the timesteps of "
                                         "their schedule and are never interpolated",
                              expected="the table's schedule (steps, shifts) or adaln=none / a table for this schedule "
                                       "(`python -m h3_turbo.tools adaln-table`)")

    def _log_nearest(self, key: tuple[int, ...], group: tuple[int, ...] | None) -> None:
        pairs = []
        for b, t in zip(key, _floats(key)):
            if group is not None:
                gb = group[key.index(b)]
            elif any(b in g for g in self.groups):
                continue
            else:
                gb = self._nearest(b, t)[1]
            if gb != b:
                pairs.append(f"{t!r} -> {_floats((gb,))[0]!r} (|dt| {abs(_floats((gb,))[0] - t):.3g})")
        log_once(("adaln-nearest", self.path, key), "H3 Turbo AdaLN table %s: timesteps matched to the nearest stored "
                 "key within %g (fp32 arithmetic of another implementation; no interpolation): %s",
                 os.path.basename(self.path), TOLERANCE, ", ".join(pairs))


def _floats(bits) -> list[float]:
    return torch.tensor(list(bits), dtype=torch.int32).view(torch.float32).tolist()


def _encode(idx: torch.Tensor, device) -> torch.Tensor:
    return torch.stack([torch.div(idx, _ENC, rounding_mode="floor"), idx % int(_ENC)], 1).float().to(device)


def _decode(t_emb: torch.Tensor) -> torch.Tensor:
    e = t_emb.float()
    return (e[:, 0] * _ENC + e[:, 1]).round().long()


class TableTimeEmbedder(torch.nn.Module):
    """Stands in for core's ``time_embedder``: maps the forward's timesteps to their table rows, encoded as an
    [M, 2] float tensor (exact in any float dtype) that the :class:`TableAdaLN` modules decode."""

    def __init__(self, table: AdaLNTable):
        super().__init__()
        self.table = table

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return _encode(self.table.rows_for(t), t.device)


class TableAdaLN(torch.nn.Module):
    """Stands in for one ``AdalnProj``: ``rows[idx]`` viewed and chunked as core's ``AdalnProj.forward`` does
    ([M, expand*hidden*modalities] -> [M*modalities, expand*hidden] -> ``expand`` chunks)."""

    def __init__(self, rows: torch.Tensor, expand: int, modalities: int, hidden: int):
        super().__init__()
        self.expand, self.modalities, self.hidden = expand, modalities, hidden
        self.register_buffer("rows", rows)

    def forward(self, t_emb: torch.Tensor):
        import comfy.model_management

        rows = comfy.model_management.cast_to(self.rows, device=t_emb.device)
        x = rows.index_select(0, _decode(t_emb).to(rows.device))
        x = x.view(x.shape[0] * self.modalities, self.expand * self.hidden)
        return x.chunk(self.expand, dim=-1)


class WeightAdaLN(torch.nn.Module):
    """The final layer's modulation from its weights when the table has no final rows: the encoded rows are turned
    back into their timesteps and run through the original ``time_embedder`` and ``adaln_proj`` (core's modules)."""

    def __init__(self, table: AdaLNTable, time_embedder, adaln_proj):
        super().__init__()
        self.table, self.time_embedder, self.adaln_proj = table, time_embedder, adaln_proj
        self._times = torch.tensor(table.timesteps(), dtype=torch.float32)

    def forward(self, t_emb: torch.Tensor):
        t = self._times[_decode(t_emb).cpu()].to(t_emb.device)
        return self.adaln_proj(self.time_embedder(t).to(t_emb.dtype))


def install(diffusion_model, table: AdaLNTable) -> int:
    """Replace ``time_embedder`` and every DiT block's ``adaln_proj`` of a built core H3 (``MiniMaxH3Model``) by the
    table, and the final layer's when the table has final rows (else it keeps computing from its weights through
    :class:`WeightAdaLN`). Returns the blocks switched. CheckpointError when the table does not fit the model."""
    dm = diffusion_model
    if getattr(dm, "use_adaln_curves", False):
        raise CheckpointError(table.path, "the model is a pruned curve-form checkpoint (adaln_t_table): an AdaLN "
                                          "table does not apply", expected="an unpruned H3")
    fl = dm.final_layer.adaln_proj
    te = getattr(dm, "time_embedder", None)
    final_weights = getattr(fl.linear, "weight", None) is not None and te is not None and \
        getattr(te.proj_in, "weight", None) is not None
    table.check_fits(len(dm.blocks), dm.hidden_size, need_final=not final_weights)
    dm.time_embedder = TableTimeEmbedder(table)
    for i, blk in enumerate(dm.blocks):
        blk.adaln_proj = TableAdaLN(table.blocks[i], 6, 3, dm.hidden_size)
    if table.final is not None:
        dm.final_layer.adaln_proj = TableAdaLN(table.final, 2, 1, dm.hidden_size)
    else:
        dm.final_layer.adaln_proj = WeightAdaLN(table, te, fl)
        log.info("H3 Turbo AdaLN table %s has no final-layer rows: the final layer computes its modulation from "
                 "its weights", table.path)
    return len(dm.blocks)


def patch(model_patcher, table: AdaLNTable) -> None:
    """The table on a ModelPatcher (call on a clone) as core object patches: ``time_embedder`` and every
    ``adaln_proj`` are swapped while the clone runs and restored afterwards, so the base model keeps its AdaLN
    weights (nothing is freed; :func:`install` is the loader's permanent form). CheckpointError when the table does
    not fit the model."""
    dm = model_patcher.model.diffusion_model
    if getattr(dm, "use_adaln_curves", False):
        raise CheckpointError(table.path, "the model is a pruned curve-form checkpoint (adaln_t_table): an AdaLN "
                                          "table does not apply", expected="an unpruned H3")
    table.check_fits(len(dm.blocks), dm.hidden_size, need_final=False)
    pfx = "diffusion_model."
    model_patcher.add_object_patch(pfx + "time_embedder", TableTimeEmbedder(table))
    for i in range(len(dm.blocks)):
        model_patcher.add_object_patch(f"{pfx}blocks.{i}.adaln_proj", TableAdaLN(table.blocks[i], 6, 3, dm.hidden_size))
    final = TableAdaLN(table.final, 2, 1, dm.hidden_size) if table.final is not None else \
        WeightAdaLN(table, dm.time_embedder, dm.final_layer.adaln_proj)
    model_patcher.add_object_patch(pfx + "final_layer.adaln_proj", final)
    import comfy.patcher_extension as pe

    from .adaln_lora import refuse_wrapper_for   # a LoRA on AdaLN keys is refused before sampling

    model_patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "h3_turbo_adaln_lora",
                                       refuse_wrapper_for(f"AdaLN table {os.path.basename(table.path)}",
                                                          "Sample the model without the fixed AdaLN table"))


# --------------------------------------------------------------------------------------------- computing one

def compute_rows(get: Callable[[str], torch.Tensor], dims: dict, groups: list[tuple[float, ...]],
                 dtype: torch.dtype = torch.bfloat16, device="cpu",
                 progress: Callable[[int, int], None] | None = None) -> tuple[list[torch.Tensor], torch.Tensor, str]:
    """(per-block rows [R, 18H], final rows [R, 2H], SHA-256 of the weights used) for ``groups``, computed with
    core's ``TimeEmbedder`` (fp32) and ``AdalnProj`` (weights in ``dtype``: the model's compute dtype) one group per
    batch, as core's forward does. ``get(core_key)`` reads one tensor (streaming: one block's weights at a time).
    ``dims``: hidden, layers, freq_dim, time_hidden, time_dim."""
    import comfy.ops
    from comfy.ldm.minimax.model import AdalnProj, TimeEmbedder

    ops = comfy.ops.disable_weight_init
    H, L = dims["hidden"], dims["layers"]
    h = hashlib.sha256()

    def load(mod, prefix, keys, cast):
        sd = {}
        for k in keys:
            t = get(f"{prefix}.{k}")
            if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise CheckpointError(prefix, f"{prefix}.{k} is {t.dtype}: a quantized AdaLN/time-embedder weight "
                                              "cannot be tabulated", expected="float weights")
            h.update(f"{prefix}.{k}|{t.dtype}|{list(t.shape)}".encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            sd[k] = t.to(cast)
        mod.load_state_dict(sd)
        return mod

    with torch.no_grad():
        te = TimeEmbedder(dims["freq_dim"], dims["time_hidden"], dims["time_dim"], dtype=torch.float32, device=device,
                          operations=ops)
        load(te, "time_embedder", ["proj_in.weight", "proj_in.bias", "proj_out.weight", "proj_out.bias"], torch.float32)
        tvals = [torch.tensor(g, dtype=torch.float32, device=device) for g in groups]
        tembs = [te(t).to(dtype) for t in tvals]

        def run(mod):
            return torch.cat([torch.cat(mod(e), -1).reshape(e.shape[0], -1) for e in tembs], 0).cpu()

        blocks = []
        ad = AdalnProj(dims["time_dim"], H, 6, 3, dtype=dtype, device=device, operations=ops)
        for i in range(L):
            load(ad, f"blocks.{i}.adaln_proj", ["linear.weight", "linear.bias"], dtype)
            blocks.append(run(ad))
            if progress is not None:
                progress(i + 1, L + 1)
        fin = AdalnProj(dims["time_dim"], H, 2, 1, dtype=dtype, device=device, operations=ops)
        load(fin, "final_layer.adaln_proj", ["linear.weight", "linear.bias"], dtype)
        final = run(fin)
        if progress is not None:
            progress(L + 1, L + 1)
    return blocks, final, h.hexdigest()


def write_table(path: str, blocks: list[torch.Tensor], final: torch.Tensor | None, groups: list[tuple[float, ...]],
                meta: dict) -> None:
    """The pack's table format: one safetensors file with ``blocks.{i}.adaln`` [R, 18H], ``final_layer.adaln``
    [R, 2H], ``timesteps`` fp32 [R] and ``__metadata__``: ``format`` = ``h3_turbo_adaln_table``,
    ``format_version``, ``table`` (JSON: ``groups`` (row lists), ``timesteps`` and ``timestep_bits`` per row, plus
    ``meta``: model hash, schedule, how it was computed)."""
    from safetensors.torch import save_file

    times = [t for g in groups for t in g]
    rows, start = [], 0
    for g in groups:
        rows.append(list(range(start, start + len(g))))
        start += len(g)
    if blocks and blocks[0].shape[0] != start:
        raise ValueError(f"write_table: {blocks[0].shape[0]} rows for {start} timesteps")
    info = dict(meta, groups=rows, timesteps=[repr(t) for t in times],
                timestep_bits=list(torch.tensor(times, dtype=torch.float32).view(torch.int32).tolist()))
    sd = {f"blocks.{i}.adaln": b.contiguous() for i, b in enumerate(blocks)}
    if final is not None:
        sd["final_layer.adaln"] = final.contiguous()
    sd["timesteps"] = torch.tensor(times, dtype=torch.float32)
    tmp = path + ".part"
    save_file(sd, tmp, metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION), "table": json.dumps(info)})
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- reading one

def _safe_open_all(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from ..formats.safetensors_io import open_tensors, read_header

    hdr = read_header(path)
    with open_tensors(path, header=hdr) as f:
        return {k: f.get_tensor(k) for k in hdr.tensors}, dict(hdr.metadata)


def _ours(path: str) -> AdaLNTable:
    sd, md = _safe_open_all(path)
    try:
        info = json.loads(md["table"])
        groups_rows = info["groups"]
        bits = [int(b) for b in info["timestep_bits"]]
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(path, f"AdaLN table metadata is malformed ({e})", key="__metadata__.table",
                              expected="the pack's table format (docs/turboh3.md)") from None
    n = sum(1 for k in sd if k.startswith("blocks.") and k.endswith(".adaln"))
    blocks = []
    for i in range(n):
        b = sd.get(f"blocks.{i}.adaln")
        if b is None or b.dim() != 2 or b.shape[0] != len(bits):
            raise CheckpointError(path, f"{'missing' if b is None else f'shape {list(b.shape)}'}", key=f"blocks.{i}.adaln",
                                  expected=f"[{len(bits)}, 18 x hidden]")
        blocks.append(b)
    if not blocks or blocks[0].shape[1] % 18:
        raise CheckpointError(path, "no blocks.N.adaln rows of width 18 x hidden", expected="the pack's table format")
    hidden = blocks[0].shape[1] // 18
    ts = sd.get("timesteps")
    if ts is None or ts.dtype != torch.float32 or ts.view(torch.int32).tolist() != bits:
        raise CheckpointError(path, "the 'timesteps' tensor disagrees with the metadata's timestep_bits", key="timesteps",
                              expected="the same fp32 values")
    groups = [tuple(bits[r] for r in rows) for rows in groups_rows]
    starts = [rows[0] for rows in groups_rows]
    fin = sd.get("final_layer.adaln")
    if fin is not None and tuple(fin.shape) != (len(bits), 2 * hidden):
        raise CheckpointError(path, f"shape {list(fin.shape)}", key="final_layer.adaln", expected=f"[{len(bits)}, {2 * hidden}]")
    return AdaLNTable(path, "h3_turbo", hidden, groups, starts, blocks, fin, info)


def _lightx2v(dir_: str, per_block_files: bool) -> AdaLNTable:
    man_path = os.path.join(dir_, "manifest.json")
    try:
        with open(man_path, encoding="utf-8") as f:
            man = json.load(f)
        entries = man["entries"]
        L, H = int(man["num_layers"]), int(man["hidden_size"])
        names = [e["name"] for e in entries]
        groups = [tuple(int(b) for b in e["timestep_bits"]) for e in entries]
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(man_path, f"LightX2V AdaLN manifest unreadable ({type(e).__name__}: {e})",
                              expected='{"num_layers", "hidden_size", "entries": [{"name", "timestep_bits"}]}') from None
    if per_block_files:
        srcs = [_safe_open_all(os.path.join(dir_, f"block_{i:03d}.safetensors"))[0] for i in range(L)]
        fin_sd = _safe_open_all(os.path.join(dir_, "norm_out.safetensors"))[0]
        bkey = lambda i, n: n  # noqa: E731
        fkey = lambda n: n  # noqa: E731
    else:
        sd = _safe_open_all(os.path.join(dir_, "adaln_cache.safetensors"))[0]
        srcs = [sd] * L
        fin_sd = sd
        bkey = lambda i, n: f"block_{i:03d}.{n}"  # noqa: E731
        fkey = lambda n: f"norm_out.{n}"  # noqa: E731
    starts, s = [], 0
    for g in groups:
        starts.append(s)
        s += len(g)
    blocks = []
    for i in range(L):
        parts = []
        for n, g in zip(names, groups):
            t = srcs[i].get(bkey(i, n))
            if t is None or tuple(t.shape) != (len(g) * 3, 6 * H):
                raise CheckpointError(dir_, f"{'missing' if t is None else f'shape {list(t.shape)}'}", key=bkey(i, n),
                                      expected=f"[{len(g) * 3}, {6 * H}] (n_t x 3 modalities, 6 x hidden)")
            parts.append(t.reshape(len(g), 18 * H))
        blocks.append(torch.cat(parts, 0))
    fparts = []
    for n, g in zip(names, groups):
        t = fin_sd.get(fkey(n))
        if t is None or tuple(t.shape) != (len(g), 2 * H):
            raise CheckpointError(dir_, f"{'missing' if t is None else f'shape {list(t.shape)}'}", key=fkey(n),
                                  expected=f"[{len(g)}, {2 * H}]")
        fparts.append(t)
    layout = "lightx2v_ready" if per_block_files else "lightx2v"
    return AdaLNTable(dir_, layout, H, groups, starts, blocks, torch.cat(fparts, 0), dict(man))


def read_table(path: str) -> AdaLNTable:
    """Read an AdaLN table, detecting its layout: a file of the pack's format (or a folder holding one), LightX2V's
    ``adaln_cache.safetensors`` + ``manifest.json`` folder, or its ``block_XXX.safetensors`` + ``norm_out.safetensors``
    + ``READY`` folder (a ``manifest.json`` path selects its folder). Anything else: CheckpointError listing what was
    found."""
    path = os.path.abspath(path)
    if os.path.isfile(path) and os.path.basename(path) in ("manifest.json", "READY"):
        path = os.path.dirname(path)
    if os.path.isfile(path):
        from ..formats.safetensors_io import read_header

        hdr = read_header(path)
        if hdr.metadata.get("format") == FORMAT:
            return _ours(path)
        table, why = _release_rows(path)
        if table is not None:
            return table
        raise CheckpointError(path, f"unknown AdaLN table layout: {_found_file(hdr)}; {why}",
                              expected=_EXPECTED_LAYOUTS)
    if not os.path.isdir(path):
        raise CheckpointError(path, "AdaLN table not found", expected="a table file or folder")
    files = sorted(os.listdir(path))
    if "adaln_cache.safetensors" in files and "manifest.json" in files:
        return _lightx2v(path, per_block_files=False)
    if "block_000.safetensors" in files and "norm_out.safetensors" in files and "manifest.json" in files:
        return _lightx2v(path, per_block_files=True)
    ours = []
    for f in files:
        if f.endswith(".safetensors"):
            from ..formats.safetensors_io import read_header

            try:
                if read_header(os.path.join(path, f)).metadata.get("format") == FORMAT:
                    ours.append(f)
            except CheckpointError:
                pass
    if len(ours) == 1:
        return _ours(os.path.join(path, ours[0]))
    table, why = _release_rows(path)
    if table is not None:
        return table
    raise CheckpointError(path, f"unknown AdaLN table layout: {_found_dir(path, files)}; {why}",
                          expected=_EXPECTED_LAYOUTS)


def _release_rows(path: str):
    from ..formats.dmd import read_release_rows   # the TurboH3 release's inferred layout (formats/dmd.py)

    table, why = read_release_rows(path)
    return table, f"not the inferred TurboH3 release layout: {why}" if why else None


_EXPECTED_LAYOUTS = ("one of: the pack's format (a .safetensors with __metadata__ format=h3_turbo_adaln_table; "
                     "`python -m h3_turbo.tools adaln-table`), LightX2V adaln_cache.safetensors + manifest.json, "
                     "LightX2V block_XXX.safetensors + norm_out.safetensors + manifest.json (+ READY), the inferred "
                     "TurboH3 release layout (one .safetensors of per-block rows [R, 18 x hidden] and final rows "
                     "[R, 2 x hidden], with R timesteps; docs/turboh3.md)")


def _found_file(hdr) -> str:
    items = list(hdr.tensors.values())
    keys = ", ".join(f"{t.name} {t.dtype} {list(t.shape)}" for t in items[:8])
    return (f"{len(items)} tensors ({keys}{', ...' if len(items) > 8 else ''}); metadata keys "
            f"{sorted(hdr.metadata)}")


def _found_dir(path: str, files: list[str]) -> str:
    from ..formats.safetensors_io import read_header

    parts = [f"files {files[:12]}{' ...' if len(files) > 12 else ''}"]
    for f in files:
        p = os.path.join(path, f)
        if f.endswith(".safetensors"):
            try:
                parts.append(f"{f}: " + _found_file(read_header(p)))
            except CheckpointError as e:
                parts.append(f"{f}: unreadable ({e.cause})")
        elif f.endswith(".json"):
            try:
                with open(p, encoding="utf-8") as fh:
                    obj = json.load(fh)
                parts.append(f"{f}: JSON keys {sorted(obj)[:12] if isinstance(obj, dict) else type(obj).__name__}")
            except (OSError, ValueError) as e:
                parts.append(f"{f}: unreadable JSON ({e})")
        if len(parts) > 6:
            break
    return "; ".join(parts)
