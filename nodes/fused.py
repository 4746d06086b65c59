"""H3 Turbo Fused Blocks: run a MODEL's DiT blocks as the pack's fused fp8 block (core's per-block hook). The block,
what it serves and its bounds: ``runtime/fused_block.py`` and docs/kernels.md."""
from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY
from ..runtime import fused_block


class H3TurboFusedBlocks(io.ComfyNode):
    """Installs the fused DiT block (RMSNorm + AdaLN modulation -> e4m3, SwiGLU -> e4m3, one-pass gated residual,
    fp8 GEMMs on the pre-quantized inputs) on a clone of a MODEL loaded with compute=fp8.

    ``mode``: ``fp8`` (install) or ``off`` (an unchanged clone). Calls the block cannot serve (CPU, fp32, weight
    patches, low-VRAM offload, layers not on fp8) run core's block, each reason logged once. Output: the clone.
    """

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboFusedBlocks",
            display_name="H3 Turbo Fused Blocks (fp8)",
            category=CATEGORY,
            description="Runs each DiT block of an H3 MODEL loaded with compute=fp8 as one fused fp8 block: the "
                        "norm, AdaLN modulation, SwiGLU and gated residual write the fp8 GEMM inputs directly "
                        "instead of bf16 round trips: a faster forward (measured in docs/kernels.md); the result moves "
                        "about 1% from the unfused fp8 path (it quantizes the same tensors, in other kernels). "
                        "Needs a CUDA GPU; elsewhere core's blocks run.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("mode", options=list(fused_block.CHOICES), default="fp8", optional=True,
                               tooltip="fp8: fused blocks on this MODEL's clone. off: an unchanged clone."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, mode="fp8") -> io.NodeOutput:
        return io.NodeOutput(fused_block.apply(model, mode))


NODES = [H3TurboFusedBlocks]
