"""The ``sdpa_core`` attention backend: core ComfyUI's registered ``"pytorch"`` attention, for comparison.

Contract: :meth:`SdpaCoreBackend.apply` calls core's ``ModelPatcher.set_model_optimized_attention`` with
``comfy.ldm.modules.attention.get_attention_function("pytorch")``, so the clone runs core's SDPA path with
core's backend priority for every input (it takes masks, GQA, any device: no fallback). Exact; output as
core's. Needs ComfyUI importable (imported on use only).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .base import AttentionBackend, Tolerance

NAME = "sdpa_core"


def _core_pytorch_attention():
    import comfy.ldm.modules.attention as core_attention

    return core_attention.get_attention_function("pytorch")


class SdpaCoreBackend(AttentionBackend):
    """``sdpa_core``: core's own PyTorch attention installed as the model's override."""

    name = NAME
    summary = "core's PyTorch attention (FA2 first), for comparison."
    approximate = False
    fallback = None
    tolerance = Tolerance(rel_l2=1e-6, cos_min=1.0 - 1e-9, dtype=torch.float32)   # float32 inputs, vs float64
    needs_comfy = True

    def supports(self, device):
        return True, ""

    def apply(self, patcher) -> None:
        patcher.set_model_optimized_attention(_core_pytorch_attention())

    def override(self):
        """What :meth:`apply` installs, built by core's own ``set_model_optimized_attention`` on a
        throwaway options holder (a new object per call, as per model)."""
        import comfy.model_patcher

        holder = SimpleNamespace(model_options={"transformer_options": {}})
        comfy.model_patcher.ModelPatcher.set_model_optimized_attention(holder, _core_pytorch_attention())
        return holder.model_options["transformer_options"]["optimized_attention_override"]


BACKEND = SdpaCoreBackend()
