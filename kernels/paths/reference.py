"""``reference``: pure torch on any device (CPU included) — the exact E2M1 dequantize per call
(:func:`kernels.nvfp4_ref.dequant_exact`) + ``F.linear``. What core ComfyUI computes on Hopper and CPU;
the eager reference every other path is tested against."""
from __future__ import annotations

import torch

from .base import ComputePath


class ReferencePath(ComputePath):
    name = "reference"
    kernel = False
    error_bound = 1e-2   # bf16 weight and output rounding only

    def supports(self, device: torch.device) -> tuple[bool, str]:
        return True, "pure-torch reference (dequantize + F.linear)"


PATH = ReferencePath()
