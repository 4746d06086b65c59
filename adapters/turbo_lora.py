"""Turbo LoRA files: read, recognize, validate and convert to the canonical fused (ComfyUI) form.

No ComfyUI import here: everything works on plain torch tensors and safetensors files, so it is
testable and usable before any model is touched.

Canonical form (docs/h3-facts.md#turbo-lora-layout), one entry per target
``<block>.<proj>`` with block in ``blocks.N`` / ``token_refiner.blocks.N`` and proj in
``attn.qkv_proj``, ``attn.out_proj``, ``mlp.fc1``, ``mlp.fc2``:

- ``A`` bf16 [R, in], ``B`` bf16 [out, R], ``alpha`` float (fp32 on disk), ``rank`` R = A.shape[0];
- qkv: R = 3r, A = cat(A_q; A_k; A_v), B = block_diag(B_q, B_k, B_v), alpha = 3*alpha_r;
- fc1: B rows [gate; up] (ComfyUI order).

The branch adds ``strength * (alpha / R) * B @ (A @ x)``. Accepted file layouts:

- ComfyUI: ``diffusion_model.<target>.{lora_A.weight, lora_B.weight, alpha}`` (the official files), also
  bare ``<target>.*`` keys, kohya ``lora_down`` / ``lora_up`` and kohya / musubi ``lora_unet_<target with _>``;
- DiffSynth-Studio: core's names with the PEFT ``.lora_A.default.weight`` infix; its fused qkv B rows are
  per-head interleaved and are de-interleaved (:func:`deinterleave_qkv_rows`, needs the model's head size);
  alpha from tensors or ``__metadata__["alpha"]``, else refused;
- Diffusers twin: ``transformer_blocks.N`` / ``token_refiner.refiner_blocks.N`` (optionally under
  ``diffusion_model.`` / ``model.``, or as ``lora_unet_`` names with one alpha per module) with
  ``attn.to_q|to_k|to_v|to_out.0`` and ``ff.net.0.proj`` (rows [up; gate]) / ``ff.net.2``, PEFT
  ``.lora_A(.default).weight``; no alpha tensors: alpha = ``__metadata__["alpha"]`` (8 when absent, the
  reference trainer's default). Converted EXACTLY to the fused form (concat A, block-diagonal B,
  alpha x3 for qkv, fc1 halves swapped).

Every tensor's values are checked (NaN / Inf, ``formats.values``) and every alpha must be > 0.

Errors are :class:`TurboLoRAError` (a ``ValueError``) naming the file, listing the first offending keys
and the counts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field

import torch

from .. import state
from ..errors import TurboLoRAError
from ..model_facts import PROJECTIONS
from . import contracts

log = logging.getLogger("h3_turbo")

DIFFUSERS_DEFAULT_ALPHA = 8.0  # reference trainer default when __metadata__["alpha"] is absent (docs/h3-facts.md#other-lora-layouts)
_SHOW = 5  # keys shown per error list

# Keys of other H3 modules: an adapter touching them was made for another base layout.
_FOREIGN_MODULE_RE = re.compile(
    r"(adaln_proj|adaln_t_table|final_layer|video_patch_proj|audio_patch_proj|condition_proj|"
    r"time_embedder|norm_out|proj_out|patch_embed|time_text_embed|norm1|norm2|q_norm|k_norm)")

_PART = r"(?P<part>lora_A(?:\.default)?\.weight|lora_B(?:\.default)?\.weight|lora_down\.weight|lora_up\.weight|alpha)"

_COMFY_RE = re.compile(
    r"^(?:diffusion_model\.|model\.diffusion_model\.)?"
    r"(?P<block>blocks\.\d+|token_refiner\.blocks\.\d+)\."
    r"(?P<proj>attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2)\." + _PART + "$")

_DIFF_RE = re.compile(
    r"^(?:transformer\.|base_model\.model\.|diffusion_model\.|model\.)?"
    r"(?P<block>transformer_blocks\.\d+|token_refiner\.refiner_blocks\.\d+)\."
    r"(?P<proj>attn\.to_q|attn\.to_k|attn\.to_v|attn\.to_out\.0|ff\.net\.0\.proj|ff\.net\.2)\." + _PART + "$")

# kohya sd-scripts / musubi-tuner: "lora_unet_" + the module path with "." written as "_"
_LORA_UNET_RE = re.compile(r"^lora_unet_(?P<body>[A-Za-z0-9_]+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)$")
_UNET_BODY = (
    (re.compile(r"^(blocks|token_refiner_blocks)_(\d+)_(attn_qkv_proj|attn_out_proj|mlp_fc1|mlp_fc2)$"),
     lambda m: f"{'blocks' if m[1] == 'blocks' else 'token_refiner.blocks'}.{m[2]}.{m[3].replace('_', '.', 1)}"),
    (re.compile(r"^(transformer_blocks|token_refiner_refiner_blocks)_(\d+)_"
                r"(attn_to_q|attn_to_k|attn_to_v|attn_to_out_0|ff_net_0_proj|ff_net_2)$"),
     lambda m: (("token_refiner.refiner_blocks" if m[1].startswith("token") else "transformer_blocks") + f".{m[2]}."
                + {"attn_to_q": "attn.to_q", "attn_to_k": "attn.to_k", "attn_to_v": "attn.to_v",
                   "attn_to_out_0": "attn.to_out.0", "ff_net_0_proj": "ff.net.0.proj", "ff_net_2": "ff.net.2"}[m[3]])),
)

_DIFF_PROJ = {"attn.to_q": ("attn.qkv_proj", 0), "attn.to_k": ("attn.qkv_proj", 1),
              "attn.to_v": ("attn.qkv_proj", 2), "attn.to_out.0": ("attn.out_proj", None),
              "ff.net.0.proj": ("mlp.fc1", None), "ff.net.2": ("mlp.fc2", None)}


def _part(p: str) -> str:
    return "A" if p.startswith(("lora_A", "lora_down")) else "B" if p.startswith(("lora_B", "lora_up")) else "alpha"


def parse_key(k: str) -> tuple[str, str, str, str, str | None] | None:
    """(family, block, proj, part, style) of one adapter key in any accepted layout, or None (module doc).

    family "comfy" (core's module names) or "diffusers"; part "A" (lora_A / lora_down), "B" (lora_B /
    lora_up) or "alpha"; style names the key layout: "diffusion_model." /
    "bare" (core names), "diffsynth" (core names with the PEFT ``.default.`` infix), "kohya" (``lora_down`` /
    ``lora_up``), "lora_unet" (kohya / musubi ``lora_unet_`` names), "diffusers"; None for a dotted ``alpha``
    key (it fits any of them).
    """
    style = None
    m = _LORA_UNET_RE.match(k)
    if m:
        dotted = next((f(mm) for rx, f in _UNET_BODY if (mm := rx.match(m["body"]))), None)
        if dotted is None:
            return None
        k, style = f"{dotted}.{m['part']}", "lora_unet"
    m = _COMFY_RE.match(k) or _DIFF_RE.match(k)
    if m is None:
        return None
    family = "comfy" if m.re is _COMFY_RE else "diffusers"
    part = m["part"]
    if style is None:
        if part == "alpha":
            style = None          # neutral: an alpha key says nothing about the A/B key style
        elif ".default." in part and family == "comfy":
            style = "diffsynth"
        elif part in ("lora_down.weight", "lora_up.weight"):
            style = "kohya"
        elif family == "diffusers":
            style = "diffusers"
        else:
            style = "diffusion_model." if k.startswith(("diffusion_model.", "model.diffusion_model.")) else "bare"
    return family, m["block"], m["proj"], _part(part), style


def _listing(title: str, items: list[str]) -> str:
    items = sorted(items, key=_natural)
    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return f"{title}: {len(items)} [{', '.join(items[:_SHOW])}{more}]"


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def target_names(num_blocks: int = 50, refiner_blocks: int = 2) -> list[str]:
    """The official target names: 4 projections of ``blocks.0..num_blocks-1`` then the refiner blocks.

    Full H3: 52 x 4 = 208 targets (624 tensors in a file).
    """
    pfx = [f"blocks.{i}" for i in range(num_blocks)] + [f"token_refiner.blocks.{j}" for j in range(refiner_blocks)]
    return [f"{p}.{proj}" for p in pfx for proj in PROJECTIONS]


def model_target_dims(diffusion_model) -> dict[str, tuple[int, int]]:
    """{target: (out_features, in_features)} of an H3 ``diffusion_model`` (ComfyUI ``MiniMaxH3Model``).

    Reads ``in_features``/``out_features`` of each projection module (quantized layers report the
    logical sizes). Raises TurboLoRAError if the model has no ``blocks``.
    """
    out: dict[str, tuple[int, int]] = {}
    blocks = getattr(diffusion_model, "blocks", None)
    if blocks is None:
        raise TurboLoRAError("the MODEL is not a MiniMax H3 diffusion model (no .blocks): a Turbo LoRA needs H3")
    refiner = getattr(getattr(diffusion_model, "token_refiner", None), "blocks", None) or []
    for pfx, blist in (("blocks", blocks), ("token_refiner.blocks", refiner)):
        for i, _ in enumerate(blist):
            for proj in PROJECTIONS:
                name = f"{pfx}.{i}.{proj}"
                m = diffusion_model.get_submodule(name)
                o = getattr(m, "out_features", None)
                n = getattr(m, "in_features", None)
                if o is None or n is None:
                    o, n = tuple(m.weight.shape)
                out[name] = (int(o), int(n))
    return out


def model_head_dim(diffusion_model) -> int | None:
    """The attention head size of an H3 ``diffusion_model`` (core's ``blocks[0].attn.head_dim``), or None."""
    blocks = getattr(diffusion_model, "blocks", None)
    hd = getattr(getattr(blocks[0], "attn", None), "head_dim", None) if blocks else None
    return int(hd) if hd is not None else None


@dataclass
class TargetLoRA:
    """One target in canonical form. ``A`` bf16 [R, in]; ``B`` bf16 [out, R]; ``alpha`` (float); R = rank.

    ``splits`` = 3 when B is exactly block-diagonal in thirds (fused qkv: apply as three rank-R/3
    products), else 1.
    """

    A: torch.Tensor
    B: torch.Tensor
    alpha: float
    splits: int = 1

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def scale(self) -> float:
        """alpha / rank (the LoRA scale before ``strength``)."""
        return self.alpha / self.rank

    def b_parts(self) -> list[torch.Tensor]:
        """The diagonal blocks of B ([out/3, R/3] each) when ``splits == 3``, else [B]."""
        if self.splits == 1:
            return [self.B]
        o, r = self.B.shape[0] // 3, self.rank // 3
        return [self.B[j * o:(j + 1) * o, j * r:(j + 1) * r].contiguous() for j in range(3)]

    def delta_weight(self, dtype=torch.float64) -> torch.Tensor:
        """(alpha/rank) * B @ A in ``dtype`` [out, in] (reference / tests)."""
        return self.scale * (self.B.to(dtype) @ self.A.to(dtype))


@dataclass
class TurboLoRA(contracts.AdapterFileNames):
    """A Turbo LoRA file in canonical form. ``targets``: {target: TargetLoRA}; ``nbytes``: tensor bytes.

    ``layout``: "comfy", "diffsynth" or "diffusers" (converted); ``key_style``: see :func:`parse_key`;
    ``contract``: the TurboContract, or None when it cannot be determined (not an official file, no contract
    metadata).
    """

    path: str
    sha256: str
    targets: dict[str, TargetLoRA]
    metadata: dict[str, str]
    layout: str
    key_style: str
    contract: contracts.TurboContract | None
    nbytes: int
    notes: list[str] = field(default_factory=list)
    head_dim: int | None = None     # the head size qkv rows were de-interleaved for (DiffSynth layout), else None

    def validate_for(self, dims: dict[str, tuple[int, int]]) -> None:
        """Check this adapter against a model's targets ``{target: (out, in)}`` (see :func:`model_target_dims`).

        Raises ONE TurboLoRAError listing missing targets, targets the model does not have, and
        targets whose A/B shapes do not match the model's in/out features (with counts).
        """
        validate_targets({t: (tuple(tl.A.shape), tuple(tl.B.shape)) for t, tl in self.targets.items()},
                         dims, self.path)


def validate_targets(shapes: dict[str, tuple[tuple, tuple]], dims: dict[str, tuple[int, int]], path: str) -> None:
    """See :meth:`TurboLoRA.validate_for`. ``shapes``: {target: (A shape [R, in], B shape [out, R])}."""
    targets = shapes
    missing = [t for t in dims if t not in targets]
    extra = [t for t in targets if t not in dims]
    bad = []
    for t, (a_shape, b_shape) in targets.items():
        if t not in dims:
            continue
        o, n = dims[t]
        if a_shape[1] != n or b_shape[0] != o:
            bad.append(f"{t}: A {list(a_shape)} B {list(b_shape)} vs model [out {o}, in {n}]")
    if not (missing or extra or bad):
        return
    parts = [f"Turbo LoRA {os.path.basename(path)!r} does not fit this model ({len(dims)} targets expected, "
             f"{len(targets)} in the file)"]
    if missing:
        parts.append(_listing("missing targets", missing))
    if extra:
        parts.append(_listing("targets this model does not have", extra))
    if bad:
        parts.append(_listing("wrong hidden sizes", bad))
    hint = ""
    if bad or extra:
        hint = (" It was made for a different H3 (other width or depth): Turbo LoRAs must match the base "
                "they were trained on.")
    raise TurboLoRAError("; ".join(parts) + "." + hint + f" File: {path}")


# ---------------------------------------------------------------------------------------------
# Hashing (cached by path + size + mtime: a 2 GB file is hashed once per process)
# ---------------------------------------------------------------------------------------------
_HASHES = state.Store("file_sha256")          # (real path, size, mtime_ns) -> hex digest
_hash_lock = _HASHES.lock
_hash_cache: dict[tuple[str, int, int], str] = _HASHES.data
HASH_STATS = state.Counters("file_sha256_stats", ("hashed",)).data


def _stat_key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return (os.path.realpath(path), int(st.st_size), int(st.st_mtime_ns))


def sha256_file(path: str) -> str:
    """SHA-256 (lowercase hex) of a file, cached per process by (real path, size, mtime_ns)."""
    key = _stat_key(path)
    with _hash_lock:
        hit = _hash_cache.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    with _hash_lock:
        _hash_cache[key] = digest
        HASH_STATS["hashed"] += 1
    return digest


def cached_sha256(path: str) -> str | None:
    """The cached SHA-256 of ``path`` if it was already hashed in this process (no I/O beyond stat)."""
    try:
        key = _stat_key(path)
    except OSError:
        return None
    with _hash_lock:
        return _hash_cache.get(key)


def read_header(path: str) -> tuple[dict[str, dict], dict[str, str]]:
    """The safetensors header of ``path``: ({key: {"dtype", "shape"}}, __metadata__). Reads only the header,
    and checks the whole container like the model loader does (``formats.safetensors_io.read_header``:
    Git LFS pointer, truncated download, header larger than the file, trailing bytes, ...).

    Raises TurboLoRAError naming the file and the cause.
    """
    from ..errors import CheckpointError
    from ..formats.safetensors_io import read_header as read_container

    try:
        hdr = read_container(path)
    except CheckpointError as e:
        raise TurboLoRAError(f"Turbo LoRA {e}") from None
    tensors = {k: {"dtype": t.dtype, "shape": list(t.shape)} for k, t in hdr.tensors.items()}
    if tensors and not any(".lora_" in k or k.endswith((".alpha", "lora_A", "lora_B")) for k in tensors):
        raise TurboLoRAError(f"Turbo LoRA {path}: not a LoRA adapter ({len(tensors)} tensors, none named "
                             "*.lora_A / *.lora_B): is it a diffusion model? Put models in models/diffusion_models "
                             "and pick a Turbo LoRA file here")
    return tensors, {str(k): str(v) for k, v in hdr.metadata.items()}


# ---------------------------------------------------------------------------------------------
# Contracts
# ---------------------------------------------------------------------------------------------
def contract_for(path: str, metadata: dict[str, str], sha: str | None) -> contracts.TurboContract | None:
    """The Turbo contract of a file: known artifact by SHA-256, else by file name, else from the
    ``h3_turbo_fixture`` metadata JSON (source "metadata"), else None (no contract can be determined).

    A file named like an official artifact whose published SHA-256 differs gets the official contract
    with ``extra={"verified": False}`` and a warning (the alpha check still applies).

    ``extra["verified"]`` means what ``/h3turbo/ready`` reports (``adapters/scan.py``): True = the SHA-256 is a
    published one; False = an official name whose content differs from its published SHA-256; None = there is
    no published SHA-256 to compare with (fixtures, other files, official names with none published).
    """
    name = os.path.basename(path)
    if sha:
        art = contracts.by_sha256(sha)
        if art is not None:
            return _with(art.contract, name=name, sha256=sha, source="known-artifact", extra={"verified": True})
    art = contracts.by_filename(name)
    if art is not None:
        verified = False if art.sha256 and sha else None
        if art.sha256 and sha and art.sha256 != sha:
            log.warning("Turbo LoRA %s: file name is the official %s but its SHA-256 %s differs from the "
                        "published %s; using the official contract, unverified", path, art.contract.variant,
                        sha, art.sha256)
        return _with(art.contract, name=name, sha256=sha, source="known-artifact",
                     extra={"verified": verified, "matched": "filename"})
    fx = metadata.get("h3_turbo_fixture")
    if fx:
        try:
            d = json.loads(fx)
            nfe = int(d["nfe"])
            sv, sa = float(d["shift_video"]), float(d["shift_audio"])
        except (ValueError, KeyError, TypeError) as e:
            raise TurboLoRAError(f"Turbo LoRA {path}: __metadata__['h3_turbo_fixture'] is not valid "
                                 f"(need JSON with nfe, shift_video, shift_audio): {fx!r} ({e})") from e
        ts = metadata.get("training_scale")
        return contracts.TurboContract(f"{nfe}step", nfe, sv, sa, float(ts) if ts else None, name, sha,
                                       "metadata", {"verified": None})
    return None


def _with(c: contracts.TurboContract, **kw) -> contracts.TurboContract:
    d = c.as_dict()
    d.update(kw)
    return contracts.TurboContract(**d)


_variant_cache: dict[tuple[str, int, int], str | None] = state.Store("turbo_variant_by_header").data


def metadata_variant(path: str) -> str | None:
    """Alias ("4step"/"8step"...) of a file from its name (official) or its header metadata; no hashing.

    Returns None when the file is not recognizably a Turbo LoRA. Cached by (path, size, mtime).
    """
    art = contracts.by_filename(os.path.basename(path))
    if art is not None:
        return art.contract.variant
    try:
        key = _stat_key(path)
    except OSError:
        return None
    if key not in _variant_cache:
        _variant_cache[key] = _header_variant(path)
    return _variant_cache[key]


def _header_variant(path: str) -> str | None:
    try:
        _, meta = read_header(path)
    except TurboLoRAError:
        return None
    fx = meta.get("h3_turbo_fixture")
    if not fx:
        return None
    try:
        return f"{int(json.loads(fx)['nfe'])}step"
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# Parsing and conversion
# ---------------------------------------------------------------------------------------------
def classify_keys(keys, path: str) -> tuple[str, str, dict]:
    """Map file keys to targets. Returns (layout, key_style, mapping) where mapping is
    {target: {"A"|"B"|"alpha" or ("A", j)...: key}}; layout "comfy", "diffsynth" (core's names with the PEFT
    ``.default.`` infix: per-head interleaved qkv rows) or "diffusers"; key_style from :func:`parse_key`
    (or "mixed"). Raises TurboLoRAError for foreign/unknown keys and for files that mix layouts.
    """
    comfy: dict = {}
    diff: dict = {}
    foreign, unknown = [], []
    styles = set()
    for k in keys:
        parsed = parse_key(k)
        if parsed is None:
            (foreign if _FOREIGN_MODULE_RE.search(k) else unknown).append(k)
            continue
        family, block, proj, part, style = parsed
        if style is not None:
            styles.add(style)
        if family == "comfy":
            comfy.setdefault(f"{block}.{proj}", {})[part] = k
        else:
            blk = block.replace("transformer_blocks.", "blocks.").replace(
                "token_refiner.refiner_blocks.", "token_refiner.blocks.")
            proj, j = _DIFF_PROJ[proj]
            diff.setdefault(f"{blk}.{proj}", {})[part if j is None else (part, j)] = k
    fname = os.path.basename(path)
    if foreign:
        raise TurboLoRAError(
            f"Turbo LoRA {fname!r} also targets modules outside the 208 block projections "
            f"({_listing('keys', foreign)}). The official Turbo LoRAs touch only attn.qkv_proj/out_proj and "
            "mlp.fc1/fc2: this adapter was made for a different base (e.g. an unpruned H3 with per-block "
            "adaln_proj, while pruned checkpoints replace AdaLN with adaln_t_table) and is refused. "
            f"File: {path}")
    if unknown:
        raise TurboLoRAError(f"Turbo LoRA {fname!r}: keys that are not H3 Turbo LoRA keys "
                             f"({_listing('keys', unknown)}); expected diffusion_model.blocks.N.<attn.qkv_proj|"
                             f"attn.out_proj|mlp.fc1|mlp.fc2>.<lora_A.weight|lora_B.weight|alpha>. File: {path}")
    if comfy and diff:
        raise TurboLoRAError(f"Turbo LoRA {fname!r} mixes ComfyUI keys ({len(comfy)} targets) and Diffusers keys "
                             f"({len(diff)} targets); refusing an ambiguous file. File: {path}")
    if not comfy and not diff:
        raise TurboLoRAError(f"Turbo LoRA {fname!r} has no LoRA tensors. File: {path}")
    if "diffsynth" in styles and len(styles) > 1:
        raise TurboLoRAError(f"Turbo LoRA {fname!r} mixes DiffSynth-Studio keys (.default. infix, per-head "
                             f"interleaved qkv) with other key styles ({', '.join(sorted(styles - {'diffsynth'}))}); "
                             f"refusing an ambiguous file. File: {path}")
    style = styles.pop() if len(styles) == 1 else "mixed" if styles else "bare"
    if comfy:
        return ("diffsynth" if style == "diffsynth" else "comfy"), style, comfy
    return "diffusers", style, diff


def deinterleave_qkv_rows(B: torch.Tensor, head_dim: int) -> torch.Tensor:
    """qkv rows per head ``[h0: q k v, h1: q k v, ...]`` (the raw MiniMax / DiffSynth-Studio order) ->
    ``[q_all; k_all; v_all]`` (core's order). B: [3 * heads * head_dim, R]; a row permutation (exact)."""
    n = B.shape[0]
    if head_dim <= 0 or n % (3 * head_dim):
        raise ValueError(f"qkv B has {n} rows, not a multiple of 3 x head_dim {head_dim}")
    return B.reshape(n // (3 * head_dim), 3, head_dim, *B.shape[1:]).transpose(0, 1).reshape(B.shape)


def _alpha_value(t: torch.Tensor, key: str, path: str) -> float:
    if t.numel() != 1:
        raise TurboLoRAError(f"Turbo LoRA {os.path.basename(path)!r}: {key} has shape {list(t.shape)}, "
                             f"expected a scalar alpha. File: {path}")
    return float(t.reshape(()).float().item())


def _is_block_diag3(B: torch.Tensor) -> bool:
    o, R = B.shape
    if o % 3 or R % 3:
        return False
    mask = torch.ones(o, R, dtype=torch.bool)
    oo, rr = o // 3, R // 3
    for j in range(3):
        mask[j * oo:(j + 1) * oo, j * rr:(j + 1) * rr] = False
    return not bool(B[mask].any())


def _metadata_alpha(metadata: dict[str, str], fname: str, path: str) -> float | None:
    if "alpha" not in metadata:
        return None
    try:
        return float(metadata["alpha"])
    except ValueError as e:
        raise TurboLoRAError(f"Turbo LoRA {fname!r}: __metadata__['alpha'] = {metadata['alpha']!r} is "
                             f"not a number. File: {path}") from e


def canonicalize(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str, head_dim: int | None = None
                 ) -> tuple[dict[str, TargetLoRA], str, str, list[str]]:
    """Turn a file's tensors into canonical targets. Returns (targets, layout, key_style, notes).

    ``head_dim``: the model's attention head size, needed only for the DiffSynth-Studio layout (its fused
    qkv B rows are per-head interleaved and are de-interleaved, :func:`deinterleave_qkv_rows`).
    Checks: every tensor's values finite (``formats.values.problems``, the checkpoints' check); per target
    A and B present, A 2-D [R, in], B 2-D [out, R] with matching R, alpha present (ComfyUI layout), scalar
    and > 0 (0 would switch the target off, a negative alpha flip its sign), alpha/R equal to
    ``__metadata__["training_scale"]`` when present. Raises ONE TurboLoRAError listing every problem found.
    """
    from ..formats import values

    fname = os.path.basename(path)
    layout, style, mapping = classify_keys(tensors.keys(), path)
    notes: list[str] = []
    problems: dict[str, list[str]] = {}

    def bad(kind, item):
        problems.setdefault(kind, []).append(item)

    for k, t in tensors.items():
        for p in values.problems(t):
            bad("tensors with NaN or Inf values", f"{k}: {p}")

    def alpha_of(parts, part, t):
        return _alpha_value(tensors[parts[part]], parts[part], path)

    out: dict[str, TargetLoRA] = {}
    if layout == "diffusers":
        per_module = style in ("kohya", "lora_unet")   # these write one alpha tensor per module
        alpha_r = None
        if not per_module:
            alpha_r = _metadata_alpha(metadata, fname, path)
            if alpha_r is None:
                alpha_r = DIFFUSERS_DEFAULT_ALPHA
                notes.append(f"Diffusers twin without __metadata__['alpha']: alpha {alpha_r:g} (reference default)")
                log.warning("Turbo LoRA %s: Diffusers layout without __metadata__['alpha']; using the reference "
                            "trainer default alpha %g", path, alpha_r)
        for t, parts in mapping.items():
            has_alpha = any(p == "alpha" or (isinstance(p, tuple) and p[0] == "alpha") for p in parts)
            if has_alpha and not per_module:
                bad("alpha tensors in a Diffusers layout (alpha must come from __metadata__)", t)
                continue
            qkv = t.endswith("attn.qkv_proj")
            need = ([(x, j) for x in ("A", "B") + (("alpha",) if per_module else ()) for j in range(3)] if qkv
                    else ["A", "B"] + (["alpha"] if per_module else []))
            miss = [p for p in need if p not in parts]
            if miss:
                bad("targets with missing lora_A/lora_B (or alpha) tensors", f"{t} (missing {miss})")
                continue
            if qkv:
                As = [tensors[parts[("A", j)]] for j in range(3)]
                Bs = [tensors[parts[("B", j)]] for j in range(3)]
                shp = {(tuple(a.shape), tuple(b.shape)) for a, b in zip(As, Bs)}
                if len(shp) != 1 or any(a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] for a, b in zip(As, Bs)):
                    bad("inconsistent q/k/v shapes", f"{t}: " + ", ".join(
                        f"A {list(a.shape)} B {list(b.shape)}" for a, b in zip(As, Bs)))
                    continue
                if per_module:
                    qa = [alpha_of(parts, ("alpha", j), t) for j in range(3)]
                    if len(set(qa)) != 1:
                        bad("q/k/v alphas that differ (one fused qkv target needs one alpha/rank)",
                            f"{t}: {', '.join(f'{a:g}' for a in qa)}")
                        continue
                    alpha = 3.0 * qa[0]
                else:
                    alpha = 3.0 * alpha_r
                A = torch.cat(As, 0)
                B = torch.block_diag(*Bs)
            else:
                A, B = tensors[parts["A"]], tensors[parts["B"]]
                if t.endswith("mlp.fc1"):
                    if B.dim() != 2 or B.shape[0] % 2:
                        bad("fc1 B with an odd number of rows", f"{t}: B {list(B.shape)}")
                        continue
                    h = B.shape[0] // 2
                    B = torch.cat([B[h:], B[:h]], 0)  # Diffusers [value; gate] -> ComfyUI [gate; value]
                alpha = alpha_of(parts, "alpha", t) if per_module else alpha_r
            out[t] = TargetLoRA(A.to(torch.bfloat16).contiguous(), B.to(torch.bfloat16).contiguous(), alpha)
    else:
        meta_alpha = _metadata_alpha(metadata, fname, path) if layout == "diffsynth" else None
        if layout == "diffsynth" and head_dim is None:
            raise TurboLoRAError(
                f"Turbo LoRA {fname!r} is in the DiffSynth-Studio layout (core's module names with the PEFT "
                f".default. infix), whose fused qkv B rows are interleaved per attention head; de-interleaving "
                f"them needs the model's head size (apply it with Apply H3 Turbo LoRA). File: {path}")
        for t, parts in mapping.items():
            miss = [p for p in ("A", "B") if p not in parts]
            if "alpha" not in parts and meta_alpha is None:
                miss.append("alpha")
            if miss:
                names = {"A": "lora_A.weight", "B": "lora_B.weight", "alpha": "alpha"}
                kind = ("targets without alpha (DiffSynth-Studio layout: no alpha tensors and no __metadata__['alpha']"
                        "; the alpha it was trained with is not in the file)" if miss == ["alpha"] and
                        layout == "diffsynth" else "targets without rank/alpha (missing lora_A, lora_B or alpha)")
                bad(kind, f"{t} (missing {'/'.join(names[m] for m in miss)})")
                continue
            B = tensors[parts["B"]]
            if layout == "diffsynth" and t.endswith("attn.qkv_proj"):
                try:
                    B = deinterleave_qkv_rows(B, head_dim)
                except ValueError as e:
                    bad("qkv B rows that cannot be de-interleaved", f"{t}: {e}")
                    continue
            alpha = alpha_of(parts, "alpha", t) if "alpha" in parts else meta_alpha
            out[t] = TargetLoRA(tensors[parts["A"]].to(torch.bfloat16).contiguous(),
                                B.to(torch.bfloat16).contiguous(), alpha)
        if layout == "diffsynth":
            notes.append(f"DiffSynth-Studio layout: qkv B rows de-interleaved per head (head_dim {head_dim})")
    # shapes, rank, alpha consistency
    ts = metadata.get("training_scale")
    try:
        ts_val = float(ts) if ts is not None else None
    except ValueError:
        bad("__metadata__ training_scale not a number", repr(ts))
        ts_val = None
    for t, tl in list(out.items()):
        A, B = tl.A, tl.B
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1] or A.shape[0] == 0:
            bad("A/B shapes that are not [R, in] / [out, R]", f"{t}: A {list(A.shape)} B {list(B.shape)}")
            out.pop(t)
            continue
        if not math.isfinite(tl.alpha):
            bad("non-finite alpha", f"{t}: {tl.alpha}")
        elif tl.alpha <= 0:
            bad("alpha <= 0 (0 switches the target off, a negative alpha flips the sign of its delta; "
                "expected alpha > 0)", f"{t}: alpha {tl.alpha:g}")
        if ts_val is not None and abs(tl.scale - ts_val) > 1e-6 * max(1.0, abs(ts_val)):
            bad("alpha/rank disagreeing with __metadata__ training_scale "
                f"{ts_val:g}", f"{t}: alpha {tl.alpha:g} / rank {tl.rank} = {tl.scale:g}")
        if t.endswith("attn.qkv_proj"):
            if _is_block_diag3(B):
                tl.splits = 3
            else:
                notes.append(f"{t}: fused qkv B is not block-diagonal; applied as one rank-{tl.rank} product")
    if problems:
        parts_ = [_listing(k, v) for k, v in problems.items()]
        raise TurboLoRAError(f"Turbo LoRA {fname!r} is not valid: " + "; ".join(parts_) + f". File: {path}")
    nd = [n for n in notes if "not block-diagonal" in n]
    if nd and layout != "diffsynth":   # DiffSynth trains one fused qkv LoRA: full-rank B is expected there
        log.warning("Turbo LoRA %s: %d fused qkv targets are not block-diagonal (applied at full rank), e.g. %s",
                    path, len(nd), nd[0])
    return out, layout, style, notes


def check_contract_alpha(targets: dict[str, TargetLoRA], contract: contracts.TurboContract | None, path: str) -> None:
    """Raise TurboLoRAError when a known artifact's expected alpha/rank differs from the file's (any target)."""
    exp = contract.alpha_over_rank if contract is not None else None
    if exp is None or contract.source != "known-artifact":
        return
    bad = [f"{t}: {tl.scale:g}" for t, tl in targets.items() if abs(tl.scale - exp) > 1e-6 * max(1.0, exp)]
    if bad:
        raise TurboLoRAError(
            f"Turbo LoRA {os.path.basename(path)!r} is recognized as {contract.name} ({contract.variant}), whose "
            f"alpha/rank is {exp:g}, but the file says otherwise ({_listing('targets', bad)}). Wrong or re-exported "
            f"file: it would be applied at the wrong strength. File: {path}")


def load_turbo_lora(path: str, sha256: str | None = None, head_dim: int | None = None) -> TurboLoRA:
    """Read, validate (model-independent checks), convert and recognize a Turbo LoRA file.

    ``sha256``: the file's SHA-256 when already known (else computed, cached per process). ``head_dim``: the
    model's attention head size (:func:`model_head_dim`), used only by the DiffSynth-Studio layout.
    Model-dependent checks: :meth:`TurboLoRA.validate_for`. Raises TurboLoRAError.
    """
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise TurboLoRAError(f"Turbo LoRA file not found: {path}")
    _, metadata = read_header(path)  # clear error for non-safetensors files
    sha = sha256 or sha256_file(path)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    targets, layout, style, notes = canonicalize(tensors, metadata, path, head_dim=head_dim)
    del tensors
    contract = contract_for(path, metadata, sha)
    check_contract_alpha(targets, contract, path)
    if contract is None:
        log.warning("Turbo LoRA %s: not a known official artifact and no contract metadata, so it carries no Turbo "
                    "contract: H3 Turbo Sigmas needs steps > 0 and uses the model's shift, and the sampler enforces "
                    "nothing (pick variant 4step/8step on Apply H3 Turbo LoRA to sample it under an official "
                    "contract)", path)
    nbytes = sum(tl.A.numel() * tl.A.element_size() + tl.B.numel() * tl.B.element_size() for tl in targets.values())
    return TurboLoRA(path, sha, targets, metadata, layout, style, contract, nbytes, notes,
                     head_dim if layout == "diffsynth" else None)


def alias_table(files: dict[str, str]) -> dict[str, str]:
    """{alias: file name} for the Turbo LoRAs among ``files`` ({name in the loras folder: full path}).

    Official artifacts recognized by file name win, in ``contracts.KNOWN_ARTIFACTS`` order (so the
    4-step v1.1 and 8-step v1.0 files with known SHA-256 come first, docs/h3-facts.md#turbo-lora-files); files whose header carries the
    ``h3_turbo_fixture`` contract (our tiny fixtures) get their "<nfe>step" alias only when no official
    file claims it (first by sorted name). Execution still hashes and checks the chosen file.
    """
    out: dict[str, str] = {}
    by_base = {os.path.basename(n): n for n in files}
    for art in contracts.KNOWN_ARTIFACTS:
        n = by_base.get(art.filename)
        if n is not None and art.contract.variant not in out:
            out[art.contract.variant] = n
    for n in sorted(files, key=_natural):
        if contracts.by_filename(os.path.basename(n)) is not None:
            continue
        v = metadata_variant(files[n])
        if v and v not in out:
            out[v] = n
    return out
