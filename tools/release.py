"""TurboH3 DMD release tools: ``verify-release``, ``export-w8a8``, ``adaln-table`` (``python -m h3_turbo.tools``),
the manifest reader they share, and the tiny DMD release the tests use (:func:`make_dmd_release`).

- :func:`manifest_entries`: ``manifest.json`` -> {relative path: :class:`ManifestEntry`} (the schema is not
  public: a ``files`` list or mapping, or a top-level list / mapping, with path, size and SHA-256 under their
  usual names; anything else is refused with the keys found);
- :func:`verify_release`: every manifest file's size and SHA-256, streamed with a progress bar; every mismatch
  and missing file listed;
- :func:`export_w8a8`: BF16 Diffusers shards -> one W8A8 file with TurboDiffusion's recipe (the 200 DiT-block
  projections as ``int8_weight`` + ``scale``, Q/K/V fused into ``to_qkv`` or kept split; the blocks' AdaLN weights
  omitted, as the release does), streaming, plus a provenance JSON beside it;
- :func:`make_adaln_table`: an AdaLN table for a schedule from BF16/NVFP4 weights (needs ComfyUI's H3 modules).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..errors import CheckpointError
from ..formats import dmd as fdmd
from ..formats.convert import write_safetensors_stream
from ..formats.schemes.diffusers_map import core_to_diffusers, rope_inv_freq
from ..formats.schemes.w8a8_int8 import RELEASE_FORMAT
from ..kernels import int8_block as ib

MANIFEST_FORMAT = "h3_turbo_release_manifest"
_PATH_KEYS = ("path", "name", "file", "filename")
_SIZE_KEYS = ("size", "bytes", "size_bytes", "num_bytes")
_SHA_KEYS = ("sha256", "sha", "hash", "digest", "checksum")


@dataclass
class ManifestEntry:
    path: str
    size: int | None
    sha256: str | None


def _entry(path: str, obj, where: str) -> ManifestEntry:
    if isinstance(obj, str):
        size, sha = None, obj
    elif isinstance(obj, dict):
        size = next((obj[k] for k in _SIZE_KEYS if k in obj), None)
        sha = next((obj[k] for k in _SHA_KEYS if k in obj), None)
    else:
        raise CheckpointError(where, f"manifest entry for {path!r} is a {type(obj).__name__}",
                              expected="an object with size and sha256")
    if sha is not None:
        sha = str(sha).lower().removeprefix("sha256:")
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise CheckpointError(where, f"manifest entry for {path!r} has sha256 {sha!r}", expected="64 hex digits")
    if size is not None and (not isinstance(size, int) or size < 0):
        raise CheckpointError(where, f"manifest entry for {path!r} has size {size!r}", expected="a byte count")
    if os.path.isabs(path) or os.path.normpath(path).startswith(".."):
        raise CheckpointError(where, f"manifest path {path!r} is outside the release folder", expected="a relative path")
    return ManifestEntry(os.path.normpath(path), size, sha)


def _is_sha(s: str) -> bool:
    s = s.lower().removeprefix("sha256:")
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def manifest_entries(path: str) -> dict[str, ManifestEntry]:
    """The files a ``manifest.json`` lists: {normalized relative path: entry}. CheckpointError (with the keys found)
    for a schema this reader does not understand."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"manifest unreadable ({type(e).__name__}: {e})", expected="JSON") from None
    items = obj.get("files", obj) if isinstance(obj, dict) else obj
    out: dict[str, ManifestEntry] = {}
    if isinstance(items, list):
        for it in items:
            p = next((it[k] for k in _PATH_KEYS if isinstance(it, dict) and k in it), None)
            if not isinstance(p, str):
                raise CheckpointError(path, f"manifest list entry without a path: {str(it)[:120]}",
                                      expected=f"objects with one of {_PATH_KEYS}")
            e = _entry(p, it, path)
            out[e.path] = e
    elif isinstance(items, dict):
        top = items is obj
        for p, it in items.items():
            if not isinstance(it, (dict, str)) or (top and isinstance(it, str) and not _is_sha(it)) or \
                    (top and isinstance(it, dict) and not any(k in it for k in _SIZE_KEYS + _SHA_KEYS)):
                continue   # top-level metadata (repo, revision, ...)
            e = _entry(p, it, path)
            out[e.path] = e
    if not out or all(e.size is None and e.sha256 is None for e in out.values()):
        keys = sorted(obj)[:12] if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(path, f"unknown manifest schema (top level: {keys}): no file entries with size / sha256",
                              expected='{"files": [{"path", "size", "sha256"}, ...]} or {"<path>": {"size", "sha256"}}')
    return out


def sha256_file(path: str, progress: Callable[[int], None] | None = None, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
            if progress is not None:
                progress(len(b))
    return h.hexdigest()


def verify_release(root: str, show_progress: bool = True) -> tuple[list[str], dict]:
    """Check every file of ``root/manifest.json`` (size, then SHA-256, streamed). Returns (problems, summary); each
    problem names the file. CheckpointError when the manifest itself is missing or unreadable."""
    if not os.path.exists(root):
        raise CheckpointError(root, "does not exist (no such folder: check the path)",
                              expected="a TurboH3 release folder holding manifest.json")
    if not os.path.isdir(root):
        raise CheckpointError(root, "is a file, not a folder", expected="a TurboH3 release folder holding manifest.json")
    man = os.path.join(root, "manifest.json")
    if not os.path.isfile(man):
        raise CheckpointError(root, "no manifest.json in this folder", expected="a TurboH3 release folder")
    entries = manifest_entries(man)
    problems: list[str] = []
    todo = []
    for rel, e in sorted(entries.items()):
        p = os.path.join(root, rel)
        if not os.path.isfile(p):
            problems.append(f"missing: {rel}")
            continue
        size = os.path.getsize(p)
        if e.size is not None and size != e.size:
            problems.append(f"size mismatch: {rel}: {size} bytes, manifest says {e.size}")
            continue
        todo.append((rel, p, e, size))
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(t[3] for t in todo), unit="B", unit_scale=True, desc="sha256", file=sys.stderr)
    try:
        for rel, p, e, _ in todo:
            if e.sha256 is None:
                continue
            got = sha256_file(p, bar.update if bar is not None else None)
            if got != e.sha256:
                problems.append(f"sha256 mismatch: {rel}: {got}, manifest says {e.sha256}")
    finally:
        if bar is not None:
            bar.close()
    listed = set(entries)
    extra = []
    for dp, _, fs in os.walk(root):
        for f in fs:
            r = os.path.normpath(os.path.relpath(os.path.join(dp, f), root))
            if r not in listed and r != "manifest.json":
                extra.append(r)
    return problems, {"files": len(entries), "checked": len(todo), "not_in_manifest": sorted(extra)}


def write_manifest(root: str, files: list[str] | None = None) -> str:
    """``root/manifest.json`` (this pack's schema: ``{"format", "files": [{"path", "size", "sha256"}]}``) for
    ``files`` (relative paths; default every file under ``root``)."""
    if files is None:
        files = sorted(os.path.relpath(os.path.join(dp, f), root) for dp, _, fs in os.walk(root) for f in fs
                       if f != "manifest.json")
    ents = [{"path": f, "size": os.path.getsize(os.path.join(root, f)), "sha256": sha256_file(os.path.join(root, f))}
            for f in files]
    p = os.path.join(root, "manifest.json")
    with open(p, "w", encoding="utf-8") as fh:
        json.dump({"format": MANIFEST_FORMAT, "files": ents}, fh, indent=1)
    return p


# --------------------------------------------------------------------------------------------- export-w8a8

def _version() -> str:
    from .. import __version__

    return __version__


def export_w8a8(src: str, out: str, fuse_qkv: bool = True, keep_block_adaln: bool = False, device: str = "cpu",
                progress: Callable[[int, int], None] | None = None) -> dict:
    """BF16 Diffusers weights (index, file or release folder) -> W8A8 safetensors at ``out`` + provenance JSON.

    The DiT blocks' four projections become ``int8_weight`` (int8 [N, K]) + ``scale`` (fp32 [ceil(N/128),
    ceil(K/128)]) with TurboDiffusion's recipe (:func:`~h3_turbo.kernels.int8_block.quantize_weight`, fp32 math on
    ``device``); ``fuse_qkv``: Q/K/V as one ``attn.to_qkv`` (quantized as the fused matrix), else split. Everything
    else keeps its name and bytes, except the blocks' AdaLN weights (dropped unless ``keep_block_adaln``);
    ``rope.inv_freq`` is added (fp32). Returns the provenance dict (also written as ``<out>.json``)."""
    rel = fdmd.find_release(src)
    path = rel.bf16 or rel.w8a8
    det = fdmd.detect_dmd(path)
    det.raise_if_errors()
    if det.scheme.quantized:
        raise CheckpointError(path, "already W8A8", expected="BF16 Diffusers weights")
    if os.path.abspath(out) in (os.path.abspath(f) for f in det.source.files):
        raise CheckpointError(out, "output path is one of the input files", expected="a new file")
    cfg = det.config
    pfx = getattr(det, "_prefix", "")
    T = det.source.header.tensors
    blocks = {f"blocks.{i}" for i in range(cfg.layers)}
    plan, jobs = [], []   # (key, dtype, shape), (kind, args)
    quant_src: set[str] = set()
    for e in det.entries:
        stem = e.key.rpartition(".")[0]
        blk = ".".join(stem.split(".")[:2])
        if blk in blocks and stem.split(".", 2)[2] in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            quant_src.update(e.sources)
            n, k = e.shape
            names = [e.sources[0][len(pfx):].rpartition(".")[0]]
            if e.op == "qkv":
                parts = [s[len(pfx):].rpartition(".")[0] for s in e.sources]
                names = [parts[0].rpartition(".")[0] + ".to_qkv"] if fuse_qkv else parts
            for i, nm in enumerate(names):
                rows = n if len(names) == 1 else T[e.sources[i]].shape[0]
                plan += [(f"{nm}.int8_weight", "I8", (rows, k)), (f"{nm}.scale", "F32", (ib.cdiv(rows, 128), ib.cdiv(k, 128)))]
            jobs.append(("quant", e, names))
    for key, t in T.items():
        if key in quant_src:
            continue
        m = det.source_names
        core = next((ck for ck, srcs in m.items() if key in srcs), None)
        if core is not None and fdmd._is_block_adaln(core) and not keep_block_adaln:
            continue
        plan.append((key[len(pfx):], t.dtype, t.shape))
        jobs.append(("copy", key, None))
    if not any(k == "rope.inv_freq" for k, _, _ in plan):
        plan.append(("rope.inv_freq", "F32", (cfg.rope_freq_dim,)))
        jobs.append(("rope", None, None))
    meta = {"format": RELEASE_FORMAT, "h3_turbo_exporter": f"h3_turbo {_version()} export-w8a8",
            "quantization": json.dumps({"method": "TurboDiffusion Int8Linear block recipe", "block": [128, 128],
                                        "int8_max": 128, "amax_floor": 1e-8, "rounding": "half to even, saturating",
                                        "activations": "quantized per call, 128 rows x 128 channels"}),
            "qkv": "fused" if fuse_qkv else "split"}

    def items():
        with det.source.reader() as r:
            done = 0
            for kind, a, b in jobs:
                if kind == "copy":
                    yield a[len(pfx):], r.get(a)
                elif kind == "rope":
                    yield "rope.inv_freq", rope_inv_freq(cfg.rope_freq_dim, cfg.rope_theta)
                else:
                    e, names = a, b
                    ws = [r.get(s) for s in e.sources]
                    if len(names) == 1:
                        w = torch.cat(ws, 0) if len(ws) > 1 else ws[0]
                        ws = [w]
                    for nm, w in zip(names, ws):
                        q = ib.quantize_weight(w.to(device))
                        yield f"{nm}.int8_weight", q.qdata.cpu()
                        yield f"{nm}.scale", q.scale.cpu()
                    done += 1
                    if progress is not None:
                        progress(done, len(quant_jobs))

    quant_jobs = [j for j in jobs if j[0] == "quant"]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_safetensors_stream(out, items(), plan, meta)
    prov = {"format": RELEASE_FORMAT, "exporter": meta["h3_turbo_exporter"], "torch": torch.__version__,
            "device": str(device), "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": {"path": os.path.abspath(path), "format": det.format,
                       "files": [{"name": os.path.basename(f), "size": os.path.getsize(f)} for f in det.source.files]},
            "recipe": json.loads(meta["quantization"]), "qkv": meta["qkv"], "layers_w8a8": len(quant_jobs),
            "block_adaln": "kept" if keep_block_adaln else "omitted (use an AdaLN table)",
            "note": "re-quantizing on another device or with TurboDiffusion's CUDA kernel (fast math) need not give "
                    "the same bytes: verify released files by their manifest, not by re-exporting",
            "output": {"path": os.path.abspath(out), "size": os.path.getsize(out), "sha256": sha256_file(out)}}
    with open(os.path.splitext(out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(prov, f, indent=1)
    return prov


# --------------------------------------------------------------------------------------------- adaln-table

def adaln_weight_source(path: str):
    """(dims, get(core_key), close, name) for the AdaLN weights of a BF16 DMD checkpoint (Diffusers index / file /
    release folder) or a core-named H3 file (BF16 or NVFP4 with float AdaLN weights)."""
    from ..formats.detect import detect
    from ..formats.safetensors_io import TensorReader, read_header

    rel = fdmd.find_release(path)
    p = rel.bf16 or rel.w8a8
    if not p.endswith(fdmd.INDEX_SUFFIX):
        hdr = read_header(p)
        if "video_patch_proj.weight" in {k.split("diffusion_model.")[-1] for k in hdr.tensors}:
            det = detect(hdr)
            c = det.config
            if c is None or c.form != "unpruned":
                raise CheckpointError(p, "no unpruned H3 AdaLN weights in this file", expected="BF16/NVFP4 H3 weights")
            r = TensorReader(p, hdr)
            t = hdr.tensors
            dims = {"hidden": c.hidden, "layers": c.layers, "freq_dim": t[det.prefix + "time_embedder.proj_in.weight"].shape[1],
                    "time_hidden": t[det.prefix + "time_embedder.proj_in.weight"].shape[0],
                    "time_dim": t[det.prefix + "time_embedder.proj_out.weight"].shape[0]}
            return dims, (lambda k: r.get_tensor(det.prefix + k)), r.close, os.path.basename(p)
    det = fdmd.detect_dmd(p)
    det.raise_if_errors()
    if not det.has_adaln or not det.has_final_adaln:
        raise CheckpointError(p, "these weights have no AdaLN weights (the W8A8 export omits them)",
                              expected="the BF16 transformer/ shards")
    c = det.config
    src = {e.key: e.sources[0] for e in det.entries if e.op == "copy"}
    r = det.source.reader()
    dims = {"hidden": c.hidden, "layers": c.layers, "freq_dim": c.freq_dim, "time_hidden": c.time_hidden,
            "time_dim": c.time_dim}
    return dims, (lambda k: r.get(src[k])), r.close, os.path.basename(p.rstrip("/"))


def ensure_comfy(device: str = "cpu") -> None:
    """Make core's modules importable outside a running ComfyUI: its checkout on ``sys.path`` (``$COMFYUI_PATH`` or
    ``~/ComfyUI``) and, when ComfyUI is not imported yet, its ``--cpu`` flag for a CPU ``device`` (core's model
    management would look for a GPU otherwise). Inside ComfyUI it changes nothing."""
    if "comfy.model_management" in sys.modules:
        return
    from ..harness import comfyui_first_on_path, find_comfyui

    comfyui_first_on_path(find_comfyui())
    from comfy.cli_args import args

    if torch.device(device).type == "cpu":
        args.cpu = True


def make_adaln_table(model: str, sched_spec: str, out: str, dtype: str = "bf16", device: str = "cpu",
                     progress: Callable[[int, int], None] | None = None) -> dict:
    """Compute the AdaLN table of ``model`` for the schedule ``sched_spec`` (:func:`h3_turbo.runtime.adaln.schedule`)
    and write it in the pack's format. ``dtype``: the compute dtype of the runtime it is for (``bf16`` on GPUs,
    ``fp32`` for ComfyUI on the CPU); ``device``: where the rows are computed, and the device type whose forwards'
    timesteps the groups hold (a table made on the CPU can miss a CUDA forward's timestep by an ulp: build it on the
    device type that will run it). Needs ComfyUI importable (core's H3 modules compute the rows)."""
    from ..runtime import adaln as A

    ensure_comfy(device)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    sched = A.schedule(sched_spec)
    groups = A.timestep_groups(sched, device=device)   # the fp32 timesteps of forwards on that device
    dims, get, close, name = adaln_weight_source(model)
    try:
        blocks, final, sha = A.compute_rows(get, dims, groups, dt, device, progress)
    finally:
        close()
    meta = {"model": {"name": name, "weights_sha256": sha, "weights_hashed": "time_embedder.*, blocks.*.adaln_proj.*, "
                      "final_layer.adaln_proj.* (core names; key, dtype, shape and bytes)", **dims},
            "schedule": sched.as_dict(),
            "computed": {"how": "core ComfyUI TimeEmbedder (fp32) -> .to(dtype) -> AdalnProj (SiLU after the cast, as "
                                "core's forward), one batch per timestep group as core's forward",
                         "dtype": str(dt).replace("torch.", ""), "timestep_mlp_dtype": "float32", "device": str(device),
                         "sampler": "H3 Turbo Sigmas + H3 Turbo Sampler (per-call audio shift); groups with and "
                                    "without visual condition rows (t = 0.999)",
                         "tool": f"h3_turbo {_version()} adaln-table", "torch": torch.__version__}}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    A.write_table(out, blocks, final, groups, meta)
    return meta


def make_release_rows_table(model: str, out_dir: str, dtype: str = "bf16", device: str = "cpu",
                            stacked: bool = False) -> dict:
    """An AdaLN table in the TurboH3 release's inferred layout (``formats.dmd.read_release_rows``; the real layout
    is not public) under ``out_dir``: ``adaln.safetensors`` with ``transformer_blocks.{i}.adaln`` [3R, 6H] (the
    diffusers view of the linear output; ``stacked``: one ``adaln`` [L, R, 18H]) and ``norm_out.adaln`` [R, 2H] in
    ``dtype``, no timesteps tensor, the schedule in ``__metadata__`` and ``adaln.json`` (``timestep_mlp_dtype``
    float32): the 11 rows of the i2va plan keyed by diffusers' fp32(1 - sigma) (:func:`~h3_turbo.formats.dmd.
    i2va_plan_timesteps`), computed with core's modules one update's group per batch. Needs ComfyUI importable."""
    from ..runtime import adaln as A
    from safetensors.torch import save_file

    ensure_comfy(device)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    ts = fdmd.i2va_plan_timesteps()
    groups = [tuple(ts[i] for i in run) for run in fdmd._increasing_runs(ts)]
    dims, get, close, name = adaln_weight_source(model)
    try:
        blocks, final, sha = A.compute_rows(get, dims, groups, dt, device)
    finally:
        close()
    H, R = dims["hidden"], len(ts)
    if stacked:
        sd = {"adaln": torch.stack(blocks).contiguous()}
    else:
        sd = {f"transformer_blocks.{i}.adaln": b.reshape(3 * R, 6 * H).contiguous() for i, b in enumerate(blocks)}
    sd["norm_out.adaln"] = final.contiguous()
    meta = {"task": "i2va", "steps": "5", "video_shift": "12.0", "audio_shift": "3.0", "timestep_mlp_dtype": "float32",
            "dtype": dtype, "model": name, "weights_sha256": sha,
            "note": "h3_turbo test fixture in the inferred TurboH3 release layout"}
    os.makedirs(out_dir, exist_ok=True)
    save_file(sd, os.path.join(out_dir, "adaln.safetensors"), metadata=meta)
    with open(os.path.join(out_dir, "adaln.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return {"path": out_dir, "timesteps": ts, "groups": groups, "meta": meta}


# --------------------------------------------------------------------------------------------- the tiny release

def _save_aligned(sd, path, metadata=None):
    from .fixtures import _save_aligned as save

    save(sd, path, metadata or {})


def diffusers_config(cfg) -> dict:
    """``config.json`` of a ``MiniMaxH3Transformer3DModel`` with the tiny fixture's sizes (Diffusers argument names)."""
    return {"_class_name": "MiniMaxH3Transformer3DModel", "num_attention_heads": cfg.heads,
            "attention_head_dim": cfg.head_dim, "hidden_size": cfg.hidden, "num_layers": cfg.num_layers,
            "num_refiner_layers": cfg.refiner_layers, "ffn_dim": cfg.ffn, "in_channels": cfg.latents_dim,
            "audio_in_channels": cfg.audio_latents_dim, "patch_size": [1, 2, 2], "text_dim": cfg.text_dim,
            "freq_dim": cfg.timestep_input_dim, "time_embed_hidden_dim": cfg.time_embed_hidden,
            "time_embed_dim": cfg.time_embed_dim, "rope_freq_dim": cfg.rope_len, "rope_theta": 10000.0,
            "norm_eps": 1e-05, "qk_norm_eps": 1e-05, "final_norm_eps": 1e-05}


def write_diffusers_shards(sd_core: dict[str, torch.Tensor], out_dir: str, cfg, shards: int = 3,
                           stem: str = "diffusion_pytorch_model") -> str:
    """The core-named state dict in exact Diffusers naming as ``shards`` safetensors + ``<stem>.safetensors.index.json``
    + ``config.json`` (the layout of a Diffusers ``transformer/`` folder). Returns the index path."""
    d = core_to_diffusers(sd_core, cfg.heads, cfg.head_dim)
    keys = list(d)
    os.makedirs(out_dir, exist_ok=True)
    wm, per = {}, -(-len(keys) // shards)
    for i in range(shards):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: d[k] for k in keys[i * per:(i + 1) * per]}
        _save_aligned(part, os.path.join(out_dir, name))
        wm.update({k: name for k in part})
    idx = os.path.join(out_dir, f"{stem}{fdmd.INDEX_SUFFIX}")
    with open(idx, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in d.values())}, "weight_map": wm}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(diffusers_config(cfg), f, indent=1)
    return idx


DMD_TINY_LAYERS = (2, 1)


def tiny_dmd_config():
    import dataclasses

    from .fixtures import TinyH3Config

    return dataclasses.replace(TinyH3Config(), num_layers=DMD_TINY_LAYERS[0], refiner_layers=DMD_TINY_LAYERS[1])


def make_dmd_release(root: str, seed: int = 0, adaln_dtype: str | None = "fp32", fuse_qkv: bool = True) -> dict:
    """A tiny TurboH3-style release under ``root``: ``transformer/`` (3 Diffusers shards + index + config),
    ``w8a8/model_w8a8.safetensors`` (+ provenance JSON) exported from it, ``adaln/adaln_dmd.safetensors`` (the DMD
    schedule, computed with core's modules in ``adaln_dtype``; None: no table, no ComfyUI needed) and
    ``manifest.json``. Also writes ``core_bf16.safetensors`` beside ``root`` (the same weights in core naming).
    Returns {"root", "index", "w8a8", "adaln", "manifest", "core", "state_dict"}."""
    from .fixtures import make_tiny_h3_state_dict

    cfg = tiny_dmd_config()
    sd = make_tiny_h3_state_dict(cfg, seed)
    os.makedirs(root, exist_ok=True)
    idx = write_diffusers_shards(sd, os.path.join(root, "transformer"), cfg)
    w8 = os.path.join(root, "w8a8", "model_w8a8.safetensors")
    export_w8a8(idx, w8, fuse_qkv=fuse_qkv)
    out = {"root": root, "index": idx, "w8a8": w8, "adaln": None, "state_dict": sd}
    if adaln_dtype is not None:
        out["adaln"] = os.path.join(root, "adaln", "adaln_dmd.safetensors")
        make_adaln_table(idx, "dmd", out["adaln"], dtype=adaln_dtype)
    out["manifest"] = write_manifest(root)
    core = os.path.join(os.path.dirname(os.path.abspath(root)), os.path.basename(root.rstrip("/")) + "_core_bf16.safetensors")
    _save_aligned(sd, core, {"h3_turbo_fixture": "tiny DMD, core naming"})
    out["core"] = core
    return out


# --------------------------------------------------------------------------------------------- CLI

def _bar(desc):
    from tqdm.auto import tqdm

    state = {"bar": None}

    def cb(done, total):
        if state["bar"] is None:
            state["bar"] = tqdm(total=total, desc=desc, file=sys.stderr)
        state["bar"].n = done
        state["bar"].refresh()
        if done >= total:
            state["bar"].close()
    return cb


def cmd_verify(args) -> int:
    try:
        problems, summary = verify_release(args.dir, show_progress=not args.quiet)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in problems:
        print(f"FAIL {p}")
    for x in summary["not_in_manifest"]:
        print(f"note: not in manifest.json: {x}")
    print(f"{summary['files']} files in manifest.json, {summary['checked']} hashed: "
          + ("OK" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


def cmd_export(args) -> int:
    try:
        prov = export_w8a8(args.input, args.output, fuse_qkv=not args.split_qkv, keep_block_adaln=args.keep_adaln,
                           device=args.device, progress=_bar("W8A8 layers"))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {prov['layers_w8a8']} W8A8 layers ({prov['qkv']} Q/K/V), "
          f"{prov['output']['size']} bytes, sha256 {prov['output']['sha256']}; provenance "
          f"{os.path.splitext(args.output)[0]}.json")
    return 0


def cmd_adaln(args) -> int:
    from ..harness import ComfyUINotFound

    try:
        ensure_comfy(args.device)
    except ComfyUINotFound as e:
        print(f"error: adaln-table computes with ComfyUI's H3 modules: {e}", file=sys.stderr)
        return 1
    try:
        meta = make_adaln_table(args.model, args.schedule, args.out, args.dtype, args.device, _bar("AdaLN blocks"))
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: schedule {meta['schedule']['name']} ({meta['schedule']['nfe']} updates, "
          f"{meta['schedule']['shift_video']:g}/{meta['schedule']['shift_audio']:g}), {meta['computed']['dtype']}, "
          f"weights sha256 {meta['model']['weights_sha256']}")
    return 0


def add_parsers(sub) -> None:
    v = sub.add_parser("verify-release", help="size + SHA-256 of every file in DIR/manifest.json (exit 1 on any problem)")
    v.add_argument("dir")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(func=cmd_verify)
    e = sub.add_parser("export-w8a8", help="BF16 Diffusers shards -> W8A8 (TurboDiffusion recipe), streaming, + provenance JSON")
    e.add_argument("input", help="a *.safetensors.index.json, a Diffusers .safetensors or a release folder")
    e.add_argument("output")
    e.add_argument("--split-qkv", action="store_true", help="write to_q/to_k/to_v (default: one fused to_qkv)")
    e.add_argument("--keep-adaln", action="store_true", help="keep the DiT blocks' AdaLN weights (default: omitted)")
    e.add_argument("--device", default="cpu", help="where the quantization math runs (cpu, cuda)")
    e.set_defaults(func=cmd_export)
    a = sub.add_parser("adaln-table", help="AdaLN table of MODEL for a schedule (the pack's format; needs ComfyUI)")
    a.add_argument("model", help="BF16 DMD shards (index / folder) or a core-named BF16/NVFP4 H3 file")
    a.add_argument("--schedule", default="dmd", help="dmd (4 updates, 12/3), 4step (6/3), 8step (12/3) or N:SV/SA")
    a.add_argument("--out", required=True)
    a.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="the runtime's compute dtype (bf16 on GPUs; fp32 for ComfyUI on the CPU)")
    a.add_argument("--device", default="cpu")
    a.set_defaults(func=cmd_adaln)


# --------------------------------------------------------------------------------------------- inspect

def is_dmd_path(path: str) -> bool:
    """True for what ``inspect`` hands to :func:`inspect_dmd`: a folder, a shard index, or a file a release scheme
    (Diffusers names, Int8Linear layers) claims."""
    if os.path.isdir(path) or path.endswith(fdmd.INDEX_SUFFIX):
        return True
    from ..formats import registry
    from ..formats.safetensors_io import read_header
    from ..formats.schemes.base import HeaderView

    try:
        view = HeaderView.of(read_header(path))
        scheme = registry.identify_release(view)[0]
    except CheckpointError:
        return False
    # a core-named float H3 keeps the standard inspect (it is also the NVFP4 loader's plain input)
    return scheme is not None and (scheme.quantized or "video_patch_proj.weight" not in view.tensors)


def _det_report(det) -> dict:
    c = det.config
    return {"path": det.path, "format": det.format, "evidence": str(det.evidence) if det.evidence else None,
            "naming": det.naming, "qkv": det.qkv, "files": len(det.source.files),
            "tensors": len(det.source.header.tensors), "tensors_by_dtype": dict(sorted(det.dtype_counts.items())),
            "config": None if c is None else asdict(c), "w8a8_layers": len(det.int8_layers),
            "adaln_weights": det.has_adaln, "final_adaln_weights": det.has_final_adaln,
            "metadata_format": det.metadata.get("format"), "errors": len(det.errors), "ok": not det.errors}


def inspect_dmd(path: str) -> tuple[dict, list[str]]:
    """``inspect`` for the DMD formats: (report, findings as text) for a release folder, an index or a file."""
    from ..runtime.adaln import read_table

    rep: dict = {"path": path, "kind": "dmd", "ok": True}
    findings: list[str] = []
    try:
        rel = fdmd.find_release(path)
    except CheckpointError as e:
        return dict(rep, ok=False), [f"[error] {e}"]
    rep["release"] = {k: getattr(rel, k) for k in ("bf16", "w8a8", "adaln", "manifest")}
    rep["weights"] = []
    for p in dict.fromkeys(x for x in (rel.bf16, rel.w8a8) if x):
        try:
            det = fdmd.detect_dmd(p)
        except CheckpointError as e:
            rep["weights"].append({"path": p, "ok": False})
            findings.append(f"[error] {e}")
            rep["ok"] = False
            continue
        r = _det_report(det)
        rep["weights"].append(r)
        rep["ok"] &= r["ok"]
        findings += [f"{os.path.basename(p)}: {f}" for f in det.findings]
    if rel.adaln:
        try:
            rep["adaln"] = read_table(rel.adaln).describe()
        except CheckpointError as e:
            rep["adaln"] = None
            findings.append(f"[error] adaln: {e}")
            rep["ok"] = False
    return rep, findings


def print_dmd_report(rep: dict, findings: list[str]) -> None:
    print(f"path: {rep['path']}  (TurboH3 DMD / H3 Diffusers checkpoint)")
    for k, v in (rep.get("release") or {}).items():
        if v:
            print(f"  {k}: {v}")
    for w in rep.get("weights", []):
        print(f"weights: {w['path']}")
        if "format" not in w:
            continue
        print(f"  format: {w['format']} ({w['evidence']}); naming {w['naming']}, Q/K/V {w['qkv']}; "
              f"{w['files']} file(s), {w['tensors']} tensors: " + ", ".join(f"{k} {v}" for k, v in w["tensors_by_dtype"].items()))
        c = w["config"]
        if c:
            print(f"  H3 config: hidden {c['hidden']}, heads {c['heads']} x {c['head_dim']}, ffn {c['ffn']}, blocks "
                  f"{c['layers']} + refiner {c['refiner_layers']}, text_dim {c['text_dim']}, time {c['freq_dim']}->"
                  f"{c['time_hidden']}->{c['time_dim']}, rope_freq_dim {c['rope_freq_dim']}")
        print(f"  W8A8 layers: {w['w8a8_layers']}; AdaLN weights: blocks {'yes' if w['adaln_weights'] else 'no'}, "
              f"final {'yes' if w['final_adaln_weights'] else 'no'}" +
              (f"; metadata format {w['metadata_format']!r}" if w.get("metadata_format") else ""))
    if "adaln" in rep:
        print(f"adaln table: {rep['adaln']}")
    print(f"findings: {len(findings)}" + ("" if findings else " (none)"))
    for f in findings:
        print("  " + f)
    print("RESULT: " + ("OK" if rep["ok"] else "ERRORS"))
