"""``H3TurboNVFP4Loader``: load a MiniMax H3 diffusion model as ComfyUI-native NVFP4, from any supported file.
The work is :func:`h3_turbo.runtime.loading.load_h3_model`; the ``compute`` combo is the compute-path registry's."""
from __future__ import annotations

import os

from comfy_api.latest import io

from . import CATEGORY
from ..kernels import registry
from ..runtime.loading import load_h3_model

COMPUTE_CHOICES = registry.choices()


class H3TurboNVFP4Loader(io.ComfyNode):
    """Load an H3 diffusion model (native NVFP4, ModelOpt, LightX2V, or BF16 quantized on load) as MODEL."""

    @classmethod
    def define_schema(cls):
        import folder_paths

        return io.Schema(
            node_id="H3TurboNVFP4Loader",
            display_name="Load H3 NVFP4 Diffusion Model",
            category=CATEGORY,
            description="Loads a MiniMax H3 diffusion model with its 208 block projections in NVFP4 (ComfyUI-native, "
                        "ModelOpt or LightX2V files; BF16 files are quantized while loading). The file is validated "
                        "before anything is built. compute: auto picks the fastest path for the GPU (fp8 on "
                        "Ada/Hopper is approximate, ~4%); exact is bit-exact NVFP4 dequant + bf16 GEMM; reference "
                        "is core's dequantize + matmul.",
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models")),
                io.Combo.Input("compute", options=list(COMPUTE_CHOICES), default="auto"),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name, compute="auto"):
        """Reload when the file changes on disk (size and mtime), not only when the name changes."""
        import folder_paths

        path = folder_paths.get_full_path("diffusion_models", unet_name)
        if path is None or not os.path.exists(path):
            return (unet_name, compute)
        st = os.stat(path)
        return (unet_name, compute, st.st_size, st.st_mtime_ns)

    @classmethod
    def execute(cls, unet_name, compute="auto") -> io.NodeOutput:
        import folder_paths

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        return io.NodeOutput(load_h3_model(path, compute))


NODES = [H3TurboNVFP4Loader]
