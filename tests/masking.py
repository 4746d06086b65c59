"""Test-only pieces for masked H3 sampling (a latent ``noise_mask``), shared by the masked-workflow tests.

``H3TurboTestMaskLatent``: LATENT -> the same AV latent filled with seeded values (the content the kept tokens must
keep) and a ``noise_mask`` NestedTensor [video mask, audio mask] (1 = generate, 0 = keep, as core's masks):

- video ``none`` (all 1), ``first_frame`` (latent frame 0 kept: video extension), ``ramp`` (columns kept, half, and
  generated: fractional values, so a newer core makes per-token modulation rows with several levels);
- audio ``none`` or ``first_half`` (the first half of the audio frames kept).
"""
from __future__ import annotations

import torch

VIDEO = ("none", "first_frame", "ramp")
AUDIO = ("none", "first_half")


def masks(video_shape, audio_shape, video: str, audio: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(video mask [1, 1, T, H, W], audio mask [1, 1, 2, T_audio]) float32 for the patterns above."""
    _, _, t, h, w = video_shape
    vm = torch.ones(1, 1, t, h, w)
    if video == "first_frame":
        vm[:, :, 0] = 0.0
    elif video == "ramp":
        vm[..., : w // 4] = 0.0
        vm[..., w // 4: w // 2] = 0.5
    elif video != "none":
        raise ValueError(video)
    am = torch.ones(1, 1, audio_shape[2], audio_shape[3])
    if audio == "first_half":
        am[..., : audio_shape[3] // 2] = 0.0
    elif audio != "none":
        raise ValueError(audio)
    return vm, am


class MaskLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",), "seed": ("INT", {"default": 0}),
                             "video": (list(VIDEO),), "audio": (list(AUDIO),)}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "go"
    CATEGORY = "h3_turbo_tests"

    def go(self, latent, seed, video, audio):
        import comfy.nested_tensor

        v, a = latent["samples"].unbind()
        g = torch.Generator().manual_seed(int(seed))
        v = torch.randn(v.shape, generator=g) * 0.7
        a = torch.randn(a.shape, generator=g) * 0.7
        vm, am = masks(v.shape, a.shape, video, audio)
        return ({"samples": comfy.nested_tensor.NestedTensor((v, a)),
                 "noise_mask": comfy.nested_tensor.NestedTensor((vm, am))},)


NODES = {"H3TurboTestMaskLatent": MaskLatent}
