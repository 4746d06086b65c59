"""``H3TurboDMDLoader``: load the TurboH3-FL2VA-I2VA DMD model (BF16 Diffusers shards, the W8A8 export, or a release
folder) as core's H3 MODEL with the DMD contract. The work is :func:`h3_turbo.runtime.dmd.load_dmd_model`."""
from __future__ import annotations

import os

from comfy_api.latest import io

from . import CATEGORY
from ..formats.dmd import INDEX_SUFFIX
from ..runtime.dmd import ADALN_AUTO, ADALN_NONE, compute_choices, load_dmd_model

#: ComfyUI model folder for AdaLN tables (``models/h3turbo_adaln/``: the pack's table files, LightX2V folders)
ADALN_FOLDER = "h3turbo_adaln"
COMPUTE_CHOICES = compute_choices()
_MAX_DEPTH = 3


def _register_adaln_folder() -> None:
    import folder_paths

    if ADALN_FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.folder_names_and_paths[ADALN_FOLDER] = ([os.path.join(folder_paths.models_dir, ADALN_FOLDER)],
                                                             {".safetensors", ".json"})


def _is_release_dir(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "manifest.json")) or os.path.isdir(os.path.join(d, "transformer")) \
        or os.path.isdir(os.path.join(d, "w8a8"))


def model_options() -> dict[str, str]:
    """{combo name: full path} of the DMD candidates under every ``diffusion_models`` folder: release folders
    (``name/``), shard indexes (``*.safetensors.index.json``) and ``.safetensors`` files (validated on load), at most
    3 folders deep; shards and files inside a release folder are listed through the folder or index."""
    import folder_paths

    out: dict[str, str] = {}
    for root in folder_paths.get_folder_paths("diffusion_models"):
        if not os.path.isdir(root):
            continue
        for dp, dns, fns in os.walk(root, followlinks=True):
            rel = os.path.relpath(dp, root)
            depth = 0 if rel == "." else rel.count(os.sep) + 1
            if depth and _is_release_dir(dp):
                out.setdefault(rel.replace(os.sep, "/") + "/", dp)
            if depth >= _MAX_DEPTH:
                dns[:] = []
            sharded = any(f.endswith(INDEX_SUFFIX) for f in fns)
            if os.path.basename(dp) == "adaln" and _is_release_dir(os.path.dirname(dp)):
                continue                        # a release's AdaLN table: picked through the release folder
            for f in fns:
                name = f if rel == "." else f"{rel}/{f}".replace(os.sep, "/")
                if f.endswith(INDEX_SUFFIX) or (f.endswith(".safetensors") and not sharded):
                    out.setdefault(name, os.path.join(dp, f))
    return dict(sorted(out.items()))


def release_tables() -> dict[str, str]:
    """{combo name: path} of the ``adaln/`` tables of the release folders under ``diffusion_models``
    (``<release>/adaln/``, e.g. ``TurboH3-FL2VA-I2VA/adaln/``)."""
    out = {}
    for name, p in model_options().items():
        if name.endswith("/") and os.path.exists(os.path.join(p, "adaln")):
            out[name + "adaln/"] = os.path.join(p, "adaln")
    return out


def adaln_options() -> list[str]:
    """``auto``, ``none``, the release tables (:func:`release_tables`) and the files of ``models/h3turbo_adaln``."""
    import folder_paths

    _register_adaln_folder()
    return [ADALN_AUTO, ADALN_NONE] + list(release_tables()) + folder_paths.get_filename_list(ADALN_FOLDER)


def _resolve(model_name: str) -> str:
    opts = model_options()
    if model_name not in opts:
        raise FileNotFoundError(f"Load TurboH3 DMD Model: {model_name!r} is not in the diffusion_models folders "
                                f"(a release folder, a *{INDEX_SUFFIX} or a .safetensors file)")
    return opts[model_name]


def _adaln_path(adaln: str) -> str:
    if adaln in (ADALN_AUTO, ADALN_NONE):
        return adaln
    rel = release_tables()
    if adaln in rel:
        return rel[adaln]
    import folder_paths

    _register_adaln_folder()
    return folder_paths.get_full_path_or_raise(ADALN_FOLDER, adaln)


class H3TurboDMDLoader(io.ComfyNode):
    """Load the TurboH3 DMD model (4 updates, shifts 12/3, no CFG) as MODEL, with its AdaLN table."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboDMDLoader",
            display_name="Load TurboH3 DMD Model",
            category=CATEGORY,
            description="Loads TurboH3-FL2VA-I2VA (a four-update DMD H3): the BF16 Diffusers shards "
                        "(transformer/*.safetensors.index.json), the W8A8 export (w8a8/model_w8a8.safetensors) or the "
                        "release folder. Files are validated first. adaln: auto = the adaln/ table of the release the model "
                        "lies in (needed by W8A8), none = compute from the BF16 weights, or a table from models/h3turbo_adaln. compute: "
                        "int8 = W8A8 int8 GEMM (BF16 weights are quantized on load), reference = BF16 / dequantized "
                        "W8A8, exact / fp8 / blackwell_fp4 = the BF16 weights' block projections quantized to NVFP4 on load (11 GB "
                        "instead of 40) and run by the NVFP4 loader's kernels (fp8: the fastest on Hopper/Ada). Sample "
                        "with H3 Turbo Sigmas + H3 Turbo Sampler (the DMD contract is attached: 4 updates, shifts 12/3). "
                        "The DMD update rule is not public: the sampler's update=auto re-noises (as TurboDiffusion's "
                        "public few-step samplers do); update=euler is the rule of diffusers' MiniMaxH3Scheduler and "
                        "LightX2V and reproduces diffusers' sampling (docs/turboh3.md).",
            inputs=[
                io.Combo.Input("model_name", options=list(model_options())),
                io.Combo.Input("adaln", options=adaln_options(), default=ADALN_AUTO, optional=True,
                               tooltip="auto: the adaln/ table of the release the model lies in (for a W8A8 file or an "
                                       "index inside a release folder too; else the weights' own AdaLN); none: compute "
                                       "from the weights; or a release's adaln/ folder or a table file from "
                                       "models/h3turbo_adaln. Tables are looked up by their timesteps (|dt| <= 2e-6), "
                                       "never interpolated."),
                io.Combo.Input("compute", options=list(COMPUTE_CHOICES), default="auto", optional=True,
                               tooltip="auto: int8 on CUDA GPUs (sm_80+ with Triton), else reference (BF16 weights when the folder has "
                                       "them). exact / fp8 / blackwell_fp4: BF16 weights quantized to NVFP4 on load."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, model_name, adaln=ADALN_AUTO, compute="auto"):
        """Reload when the chosen file / folder changes on disk (size and mtime of its top-level entries)."""
        try:
            p = _resolve(model_name)
        except FileNotFoundError:
            return (model_name, adaln, compute)
        paths = [p] if os.path.isfile(p) else [os.path.join(p, f) for f in sorted(os.listdir(p))]
        sig = tuple((os.path.basename(q), os.stat(q).st_size, os.stat(q).st_mtime_ns) for q in paths if os.path.exists(q))
        return (model_name, adaln, compute, sig)

    @classmethod
    def execute(cls, model_name, adaln=ADALN_AUTO, compute="auto") -> io.NodeOutput:
        return io.NodeOutput(load_dmd_model(_resolve(model_name), _adaln_path(adaln), compute))


NODES = [H3TurboDMDLoader]
