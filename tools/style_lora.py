"""A synthetic "style" LoRA in ComfyUI's generic LoRA layout, for tests and the GPU check of a core-loaded LoRA
beside the Turbo branch (docs/lora.md, "A style LoRA beside Turbo").

Per target ``<module>`` (a Linear of the diffusion model, core key ``diffusion_model.<module>.weight``):
``diffusion_model.<module>.lora_A.weight`` bf16 [r, in], ``.lora_B.weight`` bf16 [out, r], ``.alpha`` fp32 [] = r,
the layout core's ``comfy.lora.load_lora`` reads (``LoRAAdapter``: ``W' = W + strength * alpha / r * B @ A``).
The update of each target is drawn so that ``||B @ A||_F = rel * ||W||_F`` (``rel``: the LoRA's strength relative to
the weight it patches), so its effect is a known fraction of the layer's output whatever the model's width.
"""
from __future__ import annotations

import torch

from ..model_facts import PROJECTIONS

#: modules of the AdaLN / timestep path (the keys ``adaln=table`` keeps off the model)
ADALN_MODULES = ("time_embedder.proj_in", "time_embedder.proj_out", "final_layer.adaln_proj.linear")


def targets(depth: int, refiner_depth: int, adaln: bool) -> list[str]:
    """Module names a style LoRA patches: the four projections of every DiT and refiner block, and with
    ``adaln`` every block's ``adaln_proj.linear``, the final layer's and the time embedder's two Linears."""
    out = [f"blocks.{i}.{p}" for i in range(depth) for p in PROJECTIONS]
    out += [f"token_refiner.blocks.{j}.{p}" for j in range(refiner_depth) for p in PROJECTIONS]
    if adaln:
        out += [f"blocks.{i}.adaln_proj.linear" for i in range(depth)] + list(ADALN_MODULES)
    return out


def make_style_lora(shapes: dict[str, tuple[int, int]], weight_norms: dict[str, float], rank: int = 4,
                    rel: float = 0.5, seed: int = 7) -> dict[str, torch.Tensor]:
    """The LoRA tensors for ``shapes`` ({module: (out, in)}) with ``||B @ A||_F = rel * weight_norms[module]``.
    Deterministic for a given seed; raises KeyError when a module has no norm."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for mod, (o, i) in shapes.items():
        r = min(rank, o, i)
        a = torch.randn(r, i, generator=g) / i ** 0.5
        b = torch.randn(o, r, generator=g)
        d = (b @ a).norm()
        b *= float(rel * weight_norms[mod] / max(float(d), 1e-30))
        stem = f"diffusion_model.{mod}"
        sd[f"{stem}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
        sd[f"{stem}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
        sd[f"{stem}.alpha"] = torch.tensor(float(r), dtype=torch.float32)
    return sd


def for_model(diffusion_model, adaln: bool, rank: int = 4, rel: float = 0.5, seed: int = 7) -> dict[str, torch.Tensor]:
    """A style LoRA for a built core H3 (``MiniMaxH3Model``): its blocks' projections (and AdaLN Linears with
    ``adaln``), each update ``rel`` of the weight's Frobenius norm (NVFP4 weights: of the dequantized weight)."""
    dm = diffusion_model
    mods = targets(len(dm.blocks), len(dm.token_refiner.blocks), adaln)
    shapes, norms = {}, {}
    for name in mods:
        m = dm.get_submodule(name)
        w = m.weight
        if hasattr(w, "dequantize"):
            w = w.dequantize()
        shapes[name] = (m.out_features, m.in_features)
        norms[name] = float(w.detach().float().norm())
    return make_style_lora(shapes, norms, rank, rel, seed)
