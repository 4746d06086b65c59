"""Detect what a checkpoint is from its safetensors header (keys, dtypes, shapes, metadata), never its name.

:func:`detect` (a :class:`Header` from :func:`~h3_turbo.formats.safetensors_io.read_header`) returns a
:class:`Detection`: the model family (MiniMax H3, or what the file looks like instead), the format and the
scheme object that claimed it (:mod:`h3_turbo.formats.registry`), the key prefix, the H3 sizes read from
the shapes, one :class:`QuantLayer` per NVFP4 layer and every validation finding. It never raises for
content problems (they become findings; ``Detection.raise_if_errors()`` raises one
:class:`CheckpointError`), only when the file cannot be read. It reads tensor data only for tiny tensors
(per-layer ``comfy_quant`` JSON and scalar scales, at most :data:`SMALL_NUMEL` elements each); the values
of every tensor (NaN, Inf, negative block scales) are checked by :func:`check_block_scales`.

The formats and how detection decides between them: ``docs/formats.md``; each format's layout is in its
module under ``formats/schemes/``. Adding one: ``docs/EXTENDING.md``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..model_facts import (DEPTH, FP32_ISLAND, KEY_PREFIXES, NEVER_QUANTIZE, PROJECTIONS,  # noqa: F401 (re-exported)
                           REFINER_DEPTH)
from . import registry
from .nvfp4 import roundup
from .safetensors_io import CheckpointError, Header, TensorInfo
from .schemes.base import (CORE_QUANT_FORMATS, FLOAT_DTYPES, QUANT_SUFFIXES, SCALE_DTYPES,  # noqa: F401
                           SMALL_NUMEL, Evidence, HeaderView, QuantLayer, Scheme)
from .schemes.plain import UNCLAIMED


@dataclass
class Finding:
    """One validation result. level: "error" (refuse to load), "warning", "info"."""

    level: str
    message: str
    key: str | None = None

    def __str__(self) -> str:
        return f"[{self.level}] " + (f"{self.key}: " if self.key else "") + self.message


@dataclass(frozen=True)
class H3Sizes:
    """MiniMax H3 sizes read from a checkpoint's shapes (real: hidden 5376, 56 heads x 128, ffn 14336, 50+2 blocks,
    text 5120): the one definition the NVFP4 detection (:class:`H3Config`) and the DMD loader
    (``formats.dmd.DMDConfig``) extend."""

    hidden: int
    heads: int
    head_dim: int
    ffn: int
    layers: int
    refiner_layers: int
    text_dim: int
    latents_dim: int
    audio_latents_dim: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Logical [out, in] of the four projections of one block."""
        return {"attn.qkv_proj": (3 * self.inner, self.hidden), "attn.out_proj": (self.hidden, self.inner),
                "mlp.fc1": (2 * self.ffn, self.hidden), "mlp.fc2": (self.hidden, self.ffn)}

    def block_prefixes(self) -> list[str]:
        return [f"blocks.{i}" for i in range(self.layers)] + \
               [f"token_refiner.blocks.{j}" for j in range(self.refiner_layers)]

    def projection_stems(self) -> list[str]:
        """The 4 x (layers + refiner_layers) block projections (208 for the real model)."""
        return [f"{b}.{p}" for b in self.block_prefixes() for p in PROJECTIONS]


@dataclass(frozen=True)
class H3Config(H3Sizes):
    """:class:`H3Sizes` of a ComfyUI-layout file plus its AdaLN form."""

    form: str  # "unpruned" (adaln_proj on the time embedder) or "pruned" (adaln_t_table curve form)


class FindingsMixin:
    """Findings of a detection (``self.findings``, ``self.path``): add them, list the errors, raise them all
    as one :class:`CheckpointError` that ends with :meth:`fix_hint`."""

    findings: list

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def error(self, msg: str, key: str | None = None) -> None:
        self.findings.append(Finding("error", msg, key))

    def warn(self, msg: str, key: str | None = None) -> None:
        self.findings.append(Finding("warning", msg, key))

    def info(self, msg: str, key: str | None = None) -> None:
        self.findings.append(Finding("info", msg, key))

    def fix_hint(self) -> str:
        return "Fix: re-download or re-export the file; `python -m h3_turbo.tools inspect FILE` lists every finding."

    def raise_if_errors(self) -> None:
        """Raise :class:`CheckpointError` naming the path and every error (first 12 listed)."""
        errs = self.errors
        if not errs:
            return
        lines = "; ".join(str(e) for e in errs[:12])
        more = f" (+{len(errs) - 12} more)" if len(errs) > 12 else ""
        raise CheckpointError(self.path, f"{len(errs)} problem(s): {lines}{more}. {self.fix_hint()}")


@dataclass
class Detection(FindingsMixin):
    """What :func:`detect` found. ``format`` is ``scheme.name`` (comfy_native | comfy_metadata | modelopt |
    lightx2v | bf16 | fp16 | fp32 | mixed-plain, or unknown when no scheme claims the file); ``scheme`` is the
    :class:`~h3_turbo.formats.schemes.base.Scheme` object (``is_native``, ``is_plain``) and ``evidence``
    why it claimed the file (None for unknown)."""

    path: str
    model: str                   # "h3" or "not-h3"
    looks_like: str              # human description ("MiniMax H3", "Wan 2.x", "Flux", "unknown ...")
    format: str                  # the scheme's name (see above)
    prefix: str
    config: H3Config | None
    quant_layers: dict[str, QuantLayer] = field(default_factory=dict)
    nibble_order: str = "hi_first"
    nibble_order_source: str = "format"     # format | metadata | assumed
    scale_layout: str = "swizzled"
    scale_layout_source: str = "format"     # format | metadata | shapes | assumed
    findings: list[Finding] = field(default_factory=list)
    dtype_counts: dict[str, int] = field(default_factory=dict)
    param_bytes: int = 0
    projection_dtypes: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    other_quant: set = field(default_factory=set)   # stems quantized in a non-nvfp4 core format
    scheme: Scheme = UNCLAIMED
    evidence: Evidence | None = None
    value_scan: object = None   # formats.values.ScanResult after check_block_scales (inspect)
    unused_stems: set = field(default_factory=set)  # layers the loader leaves out (VSA gates: core ignores them)

    @property
    def is_native(self) -> bool:
        """True when the file is already ComfyUI's native per-layer layout (loading converts nothing)."""
        return self.scheme.is_native

    @property
    def is_quantized(self) -> bool:
        return bool(self.quant_layers)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the NVFP4 layers as core keeps them (packed data, swizzled scales, global/input scales,
        pre_quant_scale, 19-byte comfy_quant JSON): what ``ModelPatcher.model_size()`` counts for them."""
        return sum(q.packed_bytes for q in self.quant_layers.values())

    def fix_hint(self) -> str:
        """What the user can do about this file's errors (one sentence)."""
        if self.model != "h3":
            return ("Fix: this pack's loaders and tools take MiniMax H3 diffusion models only; in a workflow, load "
                    "other models with the loader made for them (e.g. core's UNETLoader).")
        return super().fix_hint()

    def summary(self) -> str:
        c = self.config
        cfg = (f"hidden {c.hidden}, {c.heads} heads x {c.head_dim}, ffn {c.ffn}, {c.layers}+{c.refiner_layers} "
               f"blocks, text_dim {c.text_dim}, {c.form}") if c else "no H3 config"
        return f"{self.looks_like}; format {self.format}; prefix '{self.prefix}'; {cfg}"


def _looks_like(keys: set[str]) -> str:
    """What a non-H3 file looks like, from a few signature keys."""
    def has(*ks):
        return any(k in keys for k in ks)

    def anyp(pat):
        r = re.compile(pat)
        return any(r.search(k) for k in keys)

    if has("proj_in.weight", "diffusion_model.proj_in.weight") and anyp(r"(^|\.)audio_proj_in\.weight$"):
        return ("MiniMax H3 in Diffusers naming (e.g. the TurboH3 DMD release): load it with Load TurboH3 DMD Model "
                "(H3TurboDMDLoader)")
    if anyp(r"lora_(A|B|up|down)\b|\.lora_") :
        return "a LoRA adapter, not a diffusion model (put it in models/loras)"
    if has("patch_embedding.weight") and anyp(r"^blocks\.\d+\.(self_attn|cross_attn)\."):
        return "Wan 2.x (not MiniMax H3)"
    if anyp(r"^double_blocks\.\d+\.img_attn"):
        return "Flux (not MiniMax H3)"
    if anyp(r"^transformer_blocks\.\d+\.attn1?\.to_q") or has("adaln_single.linear.weight"):
        return "a diffusers-format DiT (LTX-Video/other; not ComfyUI MiniMax H3 naming)"
    if anyp(r"^input_blocks\.\d+"):
        return "a Stable Diffusion UNet (not MiniMax H3)"
    if anyp(r"^(model\.)?layers\.\d+\.self_attn\.q_proj") or anyp(r"^visual\."):
        return "a text encoder / LLM (load it with CLIPLoader, not as a diffusion model)"
    if anyp(r"^(encoder|decoder)\.") and not anyp(r"blocks\.\d+\.attn"):
        return "a VAE (load it with VAELoader)"
    return "unknown (no video_patch_proj/audio_patch_proj: not MiniMax H3)"


_BLOCK_KEY = re.compile(r"^((?:token_refiner\.)?blocks\.\d+)\.")
#: VSA (FastVideo video sparse attention) compression gates in core's names (newer core builds and ignores them)
VSA_GATE = re.compile(r"^(blocks|token_refiner\.blocks)\.\d+\.attn\.to_gate_compress\.weight$")


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _spans(pfx: str, idx: list[int]) -> str:
    """Sorted indices as "<pfx>a..b, <pfx>c" runs (e.g. "blocks.25..49")."""
    runs, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            runs.append(f"{pfx}{start}" + (f"..{v}" if v != start else ""))
            start = None
    return ", ".join(runs)


def _count_blocks(keys: set[str], pfx: str) -> tuple[int, list[int]]:
    r = re.compile(r"^" + re.escape(pfx) + r"(\d+)\.")
    idx = sorted({int(m.group(1)) for k in keys if (m := r.match(k))})
    return len(idx), idx


def detect(header: Header, read_small: bool = True) -> Detection:
    """Detect format and H3 config of a header and validate structure (see module doc).

    read_small: read ``comfy_quant`` JSON and scalar scales from the file (tiny reads) to check that
    they parse, are finite and positive. Never raises for content problems: they become findings
    (``Detection.raise_if_errors()`` turns errors into one :class:`CheckpointError`); raises
    :class:`CheckpointError` only when those tiny tensors cannot be read.
    """
    view = HeaderView.of(header)
    prefix = view.prefix
    det = Detection(path=header.path, model="not-h3", looks_like="", format="unknown", prefix=prefix,
                    config=None, metadata=dict(header.metadata))
    for t in header.tensors.values():
        det.dtype_counts[t.dtype] = det.dtype_counts.get(t.dtype, 0) + 1
        det.param_bytes += t.nbytes
    if view.outside:
        det.warn(f"{len(view.outside)} tensors outside the '{prefix}' prefix are ignored (e.g. {view.outside[0]})")

    keys = set(view.tensors)
    if not ({"video_patch_proj.weight", "audio_patch_proj.weight"} <= keys):
        det.looks_like = _looks_like(keys)
        det.error(f"not a MiniMax H3 diffusion model: looks like {det.looks_like}")
        return det
    det.model, det.looks_like = "h3", "MiniMax H3"
    if read_small:
        view.read_small(header)

    _identify(det, view)
    det.scheme.detect_layers(det, view)
    cfg = _detect_config(det, view.tensors)
    det.config = cfg
    if cfg is not None:
        _validate_blocks(det, view.tensors, cfg)
        _validate_metadata_config(det, cfg)
    det.scheme.validate(det, view)
    return det


def _identify(det: Detection, view: HeaderView) -> None:
    """Ask the registry which scheme owns the file. Several claiming is an error finding (the message names
    each scheme and its evidence); validation then goes on with the first of them in registry order."""
    mixed = None
    try:
        det.scheme, det.evidence = registry.identify(view)
    except CheckpointError as e:
        mixed = e
        det.scheme, det.evidence = e.claims[0]
    for msg, key in view.problems:
        det.error(msg, key)
    if mixed is not None:
        det.error(mixed.cause)
    det.format = det.scheme.name


# ----------------------------------------------------------------------------- config

def _shape(T, k):
    t = T.get(k)
    return tuple(t.shape) if t is not None else None


def _detect_config(det: Detection, T: dict[str, TensorInfo]) -> H3Config | None:
    keys = set(T)
    ok = True

    def need(k, ndim):
        nonlocal ok
        s = _shape(T, k)
        if s is None or len(s) != ndim:
            det.error(f"missing or malformed (shape {list(s) if s else None}; expected {ndim}-D)", k)
            ok = False
            return None
        return s

    def logical_rows(stem):
        q = det.quant_layers.get(stem)
        s = _shape(T, f"{stem}.weight")
        return q.n if q else (s[0] if s else None)

    vpp = need("video_patch_proj.weight", 2)
    app = need("audio_patch_proj.weight", 2)
    qn = need("blocks.0.attn.q_norm.weight", 1)
    cp = need("condition_proj.weight", 2)
    vo = need("final_layer.video_out.weight", 2)
    ao = need("final_layer.audio_out.weight", 2)
    if "blocks.0.attn.qkv_proj.weight" not in keys or "blocks.0.mlp.fc1.weight" not in keys:
        det.error("block 0 projections missing (blocks.0.attn.qkv_proj.weight / blocks.0.mlp.fc1.weight)")
        return None
    if not ok:
        return None
    for stem in NEVER_QUANTIZE:
        if stem in det.quant_layers:
            det.error("is quantized: core's H3 detector reads its input width from this weight, so the model "
                      "would be built with the wrong size; keep it unquantized", f"{stem}.weight")
    for stem in FP32_ISLAND:
        if stem in det.quant_layers and stem not in NEVER_QUANTIZE:
            det.warn("part of the fp32 island is quantized (precision loss on the input/output projections)", stem)
    hidden, head_dim = vpp[0], qn[0]
    qkv_n, fc1_n = logical_rows("blocks.0.attn.qkv_proj"), logical_rows("blocks.0.mlp.fc1")
    if head_dim <= 0 or qkv_n % (3 * head_dim):
        det.error(f"qkv rows {qkv_n} are not a multiple of 3 x head_dim ({head_dim})", "blocks.0.attn.qkv_proj.weight")
        return None
    heads = qkv_n // (3 * head_dim)
    layers, idx = _count_blocks(keys, "blocks.")
    rlayers, ridx = _count_blocks(keys, "token_refiner.blocks.")
    for what, pfx, have, depth in (("DiT", "blocks.", idx, DEPTH), ("token refiner", "token_refiner.blocks.", ridx,
                                                                    REFINER_DEPTH)):
        holes = sorted(set(range(max(have) + 1)) - set(have)) if have else []
        if holes:
            det.error(f"{what} blocks missing: {_spans(pfx, holes)} (the file has {pfx}0..{max(have)} except "
                      f"these; a checkpoint shard missing?); core would build only {pfx}0..{holes[0] - 1} and "
                      f"ignore the rest")
        elif len(have) != depth:
            gone = f": {_spans(pfx, list(range(len(have), depth)))} absent (a checkpoint shard missing?)" \
                if len(have) < depth else ""
            det.warn(f"{len(have)} {what} blocks, MiniMax H3 has {depth}{gone}; the model is built "
                     f"{len(have)} blocks deep")
    form = "pruned" if "adaln_t_table" in keys else "unpruned"
    # with holes, validate every index up to the last one present (the holes themselves are one error above)
    layers, rlayers = (max(idx) + 1 if idx else 0), (max(ridx) + 1 if ridx else 0)
    cfg = H3Config(hidden=hidden, heads=heads, head_dim=head_dim, ffn=fc1_n // 2, layers=layers,
                   refiner_layers=rlayers, text_dim=cp[1], latents_dim=vo[0] // 4, audio_latents_dim=ao[0],
                   form=form)
    if app[0] != hidden:
        det.error(f"audio_patch_proj has {app[0]} rows but hidden is {hidden}", "audio_patch_proj.weight")
    if vpp[1] and vo[0] != vpp[1] and vo[0] % vpp[1] == 0:
        n = vo[0] // vpp[1]
        det.error(f"final_layer.video_out has {vo[0]} rows = {n} x {vpp[1]} (video_patch_proj's input width): a PDD "
                  f"head-bank checkpoint ({n} output heads per stream, which newer core's FinalLayer blends per step "
                  f"from the sampler's sigma schedule). This loader does not support PDD head banks; load the file "
                  f"with core's UNETLoader on a core that has them", "final_layer.video_out.weight")
    gates = {k[:-len(".weight")] for k in keys if VSA_GATE.match(k)}
    if gates:
        det.unused_stems |= gates
        det.warn(f"{len(gates)} blocks carry attn.to_gate_compress (the compression gate of FastVideo's VSA, video "
                 f"sparse attention; e.g. {min(gates, key=_natural_key)}): neither core nor this pack runs VSA, and "
                 f"core's own dense H3 forward ignores the gate, so the loader leaves it out and the model runs "
                 f"dense attention")
    if cfg.latents_dim != 24 or cfg.audio_latents_dim != 32:
        det.warn(f"latent channels video {cfg.latents_dim} / audio {cfg.audio_latents_dim} differ from H3's 24 / 32")
    if cfg.text_dim == hidden:
        det.warn("text_dim == hidden: core's H3 then skips condition_proj and the token refiner")
    if cp[0] != hidden:
        det.error(f"condition_proj has {cp[0]} rows, hidden is {hidden}", "condition_proj.weight")
    if layers == 0:
        det.error("no DiT blocks (blocks.N.*)")
    return cfg


# core's MiniMaxH3Model constructor args that core's detector reads from the shapes, and the H3Config field
# holding the shape-derived value. core merges __metadata__["config"]["transformer"] over the detected
# values (ComfyUI comfy/model_detection.py, detect_unet_config; docs/h3-facts.md), so a disagreeing
# override builds a model the weights do not fit.
SHAPE_CONFIG_KEYS = {"hidden_size": "hidden", "num_layers": "layers", "token_refiner_num_layers": "refiner_layers",
                     "num_attention_heads": "heads", "attention_head_dim": "head_dim", "ffn_hidden_size": "ffn",
                     "text_dim": "text_dim", "latents_dim": "latents_dim", "audio_latents_dim": "audio_latents_dim"}


def _validate_metadata_config(det: Detection, cfg: H3Config) -> None:
    """Check ``__metadata__["config"]`` (JSON, ``["transformer"]`` merged over the detected sizes by core)
    against the sizes read from the shapes. Other keys (e.g. ``sigma_shift_video``) are legitimate overrides."""
    raw = det.metadata.get("config")
    if raw is None:
        return
    try:
        conf = json.loads(raw)
    except (TypeError, ValueError) as e:
        det.error(f"__metadata__['config'] is not valid JSON ({e}); core would fail to parse it", "__metadata__")
        return
    tr = conf.get("transformer") if isinstance(conf, dict) else None
    if tr is None:
        return
    if not isinstance(tr, dict):
        det.error("__metadata__['config']['transformer'] is not a JSON object", "__metadata__")
        return
    for key, field_name in SHAPE_CONFIG_KEYS.items():
        if key in tr and tr[key] != getattr(cfg, field_name):
            det.error(f"metadata config sets transformer.{key} = {tr[key]!r} but the weights say "
                      f"{getattr(cfg, field_name)} (core would build a model the weights do not fit: fix or "
                      f"remove '{key}' in __metadata__['config'])", f"__metadata__.config.transformer.{key}")


def _validate_blocks(det: Detection, T: dict[str, TensorInfo], cfg: H3Config) -> None:
    shapes = cfg.projection_shapes()
    have = {m.group(1) for k in T if (m := _BLOCK_KEY.match(k))}
    for b in cfg.block_prefixes():
        if b not in have:
            continue   # a hole in the block indices: reported once by _detect_config
        for p, (n, k) in shapes.items():
            stem = f"{b}.{p}"
            key = f"{stem}.weight"
            t = T.get(key)
            if t is None:
                det.error(f"block projection missing (expected [{n}, {k}])", key)
                continue
            q = det.quant_layers.get(stem)
            if q is not None:
                if (q.n, q.k) != (n, k) and (q.n, q.k) != (roundup(n, 16), roundup(k, 16)):
                    det.error(f"NVFP4 weight {t.dtype} {list(t.shape)} holds a [{q.n}, {q.k}] matrix",
                              key)
                    det.findings[-1].message += f" (expected [{n}, {k}] from hidden {cfg.hidden}, heads " \
                                                f"{cfg.heads}x{cfg.head_dim}, ffn {cfg.ffn}: uint8 [{roundup(n, 16)}, {roundup(k, 16) // 2}])"
                else:
                    q.n, q.k = n, k
            elif t.dtype in FLOAT_DTYPES:
                if tuple(t.shape) != (n, k):
                    det.error(f"shape {list(t.shape)} (expected [{n}, {k}] from hidden {cfg.hidden}, heads "
                              f"{cfg.heads}x{cfg.head_dim}, ffn {cfg.ffn})", key)
            else:
                det.error(f"dtype {t.dtype} without quantization scales (expected BF16/F16/F32 or NVFP4)", key)
        for nk, want in ((f"{b}.attn.q_norm.weight", (cfg.head_dim,)), (f"{b}.attn.k_norm.weight", (cfg.head_dim,)),
                         (f"{b}.norm1.weight", (cfg.hidden,)), (f"{b}.norm2.weight", (cfg.hidden,))):
            s = _shape(T, nk)
            if s != want:
                det.error(f"{'missing' if s is None else 'shape ' + str(list(s))} (expected {list(want)})", nk)
        if b.startswith("blocks.") and cfg.form == "unpruned":
            if f"{b}.adaln_proj.linear.weight" not in T:
                det.error("missing (unpruned checkpoint: every DiT block has adaln_proj)", f"{b}.adaln_proj.linear.weight")
    if cfg.form == "unpruned":
        for k in ("time_embedder.proj_in.weight", "time_embedder.proj_out.weight"):
            if k not in T:
                det.error("missing (unpruned checkpoint without adaln_t_table needs the time embedder)", k)
    # extra projection keys (e.g. a bias on the bias-free projections)
    allowed = {"weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant",
               "weight_global_scale", "input_global_scale", "alpha", "input_absmax"}
    rx = re.compile(r"^(blocks|token_refiner\.blocks)\.\d+\.(attn\.(qkv|out)_proj|mlp\.fc[12])\.([A-Za-z0-9_]+)$")
    for k in T:
        m = rx.match(k)
        if m and m.group(4) not in allowed:
            det.error("unexpected key on a bias-free block projection", k)


def check_block_scales(path: str, det: Detection, max_report: int = 8) -> list[Finding]:
    """Read every tensor of the file (under its prefix) once and check its values with
    :func:`h3_turbo.formats.values.scan`: NaN / Inf in float tensors, NaN (e4m3 0x7F/0xFF) or negative NVFP4
    block scales. (The name predates the full scan.) Appends one error finding per problem (at most
    ``max_report`` tensors, then one finding with the count of the rest) to ``det.findings``, returns them."""
    from . import values

    res = values.scan(path, det, max_report=max_report)
    out = [Finding("error", msg, key) for key, msg in res.bad]
    shown = len({k for k, _ in res.bad})
    if res.bad_tensors > shown:
        out.append(Finding("error", f"{res.bad_tensors - shown} more tensors with bad values"))
    det.findings.extend(out)
    det.value_scan = res
    return out
