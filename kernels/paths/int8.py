"""``int8``: W8A8 with TurboDiffusion's 128x128 block scales (the TurboH3 DMD export, ``h3_fl2va_turbo_w8a8_128``).

Weights: :class:`~h3_turbo.kernels.int8_block.Int8Weight` (int8 [N, K] + fp32 block scales), not NVFP4: this path
serves the DMD loader (``weight_format = "int8_block128"``), never the NVFP4 loader. Activations are block-quantized
per call (128 rows x 128 channels, ``amax/128``), one int32 product per 128-wide K slice, scaled into fp32.

Backends (``PATH.settings.backend``): ``triton`` (:mod:`..int8_triton`, one fused kernel; CUDA sm_80+ with Triton),
``int_mm`` (``torch._int_mm`` per K slice + an fp32 epilogue: the library path, exact, runs on the CPU and on CUDA;
on the GPU it writes one [M, N] int32 product per K slice, so it is slow there), ``auto`` = triton on CUDA when
Triton is present, else int_mm. The reference for these weights dequantizes them (``reference_weight``).
``error_bound``: relative L2 vs the float64 product with the dequantized weight (the activation quantization
error; ~0.5-1% on Gaussian activations).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...logs import log_once
from .. import int8_block as ib
from . import base
from .base import ComputePath

WEIGHT_FORMAT = "int8_block128"
BACKENDS = ("auto", "triton", "int_mm")


@dataclass
class Int8Settings:
    backend: str = "auto"


@dataclass
class PreparedInt8:
    """The weight as the path keeps it (no load-time re-expression)."""

    weight: ib.Int8Weight

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    @property
    def in_features(self) -> int:
        return self.weight.in_features


class Int8Path(ComputePath):
    name = "int8"
    weight_format = WEIGHT_FORMAT
    approximate = True
    error_bound = 0.03
    kernel = True

    def __init__(self):
        self.settings = Int8Settings()

    def supports(self, device: torch.device) -> tuple[bool, str]:
        dev = torch.device(device)
        if dev.type == "cpu":
            return True, "torch._int_mm on the CPU (one int32 product per 128-wide K slice, fp32 epilogue)"
        if dev.type != "cuda":
            return False, f"device {dev} is neither CPU nor CUDA"
        cc = base.capability(dev)
        if cc < (8, 0):
            return False, f"int8 tensor cores need sm_80 or newer (this GPU is sm_{cc[0]}{cc[1]})"
        if base.has_triton():
            return True, "fused Triton W8A8 kernel (int8 tensor cores, per-K-slice block scales)"
        return False, ("the fused W8A8 kernel needs Triton (torch._int_mm per 128-wide K slice would be slower than "
                       "compute=reference on a GPU)")

    def backend_for(self, x2d: torch.Tensor) -> str:
        b = self.settings.backend
        if b not in BACKENDS:
            raise ValueError(f"int8 path: backend {b!r}; expected one of {BACKENDS}")
        if b == "auto":
            return "triton" if x2d.device.type == "cuda" and base.has_triton() else "int_mm"
        return b

    def takes(self, x2d: torch.Tensor) -> bool:
        return x2d.device.type in ("cpu", "cuda") and x2d.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def prepare(self, weight: ib.Int8Weight) -> PreparedInt8:
        if not isinstance(weight, ib.Int8Weight):
            raise ValueError(f"int8 path: prepare takes an Int8Weight (W8A8 block weights), got {type(weight).__name__}")
        weight.validate()
        return PreparedInt8(weight)

    def reference_weight(self, prepared: PreparedInt8, dtype: torch.dtype) -> torch.Tensor:
        return ib.dequantize(prepared.weight, dtype)

    def linear(self, x2d: torch.Tensor, prepared: PreparedInt8) -> torch.Tensor:
        if not self.takes(x2d):
            log_once(("fallback", self.name, str(x2d.dtype), x2d.device.type),
                     "H3 Turbo int8 path: input %s on %s is not supported; using the dequantized weight (reference)",
                     x2d.dtype, x2d.device.type)
            return F.linear(x2d, self.reference_weight(prepared, x2d.dtype))
        return self.guarded_linear(x2d, prepared)

    def kernel_linear(self, x2d: torch.Tensor, prepared: PreparedInt8) -> torch.Tensor:
        if self.backend_for(x2d) == "triton":
            from .. import int8_triton

            return int8_triton.gemm(x2d, prepared.weight)
        return ib.int_mm_linear(x2d, prepared.weight)

    def prepared_bytes(self, shapes: list[tuple[int, int]], lean: bool = False) -> int:
        return 0

    def workspace_bytes(self, shapes: list[tuple[int, int]], act_bytes: int = 2) -> int:
        return 0


PATH = Int8Path()


def reference_linear(x2d: torch.Tensor, prepared: PreparedInt8) -> torch.Tensor:
    """``compute=reference`` for W8A8 weights: dequantize to x's dtype per call + ``F.linear``."""
    return F.linear(x2d, ib.dequantize(prepared.weight, x2d.dtype))
