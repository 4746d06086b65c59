"""``H3TurboNVFP4Loader``: load a MiniMax H3 diffusion model as ComfyUI-native NVFP4, from any supported file.
The work is :func:`h3_turbo.runtime.loading.load_h3_model`; the ``compute`` combo is the compute-path registry's."""
from __future__ import annotations

import os

from comfy_api.latest import io

from . import CATEGORY
from ..kernels import registry
from ..runtime.loading import ADALN_CHOICES, WEIGHTS_CHOICES, load_h3_model

COMPUTE_CHOICES = registry.choices()


def _compute_tooltip() -> str:
    exact = [n for n in COMPUTE_CHOICES if n in registry.PATHS and not registry.PATHS[n].approximate]
    approx = [n for n in COMPUTE_CHOICES if n in registry.PATHS and registry.PATHS[n].approximate]
    return (f"How the NVFP4 layers run. auto: the fastest path this GPU supports (logged once). "
            f"Exact NVFP4 math: {', '.join(exact)}; approximate, faster: {', '.join(approx)}. "
            "A path this device cannot run is an error, never a silent fallback.")


class H3TurboNVFP4Loader(io.ComfyNode):
    """Load an H3 diffusion model (native NVFP4, ModelOpt, LightX2V, or BF16 quantized on load) as MODEL."""

    @classmethod
    def define_schema(cls):
        import folder_paths

        return io.Schema(
            node_id="H3TurboNVFP4Loader",
            display_name="Load H3 NVFP4 Diffusion Model",
            category=CATEGORY,
            description="Loads a MiniMax H3 diffusion model (models/diffusion_models) with its 208 block projections "
                        "in NVFP4, into core's own H3 model. Reads ComfyUI-native NVFP4, ModelOpt and LightX2V "
                        "exports; a BF16/FP16/FP32 file is quantized to NVFP4 while it loads. The file is checked "
                        "before anything is built: a bad file gets one clear error and loaded models stay as they "
                        "are. compute auto picks the fastest path for the GPU (fp8 on Ada/Hopper is approximate, "
                        "about 4%); pick exact for results equal to the BF16-dequantized NVFP4 weights.",
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="An H3 checkpoint in models/diffusion_models: NVFP4, or BF16/FP16/FP32 "
                                       "(quantized while loading). The format is read from the file, not its name."),
                io.Combo.Input("compute", options=list(COMPUTE_CHOICES), default="auto", tooltip=_compute_tooltip()),
                io.Combo.Input("adaln", options=list(ADALN_CHOICES), default="auto", optional=True,
                               tooltip="Where the AdaLN weights (26 GB in an unpruned checkpoint) live. resident: on "
                                       "the GPU (core). table: in CPU memory; their output is computed once per "
                                       "timestep group and cached on disk per schedule (bit-identical to "
                                       "resident). auto: resident when the model fits the free VRAM with margin, "
                                       "else table. Pruned checkpoints are left to core."),
                io.Combo.Input("weights", options=list(WEIGHTS_CHOICES), default="auto", optional=True,
                               tooltip="Per-layer weight copies of the compute path (fp8 keeps an e4m3 copy of "
                                       "every projection: +18.7 GiB for the full model). lean: no copies, each "
                                       "call derives the weight from the NVFP4 storage (the same output bit for "
                                       "bit, a few percent slower). resident: keep the copies. auto: resident "
                                       "when they fit the free VRAM with margin, else lean."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name, compute="auto", adaln="auto", weights="auto"):
        """Reload when the file changes on disk (size and mtime), not only when the name changes."""
        import folder_paths

        path = folder_paths.get_full_path("diffusion_models", unet_name)
        if path is None or not os.path.exists(path):
            return (unet_name, compute, adaln, weights)
        st = os.stat(path)
        return (unet_name, compute, adaln, weights, st.st_size, st.st_mtime_ns)

    @classmethod
    def execute(cls, unet_name, compute="auto", adaln="auto", weights="auto") -> io.NodeOutput:
        import folder_paths

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        return io.NodeOutput(load_h3_model(path, compute, adaln=adaln, weights=weights))


NODES = [H3TurboNVFP4Loader]
