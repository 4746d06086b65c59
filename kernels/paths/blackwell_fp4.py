"""``blackwell_fp4``: W4A4 on FP4 tensor cores through comfy-kitchen ``scaled_mm_nvfp4``, as core does on
Blackwell (compute capability >= 10, torch built for CUDA >= 13). Activations are quantized to NVFP4 per
call (``amax(|x|) / (448 * 6)``, rows/cols zero-padded to 16); approximate. Runs only where comfy-kitchen
has the op; unit-tested with mocks (no Blackwell GPU here)."""
from __future__ import annotations

import torch

from . import base
from .base import ComputePath


class BlackwellFP4Path(ComputePath):
    name = "blackwell_fp4"
    approximate = True
    error_bound = 0.2
    kernel = False  # comfy-kitchen takes any input it supports; no eager fallback of ours in between

    def supports(self, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"device {device} is not CUDA"
        cc = base.capability(device)
        if cc < (10, 0):
            return False, f"compute capability {cc[0]}.{cc[1]} < 10.0 (no FP4 tensor cores)"
        if base.cuda_major() < 13:
            return False, f"torch is built for CUDA {torch.version.cuda}; FP4 scaled_mm needs CUDA 13 (cu130)"
        if not base.has_ck_fp4():
            return False, "comfy-kitchen with scaled_mm_nvfp4 is not importable"
        return True, f"comfy-kitchen scaled_mm_nvfp4 on sm_{cc[0]}{cc[1]}"

    def kernel_linear(self, x2d: torch.Tensor, prepared) -> torch.Tensor:
        import comfy_kitchen as ck
        p = prepared.packed
        m, k = x2d.shape
        sx = (x2d.abs().amax().float() / (448.0 * 6.0)).reshape(())
        sx = torch.where(sx > 0, sx, torch.ones_like(sx))
        pad = (m % 16 != 0) or (k % 16 != 0)
        qx, bsx = ck.quantize_nvfp4(x2d, sx, 0.0, pad)
        out = ck.scaled_mm_nvfp4(qx, p.qdata, tensor_scale_a=sx, tensor_scale_b=p.global_scale.float().reshape(()),
                                 block_scale_a=bsx, block_scale_b=p.block_scale, out_dtype=x2d.dtype)
        return out[:m, : p.out_features]

    def linear(self, x2d, prepared):
        return self.guarded_linear(x2d, prepared)


PATH = BlackwellFP4Path()
