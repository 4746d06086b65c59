"""The fused-LoRA layer interface: what a linear layer offers the Turbo runtime branch
(:mod:`h3_turbo.adapters.branch`) so base and LoRA run in one kernel call.

The pack's NVFP4 layers (:func:`h3_turbo.runtime.ops.make_operations`) implement it; any other layer is
wrapped unfused. Standard library + torch only (no ComfyUI import).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class FusedLoRALinear(Protocol):
    def h3turbo_fusable(self, input: torch.Tensor) -> bool:
        """Cheap check: can :meth:`h3turbo_lora_forward` serve this call (GPU kernel path, bf16/fp16 input, no
        weight patch/offload/grad, no ``pre_quant_scale``)?"""

    def h3turbo_lora_forward(self, input: torch.Tensor, A: torch.Tensor, Bc: torch.Tensor, coef: float,
                             blocks: int, amax_a: torch.Tensor | None, key: Any = None) -> torch.Tensor:
        """The layer's output plus ``coef * Bc @ (A @ input)`` (block-diagonal over ``blocks`` qkv blocks),
        computed together. A [blocks*r, K], Bc [N, r], amax_a fp32 [blocks*r] on input's device and dtype;
        ``key`` identifies the adapter target. Only for inputs :meth:`h3turbo_fusable` accepted."""


def fusable_check(module) -> Any:
    """The module's bound ``h3turbo_fusable`` if it implements :class:`FusedLoRALinear` and nothing wrapped its
    forward yet, else None."""
    if "forward" in getattr(module, "__dict__", {}) or not isinstance(module, FusedLoRALinear):
        return None
    return module.h3turbo_fusable
