"""``exact``: W4A16 on CUDA + Triton (sm_80+). The weight is the reference dequant bit for bit
(``(E2M1[q] * block_scale) * weight_scale_2`` in fp32, rounded once to the activation dtype); bf16/fp16
tensor-core products with fp32 accumulation. Output within bf16 GEMM rounding of the float64 product.

Strategies (``SETTINGS.strategy``; same numbers up to summation order):

- ``fused``: Triton dequant-GEMM (:func:`kernels.triton_nvfp4.gemm_exact`) on the native storage, the weight
  never materialised;
- ``full``: the whole weight dequantized from the native storage into one reused buffer
  (:func:`kernels.triton_nvfp4.fold_weight`, the Turbo LoRA optionally folded in), then one cuBLAS GEMM;
- ``tiled``: row tiles dequantized on a side stream, overlapped with cuBLAS GEMMs on column slices.

``auto``: fused up to ``fused_max_m`` rows, else ``large_m_strategy``. Why these defaults: docs/kernels.md.
Prepared memory: none. Every strategy reads ComfyUI's native NVFP4 storage (the packed weights ComfyUI already
holds); the per-call weight of ``full``/``tiled`` lives in one reused buffer per device (``workspace_bytes``).
So ``weights=lean`` and ``weights=resident`` are the same thing on this path.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import base
from .base import WORK_BUFFERS, SIDE_STREAMS, ComputePath, LoRAOperands, PackedNVFP4, PreparedPacked


@dataclass
class ExactSettings:
    #: "auto" | "fused" | "tiled" | "full"
    strategy: str = "auto"
    #: with strategy "auto", the fused Triton kernel serves M <= fused_max_m rows, large_m_strategy the rest
    fused_max_m: int = 256
    #: above fused_max_m rows: "full" (whole weight into one reused buffer) or "tiled" (row tiles, side stream)
    large_m_strategy: str = "full"
    #: "full" + LoRA from this many rows; below, the tiled fold (the whole-weight fold is not hidden there)
    full_lora_min_m: int = 8192
    #: fold the Turbo LoRA into the per-call weight above fused_max_m rows (False: always the unfused branch)
    lora_fold: bool = True
    #: rows of W dequantized per tile by the tiled strategy
    tile_rows: int = 3072


@dataclass
class PreparedExact(PreparedPacked):
    """The native storage (the same tensors, no copy) and its global scale as an fp32 [1] tensor."""
    gs: torch.Tensor = None   # fp32 [1]


class ExactPath(ComputePath):
    name = "exact"
    error_bound = 1e-2   # bf16 output rounding (~2e-3 rel in practice)

    def __init__(self):
        self.settings = ExactSettings()

    def supports(self, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"needs a CUDA GPU, but the device is {device}"
        if not base.has_triton():
            return False, "Triton is not installed"
        cc = base.capability(device)
        if cc < (8, 0):
            return False, f"compute capability {cc[0]}.{cc[1]} < 8.0 (no bf16 tensor cores)"
        return True, f"Triton fused dequant-GEMM on sm_{cc[0]}{cc[1]}"

    def prepare(self, packed: PackedNVFP4, lean: bool = False) -> PreparedExact:
        packed.check_finite_scales()
        gs = packed.global_scale.detach().float().reshape(1).to(packed.qdata.device)
        return PreparedExact(packed, gs)

    def strategy(self, m: int) -> str:
        s = self.settings
        return ("fused" if m <= s.fused_max_m else s.large_m_strategy) if s.strategy == "auto" else s.strategy

    def kernel_linear(self, x2d: torch.Tensor, p: PreparedExact) -> torch.Tensor:
        from .. import triton_nvfp4 as tk
        strat = self.strategy(x2d.shape[0])
        if strat == "full":
            return self.full(x2d, p)
        if strat == "tiled":
            return self.tiled(x2d, p)
        pk = p.packed
        return tk.gemm_exact(x2d, pk.qdata, pk.block_scale, p.gs, p.out_features, p.in_features)

    def lora(self, x2d: torch.Tensor, p, lo: LoRAOperands):
        from .. import triton_nvfp4 as tk
        if not isinstance(p, PreparedExact):
            return None
        m = x2d.shape[0]
        s = self.settings
        strat = self.strategy(m)
        if strat == "fused" and lo.nb % 64 == 0:
            h = torch.nn.functional.linear(x2d, lo.a)
            pk = p.packed
            return tk.gemm_exact(x2d, pk.qdata, pk.block_scale, p.gs, p.out_features, p.in_features,
                                 lora=(h, lo.bc, float(lo.scale), lo.nb)), "fused_epilogue"
        if (s.lora_fold and strat == "full" and m >= s.full_lora_min_m
                and tk.fold_bn(lo.nb) is not None):
            return self.full(x2d, p, lora=(lo.a, lo.bc, float(lo.scale), lo.nb)), "full_fold"
        if s.lora_fold and strat in ("tiled", "full"):
            return self.tiled(x2d, p, lora=(lo.a, lo.bc, float(lo.scale), lo.nb)), "tiled_fold"
        return None

    def full(self, x2d: torch.Tensor, p: PreparedExact, lora: tuple | None = None) -> torch.Tensor:
        """Dequantize the whole weight (Triton, from the native storage, optionally with the LoRA
        ``(A, Bc, scale, nb)`` folded in: ``triton_nvfp4.fold_weight``) into the reused buffer, then one cuBLAS
        GEMM. Same numbers as ``fused``/``tiled`` up to GEMM summation order (bit-identical weight)."""
        from .. import triton_nvfp4 as tk
        pk = p.packed
        n, k = p.out_features, p.in_features
        w = base.scratch(x2d.device, x2d.dtype, n * k).view(n, k)
        tk.fold_weight(pk.qdata, pk.block_scale, p.gs, n, k, w, lora=lora)
        return torch.mm(x2d, w.t())

    def tiled(self, x2d: torch.Tensor, p: PreparedExact, lora: tuple | None = None) -> torch.Tensor:
        """Dequantize W in row tiles (Triton, side stream, double buffer) overlapped with cuBLAS GEMMs writing
        column slices of the output. ``lora`` (A [blocks*r, K], Bc [N, r], scale, rows per block NB): each
        transient tile gets ``tile += scale * Bc[rows] @ A[block]`` before its GEMM (the tile is already the
        rounded weight, so W + update is rounded twice, unlike :meth:`full`). The NVFP4 storage is never
        modified."""
        from .. import triton_nvfp4 as tk
        n, k = p.out_features, p.in_features
        m = x2d.shape[0]
        out = torch.empty((m, n), device=x2d.device, dtype=x2d.dtype)
        t = min(self.settings.tile_rows, n)
        key = ("tiles", x2d.device, x2d.dtype, t, k)
        with WORK_BUFFERS.lock:
            bufs = WORK_BUFFERS.data.get(key)
            if bufs is None:
                bufs = WORK_BUFFERS.data[key] = [torch.empty((t, k), device=x2d.device, dtype=x2d.dtype)
                                                 for _ in range(2)]
        cuda = x2d.device.type == "cuda"  # CPU (tests, TRITON_INTERPRET=1): same code, no streams
        if cuda:
            with SIDE_STREAMS.lock:
                side = SIDE_STREAMS.data.get(x2d.device)
                if side is None:
                    side = SIDE_STREAMS.data[x2d.device] = torch.cuda.Stream(x2d.device)
            main = torch.cuda.current_stream(x2d.device)
            free = [torch.cuda.Event(), torch.cuda.Event()]
            free[0].record(main)
            free[1].record(main)
        for i, r0 in enumerate(range(0, n, t)):
            r1 = min(n, r0 + t)
            b = bufs[i % 2][: r1 - r0]
            if cuda:
                ready = torch.cuda.Event()
            with (torch.cuda.stream(side) if cuda else contextlib.nullcontext()):
                if cuda:
                    side.wait_event(free[i % 2])
                tk.fold_weight(p.packed.qdata, p.packed.block_scale, p.gs, r1 - r0, k, b, row0=r0)
                if lora is not None:
                    a, bc, scale, nb = lora
                    r = bc.shape[1]
                    for blk in range(r0 // nb, (r1 - 1) // nb + 1):
                        s0, s1 = max(r0, blk * nb), min(r1, (blk + 1) * nb)
                        b[s0 - r0:s1 - r0].addmm_(bc[s0:s1], a[blk * r:(blk + 1) * r], alpha=scale)
                if cuda:
                    ready.record(side)
            if cuda:
                main.wait_event(ready)
            torch.mm(x2d, b.t(), out=out[:, r0:r1])
            if cuda:
                free[i % 2] = torch.cuda.Event()
                free[i % 2].record(main)
        return out

    def prepared_bytes(self, shapes: list[tuple[int, int]], lean: bool = False) -> int:
        return 4 * len(shapes)   # the fp32 global scale per layer

    def workspace_bytes(self, shapes: list[tuple[int, int]], act_bytes: int = 2) -> int:
        """The largest layer's whole-weight buffer (N*K activations) plus the row-tile double buffers
        (2 x min(tile_rows, N) x K per distinct tile shape)."""
        if not shapes:
            return 0
        t_rows = self.settings.tile_rows
        tiles = {(min(t_rows, n), k) for n, k in shapes}
        return max(n * k for n, k in shapes) * act_bytes + sum(2 * t * k * act_bytes for t, k in tiles)


PATH = ExactPath()
