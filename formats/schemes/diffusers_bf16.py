"""``diffusers_bf16``: the MiniMax H3 DiT with float weights in Diffusers naming (``MiniMaxH3Transformer3DModel``),
one file or shards + ``*.safetensors.index.json``: the TurboH3-FL2VA-I2VA ``transformer/`` (626 BF16 + 12 FP32
tensors: the fp32 island ``proj_in``, ``audio_proj_in``, ``time_embedder.linear_1/2``, ``proj_out``,
``audio_proj_out``, weight + bias each). Core-named float files are accepted too (naming ``core``).

Layout and its public source: docs/turboh3.md ("Formats"); the name mapping: :mod:`.diffusers_map`.
"""
from __future__ import annotations

from .base import Evidence, HeaderView
from .diffusers_map import DIFFUSERS_MARKERS, ReleaseScheme, map_key


class DiffusersBF16(ReleaseScheme):
    name = "diffusers_bf16"
    summary = "H3 DiT, float weights, Diffusers naming (shards + index, or one file)"
    quantized = False

    def claims(self, view: HeaderView) -> Evidence | None:
        if view.stems_with("int8_weight"):
            return None
        marks = [k for k in DIFFUSERS_MARKERS if k in view.tensors]
        if not marks:
            core = view.tensors.get("blocks.0.attn.qkv_proj.weight")
            if "video_patch_proj.weight" in view.tensors and core is not None and core.dtype in ("BF16", "F16", "F32") \
                    and not view.quant_marked:
                return Evidence("core H3 names with float block projections and no quantization marker")
            return None
        mapped = sum(1 for k in view.tensors if map_key(k) is not None)
        return Evidence(f"Diffusers H3 names ({', '.join(marks)}; {mapped}/{len(view.tensors)} keys map to core "
                        f"names) and no int8_weight tensors")


SCHEME = DiffusersBF16()
