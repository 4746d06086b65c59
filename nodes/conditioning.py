"""Utility nodes for runs without the 32 B text encoder or the full-size VAEs (tests, the tiny demo)."""
from __future__ import annotations

import logging
import os

import torch
from comfy_api.latest import io

from . import CATEGORY, checks

log = logging.getLogger("h3_turbo")


def _text_dim(model) -> int:
    """H3 text width (``condition_proj`` input features) of a ComfyUI MODEL; ValueError if not H3."""
    dm = getattr(getattr(model, "model", None), "diffusion_model", None)
    proj = getattr(dm, "condition_proj", None)
    if proj is None or not hasattr(proj, "in_features"):
        raise ValueError("H3TurboTestConditioning: the MODEL is not a MiniMax H3 model "
                         "(no diffusion_model.condition_proj); connect an H3 loader's MODEL.")
    return int(proj.in_features)


class H3TurboTestConditioning(io.ComfyNode):
    """Seeded Gaussian text conditioning in the model's text width: [1, tokens, text_dim] fp32.

    Stands in for the Qwen3-VL text encoder output when it is not installed (tests, the tiny demo).
    It carries no meaning; for real prompts use core's MiniMaxH3ImageToVideo with the text encoder.
    """

    DISPLAY = "H3 Turbo Random Conditioning (test)"
    NUMBERS = {"seed": checks.Number("int", 0, 0, 2**31 - 1), "tokens": checks.Number("int", 16, 1, 4096)}

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboTestConditioning",
            display_name=cls.DISPLAY,
            category=CATEGORY,
            description="Random text conditioning (seeded) in the H3 model's text width: a stand-in for the 32 B "
                        "text encoder, to test a model or a workflow without it (the tiny demo). It is not a "
                        "prompt: for real prompts use MiniMax H3 Image to Video with the text encoder.",
            inputs=[
                io.Model.Input("model", tooltip="The H3 MODEL the conditioning is for (sets its width)."),
                cls.NUMBERS["seed"].input("seed", control_after_generate=io.ControlAfterGenerate.fixed,
                                          tooltip="Seed of the random values: the same seed gives the same conditioning."),
                cls.NUMBERS["tokens"].input("tokens", tooltip="Number of text tokens."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, model, seed, tokens) -> io.NodeOutput:
        seed, tokens = checks.check(cls, seed=seed, tokens=tokens)
        g = torch.Generator().manual_seed(seed)
        ctx = torch.randn(1, tokens, _text_dim(model), generator=g)
        return io.NodeOutput([[ctx, {}]])


def latent_preview_frames(video_latent: torch.Tensor, upscale: int = 8) -> torch.Tensor:
    """RGB preview of an H3 video latent with core's ``MiniMaxH3Video.latent_rgb_factors``.

    video_latent: [1, 24, T, h, w] float. Returns uint8 [T, h*upscale, w*upscale, 3].
    """
    from comfy.latent_formats import MiniMaxH3Video

    fmt = MiniMaxH3Video()
    f = torch.tensor(fmt.latent_rgb_factors, dtype=torch.float32)  # [24, 3]
    b = torch.tensor(fmt.latent_rgb_factors_bias, dtype=torch.float32)
    x = video_latent[0].float().permute(1, 2, 3, 0)  # [T, h, w, 24]
    rgb = (x @ f + b).clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)
    rgb = rgb.repeat_interleave(upscale, 1).repeat_interleave(upscale, 2)
    # yuv420p needs even sizes
    return rgb[:, : rgb.shape[1] // 2 * 2, : rgb.shape[2] // 2 * 2]


def write_mp4(frames: torch.Tensor, path: str, fps: int = 24) -> str:
    """Write uint8 [T, H, W, 3] frames as H.264 mp4 with PyAV (a ComfyUI dependency)."""
    import av

    with av.open(path, mode="w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for fr in frames.numpy():
            for pkt in s.encode(av.VideoFrame.from_ndarray(fr, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path


class H3TurboSaveLatentPreview(io.ComfyNode):
    """Writes a 24 fps latent-preview mp4 of an H3 AV latent's video stream (no VAE needed)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboSaveLatentPreview",
            display_name="H3 Turbo Save Latent Preview (mp4)",
            category=CATEGORY,
            description="Saves a quick look at an H3 video+audio latent without the video VAE: a 24 fps mp4 of "
                        "its video part through core's latent RGB preview colors, 8x enlarged. Silent, and only "
                        "a preview: decode with VAE Decode for the real video.",
            inputs=[io.Latent.Input("av_latent", tooltip="The video+audio LATENT of an H3 sampler."),
                    io.String.Input("filename_prefix", default="h3turbo/preview",
                                    tooltip="Output file name prefix (subfolders allowed), under ComfyUI's output "
                                            "folder.")],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, av_latent, filename_prefix) -> io.NodeOutput:
        import folder_paths
        from comfy_api.latest import ui

        s = av_latent["samples"]
        video = s.unbind()[0] if getattr(s, "is_nested", False) else s
        if video.ndim != 5:
            raise ValueError(f"H3TurboSaveLatentPreview: expected an H3 video latent [1,24,T,h,w], got {tuple(video.shape)}")
        out_dir, name, counter, subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory())
        fname = f"{name}_{counter:05}_.mp4"
        write_mp4(latent_preview_frames(video), os.path.join(out_dir, fname))
        return io.NodeOutput(ui=ui.PreviewVideo([ui.SavedResult(fname, subfolder, io.FolderType.output)]))


NODES = [H3TurboTestConditioning, H3TurboSaveLatentPreview]
