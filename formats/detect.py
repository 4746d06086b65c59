"""Detect what a checkpoint is, from its safetensors header (keys, dtypes, shapes, metadata), never its name.

:func:`detect` returns a :class:`Detection`: the model family (MiniMax H3, or what the file looks like
instead), the weight format, the key prefix, the H3 sizes read from the shapes, one record per
quantized layer and every validation finding. It reads tensor data only for tiny tensors (per-layer
``comfy_quant`` JSON and scalar scales, at most :data:`SMALL_NUMEL` elements each); block scales are
checked by :func:`check_block_scales`.

Formats (H3_FACTS §3; research/comfyui-h3.md §4.2):

- ``comfy_native``: per layer ``P.weight`` uint8 [N,K/2] (hi-first nibbles), ``P.weight_scale`` e4m3
  swizzled [roundup(N,128), roundup(K/16,4)], ``P.weight_scale_2`` fp32 [], optional ``input_scale``,
  ``pre_quant_scale`` [K], and ``P.comfy_quant`` = uint8 JSON ``{"format": "nvfp4"}``.
- ``comfy_metadata``: the same tensors without ``comfy_quant``; ``__metadata__["_quantization_metadata"]``
  = ``{"format_version": "1.0", "layers": {P: {"format": "nvfp4"}}}``.
- ``modelopt`` (NVIDIA ModelOpt export, layout inferred): ``weight`` uint8 [N,K/2], ``weight_scale`` e4m3
  [N,K/16] (plain) or swizzled, ``weight_scale_2`` fp32, ``input_scale`` fp32, optional
  ``pre_quant_scale`` [K]. Nibble order and scale layout are not confirmed for real files: read from
  metadata (``nvfp4_nibble_order`` = hi_first|lo_first, ``nvfp4_scale_layout`` = linear|swizzled),
  else the scale shapes decide the layout when they can, else assumed (lo_first, linear) and reported.
- ``lightx2v``: ``weight`` uint8, ``weight_scale`` e4m3 swizzled, ``weight_global_scale`` fp32 =
  1/weight_scale_2, optional ``input_global_scale`` (= 1/input_scale) with ``alpha``
  (= input_scale * weight_scale_2). Nibble order as for ModelOpt (metadata, else assumed lo_first).
- ``bf16`` / ``fp16`` / ``fp32``: plain checkpoints (the dtype of the block projections).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

from .nvfp4 import roundup
from .safetensors_io import CheckpointError, Header, TensorInfo, open_tensors

PROJECTIONS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
SMALL_NUMEL = 4096
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
SCALE_DTYPES = ("F8_E4M3", "U8")
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant",
                  "weight_global_scale", "input_global_scale", "alpha", "input_absmax")
# Formats core's QUANT_ALGOS knows (comfy/quant_ops.py, 2026-08); only nvfp4 is validated in depth.
CORE_QUANT_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8", "int8_tensorwise",
                      "convrot_w4a4", "asym_w4a8_int8", "awq_w4a16")
# Layers whose K is read by core's detector or that core keeps in fp32 (must stay unquantized).
NEVER_QUANTIZE = ("condition_proj", "time_embedder.proj_in", "time_embedder.proj_out")
FP32_ISLAND = ("video_patch_proj", "audio_patch_proj", "time_embedder.proj_in", "time_embedder.proj_out",
               "final_layer.video_out", "final_layer.audio_out")


@dataclass
class Finding:
    """One validation result. level: "error" (refuse to load), "warning", "info"."""

    level: str
    message: str
    key: str | None = None

    def __str__(self) -> str:
        return f"[{self.level}] " + (f"{self.key}: " if self.key else "") + self.message


@dataclass(frozen=True)
class H3Config:
    """MiniMax H3 sizes read from the shapes (real: hidden 5376, 56 heads x 128, ffn 14336, 50+2 blocks, text 5120)."""

    hidden: int
    heads: int
    head_dim: int
    ffn: int
    layers: int
    refiner_layers: int
    text_dim: int
    latents_dim: int
    audio_latents_dim: int
    form: str  # "unpruned" (adaln_proj on the time embedder) or "pruned" (adaln_t_table curve form)

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


@dataclass
class QuantLayer:
    """One NVFP4 layer. n, k: logical [out, in]. suffixes: the key suffixes present for the stem."""

    stem: str
    scheme: str
    n: int
    k: int
    suffixes: tuple[str, ...]
    scale_layout: str = "swizzled"
    packed_bytes: int = 0


@dataclass
class Detection:
    path: str
    model: str                   # "h3" or "not-h3"
    looks_like: str              # human description ("MiniMax H3", "Wan 2.x", "Flux", "unknown ...")
    format: str                  # comfy_native | comfy_metadata | modelopt | lightx2v | bf16 | fp16 | fp32 | mixed-plain | unknown
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

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def is_quantized(self) -> bool:
        return bool(self.quant_layers)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the NVFP4 layers as core keeps them (packed data, swizzled scales, global/input scales,
        pre_quant_scale, 19-byte comfy_quant JSON): what ``ModelPatcher.model_size()`` counts for them."""
        return sum(q.packed_bytes for q in self.quant_layers.values())

    def error(self, msg: str, key: str | None = None) -> None:
        self.findings.append(Finding("error", msg, key))

    def warn(self, msg: str, key: str | None = None) -> None:
        self.findings.append(Finding("warning", msg, key))

    def info(self, msg: str, key: str | None = None) -> None:
        self.findings.append(Finding("info", msg, key))

    def raise_if_errors(self) -> None:
        """Raise :class:`CheckpointError` naming the path and every error (first 12 listed)."""
        errs = self.errors
        if not errs:
            return
        lines = "; ".join(str(e) for e in errs[:12])
        more = f" (+{len(errs) - 12} more)" if len(errs) > 12 else ""
        raise CheckpointError(self.path, f"{len(errs)} problem(s): {lines}{more}. {self.fix_hint()}")

    def fix_hint(self) -> str:
        """What the user can do about this file's errors (one sentence)."""
        if self.model != "h3":
            return ("Fix: this loader takes MiniMax H3 checkpoints only; load other models with the loader "
                    "made for them (e.g. core's UNETLoader).")
        return ("Fix: re-download or re-export the file; `python -m h3_turbo.tools inspect FILE` lists "
                "every finding.")

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


def _strip_prefix(names: list[str]) -> str:
    for p in KEY_PREFIXES:
        if f"{p}video_patch_proj.weight" in names:
            return p
    for p in KEY_PREFIXES:
        if sum(1 for n in names if n.startswith(p)) > len(names) // 2:
            return p
    return ""


def _count_blocks(keys: set[str], pfx: str) -> tuple[int, list[int]]:
    r = re.compile(r"^" + re.escape(pfx) + r"(\d+)\.")
    idx = sorted({int(m.group(1)) for k in keys if (m := r.match(k))})
    return len(idx), idx


def _split(key: str) -> tuple[str, str]:
    """stem, suffix for a parameter key (``a.b.weight_scale`` -> ``a.b``, ``weight_scale``)."""
    stem, _, suf = key.rpartition(".")
    return stem, suf


def detect(header: Header, read_small: bool = True) -> Detection:
    """Detect format and H3 config of a header and validate structure (see module doc).

    read_small: read ``comfy_quant`` JSON and scalar scales from the file (tiny reads) to check that
    they parse, are finite and positive. Never raises for content problems: they become findings
    (``Detection.raise_if_errors()`` turns errors into one :class:`CheckpointError`).
    """
    names = list(header.tensors)
    prefix = _strip_prefix(names)
    T: dict[str, TensorInfo] = {}
    outside = []
    for n in names:
        if prefix and not n.startswith(prefix):
            outside.append(n)
            continue
        T[n[len(prefix):]] = header.tensors[n]
    keys = set(T)
    det = Detection(path=header.path, model="not-h3", looks_like="", format="unknown", prefix=prefix,
                    config=None, metadata=dict(header.metadata))
    for t in header.tensors.values():
        det.dtype_counts[t.dtype] = det.dtype_counts.get(t.dtype, 0) + 1
        det.param_bytes += t.nbytes
    if outside:
        det.warn(f"{len(outside)} tensors outside the '{prefix}' prefix are ignored (e.g. {outside[0]})")

    if not ({"video_patch_proj.weight", "audio_patch_proj.weight"} <= keys):
        det.looks_like = _looks_like(keys)
        det.error(f"not a MiniMax H3 diffusion model: looks like {det.looks_like}")
        return det
    det.model, det.looks_like = "h3", "MiniMax H3"

    small: dict[str, object] = {}
    if read_small:
        want = [k for k, t in T.items() if t.numel <= SMALL_NUMEL and _split(k)[1] in QUANT_SUFFIXES
                and _split(k)[1] not in ("pre_quant_scale",)]
        if want:
            try:
                with open_tensors(header.path, header=header) as f:
                    for k in want:
                        small[k] = f.get_tensor(prefix + k)
            except Exception as e:  # container already validated; anything here is a real read error
                raise CheckpointError(header.path, f"cannot read small tensors: {e}") from None

    _detect_format(det, T, small)
    cfg = _detect_config(det, T)
    det.config = cfg
    if cfg is not None:
        _validate_blocks(det, T, cfg)
        _validate_metadata_config(det, cfg)
    _validate_quant_layers(det, T, small)
    return det


# ----------------------------------------------------------------------------- format

def _detect_format(det: Detection, T: dict[str, TensorInfo], small: dict) -> None:
    keys = set(T)
    suf_of = {}
    for k in keys:
        stem, suf = _split(k)
        suf_of.setdefault(stem, set()).add(suf)
    native = {s for s, ss in suf_of.items() if "comfy_quant" in ss}
    lx = {s for s, ss in suf_of.items() if "weight_global_scale" in ss}
    mo = {s for s, ss in suf_of.items() if "weight_scale_2" in ss or
          ("weight_scale" in ss and "weight" in ss and T[f"{s}.weight"].dtype == "U8")}
    qmeta = det.metadata.get("_quantization_metadata")
    meta_layers: dict = {}
    if qmeta is not None:
        try:
            meta_layers = json.loads(qmeta).get("layers", {})
            if not isinstance(meta_layers, dict):
                raise ValueError("'layers' is not an object")
        except (ValueError, AttributeError) as e:
            det.error(f"__metadata__['_quantization_metadata'] is not valid JSON with a 'layers' object ({e})",
                      "__metadata__")
            meta_layers = {}

    schemes = []
    if native:
        schemes.append("comfy_native")
    if meta_layers:
        schemes.append("comfy_metadata")
    if lx:
        schemes.append("lightx2v")
    if mo - native - lx - set(meta_layers):
        schemes.append("modelopt")
    if len(schemes) > 1:
        det.error(f"mixed quantization schemes in one file: {', '.join(schemes)}; convert it with one tool")
    if schemes:
        det.format = schemes[0]
    else:
        dts: dict[str, int] = {}
        for k, t in T.items():
            if re.match(r"^(blocks|token_refiner\.blocks)\.\d+\.(attn\.(qkv|out)_proj|mlp\.fc[12])\.weight$", k):
                dts[t.dtype] = dts.get(t.dtype, 0) + 1
        det.projection_dtypes = dts
        name = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
        if len(dts) == 1 and next(iter(dts)) in name:
            det.format = name[next(iter(dts))]
        elif dts and all(d in name for d in dts):
            det.format = "mixed-plain"
        elif dts:
            det.format = "unknown"
            det.error(f"block projections stored as {sorted(dts)} without quantization markers "
                      "(no comfy_quant / _quantization_metadata / weight_scale_2): cannot tell the format")
        return

    # the set of quantized stems and their scheme
    stems = {"comfy_native": native, "comfy_metadata": set(meta_layers), "lightx2v": lx,
             "modelopt": mo - native - lx - set(meta_layers)}[det.format]
    for s in sorted(stems):
        fmt = None
        if det.format == "comfy_native":
            ck = small.get(f"{s}.comfy_quant")
            if ck is None:
                det.error("comfy_quant is not a small uint8 tensor", f"{s}.comfy_quant")
                continue
            try:
                conf = json.loads(bytes(ck.to("cpu").view(-1).tolist()).decode("utf-8"))
                fmt = conf.get("format")
            except Exception as e:
                det.error(f"comfy_quant is not UTF-8 JSON ({e})", f"{s}.comfy_quant")
                continue
        elif det.format == "comfy_metadata":
            conf = meta_layers.get(s)
            fmt = conf.get("format") if isinstance(conf, dict) else None
        else:
            fmt = "nvfp4"
        if fmt != "nvfp4":
            if fmt in CORE_QUANT_FORMATS:
                det.warn(f"layer is quantized as {fmt!r} (core loads it; this pack only validates nvfp4)", s)
                det.other_quant.add(s)
            else:
                det.error(f"unknown quantization format {fmt!r} (expected nvfp4)", s)
            continue
        if f"{s}.weight" not in T:
            det.error("quantized layer has no weight tensor", f"{s}.weight")
            continue
        w = T[f"{s}.weight"]
        if w.dtype != "U8" or len(w.shape) != 2:
            det.error(f"NVFP4 weight is {w.dtype} {list(w.shape)} (expected uint8 [N, K/2])", f"{s}.weight")
            continue
        det.quant_layers[s] = QuantLayer(s, det.format, w.shape[0], w.shape[1] * 2,
                                         tuple(sorted(suf_of.get(s, ()))))
    # nibble order and scale layout
    if det.format in ("modelopt", "lightx2v"):
        no = det.metadata.get("nvfp4_nibble_order")
        if no in ("hi_first", "lo_first"):
            det.nibble_order, det.nibble_order_source = no, "metadata"
        else:
            det.nibble_order, det.nibble_order_source = "lo_first", "assumed"
            det.warn(f"{det.format}: nibble order not stated in metadata; ASSUMED lo_first (element 2j in the low "
                     "nibble, the NVIDIA/PyTorch float4_e2m1fn_x2 convention). If images are garbage, re-convert with "
                     "`python -m h3_turbo.tools convert IN OUT --nibble-order hi_first`")
    if det.format == "modelopt":
        sl = det.metadata.get("nvfp4_scale_layout")
        if sl in ("linear", "swizzled"):
            det.scale_layout, det.scale_layout_source = sl, "metadata"
        else:
            votes = set()
            for s, q in det.quant_layers.items():
                t = T.get(f"{s}.weight_scale")
                if t is None or len(t.shape) != 2:
                    continue
                lin = (q.n, q.k // 16)
                swz = (roundup(q.n, 128), roundup(q.k // 16, 4))
                if lin != swz:
                    if tuple(t.shape) == lin:
                        votes.add("linear")
                    elif tuple(t.shape) == swz:
                        votes.add("swizzled")
            if len(votes) == 1:
                det.scale_layout, det.scale_layout_source = votes.pop(), "shapes"
            elif len(votes) > 1:
                det.error("modelopt: block-scale shapes disagree between layers (some plain [N,K/16], some swizzled)")
            else:
                det.scale_layout, det.scale_layout_source = "linear", "assumed"
                det.warn("modelopt: block-scale layout cannot be told from the shapes or metadata; ASSUMED plain "
                         "[N, K/16] (ModelOpt export). Override with `convert --scale-layout swizzled`")
    for q in det.quant_layers.values():
        q.scale_layout = det.scale_layout


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
    if idx != list(range(layers)):
        det.error(f"DiT block indices are not 0..{layers - 1}: missing {sorted(set(range(max(idx) + 1)) - set(idx))}")
    if ridx != list(range(rlayers)):
        det.error(f"refiner block indices are not contiguous: {ridx}")
    form = "pruned" if "adaln_t_table" in keys else "unpruned"
    cfg = H3Config(hidden=hidden, heads=heads, head_dim=head_dim, ffn=fc1_n // 2, layers=layers,
                   refiner_layers=rlayers, text_dim=cp[1], latents_dim=vo[0] // 4, audio_latents_dim=ao[0],
                   form=form)
    if app[0] != hidden:
        det.error(f"audio_patch_proj has {app[0]} rows but hidden is {hidden}", "audio_patch_proj.weight")
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
# values (comfyui-h3.md §2.1), so a disagreeing override builds a model the weights do not fit.
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
    for b in cfg.block_prefixes():
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


# ----------------------------------------------------------------------------- quant layers

def _scalar_ok(det, T, small, key, what, positive=True) -> float | None:
    t = T.get(key)
    if t is None:
        return None
    if t.numel != 1 or t.dtype not in FLOAT_DTYPES:
        det.error(f"{what} is {t.dtype} {list(t.shape)}", key)
        det.findings[-1].message += " (expected one fp32 value, shape [] )"
        return None
    v = small.get(key)
    if v is None:
        return None
    v = float(v.float().reshape(-1)[0])
    if not (v == v and abs(v) != float("inf")):
        det.error(f"{what} is {v} (expected a finite positive number)", key)
    elif positive and v <= 0:
        det.error(f"{what} is {v} (expected > 0)", key)
    return v


def _validate_quant_layers(det: Detection, T: dict[str, TensorInfo], small: dict) -> None:
    fmt = det.format
    need_by_fmt = {
        "comfy_native": ({"weight", "weight_scale", "weight_scale_2", "comfy_quant"},
                         {"input_scale", "pre_quant_scale"}),
        "comfy_metadata": ({"weight", "weight_scale", "weight_scale_2"}, {"input_scale", "pre_quant_scale"}),
        "modelopt": ({"weight", "weight_scale", "weight_scale_2"}, {"input_scale", "pre_quant_scale"}),
        "lightx2v": ({"weight", "weight_scale", "weight_global_scale"},
                     {"input_global_scale", "alpha", "input_absmax"}),
    }
    if fmt not in need_by_fmt:
        # plain file: any quant-looking key is an orphan
        for k in T:
            stem, suf = _split(k)
            if suf in QUANT_SUFFIXES and suf != "alpha":
                det.error(f"quantization key in a plain {fmt} checkpoint (no layer is marked quantized)", k)
        return
    req, opt = need_by_fmt[fmt]
    quant_stems = set(det.quant_layers)
    for k in T:
        stem, suf = _split(k)
        if suf in QUANT_SUFFIXES and stem not in quant_stems and stem not in det.other_quant:
            if suf == "alpha" and fmt != "lightx2v":
                continue
            det.error(f"orphan quantization key: layer '{stem}' is not marked NVFP4 ({fmt})", k)
    for s, q in det.quant_layers.items():
        present = set(q.suffixes)
        for miss in sorted(req - present):
            det.error(f"missing {miss} for an NVFP4 layer ({fmt})", f"{s}.{miss}")
        for extra in sorted(present - req - opt - {"bias"}):
            det.error(f"extra key for an NVFP4 layer in {fmt} format", f"{s}.{extra}")
        w = T[f"{s}.weight"]
        # block scales
        st = T.get(f"{s}.weight_scale")
        if st is not None:
            if st.dtype not in SCALE_DTYPES:
                det.error(f"block scales are {st.dtype} (expected F8_E4M3, or U8 bytes of e4m3)", f"{s}.weight_scale")
            pn, pk = w.shape[0], w.shape[1] * 2
            swz = (roundup(pn, 128), roundup(pk // 16, 4))
            lin = (q.n, roundup(q.k, 16) // 16)
            want = lin if q.scale_layout == "linear" else swz
            if tuple(st.shape) != want:
                det.error(f"block-scale shape {list(st.shape)} (expected {list(want)}: "
                          f"{'plain [N, K/16]' if q.scale_layout == 'linear' else 'swizzled [roundup(N,128), roundup(K/16,4)]'}"
                          f" for weight {list(w.shape)})", f"{s}.weight_scale")
            q.packed_bytes = w.nbytes + (roundup(pn, 128) * roundup(pk // 16, 4))
        else:
            q.packed_bytes = w.nbytes
        q.packed_bytes += 4 + 19  # weight_scale_2 + the comfy_quant JSON core keeps ({"format": "nvfp4"})
        if f"{s}.input_scale" in T:
            q.packed_bytes += 4
        pq = T.get(f"{s}.pre_quant_scale")
        if pq is not None:
            if pq.dtype not in FLOAT_DTYPES or pq.shape != (q.k,):
                det.error(f"pre_quant_scale is {pq.dtype} {list(pq.shape)} (expected float [{q.k}])", f"{s}.pre_quant_scale")
            q.packed_bytes += pq.nbytes
        if fmt == "lightx2v":
            _scalar_ok(det, T, small, f"{s}.weight_global_scale", "weight_global_scale")
            _scalar_ok(det, T, small, f"{s}.input_global_scale", "input_global_scale")
            _scalar_ok(det, T, small, f"{s}.alpha", "alpha")
            _scalar_ok(det, T, small, f"{s}.input_absmax", "input_absmax")
            if "alpha" in present and "input_global_scale" not in present:
                det.error("alpha without input_global_scale", f"{s}.alpha")
        else:
            _scalar_ok(det, T, small, f"{s}.weight_scale_2", "weight_scale_2")
            _scalar_ok(det, T, small, f"{s}.input_scale", "input_scale")


def check_block_scales(path: str, det: Detection, max_report: int = 8) -> list[Finding]:
    """Read every NVFP4 layer's block scales and flag NaN (e4m3 0x7F/0xFF) or negative scales.

    Appends the findings to ``det.findings`` and returns them. Reads ~N*K/16 bytes per layer.
    """
    out: list[Finding] = []
    with open_tensors(path) as f:
        for s in det.quant_layers:
            key = det.prefix + s + ".weight_scale"
            try:
                b = f.get_tensor(key)
            except Exception:
                continue
            u = b.contiguous().view(-1).view(torch.uint8)
            nan = int(((u & 0x7F) == 0x7F).sum())
            neg = int(((u & 0x80) != 0).sum())
            if nan:
                out.append(Finding("error", f"{nan} block scales are NaN (e4m3 0x7F/0xFF; expected finite)", key))
            if neg:
                out.append(Finding("error", f"{neg} block scales are negative (expected >= 0)", key))
            if len(out) >= max_report:
                break
    det.findings.extend(out)
    return out
