"""Tiny, deterministic H3 fixtures in the exact real on-disk layouts (no ComfyUI needed).

``python -m h3_turbo.tools make-fixtures DIR`` writes a ComfyUI-style models tree::

    DIR/diffusion_models/h3_tiny_bf16.safetensors         tiny H3, BF16 (fp32 island in fp32)
    DIR/diffusion_models/h3_tiny_nvfp4.safetensors        same weights, ComfyUI-native NVFP4 (comfy_quant)
    DIR/loras/h3_tiny_turbo_4step_comfyui_bf16.safetensors  alpha = rank (scale 1, like 4-step v1.1)
    DIR/loras/h3_tiny_turbo_8step_comfyui_bf16.safetensors  alpha/rank = 1/16 (like 8-step v1.0)

The tiny model keeps the real depth (50 DiT blocks + 2 refiner blocks, so an adapter has the official
208 targets = 624 tensors) and the real latent sizes (video 24 channels, audio 32), with a narrow
width (hidden 64, 2 heads x 32, FFN 128, text_dim 48). ComfyUI's own ``detect_unet_config`` detects
it as ``minimax_h3`` (sizes are read from the shapes: ComfyUI ``comfy/model_detection.py``).

Layouts (``docs/h3-facts.md``; NVFP4 formats: ``docs/formats.md``):
- block projections ``blocks.{i}.attn.qkv_proj.weight`` [3*heads*hd, H] (rows Q|K|V),
  ``attn.out_proj`` [H, heads*hd], ``mlp.fc1`` [2*FFN, H] (rows gate|up), ``mlp.fc2`` [H, FFN];
- LoRA: ``diffusion_model.<target>.lora_A.weight`` bf16 [r, in], ``.lora_B.weight`` bf16 [out, r],
  ``.alpha`` fp32 []; qkv at rank 3r with block-diagonal B and alpha x3; ``__metadata__`` with
  ``training_rank``, ``training_alpha``, ``training_scale``, ``base_model``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from ..model_facts import FP32_ISLAND, PROJECTIONS

#: key prefixes of the tensors kept in fp32 (the fp32 island of ``model_facts``)
FP32_ISLAND_PREFIXES = tuple(f"{m}." for m in FP32_ISLAND)


@dataclass(frozen=True)
class TinyH3Config:
    """Sizes of the tiny H3 (all ints). Real H3: hidden 5376, heads 56 x 128, ffn 14336, text 5120."""

    hidden: int = 64
    heads: int = 2
    head_dim: int = 32
    ffn: int = 128
    text_dim: int = 48
    timestep_input_dim: int = 32
    time_embed_hidden: int = 64
    time_embed_dim: int = 32
    rope_len: int = 4
    num_layers: int = 50
    refiner_layers: int = 2
    latents_dim: int = 24
    audio_latents_dim: int = 32
    lora_rank: int = 4  # the "other projections" rank; qkv uses 3x (real: 128 / 384)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


def block_prefixes(cfg: TinyH3Config) -> list[str]:
    """Module prefixes of every block holding the four projections, DiT blocks first."""
    return [f"blocks.{i}" for i in range(cfg.num_layers)] + \
           [f"token_refiner.blocks.{j}" for j in range(cfg.refiner_layers)]


def projection_shapes(cfg: TinyH3Config) -> dict[str, tuple[int, int]]:
    """[out, in] of the four projections of one block."""
    return {
        "attn.qkv_proj": (3 * cfg.inner, cfg.hidden),
        "attn.out_proj": (cfg.hidden, cfg.inner),
        "mlp.fc1": (2 * cfg.ffn, cfg.hidden),
        "mlp.fc2": (cfg.hidden, cfg.ffn),
    }


def make_tiny_h3_state_dict(cfg: TinyH3Config = TinyH3Config(), seed: int = 0, device="cpu",
                            projection=None) -> dict[str, torch.Tensor]:
    """A tiny (or, with a full-width ``cfg``, full-width partial-depth) H3 state dict in ComfyUI key names.

    Block tensors are bf16; the fp32 island (patch projections, time embedder, final outputs) is
    fp32, as in the real BF16 checkpoints. Deterministic for a given ``seed`` and ``device`` (the random numbers
    are drawn there). ``projection(w)``: optional hook for each of the 208 block projections' fp32 weight
    [out, in]; returns the tensors to store under ``<layer>.`` (default ``{"weight": w}``), e.g. an NVFP4
    ``weight``/``weight_scale``/``weight_scale_2``/``comfy_quant`` set made as the weight is drawn; uint8 / e4m3
    tensors and ``weight_scale_2`` are stored as returned.
    """
    g = torch.Generator(device=device).manual_seed(seed)

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g, device=device) * (gain / in_f ** 0.5)

    def vec(n: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(n, generator=g, device=device) * std

    H, TD = cfg.hidden, cfg.time_embed_dim
    sd: dict[str, torch.Tensor] = {
        "video_patch_proj.weight": lin(H, cfg.latents_dim * 4), "video_patch_proj.bias": vec(H),
        "audio_patch_proj.weight": lin(H, cfg.audio_latents_dim), "audio_patch_proj.bias": vec(H),
        "condition_proj.weight": lin(H, cfg.text_dim), "condition_proj.bias": vec(H),
        "time_embedder.proj_in.weight": lin(cfg.time_embed_hidden, cfg.timestep_input_dim),
        "time_embedder.proj_in.bias": vec(cfg.time_embed_hidden),
        "time_embedder.proj_out.weight": lin(TD, cfg.time_embed_hidden),
        "time_embedder.proj_out.bias": vec(TD),
        "rope.inv_freq": 1.0 / (10000 ** (torch.arange(cfg.rope_len, dtype=torch.float32) / cfg.rope_len)),
    }
    shapes = projection_shapes(cfg)
    for pfx in block_prefixes(cfg):
        sd[f"{pfx}.norm1.weight"] = 1 + vec(H, 0.05)
        sd[f"{pfx}.norm2.weight"] = 1 + vec(H, 0.05)
        sd[f"{pfx}.attn.q_norm.weight"] = 1 + vec(cfg.head_dim, 0.05)
        sd[f"{pfx}.attn.k_norm.weight"] = 1 + vec(cfg.head_dim, 0.05)
        for proj, (o, i) in shapes.items():
            w = lin(o, i)
            for suffix, t in (projection(w) if projection is not None else {"weight": w}).items():
                sd[f"{pfx}.{proj}.{suffix}"] = t
        if pfx.startswith("blocks."):
            sd[f"{pfx}.adaln_proj.linear.weight"] = lin(6 * H * 3, TD, 0.1)
            sd[f"{pfx}.adaln_proj.linear.bias"] = vec(6 * H * 3)
    sd["token_refiner.final_norm.weight"] = 1 + vec(H, 0.05)
    sd["final_layer.norm.weight"] = 1 + vec(H, 0.05)
    sd["final_layer.adaln_proj.linear.weight"] = lin(2 * H, TD, 0.1)
    sd["final_layer.adaln_proj.linear.bias"] = vec(2 * H)
    sd["final_layer.video_out.weight"] = lin(cfg.latents_dim * 4, H)
    sd["final_layer.video_out.bias"] = vec(cfg.latents_dim * 4)
    sd["final_layer.audio_out.weight"] = lin(cfg.audio_latents_dim, H)
    sd["final_layer.audio_out.bias"] = vec(cfg.audio_latents_dim)

    for k, v in sd.items():
        if v.dtype in (torch.uint8, torch.float8_e4m3fn) or k.endswith("weight_scale_2"):
            sd[k] = v.contiguous()
        elif k == "rope.inv_freq" or k.startswith(FP32_ISLAND_PREFIXES):
            sd[k] = v.float().contiguous()
        else:
            sd[k] = v.to(torch.bfloat16).contiguous()
    return sd


def nvfp4_quantize_state_dict(sd: dict[str, torch.Tensor], cfg: TinyH3Config = TinyH3Config()) -> dict[str, torch.Tensor]:
    """ComfyUI-native NVFP4 of the 208 block projections, made with comfy-kitchen's quantizer.

    Per projection ``P``: ``P.weight`` uint8 [N, K/2], ``P.weight_scale`` float8_e4m3fn (swizzled),
    ``P.weight_scale_2`` fp32 [], ``P.comfy_quant`` uint8 JSON ``{"format": "nvfp4"}`` (``docs/formats.md``).
    Raises ImportError when comfy-kitchen is not installed.
    """
    from comfy_kitchen.tensor import TensorCoreNVFP4Layout  # comfy-kitchen 0.2.31

    out = dict(sd)
    marker = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    for pfx in block_prefixes(cfg):
        for proj in PROJECTIONS:
            key = f"{pfx}.{proj}"
            w = out.pop(f"{key}.weight")
            qdata, params = TensorCoreNVFP4Layout.quantize(w.to(torch.bfloat16))
            out[f"{key}.weight"] = qdata.contiguous()
            out[f"{key}.weight_scale"] = params.block_scale.contiguous()
            out[f"{key}.weight_scale_2"] = params.scale.float().reshape(()).contiguous()
            out[f"{key}.comfy_quant"] = marker.clone()
    return out


def make_turbo_lora(sd_model: dict[str, torch.Tensor], cfg: TinyH3Config = TinyH3Config(), *,
                    alpha_over_rank: float = 1.0, seed: int = 1, nfe: int = 4,
                    shifts: tuple[float, float] = (6.0, 3.0), b_std: float = 0.05) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A tiny Turbo LoRA in the official Comfy layout: 208 targets x (A, B, alpha) = 624 tensors.

    qkv: A = cat(A_q; A_k; A_v) [3r, in], B = block_diag(B_q, B_k, B_v) [3*inner, 3r], alpha = 3*alpha.
    Returns ``(tensors, metadata)``; metadata mirrors the headers of the released Turbo LoRAs (``docs/h3-facts.md``).
    """
    g = torch.Generator().manual_seed(seed)
    r = cfg.lora_rank
    alpha = alpha_over_rank * r
    shapes = projection_shapes(cfg)
    t: dict[str, torch.Tensor] = {}
    for pfx in block_prefixes(cfg):
        for proj in PROJECTIONS:
            o, i = shapes[proj]
            stem = f"diffusion_model.{pfx}.{proj}"
            if proj == "attn.qkv_proj":
                a = torch.randn(3 * r, i, generator=g) / i ** 0.5
                b = torch.zeros(o, 3 * r)
                third = o // 3
                for s in range(3):
                    b[s * third:(s + 1) * third, s * r:(s + 1) * r] = torch.randn(third, r, generator=g) * b_std
                al = 3 * alpha
            else:
                a = torch.randn(r, i, generator=g) / i ** 0.5
                b = torch.randn(o, r, generator=g) * b_std
                al = alpha
            t[f"{stem}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            t[f"{stem}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
            t[f"{stem}.alpha"] = torch.tensor(float(al), dtype=torch.float32)
    meta = {
        "training_rank": str(r),
        "training_alpha": str(float(alpha)),
        "training_scale": str(float(alpha_over_rank)),
        "base_model": "h3-turbo tiny fixture (Comfy-Org/MiniMax-H3 layout)",
        "source_format": "Diffusers PEFT LoRA",
        "target_format": "ComfyUI generic LoRA",
        "qkv_fusion": "block diagonal B; concat A; alpha multiplied by 3",
        "swi_glu_mapping": "Diffusers [value;gate] -> ComfyUI [gate;value]",
        "h3_turbo_fixture": json.dumps({"nfe": nfe, "shift_video": shifts[0], "shift_audio": shifts[1]}),
    }
    return t, meta


FIXTURE_FILES = {
    "bf16": ("diffusion_models", "h3_tiny_bf16.safetensors"),
    "nvfp4": ("diffusion_models", "h3_tiny_nvfp4.safetensors"),
    "lora_4step": ("loras", "h3_tiny_turbo_4step_comfyui_bf16.safetensors"),
    "lora_8step": ("loras", "h3_tiny_turbo_8step_comfyui_bf16.safetensors"),
}


def _save_aligned(sd, path: str, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, then the header padded with spaces (the format allows it) so the data
    starts 64-byte aligned: core's UNETLoader computes on the mmap'ed tensors in place (at their file offset's
    alignment), our loader on aligned buffers, and CPU BLAS results depend on operand alignment."""
    from safetensors.torch import save_file

    save_file(sd, path, metadata=metadata)
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    # the writer orders ``__metadata__`` by a hash map (a different order each run): sorted here, so that the same
    # inputs give the same bytes; tensor entries and their offsets are kept as written
    hdr = json.loads(raw[8:8 + n])
    if "__metadata__" in hdr:
        hdr["__metadata__"] = dict(sorted(hdr["__metadata__"].items()))
    head = json.dumps(hdr, separators=(",", ":")).encode()
    pad = -(8 + len(head)) % 64
    with open(path, "wb") as f:
        f.write((len(head) + pad).to_bytes(8, "little") + head + b" " * pad + raw[8 + n:])


def make_fixtures(root: str, cfg: TinyH3Config = TinyH3Config(), seed: int = 0, nvfp4: bool = True) -> dict[str, str]:
    """Write the fixture tree under ``root``; returns {name: path}. Idempotent (same bytes each run)."""
    save_file = _save_aligned

    paths = {k: os.path.join(root, d, f) for k, (d, f) in FIXTURE_FILES.items()}
    for p in paths.values():
        os.makedirs(os.path.dirname(p), exist_ok=True)
    sd = make_tiny_h3_state_dict(cfg, seed)
    meta = {"h3_turbo_fixture": json.dumps(asdict(cfg))}
    save_file(sd, paths["bf16"], metadata=meta)
    if nvfp4:
        save_file(nvfp4_quantize_state_dict(sd, cfg), paths["nvfp4"], metadata=meta)
    else:
        paths.pop("nvfp4")
    lora4, m4 = make_turbo_lora(sd, cfg, alpha_over_rank=1.0, seed=seed + 1, nfe=4, shifts=(6.0, 3.0))
    save_file(lora4, paths["lora_4step"], metadata=m4)
    lora8, m8 = make_turbo_lora(sd, cfg, alpha_over_rank=1 / 16, seed=seed + 2, nfe=8, shifts=(12.0, 3.0))
    save_file(lora8, paths["lora_8step"], metadata=m8)
    for p in paths.values():  # safetensors writes 0600; model files are meant to be shared (0644, umask applies)
        os.chmod(p, 0o666 & ~_umask())
    return paths


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
