"""Diffusers <-> ComfyUI-core names of the MiniMax H3 DiT, and the base class of the TurboH3 DMD release formats.

The mapping is huggingface/diffusers ``scripts/convert_minimax_h3_to_diffusers.py`` inverted (docs/h3-facts.md,
"Diffusers names"): renames only, except ``attn.to_q/to_k/to_v`` (three [inner, hidden] weights) -> core's fused
``attn.qkv_proj`` (contiguous thirds, no per-head reorder: the Diffusers state dict is already ``[q; k; v]``),
``ff.net.0.proj`` rows ``[value; gate]`` -> core ``mlp.fc1`` rows ``[gate; value]`` (halves swapped), and
``rope.inv_freq`` (dropped by the converter) recomputed from ``rope_freq_dim`` / ``rope_theta``. Diffusers' fused
``attn.to_qkv`` (``fused_projections``) and core names are accepted as well. No transposes anywhere.

:func:`map_key` maps one key to a :class:`Mapped` (core module, parameter, operation) or None (an unknown tensor
family); :func:`family` gives the digit-free family of a key for error lists.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

#: Diffusers module -> core module (regex, template). Order matters only for readability: patterns are anchored.
_BLOCK = r"(?P<blk>transformer_blocks|token_refiner\.refiner_blocks|blocks|token_refiner\.blocks)\.(?P<i>\d+)"
_RULES: tuple[tuple[str, str, str], ...] = (
    # (pattern on the module path, core module template, op)
    (r"proj_in", "video_patch_proj", "copy"),
    (r"audio_proj_in", "audio_patch_proj", "copy"),
    (r"context_embedder", "condition_proj", "copy"),
    (r"time_embedder\.linear_1", "time_embedder.proj_in", "copy"),
    (r"time_embedder\.linear_2", "time_embedder.proj_out", "copy"),
    (_BLOCK + r"\.(?P<n>norm1|norm2)", "{B}.{n}", "shared"),
    (_BLOCK + r"\.attn\.norm_q", "{B}.attn.q_norm", "copy"),
    (_BLOCK + r"\.attn\.norm_k", "{B}.attn.k_norm", "copy"),
    (_BLOCK + r"\.attn\.to_(?P<part>q|k|v)", "{B}.attn.qkv_proj", "qkv"),
    (_BLOCK + r"\.attn\.to_qkv", "{B}.attn.qkv_proj", "copy"),
    (_BLOCK + r"\.attn\.to_out\.0", "{B}.attn.out_proj", "copy"),
    (_BLOCK + r"\.ff\.net\.0\.proj", "{B}.mlp.fc1", "swap"),
    (_BLOCK + r"\.ff\.net\.2", "{B}.mlp.fc2", "copy"),
    (_BLOCK + r"\.adaln_proj\.linear", "{B}.adaln_proj.linear", "shared"),
    (r"token_refiner\.final_norm", "token_refiner.final_norm", "copy"),
    (r"norm_out\.norm", "final_layer.norm", "copy"),
    (r"norm_out\.linear", "final_layer.adaln_proj.linear", "copy"),
    (r"proj_out", "final_layer.video_out", "copy"),
    (r"audio_proj_out", "final_layer.audio_out", "copy"),
    (r"rope", "rope", "copy"),
    # core names (a file in ComfyUI / original naming): identity
    (r"(?P<core>video_patch_proj|audio_patch_proj|condition_proj|time_embedder\.proj_in|time_embedder\.proj_out|"
     r"token_refiner\.final_norm|final_layer\.norm|final_layer\.adaln_proj\.linear|final_layer\.video_out|"
     r"final_layer\.audio_out)", "{core}", "copy"),
    (_BLOCK + r"\.(?P<core>attn\.qkv_proj|attn\.out_proj|attn\.q_norm|attn\.k_norm)", "{B}.{core}", "copy"),
    (_BLOCK + r"\.(?P<core>mlp\.fc1|mlp\.fc2)", "{B}.{core}", "core"),
)
_COMPILED = tuple((re.compile("^" + p + "$"), t, op) for p, t, op in _RULES)
#: the four block projections' core suffixes
PROJECTION_MODULES = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
#: parameters each family may carry
PARAMS = ("weight", "bias", "inv_freq", "int8_weight", "scale")
#: core modules of the fp32 island (kept in fp32, as the Diffusers converter keeps the original's precision)
FP32_CORE = ("video_patch_proj", "audio_patch_proj", "time_embedder.proj_in", "time_embedder.proj_out",
             "final_layer.video_out", "final_layer.audio_out")
DIFFUSERS_MARKERS = ("proj_in.weight", "audio_proj_in.weight", "transformer_blocks.0.norm1.weight")


@dataclass(frozen=True)
class Mapped:
    """One source key in core terms: ``module`` (core module path), ``param`` (weight, bias, int8_weight, scale,
    inv_freq), ``op`` (copy | qkv | swap), ``part`` (q/k/v for qkv), ``naming`` (diffusers | core)."""

    module: str
    param: str
    op: str
    part: str | None = None
    naming: str = "diffusers"

    @property
    def key(self) -> str:
        return f"{self.module}.{self.param}"


def _core_block(blk: str, i: str) -> str:
    return f"blocks.{i}" if blk in ("transformer_blocks", "blocks") else f"token_refiner.blocks.{i}"


def map_key(key: str) -> Mapped | None:
    """The core name of one (prefix-free) key, or None when no family matches."""
    module, _, param = key.rpartition(".")
    if param not in PARAMS or not module:
        return None
    for rx, tmpl, op in _COMPILED:
        m = rx.match(module)
        if m is None:
            continue
        g = m.groupdict()
        core_blk = g.get("blk") in ("blocks", "token_refiner.blocks")
        naming = "core" if ("core" in g or (op == "shared" and core_blk)) else "diffusers"
        if g.get("blk") is not None:
            if core_blk != (naming == "core"):
                return None            # a core block name with a Diffusers sub-module (or the reverse)
            g["B"] = _core_block(g["blk"], g["i"])
        target = tmpl.format(**{k: v for k, v in g.items() if v is not None})
        if op in ("core", "shared"):
            op = "copy"
        if (param == "inv_freq") != (target == "rope"):
            return None
        return Mapped(target, param, op, g.get("part"), naming)
    return None


def family(key: str) -> str:
    """The key with its block indices replaced by N (``transformer_blocks.N.attn.foo.weight``)."""
    return re.sub(r"\.\d+\.", ".N.", key)


def rope_inv_freq(rope_freq_dim: int, rope_theta: float = 10000.0) -> torch.Tensor:
    """``1 / theta ** (arange(0, 2d, 2) / 2d)`` in fp32: diffusers' ``MiniMaxH3RotaryPosEmbed`` buffer, which its
    converter states is bitwise equal to the original checkpoint's ``rope.inv_freq``."""
    d = int(rope_freq_dim)
    return 1.0 / (float(rope_theta) ** (torch.arange(0, 2 * d, 2, dtype=torch.float32) / (2 * d)))


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[a; b]`` -> ``[b; a]`` (fc1: Diffusers ``[value; gate]`` <-> core ``[gate; value]``)."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0).contiguous()


# --------------------------------------------------------------------------------------------- core -> Diffusers

_CORE_TO_DIFFUSERS = (
    ("video_patch_proj.", "proj_in."), ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."), ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."), ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."), ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
)


def diffusers_key(core_key: str) -> str:
    """The Diffusers name of a core key (renames only; ``qkv_proj`` / ``fc1`` need :func:`core_to_diffusers`)."""
    k = core_key
    if k.startswith("token_refiner.blocks."):
        k = k.replace("token_refiner.blocks.", "token_refiner.refiner_blocks.", 1)
    elif k.startswith("blocks."):
        k = k.replace("blocks.", "transformer_blocks.", 1)
    for a, b in _CORE_TO_DIFFUSERS:
        if k.startswith(a):
            k = b + k[len(a):]
    for a, b in ((".attn.q_norm.", ".attn.norm_q."), (".attn.k_norm.", ".attn.norm_k."),
                 (".attn.out_proj.", ".attn.to_out.0."), (".mlp.fc2.", ".ff.net.2."), (".mlp.fc1.", ".ff.net.0.proj.")):
        k = k.replace(a, b)
    return k


def core_to_diffusers(sd: dict[str, torch.Tensor], heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """A core-named H3 state dict in Diffusers naming, as the Diffusers converter writes it (from the reference
    layout): ``qkv_proj`` split into contiguous thirds, ``fc1`` halves swapped, ``rope.inv_freq`` dropped."""
    out: dict[str, torch.Tensor] = {}
    inner = heads * head_dim
    for k, v in sd.items():
        if k == "rope.inv_freq":
            continue
        if k.endswith(".attn.qkv_proj.weight"):
            base = diffusers_key(k)[: -len("qkv_proj.weight")]
            if v.shape[0] != 3 * inner:
                raise ValueError(f"{k}: {v.shape[0]} rows, expected 3 x {heads} x {head_dim}")
            for part, t in zip("qkv", v.split(inner, dim=0)):
                out[f"{base}to_{part}.weight"] = t.contiguous()
        elif k.endswith(".mlp.fc1.weight"):
            out[diffusers_key(k)] = swap_halves(v)
        else:
            out[diffusers_key(k)] = v
    return out


# --------------------------------------------------------------------------------------------- release schemes

class ReleaseScheme:
    """A checkpoint format of the TurboH3 DMD release, read by :mod:`h3_turbo.formats.dmd` (one file, or shards
    with a ``*.safetensors.index.json``). Subclasses set ``name`` (the detection's format string), ``quantized``
    (W8A8 layers) and implement ``claims(view) -> Evidence | None`` (header only: exactly one scheme may claim).
    The name mapping (:func:`map_key`) and the conversion to core's layout are shared (``formats/dmd.py``)."""

    name = "?"
    summary = ""
    quantized = False

    def __repr__(self) -> str:
        return f"<release scheme {self.name}>"

    def claims(self, view):
        raise NotImplementedError
