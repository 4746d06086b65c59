"""MiniMax H3 DiT facts the pack's code relies on (sizes, names, precision islands).

Public sources: core ComfyUI ``comfy/ldm/minimax/model.py`` (module names and shapes) and
``comfy/model_detection.py`` (how core detects H3); ``docs/h3-facts.md`` states each fact with its source.
"""
from __future__ import annotations

#: the four linear projections of every DiT and refiner block, in core's module names
PROJECTIONS: tuple[str, ...] = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
#: DiT blocks in the released model (plus 2 token-refiner blocks)
DEPTH = 50
REFINER_DEPTH = 2
HIDDEN = 5376
HEADS = 56
HEAD_DIM = 128
#: layers core keeps in fp32 (patch projections, time embedder, final video/audio outputs)
FP32_ISLAND: tuple[str, ...] = ("video_patch_proj", "audio_patch_proj", "time_embedder.proj_in",
                                "time_embedder.proj_out", "final_layer.video_out", "final_layer.audio_out")
#: layers whose in_features core's detector reads, or that core keeps in fp32: never quantized
NEVER_QUANTIZE: tuple[str, ...] = ("condition_proj", "time_embedder.proj_in", "time_embedder.proj_out")
#: prefixes a diffusion-model state dict may carry
KEY_PREFIXES: tuple[str, ...] = ("model.diffusion_model.", "diffusion_model.")
