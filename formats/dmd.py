"""The TurboH3 DMD checkpoints: find them, detect and validate them from their headers, and stream them into core's
H3 layout (docs/turboh3.md).

- :func:`find_release` -> :class:`Release`: what a ``model_name`` points at: one ``.safetensors`` file, a shard
  index ``*.safetensors.index.json``, or a release folder (``transformer/`` shards + index + ``config.json``,
  ``w8a8/*.safetensors``, ``adaln/``, ``manifest.json``);
- :func:`open_source` -> :class:`Source`: the tensors of one checkpoint (every shard's header validated, the index
  checked against them; nothing else is read);
- :func:`detect_dmd` -> :class:`DMDDetection`: the format (a release scheme of ``formats/registry.py``), the H3
  sizes read from the shapes (cross-checked with ``config.json``), the core-named tensors conversion yields
  (:class:`CoreEntry`) and every finding. Unknown tensor families, missing or extra keys, missing ``scale`` tensors,
  wrong shapes are errors naming the key; ``raise_if_errors`` raises one :class:`CheckpointError`;
- :func:`iter_core`: ``(core key, tensor)`` one entry at a time, reading each source tensor once (peak: one layer).

Core layout of a W8A8 layer (what the DMD operations load, ``runtime/dmd.py``): ``P.weight`` int8 [N, K] and
``P.int8_scale`` fp32 [ceil(N/128), ceil(K/128)] (or [N, ceil(K/128)] when split q/k/v with N % 128 != 0 were fused:
per-row scales, exact).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..errors import CheckpointError
from ..kernels import int8_block as ib
from . import registry
from .detect import Finding, FindingsMixin, H3Sizes, _looks_like
from .safetensors_io import Header, TensorInfo, TensorReader, read_header
from .schemes.base import HeaderView
from .schemes.diffusers_map import FP32_CORE, Mapped, family, map_key, rope_inv_freq, swap_halves

INDEX_SUFFIX = ".safetensors.index.json"
INT8_SCALE = "int8_scale"


# --------------------------------------------------------------------------------------------- where the files are

@dataclass
class Release:
    """What a model path points at. ``bf16``: a shard index or float file; ``w8a8``: the W8A8 file; ``adaln``: the
    release's AdaLN table folder/file; ``manifest``: ``manifest.json``; ``root``: the folder (None for a file)."""

    path: str
    root: str | None = None
    bf16: str | None = None
    w8a8: str | None = None
    adaln: str | None = None
    manifest: str | None = None


#: folders above a file (its own folder first) searched for the release root it belongs to
RELEASE_ROOT_DEPTH = 2


def is_release_root(d: str) -> bool:
    """A TurboH3 release folder: ``adaln/`` beside ``manifest.json``, ``transformer/`` or ``w8a8/`` (the card's
    layout)."""
    return os.path.exists(os.path.join(d, "adaln")) and (
        os.path.isfile(os.path.join(d, "manifest.json")) or os.path.isdir(os.path.join(d, "transformer"))
        or os.path.isdir(os.path.join(d, "w8a8")))


def release_root_of(path: str) -> str | None:
    """The release folder a file or index lies in (its own folder or up to :data:`RELEASE_ROOT_DEPTH` folders above,
    e.g. ``ROOT/w8a8/model_w8a8.safetensors`` or ``ROOT/transformer/*.index.json`` -> ``ROOT``), else None."""
    d = os.path.dirname(os.path.abspath(path))
    for _ in range(RELEASE_ROOT_DEPTH + 1):
        if is_release_root(d):
            return d
        up = os.path.dirname(d)
        if up == d:
            break
        d = up
    return None


def find_release(path: str) -> Release:
    """Resolve a file, an index or a release folder. A file or index inside a release folder (:func:`release_root_of`)
    gets that release's ``adaln/`` and ``manifest.json`` (its weights stay the file picked). CheckpointError when
    nothing loadable is there."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        rel = Release(path)
        if path.endswith(INDEX_SUFFIX):
            rel.bf16 = path
        else:
            rel.w8a8 = path  # decided by detection: a float file is used as the BF16 weights
        root = release_root_of(path)
        if root is not None:
            rel.root, rel.adaln = root, os.path.join(root, "adaln")
            if os.path.isfile(os.path.join(root, "manifest.json")):
                rel.manifest = os.path.join(root, "manifest.json")
        return rel
    if not os.path.isdir(path):
        raise CheckpointError(path, "not found", expected="a .safetensors file, a *.safetensors.index.json or a "
                                                          "TurboH3 release folder")
    rel = Release(path, root=path)
    for d in (path, os.path.join(path, "transformer")):
        idx = sorted(f for f in os.listdir(d) if f.endswith(INDEX_SUFFIX)) if os.path.isdir(d) else []
        if idx:
            rel.bf16 = os.path.join(d, idx[0])
            break
    wd = os.path.join(path, "w8a8")
    if os.path.isdir(wd):
        files = sorted(f for f in os.listdir(wd) if f.endswith(".safetensors"))
        if files:
            rel.w8a8 = os.path.join(wd, files[0])
    if os.path.exists(os.path.join(path, "adaln")):
        rel.adaln = os.path.join(path, "adaln")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        rel.manifest = os.path.join(path, "manifest.json")
    if rel.bf16 is None and rel.w8a8 is None:
        found = sorted(os.listdir(path))[:20]
        raise CheckpointError(path, f"no transformer/*{INDEX_SUFFIX} and no w8a8/*.safetensors in this folder "
                                    f"(found: {found})", expected="a TurboH3 release folder")
    return rel


# --------------------------------------------------------------------------------------------- the tensors

@dataclass
class Source:
    """One checkpoint's tensors: ``files`` (shards in index order, or the one file), ``header`` (every shard's
    entries merged; ``path`` = the index or the file), ``file_of`` (key -> shard path), ``index`` (the parsed
    index JSON or None), ``config`` (``config.json`` beside it, or None)."""

    path: str
    files: list[str]
    header: Header
    file_of: dict[str, str]
    headers: dict[str, Header]
    index: dict | None = None
    config: dict | None = None
    config_path: str | None = None

    def reader(self) -> "SourceReader":
        return SourceReader(self)


class SourceReader:
    """``get(key)``: one tensor from its shard (positional reads, its own memory). Use as a context manager."""

    def __init__(self, src: Source):
        self.src = src
        self._open: dict[str, TensorReader] = {}

    def get(self, key: str) -> torch.Tensor:
        f = self.src.file_of[key]
        r = self._open.get(f)
        if r is None:
            r = self._open[f] = TensorReader(f, self.src.headers[f])
        return r.get_tensor(key)

    def close(self) -> None:
        for r in self._open.values():
            r.close()
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise CheckpointError(path, f"cannot read the {what}: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"the {what} is not valid JSON ({e})", expected="a JSON object") from None
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"the {what} is a JSON {type(obj).__name__}", expected="a JSON object")
    return obj


def open_source(path: str) -> Source:
    """The tensors of ``path`` (a ``.safetensors`` file or a ``*.safetensors.index.json``). Every shard header is
    validated (:func:`read_header`); the index must list only existing shards, and its weight map must equal the
    shards' tensors. Raises :class:`CheckpointError` naming the shard / key."""
    path = os.path.abspath(path)
    if not path.endswith(INDEX_SUFFIX):
        hdr = read_header(path)
        src = Source(path, [path], hdr, {k: path for k in hdr.tensors}, {path: hdr})
        cfg = os.path.join(os.path.dirname(path), "config.json")
        if os.path.isfile(cfg):
            src.config, src.config_path = _read_json(cfg, "transformer config"), cfg
        return src
    idx = _read_json(path, "shard index")
    wm = idx.get("weight_map")
    if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(path, "the index has no 'weight_map' of tensor name -> shard file", key="weight_map",
                              expected='{"weight_map": {"<tensor>": "<shard>.safetensors", ...}}')
    base = os.path.dirname(path)
    shards = list(dict.fromkeys(wm.values()))
    for s in shards:
        if os.path.isabs(s) or os.path.normpath(s).startswith(".."):
            raise CheckpointError(path, f"shard {s!r} is outside the index's folder", key="weight_map")
    missing = [s for s in shards if not os.path.isfile(os.path.join(base, s))]
    if missing:
        n = {s: sum(1 for v in wm.values() if v == s) for s in missing}
        raise CheckpointError(path, "missing shard(s): " + ", ".join(f"{s} ({n[s]} tensors)" for s in missing)
                              + f" of {len(shards)}", expected="every shard the index lists (re-download them; "
                                                             "`python -m h3_turbo.tools verify-release DIR` checks all)")
    headers: dict[str, Header] = {}
    merged: dict[str, TensorInfo] = {}
    file_of: dict[str, str] = {}
    meta: dict[str, str] = {}
    for s in shards:
        f = os.path.join(base, s)
        h = headers[f] = read_header(f)
        meta.update(h.metadata)
        for k, t in h.tensors.items():
            if k in merged:
                raise CheckpointError(f, f"tensor also stored in {os.path.basename(file_of[k])}", key=k,
                                      expected="each tensor in one shard")
            merged[k], file_of[k] = t, f
    for k, s in wm.items():
        f = os.path.join(base, s)
        if file_of.get(k) != f:
            where = f"it is in {os.path.basename(file_of[k])}" if k in file_of else "no shard holds it"
            raise CheckpointError(path, f"the index maps it to {s}, but {where}", key=k,
                                  expected="an index that matches its shards")
    extra = sorted(set(merged) - set(wm))
    if extra:
        raise CheckpointError(os.path.join(base, os.path.basename(file_of[extra[0]])),
                              f"{len(extra)} tensor(s) in the shards are not in the index (e.g. {extra[:3]})",
                              key=extra[0], expected="an index that lists every tensor")
    total = (idx.get("metadata") or {}).get("total_size") if isinstance(idx.get("metadata"), dict) else None
    hdr = Header(path=path, file_size=sum(h.file_size for h in headers.values()), data_start=0,
                 tensors=merged, metadata=meta)
    src = Source(path, [os.path.join(base, s) for s in shards], hdr, file_of, headers, idx)
    if isinstance(total, int) and total != sum(t.nbytes for t in merged.values()):
        src.total_size_mismatch = (total, sum(t.nbytes for t in merged.values()))
    cfg = os.path.join(base, "config.json")
    if os.path.isfile(cfg):
        src.config, src.config_path = _read_json(cfg, "transformer config"), cfg
    return src


# --------------------------------------------------------------------------------------------- detection

@dataclass(frozen=True)
class DMDConfig(H3Sizes):
    """:class:`~.detect.H3Sizes` read from a DMD file's shapes plus the time-embedder and RoPE sizes."""

    freq_dim: int
    time_hidden: int
    time_dim: int
    rope_freq_dim: int
    rope_theta: float = 10000.0


#: config.json (Diffusers ``MiniMaxH3Transformer3DModel`` argument names) -> DMDConfig field
CONFIG_JSON_FIELDS = {"hidden_size": "hidden", "num_attention_heads": "heads", "attention_head_dim": "head_dim",
                      "ffn_dim": "ffn", "num_layers": "layers", "num_refiner_layers": "refiner_layers",
                      "text_dim": "text_dim", "in_channels": "latents_dim", "audio_in_channels": "audio_latents_dim",
                      "freq_dim": "freq_dim", "time_embed_hidden_dim": "time_hidden", "time_embed_dim": "time_dim",
                      "rope_freq_dim": "rope_freq_dim", "rope_theta": "rope_theta"}
#: config.json keys core's H3 takes as constructor arguments (passed as ``__metadata__["config"]["transformer"]``)
CORE_CONFIG_KEYS = ("norm_eps", "qk_norm_eps", "final_norm_eps")


@dataclass
class CoreEntry:
    """One core-named tensor conversion yields: ``op`` (copy | qkv | swap | rope), ``sources`` (file keys, with
    prefix; q, k, v for qkv), safetensors ``dtype`` and ``shape`` (logical shape for int8 layers)."""

    key: str
    op: str
    sources: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Int8Layer:
    """A W8A8 layer in core terms: ``stem`` (core module), [n, k], ``op`` (copy | qkv | swap), ``weights`` and
    ``scales`` (file keys), optional ``bias`` key."""

    stem: str
    n: int
    k: int
    op: str
    weights: tuple[str, ...]
    scales: tuple[str, ...]
    bias: str | None = None


@dataclass
class DMDDetection(FindingsMixin):
    path: str
    source: Source
    scheme: object = None
    evidence: object = None
    config: DMDConfig | None = None
    naming: str = "diffusers"
    qkv: str = "split"                   # split | fused (how the file stores Q/K/V)
    entries: list[CoreEntry] = field(default_factory=list)
    int8_layers: dict[str, Int8Layer] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    has_adaln: bool = False              # every DiT block's adaln_proj.linear is in the file
    has_final_adaln: bool = False        # norm_out.linear (final_layer.adaln_proj.linear)
    metadata: dict = field(default_factory=dict)
    dtype_counts: dict = field(default_factory=dict)
    source_names: dict = field(default_factory=dict)   # core key -> the file keys it comes from (for messages)

    @property
    def format(self) -> str:
        return self.scheme.name if self.scheme is not None else "unknown"

    def fix_hint(self) -> str:
        return "Fix: re-download or re-export the files; `python -m h3_turbo.tools inspect PATH` lists every finding."

    def core_keys(self, adaln: bool = True) -> list[str]:
        """The core keys :func:`iter_core` yields (``adaln=False``: without the DiT blocks' AdaLN weights)."""
        out = []
        for e in self.entries:
            if not adaln and _is_block_adaln(e.key):
                continue
            out.append(e.key)
        for s, lay in self.int8_layers.items():
            out += [f"{s}.weight", f"{s}.{INT8_SCALE}"] + ([f"{s}.bias"] if lay.bias else [])
        return out


def _is_block_adaln(key: str) -> bool:
    return key.startswith("blocks.") and ".adaln_proj." in key


def _expected(cfg: DMDConfig) -> dict[str, tuple[int, ...]]:
    """Core key -> logical shape of every tensor an H3 DiT of these sizes has (the converter's plan, in core names;
    ``rope.inv_freq`` excluded: it may be recomputed)."""
    H, inner, ffn, td = cfg.hidden, cfg.inner, cfg.ffn, cfg.time_dim
    vp = cfg.latents_dim * 4
    e = {"video_patch_proj.weight": (H, vp), "video_patch_proj.bias": (H,),
         "audio_patch_proj.weight": (H, cfg.audio_latents_dim), "audio_patch_proj.bias": (H,),
         "condition_proj.weight": (H, cfg.text_dim), "condition_proj.bias": (H,),
         "time_embedder.proj_in.weight": (cfg.time_hidden, cfg.freq_dim), "time_embedder.proj_in.bias": (cfg.time_hidden,),
         "time_embedder.proj_out.weight": (td, cfg.time_hidden), "time_embedder.proj_out.bias": (td,),
         "token_refiner.final_norm.weight": (H,), "final_layer.norm.weight": (H,),
         "final_layer.adaln_proj.linear.weight": (2 * H, td), "final_layer.adaln_proj.linear.bias": (2 * H,),
         "final_layer.video_out.weight": (vp, H), "final_layer.video_out.bias": (vp,),
         "final_layer.audio_out.weight": (cfg.audio_latents_dim, H), "final_layer.audio_out.bias": (cfg.audio_latents_dim,)}
    blocks = [f"blocks.{i}" for i in range(cfg.layers)] + [f"token_refiner.blocks.{j}" for j in range(cfg.refiner_layers)]
    for b in blocks:
        e.update({f"{b}.norm1.weight": (H,), f"{b}.norm2.weight": (H,), f"{b}.attn.qkv_proj.weight": (3 * inner, H),
                  f"{b}.attn.q_norm.weight": (cfg.head_dim,), f"{b}.attn.k_norm.weight": (cfg.head_dim,),
                  f"{b}.attn.out_proj.weight": (H, inner), f"{b}.mlp.fc1.weight": (2 * ffn, H),
                  f"{b}.mlp.fc2.weight": (H, ffn)})
        if b.startswith("blocks."):
            e[f"{b}.adaln_proj.linear.weight"] = (18 * H, td)
            e[f"{b}.adaln_proj.linear.bias"] = (18 * H,)
    return e


def _count(keys, prefix: str) -> int:
    idx = {int(k[len(prefix):].split(".", 1)[0]) for k in keys if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()}
    return len(idx)


def detect_dmd(path: str) -> DMDDetection:
    """Detect and validate a DMD checkpoint (``.safetensors`` or index). Raises :class:`CheckpointError` for container
    problems (missing shard, truncated file, index vs shards); content problems become findings."""
    src = open_source(path)
    view = HeaderView.of(src.header)
    det = DMDDetection(path=os.path.abspath(path), source=src, metadata=dict(src.header.metadata))
    for t in src.header.tensors.values():
        det.dtype_counts[t.dtype] = det.dtype_counts.get(t.dtype, 0) + 1
    if getattr(src, "total_size_mismatch", None):
        a, b = src.total_size_mismatch
        det.warn(f"index metadata total_size is {a} bytes, the shards' tensors hold {b}", "metadata.total_size")
    try:
        det.scheme, det.evidence = registry.identify_release(view)
    except CheckpointError as e:
        det.error(e.cause)
        return det
    if det.scheme is None:
        keys = set(view.tensors)
        what = ("a core-named quantized MiniMax H3 (NVFP4 / ComfyUI quant formats): load it with Load H3 NVFP4 "
                "Diffusion Model" if "video_patch_proj.weight" in keys else f"looks like {_looks_like(keys)}")
        det.error(f"not a TurboH3 DMD / H3 Diffusers checkpoint (no Diffusers H3 names, no Int8Linear layers, no "
                  f"float core-named H3): {what}")
        return det
    pfx = view.prefix
    T = view.tensors
    # ---- map every key; unknown families are refused with the list
    mapped: dict[str, Mapped] = {}
    unknown: list[str] = []
    for k in T:
        m = map_key(k)
        (unknown.append(k) if m is None else mapped.__setitem__(k, m))
    if unknown:
        fams: dict[str, list[str]] = {}
        for k in unknown:
            fams.setdefault(family(k), []).append(k)
        listing = "; ".join(f"{f} ({len(v)}x, e.g. {v[0]})" for f, v in sorted(fams.items()))
        det.error(f"{len(unknown)} tensor(s) of {len(fams)} unknown famil{'y' if len(fams) == 1 else 'ies'} (not an "
                  f"H3 DiT name in Diffusers or core naming): {listing}", unknown[0])
    namings = {m.naming for m in mapped.values() if m.naming == "core"}
    det.naming = "core" if namings else "diffusers"
    # ---- group by core module
    mods: dict[str, dict[str, list[tuple[str, Mapped]]]] = {}
    for k, m in mapped.items():
        mods.setdefault(m.module, {}).setdefault(m.param, []).append((k, m))
    logical: dict[str, tuple[str, tuple[int, ...], tuple[str, ...], str]] = {}   # core key -> (dtype, shape, src, op)
    for mod, params in mods.items():
        _group_module(det, T, mod, params, logical)
    for k, v in logical.items():
        det.source_names[k] = v[2]
    for s_, lay in det.int8_layers.items():
        det.source_names[f"{s_}.weight"] = lay.weights
    # ---- config from the shapes
    cfg = _config(det, logical, src.config)
    det.config = cfg
    if cfg is None:
        return det
    want = _expected(cfg)
    has = set(logical) | {f"{s}.weight" for s in det.int8_layers}
    blocks_adaln = [f"blocks.{i}.adaln_proj.linear.weight" for i in range(cfg.layers)]
    present_adaln = [k for k in blocks_adaln if k in has]
    det.has_adaln = len(present_adaln) == cfg.layers
    det.has_final_adaln = "final_layer.adaln_proj.linear.weight" in has
    if present_adaln and not det.has_adaln:
        det.error(f"AdaLN weights of {len(present_adaln)} of {cfg.layers} DiT blocks present: all or none "
                  f"(missing e.g. {sorted(set(blocks_adaln) - set(present_adaln))[0]})")
    for k, shp in want.items():
        optional_adaln = (_is_block_adaln(k) and not present_adaln) or \
                         (k.startswith("final_layer.adaln_proj.") and not det.has_final_adaln)
        got = _logical_shape(det, logical, k)
        if got is None:
            if not optional_adaln:
                det.error(f"missing (expected {list(shp)} from hidden {cfg.hidden}, heads {cfg.heads}x{cfg.head_dim}, "
                          f"ffn {cfg.ffn})", _named(det, k))
        elif tuple(got) != tuple(shp):
            det.error(f"shape {list(got)} (expected {list(shp)})", _named(det, k))
    extra = sorted(k for k in logical if k not in want and k != "rope.inv_freq")
    for k in extra:
        det.error("unexpected tensor for an H3 DiT of these sizes (block index beyond the count, or a bias on a "
                  "bias-free projection)", _named(det, k))
    # ---- precision: the fp32 island in fp32, the rest float (BF16 in the release)
    for k, (dt, shp, srcs, op) in logical.items():
        if k.rpartition(".")[0] in FP32_CORE:
            if dt != "F32":
                det.warn(f"fp32-island tensor stored as {dt} (the release keeps it FP32)", _named(det, k))
        elif dt not in ("BF16", "F16", "F32", "I8"):
            det.error(f"dtype {dt} (expected a float dtype)", _named(det, k))
    fmt = det.metadata.get("format")
    if det.scheme.quantized and fmt is not None:
        from .schemes.w8a8_int8 import RELEASE_FORMAT

        if fmt != RELEASE_FORMAT:
            det.warn(f"__metadata__ format is {fmt!r} (the TurboH3 card names {RELEASE_FORMAT!r})", "__metadata__.format")
    if det.scheme.quantized and not det.int8_layers:
        det.error("no Int8Linear layer could be used (see the findings above)")
    if not det.has_adaln:
        det.info("no AdaLN weights in the DiT blocks (as in the TurboH3 W8A8 export): the model needs an AdaLN "
                 "table for its schedule")
    # ---- the entries, in core key order of the expected plan
    order = list(want) + ["rope.inv_freq"]
    for k in order:
        if k in logical:
            dt, shp, srcs, op = logical[k]
            det.entries.append(CoreEntry(k, op, srcs, dt, tuple(shp)))
    if "rope.inv_freq" not in logical:
        det.entries.append(CoreEntry("rope.inv_freq", "rope", (), "F32", (cfg.rope_freq_dim,)))
        det.info(f"rope.inv_freq recomputed (rope_freq_dim {cfg.rope_freq_dim}, theta {cfg.rope_theta:g}): the "
                 "Diffusers converter drops it as a pure function of the config")
    det._prefix = pfx
    return det


def _named(det: DMDDetection, core_key: str) -> str:
    """A core key with the file keys it comes from (messages name the file's own keys)."""
    srcs = det.source_names.get(core_key)
    if not srcs:
        return core_key
    return f"{srcs[0]}" + (f" (+{len(srcs) - 1} more)" if len(srcs) > 1 else "") + f" -> {core_key}"


def _logical_shape(det, logical, key):
    if key in logical:
        return logical[key][1]
    stem = key[: -len(".weight")] if key.endswith(".weight") else None
    if stem in det.int8_layers:
        lay = det.int8_layers[stem]
        return (lay.n, lay.k)
    return None


def _group_module(det: DMDDetection, T: dict[str, TensorInfo], mod: str, params: dict, logical: dict) -> None:
    """One core module's tensors -> ``logical`` entries (float) or ``det.int8_layers`` (W8A8), with findings."""
    for p, items in params.items():
        if p in ("int8_weight", "scale"):
            continue
        ops = {m.op for _, m in items}
        if "qkv" in ops:
            parts = {m.part: k for k, m in items}
            if len(items) != len(parts) or len(ops) > 1:
                det.error(f"Q/K/V stored both fused and split (or twice): {sorted(k for k, _ in items)}", items[0][0])
                continue
            miss = [f"to_{x}" for x in "qkv" if x not in parts]
            if miss:
                some = next(iter(parts.values()))
                det.error(f"split Q/K/V incomplete: {', '.join(miss)} missing", some.replace(f"to_{next(iter(parts))}", miss[0]))
                continue
            srcs = tuple(parts[x] for x in "qkv")
            shapes = [T[s].shape for s in srcs]
            dts = {T[s].dtype for s in srcs}
            if len({s[1:] for s in shapes}) != 1 or len(dts) != 1 or any(len(s) != 2 for s in shapes):
                det.error(f"to_q/to_k/to_v differ: {[(T[s].dtype, list(T[s].shape)) for s in srcs]}", srcs[0])
                continue
            if mod == "blocks.0.attn.qkv_proj":
                det.qkv = "split"
            logical[f"{mod}.{p}"] = (dts.pop(), (sum(s[0] for s in shapes), shapes[0][1]), srcs, "qkv")
        else:
            if len(items) > 1:
                det.error(f"{len(items)} tensors map to the same core tensor {mod}.{p}: {sorted(k for k, _ in items)}",
                          items[0][0])
                continue
            k, m = items[0]
            if mod == "blocks.0.attn.qkv_proj":
                det.qkv = "fused"
            logical[f"{mod}.{p}"] = (T[k].dtype, T[k].shape, (k,), m.op)
    if "int8_weight" in params or "scale" in params:
        _int8_layer(det, T, mod, params, logical)


def _int8_layer(det, T, mod, params, logical) -> None:
    w_items, s_items = params.get("int8_weight", []), params.get("scale", [])
    if f"{mod}.weight" in logical:
        det.error(f"both a float weight and an int8_weight for {mod}", w_items[0][0] if w_items else s_items[0][0])
        logical.pop(f"{mod}.weight")
        return
    if not w_items:
        for k, _ in s_items:
            det.error("orphan 'scale': the layer has no int8_weight", k)
        return
    wk = {m.part: k for k, m in w_items}
    sk = {m.part: k for k, m in s_items}
    ok = True
    for part, k in wk.items():
        if part not in sk:
            det.error("missing 'scale' for an Int8Linear layer (int8_weight without its 128x128 block scales)",
                      k[: -len("int8_weight")] + "scale")
            ok = False
    op = w_items[0][1].op
    if op == "qkv" and set(wk) != set("qkv"):
        miss = [f"to_{x}" for x in "qkv" if x not in wk]
        det.error(f"split Q/K/V incomplete: {', '.join(miss)} missing", next(iter(wk.values())))
        ok = False
    if not ok:
        return
    parts = sorted(wk) if op == "qkv" else [None]
    if op == "qkv":
        parts = ["q", "k", "v"]
    n = 0
    k_in = None
    for part in parts:
        w, s = T[wk[part]], T[sk[part]]
        if w.dtype != "I8" or len(w.shape) != 2:
            det.error(f"int8_weight is {w.dtype} {list(w.shape)} (expected int8 [out, in])", wk[part])
            return
        try:
            ib.Int8Weight.row_group_of(w.shape[0], s.shape[0] if s.shape else -1)
            ok_shape = len(s.shape) == 2 and s.shape[1] == ib.cdiv(w.shape[1], ib.BLOCK)
        except ValueError:
            ok_shape = False
        if s.dtype != "F32" or not ok_shape:
            det.error(f"scale is {s.dtype} {list(s.shape)} (expected float32 [{ib.cdiv(w.shape[0], 128)}, "
                      f"{ib.cdiv(w.shape[1], 128)}]: one per 128x128 tile of int8_weight {list(w.shape)})", sk[part])
            return
        if k_in is not None and w.shape[1] != k_in:
            det.error("to_q/to_k/to_v int8 weights differ in in_features", wk[part])
            return
        k_in = w.shape[1]
        n += w.shape[0]
        if w.shape[1] % ib.BLOCK and not any("not a multiple of 128" in f.message for f in det.findings):
            det.info(f"in_features {w.shape[1]} is not a multiple of 128 (TurboDiffusion's kernel needs K % 128 == 0; "
                     "the pack's kernels zero-pad the last K slice)", wk[part])
    bias = params.get("bias")
    logical.pop(f"{mod}.bias", None)
    if mod == "blocks.0.attn.qkv_proj":
        det.qkv = "split" if op == "qkv" else "fused"
    det.int8_layers[mod] = Int8Layer(mod, n, k_in, op, tuple(wk[p] for p in parts), tuple(sk[p] for p in parts),
                                     bias[0][0] if bias else None)


def _config(det: DMDDetection, logical: dict, cfg_json: dict | None) -> DMDConfig | None:
    def shp(key):
        return _logical_shape(det, logical, key)

    need = {k: shp(k) for k in ("video_patch_proj.weight", "blocks.0.attn.q_norm.weight", "blocks.0.attn.qkv_proj.weight",
                                "blocks.0.mlp.fc1.weight", "condition_proj.weight", "time_embedder.proj_in.weight",
                                "time_embedder.proj_out.weight", "final_layer.video_out.weight",
                                "final_layer.audio_out.weight")}
    miss = [k for k, v in need.items() if v is None]
    if miss:
        det.error(f"cannot read the H3 sizes: missing {', '.join(_named(det, k) for k in miss)}")
        return None
    keys = set(logical) | {f"{s}.weight" for s in det.int8_layers}
    hd = need["blocks.0.attn.q_norm.weight"][0]
    rows = need["blocks.0.attn.qkv_proj.weight"][0]
    if hd <= 0 or rows % (3 * hd):
        det.error(f"qkv rows {rows} are not 3 x head_dim ({hd}) x heads", _named(det, "blocks.0.attn.qkv_proj.weight"))
        return None
    rope = logical.get("rope.inv_freq")
    cj = cfg_json or {}
    cfg = DMDConfig(hidden=need["video_patch_proj.weight"][0], heads=rows // (3 * hd), head_dim=hd,
                    ffn=need["blocks.0.mlp.fc1.weight"][0] // 2, layers=_count(keys, "blocks."),
                    refiner_layers=_count(keys, "token_refiner.blocks."), text_dim=need["condition_proj.weight"][1],
                    latents_dim=need["final_layer.video_out.weight"][0] // 4,
                    audio_latents_dim=need["final_layer.audio_out.weight"][0],
                    freq_dim=need["time_embedder.proj_in.weight"][1], time_hidden=need["time_embedder.proj_in.weight"][0],
                    time_dim=need["time_embedder.proj_out.weight"][0],
                    rope_freq_dim=rope[1][0] if rope else int(cj.get("rope_freq_dim", 16)),
                    rope_theta=float(cj.get("rope_theta", 10000.0)))
    for ck, fld in CONFIG_JSON_FIELDS.items():
        if ck in cj and fld not in ("rope_theta",) and cj[ck] != getattr(cfg, fld):
            det.error(f"config.json sets {ck} = {cj[ck]!r} but the weights say {getattr(cfg, fld)}",
                      f"config.json:{ck}")
    if "patch_size" in cj and list(cj["patch_size"]) != [1, 2, 2]:
        det.error(f"config.json patch_size {cj['patch_size']} (core's H3 uses [1, 2, 2])", "config.json:patch_size")
    return cfg


def core_metadata(det: DMDDetection) -> dict[str, str]:
    """``__metadata__`` for core's loader: ``config.transformer`` with config.json's norm eps values (core merges
    it over the sizes it reads from the shapes) and the provenance."""
    cj = det.source.config or {}
    tr = {k: cj[k] for k in CORE_CONFIG_KEYS if k in cj}
    meta = {"h3_turbo_source_format": det.format, "h3_turbo_source": os.path.basename(det.path)}
    if tr:
        meta["config"] = json.dumps({"transformer": tr})
    return meta


# --------------------------------------------------------------------------------------------- streaming

def int8_weight_of(lay: Int8Layer, get: Callable[[str], torch.Tensor]) -> ib.Int8Weight:
    """The layer's W8A8 weight in core layout: split q/k/v fused (:func:`~..kernels.int8_block.fuse_rows`), fc1
    halves swapped (exact: whole 128-row blocks, else per-row scales)."""
    ws = [ib.Int8Weight(get(w), get(s).float(), 0) for w, s in zip(lay.weights, lay.scales)]
    for w in ws:
        w.row_group = ib.Int8Weight.row_group_of(w.qdata.shape[0], w.scale.shape[0])
        w.validate(lay.stem)
    if lay.op == "qkv":
        return ib.fuse_rows(ws)
    w = ws[0]
    if lay.op == "swap":
        n = w.out_features
        half = n // 2
        if w.row_group == ib.BLOCK and half % ib.BLOCK == 0:
            nb = half // ib.BLOCK
            return ib.Int8Weight(swap_halves(w.qdata), torch.cat([w.scale[nb:], w.scale[:nb]]).contiguous(), ib.BLOCK)
        rs = w.row_scales()
        return ib.Int8Weight(swap_halves(w.qdata), torch.cat([rs[half:], rs[:half]]).contiguous(), 1)
    return w


def _scale_rows(det: DMDDetection, lay: Int8Layer) -> int:
    """Rows of the core-layout scale :func:`int8_weight_of` makes for ``lay`` (from the header only)."""
    T = det.source.header.tensors
    parts = [(T[w].shape[0], T[s].shape[0]) for w, s in zip(lay.weights, lay.scales)]
    blocks = all(sr == ib.cdiv(n, ib.BLOCK) and n % ib.BLOCK == 0 for n, sr in parts)
    if lay.op == "qkv":
        return sum(sr for _, sr in parts) if blocks else lay.n
    n, sr = parts[0]
    grouped = sr == ib.cdiv(n, ib.BLOCK)
    if lay.op == "swap":
        return sr if grouped and (n // 2) % ib.BLOCK == 0 else n
    return sr


def core_plan(det: DMDDetection, adaln: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{core key: (safetensors dtype, shape)}`` of what :func:`iter_core` yields, from the headers alone."""
    out = {}
    for e in det.entries:
        if adaln or not _is_block_adaln(e.key):
            out[e.key] = (e.dtype, tuple(e.shape))
    T = det.source.header.tensors
    for s, lay in det.int8_layers.items():
        out[f"{s}.weight"] = ("I8", (lay.n, lay.k))
        out[f"{s}.{INT8_SCALE}"] = ("F32", (_scale_rows(det, lay), ib.cdiv(lay.k, ib.BLOCK)))
        if lay.bias:
            out[f"{s}.bias"] = (T[lay.bias].dtype, tuple(T[lay.bias].shape))
    return out


def iter_core(det: DMDDetection, adaln: bool = True, progress: Callable[[int, int], None] | None = None,
              only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(core key, tensor)`` for the whole checkpoint, converting as it reads (one entry in memory at a time).
    ``adaln=False`` skips the DiT blocks' AdaLN weights (an AdaLN table replaces them); ``only``: just these core
    keys (a W8A8 layer is read when its ``weight`` is asked for). Float tensors keep their stored dtype (the 12
    fp32-island tensors stay fp32); W8A8 layers yield ``P.weight`` int8 and ``P.int8_scale``."""
    det.raise_if_errors()
    cfg = det.config
    pfx = getattr(det, "_prefix", "")
    total = len(det.entries) + len(det.int8_layers)
    done = 0
    with det.source.reader() as r:
        def get(k):
            return r.get(pfx + k)

        for e in det.entries:
            done += 1
            if (not adaln and _is_block_adaln(e.key)) or (only is not None and e.key not in only):
                continue
            if e.op == "rope":
                yield e.key, rope_inv_freq(cfg.rope_freq_dim, cfg.rope_theta)
            elif e.op == "qkv":
                yield e.key, torch.cat([get(s) for s in e.sources], 0)
            elif e.op == "swap":
                yield e.key, swap_halves(get(e.sources[0]))
            else:
                yield e.key, get(e.sources[0])
            if progress is not None:
                progress(done, total)
        for s, lay in det.int8_layers.items():
            done += 1
            if only is not None and f"{s}.weight" not in only:
                continue
            w = int8_weight_of(lay, get)
            yield f"{s}.weight", w.qdata
            yield f"{s}.{INT8_SCALE}", w.scale
            if lay.bias:
                yield f"{s}.bias", get(lay.bias)
            if progress is not None:
                progress(done, total)


# --------------------------------------------------------------------------------------------- the release's adaln/

#: the TurboH3 card's verified schedule: i2va, 5 sigma points (4 updates), video shift 12, audio shift 3
I2VA_PLAN = {"task": "i2va", "steps": 5, "video_shift": 12.0, "audio_shift": 3.0}
RELEASE_ROWS_LAYOUT = "turboh3_release_rows"
_BLOCK_RE = re.compile(r"(?:^|[._])(?:transformer_blocks|blocks|block|layers|layer)[._]?(\d+)(?:[._]|$)")
_STEPS_KEYS = ("steps", "num_inference_steps", "num_steps", "sigma_points")
_VSHIFT_KEYS = ("video_shift", "flow_shift", "shift", "sigma_shift_video", "video_flow_shift")
_ASHIFT_KEYS = ("audio_shift", "audio_flow_shift", "sigma_shift_audio")


def i2va_plan_timesteps(steps: int = 5, shift_video: float = 12.0, shift_audio: float = 3.0,
                        cond: float = 0.999) -> list[float]:
    """The rows of the i2va plan as diffusers' ``MiniMaxH3Scheduler`` and modular pipeline key them: per update the
    sorted distinct {t_video, t_audio, max(t_video, cond)}, ``t = fp32(1 - sigma)``, ``sigma = s*b/(1+(s-1)*b)`` on
    ``b = linspace(1, 0, steps)`` in fp32 (``steps`` sigma points incl. 0). 5 / 12 / 3: step 0 {0, 0.999}, steps 1-3
    {t_v, t_a, 0.999}: 11 rows."""
    b = torch.linspace(1.0, 0.0, int(steps), dtype=torch.float32)
    out: list[float] = []
    sv, sa = (s * b / (1 + (s - 1) * b) for s in (shift_video, shift_audio))
    for i in range(int(steps) - 1):
        tv, ta = float(1.0 - sv[i]), float(1.0 - sa[i])
        out += sorted({tv, ta, max(tv, float(torch.tensor(cond, dtype=torch.float32)))})
    return out


def _increasing_runs(ts: list[float]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, t in enumerate(ts):
        if runs and t > ts[runs[-1][-1]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _json_values(md: dict) -> dict:
    out = {}
    for k, v in md.items():
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                pass
        out[k] = v
        if isinstance(v, dict):                # one level of nesting ("schedule": {...}, "table": {...})
            for k2, v2 in v.items():
                out.setdefault(k2, v2)
    return out


def _first(d: dict, keys):
    return next((d[k] for k in keys if k in d), None)


def read_release_rows(path: str):
    """The inferred layout of the TurboH3 release's ``adaln/`` (its format is not public; docs/turboh3.md, "AdaLN
    table layouts"): one ``.safetensors`` (``path`` or the only one in folder ``path``, ``*.json`` beside it read as
    metadata) holding R rows of AdaLN outputs: per DiT block one tensor named with its block index (``[R, 18H]``,
    ``[3R, 6H]``, ``[R, 3, 6H]`` or ``[R, 3, 6, H]``: the linear output in core's / diffusers' row order), or one
    stacked ``[L, ...]`` tensor of those, and the final layer's ``[R, 2H]`` / ``[R, 2, H]`` (a name with ``norm_out``
    or ``final``). The R timesteps: a 1-D float tensor named ``*timestep*``, else a ``timesteps`` list in the
    metadata / JSON, else the i2va plan (:func:`i2va_plan_timesteps`) when the metadata names its schedule (5 points,
    shifts 12/3) and R = 11. Timestep groups = the maximal increasing runs of the rows (one per update).
    Returns (AdaLNTable, None), or (None, why it is not this layout)."""
    from ..runtime.adaln import AdaLNTable, _bits

    if os.path.isdir(path):
        files = sorted(os.listdir(path))
        st = [f for f in files if f.endswith(".safetensors")]
        if len(st) != 1:
            return None, f"the release layout has one .safetensors in adaln/ ({len(st)} found)"
        file, jsons = os.path.join(path, st[0]), [os.path.join(path, f) for f in files if f.endswith(".json")]
    else:
        file, jsons = path, []
    hdr = read_header(file)
    md = _json_values(dict(hdr.metadata))
    for j in jsons:
        try:
            with open(j, encoding="utf-8") as f:
                obj = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict):
            for k, v in _json_values(obj).items():
                md.setdefault(k, v)
    T = hdr.tensors
    final = [t for k, t in T.items() if ("norm_out" in k or "final" in k) and len(t.shape) in (2, 3)]
    if len(final) != 1:
        return None, f"no single final-layer tensor (a name with norm_out / final; {len(final)} found)"
    fin = final[0]
    R = fin.shape[0]
    if len(fin.shape) == 3 and fin.shape[1] != 2 or len(fin.shape) == 2 and fin.shape[1] % 2:
        return None, f"final-layer tensor {fin.name} {list(fin.shape)} is not [R, 2 x hidden] or [R, 2, hidden]"
    H = fin.shape[2] if len(fin.shape) == 3 else fin.shape[1] // 2
    ok_block = {(R, 18 * H), (3 * R, 6 * H), (R, 3, 6 * H), (R, 3, 6, H)}
    ts_t = [t for k, t in T.items() if "timestep" in k.lower() and len(t.shape) == 1]
    skip = {fin.name} | {t.name for t in ts_t}
    blocks: dict[int, object] = {}
    stacked = None
    for k, t in T.items():
        if k in skip:
            continue
        m = _BLOCK_RE.search(k)
        if m and tuple(t.shape) in ok_block:
            if int(m.group(1)) in blocks:
                return None, f"two tensors for block {m.group(1)}: {blocks[int(m.group(1))].name}, {k}"
            blocks[int(m.group(1))] = t
        elif len(t.shape) >= 3 and tuple(t.shape[1:]) in ok_block and stacked is None:
            stacked = t
        else:
            return None, (f"tensor {k} {t.dtype} {list(t.shape)} fits neither a block's rows {sorted(ok_block)} nor "
                          f"a stacked [L, ...] of them (R = {R} rows, hidden {H} from {fin.name} {list(fin.shape)})")
    if blocks and stacked is not None or not blocks and stacked is None:
        return None, "per-block tensors and a stacked one, or neither"
    L = stacked.shape[0] if stacked is not None else len(blocks)
    if stacked is None and sorted(blocks) != list(range(L)):
        return None, f"block indices {sorted(blocks)[:8]}... are not 0..{L - 1}"
    # ---- the timesteps
    how = None
    if len(ts_t) == 1 and ts_t[0].shape == (R,) and ts_t[0].dtype in ("F32", "F64", "BF16", "F16"):
        src = ts_t[0]
        how = f"tensor {src.name}"
    elif isinstance(md.get("timesteps"), list) and len(md["timesteps"]) == R:
        ts = [float(x) for x in md["timesteps"]]
        how = "metadata 'timesteps'"
    else:
        steps, sv, sa = _first(md, _STEPS_KEYS), _first(md, _VSHIFT_KEYS), _first(md, _ASHIFT_KEYS)
        try:
            plan = (int(steps), float(sv), float(sa)) == (5, 12.0, 3.0)
        except (TypeError, ValueError):
            plan = False
        if not (plan and R == 11):
            return None, (f"no timesteps: no 1-D '*timestep*' tensor of {R} values, no 'timesteps' list of {R} in "
                          f"the metadata, and no i2va schedule (steps {steps}, shifts {sv}/{sa}; 11 rows) to derive "
                          "them from")
        ts = i2va_plan_timesteps()
        how = "the i2va plan of its metadata (5 points, shifts 12/3, t = fp32(1 - sigma))"
    from .safetensors_io import open_tensors

    with open_tensors(file, header=hdr) as r:
        if how.startswith("tensor"):
            ts = r.get_tensor(src.name).float().tolist()
        fin_t = r.get_tensor(fin.name).reshape(R, 2 * H)
        if stacked is not None:
            st_t = r.get_tensor(stacked.name)
            rows = [st_t[i].reshape(R, 18 * H) for i in range(L)]
        else:
            rows = [r.get_tensor(blocks[i].name).reshape(R, 18 * H) for i in range(L)]
    runs = _increasing_runs(ts)
    bits = _bits(ts)
    groups = [tuple(bits[i] for i in run) for run in runs]
    meta = {k: v for k, v in md.items() if isinstance(v, (str, int, float, bool))}
    meta.update(timesteps_from=how, file=os.path.basename(file))
    return AdaLNTable(path, RELEASE_ROWS_LAYOUT, H, groups, [run[0] for run in runs], rows, fin_t, meta), None
