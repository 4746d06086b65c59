"""The compute-path interface: one :class:`ComputePath` object per way of running an NVFP4 linear.

A path takes ComfyUI's native NVFP4 storage (:class:`PackedNVFP4`) and computes ``y = x @ W^T``:

- ``supports(device) -> (ok, reason)``: can this device run it (reason either way, for logs and errors);
- ``prepare(packed, lean=False) -> prepared``: load-time work (a re-expressed copy of the weight, or nothing;
  ``lean``: no per-layer copy, the path derives its weight per call into a reused buffer — paths with
  ``has_lean_mode`` False keep no copies in either mode);
- ``linear(x2d, prepared) -> y2d``: one call; x2d [M, K] bf16/fp16 on CUDA for the kernel paths (other
  inputs run the eager reference, logged once). A kernel that fails to build or launch for a layer shape
  (:func:`run_kernel`) makes that shape run the reference computation from then on, logged once with the path,
  the shape and the error's first line (:data:`KERNEL_FAILURES`);
- ``lora(x2d, prepared, lora) -> (y2d, route) | None``: base + LoRA computed together, or None for
  "use the unfused branch" (``kernels.dispatch.linear_with_lora`` owns the unfused branch);
- ``prepared_bytes(shapes, lean)`` / ``workspace_bytes(shapes)``: memory kept per model / reused per process;
- ``reference_weight(prepared, dtype)``: the weight this path's output approximates;
- ``approximate`` and ``error_bound``: relative L2 bound of ``linear`` against the float64 product of the
  exactly dequantized weight, the number the parametrized tests hold each path to.

Settings that benchmarks and tests vary live in each path's ``settings`` dataclass, not module globals.
Add a path: docs/EXTENDING.md.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ... import state
from ...logs import log_once
from .. import nvfp4_ref as ref

#: reused per-call buffers of the kernel paths, one set per (device, dtype, ...) key; freed on model unload
WORK_BUFFERS = state.Store("kernel_work_buffers",
                           describe=lambda d: {"buffers": len(d), "bytes": _buffer_bytes(d)})
#: side CUDA streams of the tiled exact strategy, one per device
SIDE_STREAMS = state.Store("kernel_side_streams")
#: kernel calls that failed to build or launch, (path, what, rows class, N, K, dtype) -> "Type: first line";
#: such a layer shape runs its fallback without trying the kernel again (cleared: tried again)
KERNEL_FAILURES = state.Store("kernel_failures", describe=lambda d: {"entries": len(d),
                                                                     "failures": {repr(k): v for k, v in d.items()}})


def _buffer_bytes(d: dict) -> int:
    n = 0
    for v in d.values():
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            n += t.numel() * t.element_size()
    return n


@dataclass
class PackedNVFP4:
    """One NVFP4 linear weight in ComfyUI's native storage (docs/h3-facts.md, "NVFP4 storage layout").

    qdata: uint8 [Np, Kp/2] (Np = roundup(N,16), Kp = roundup(K,16); element 2j in the HIGH nibble).
    block_scale: float8_e4m3fn [roundup(Np,128), roundup(Kp/16,4)], cuBLAS to_blocked layout.
    global_scale: fp32 scalar tensor (``weight_scale_2``). out_features N, in_features K.
    """
    qdata: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    out_features: int
    in_features: int

    def validate(self, where: str = "PackedNVFP4") -> None:
        """Raise ValueError naming the field and the expected shape/dtype."""
        n, k = self.out_features, self.in_features
        rnd = ref.fmt.roundup
        if self.qdata.dtype != torch.uint8 or self.qdata.dim() != 2:
            raise ValueError(f"{where}: qdata must be a 2-D uint8 tensor, got {self.qdata.dtype} "
                             f"{tuple(self.qdata.shape)}")
        np_, kh = self.qdata.shape
        if k % 16 or np_ < n or np_ % 16 or kh * 2 != rnd(k, 16):
            raise ValueError(f"{where}: qdata shape {tuple(self.qdata.shape)} does not hold a [{n}, {k}] "
                             f"NVFP4 weight (expected [{rnd(n, 16)}, {rnd(k, 16) // 2}], K % 16 == 0)")
        exp = (rnd(np_, 128), rnd(kh * 2 // 16, 4))
        if self.block_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"{where}: block_scale must be float8_e4m3fn, got {self.block_scale.dtype}")
        if tuple(self.block_scale.shape) != exp:
            raise ValueError(f"{where}: block_scale shape {tuple(self.block_scale.shape)} != swizzled {exp}")
        if self.global_scale.numel() != 1:
            raise ValueError(f"{where}: global_scale (weight_scale_2) must be a scalar, "
                             f"got shape {tuple(self.global_scale.shape)}")

    def check_finite_scales(self) -> None:
        """ValueError when a block scale byte is an e4m3 NaN (0x7f/0xff)."""
        if ref.fmt.bad_scale_counts(self.block_scale)[0]:
            raise ValueError("NVFP4 block_scale (weight_scale) holds NaN bytes (0x7f/0xff)")


@dataclass
class PreparedPacked:
    """A path that keeps the packed NVFP4 tensors as they are (no load-time re-expression)."""

    packed: PackedNVFP4

    @property
    def out_features(self) -> int:
        return self.packed.out_features

    @property
    def in_features(self) -> int:
        return self.packed.in_features


# --------------------------------------------------------------------------- device capabilities
# Module-level functions (not methods) so tests can replace them with monkeypatch on this module.

def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def cuda_major() -> int:
    v = torch.version.cuda
    return int(v.split(".")[0]) if v else 0


def has_ck_fp4() -> bool:
    try:
        import comfy_kitchen as ck  # noqa: F401
        return hasattr(ck, "scaled_mm_nvfp4")
    except Exception:  # noqa: BLE001
        return False


@functools.lru_cache(maxsize=None)
def probe_fp8(device_index: int) -> tuple[bool, str]:
    """Run a tiny rowwise ``torch._scaled_mm`` on the device; (works, reason)."""
    try:
        dev = torch.device("cuda", device_index)
        a = torch.ones(16, 32, device=dev).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=dev).to(torch.float8_e4m3fn)
        sa = torch.ones(16, 1, device=dev)
        sb = torch.ones(1, 16, device=dev)
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        ok = bool((out.float() == 32).all())
        return ok, "rowwise torch._scaled_mm works" if ok else "torch._scaled_mm gave wrong values"
    except Exception as e:  # noqa: BLE001 - any failure means "no fp8 here"
        return False, f"torch._scaled_mm (fp8 rowwise) failed: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- shared buffers

def scratch(device, dtype, numel: int) -> torch.Tensor:
    """A flat reusable buffer of >= numel elements per (device, dtype) for the per-call weight (grown to the
    largest layer; zero-filled when allocated so unused fp8 rows stay finite). Logged once per size."""
    key = ("scratch", str(device), dtype)
    with WORK_BUFFERS.lock:
        buf = WORK_BUFFERS.data.get(key)
        if buf is None or buf.numel() < numel:
            WORK_BUFFERS.data.pop(key, None)
            buf = torch.zeros(numel, device=device, dtype=dtype)
            WORK_BUFFERS.data[key] = buf
            log_once(("scratch", key, numel), "H3 Turbo: per-call weight buffer %s %s: %.0f MiB (one per device and "
                     "dtype, reused by every layer)", device, dtype, numel * buf.element_size() / 2**20)
    return buf[:numel]


def release_work_buffers() -> int:
    """Drop every reused per-call buffer (allocated again at the next call that needs it); bytes released."""
    with WORK_BUFFERS.lock:
        n = _buffer_bytes(WORK_BUFFERS.data)
        WORK_BUFFERS.data.clear()
    return n


# --------------------------------------------------------------------------- kernel build / launch failures

def rows_class(m: int) -> int:
    """The power of two >= m (at least 16, at most 8192) that a kernel's tile choice depends on (autotuning key)."""
    b = 16
    while b < m and b < 8192:
        b *= 2
    return b


def is_kernel_failure(e: BaseException) -> bool:
    """True for what a kernel's build or launch raises (Triton / MLIR / ptxas / CUDA driver errors); False for the
    errors the pack raises on purpose (ValueError, TypeError: bad inputs) and for out-of-memory, which propagate."""
    return isinstance(e, Exception) and not isinstance(e, (ValueError, TypeError, torch.OutOfMemoryError))


def first_line(e: BaseException) -> str:
    """``Type: first non-empty line of the message`` (a compiler's full text stays out of the log)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def run_kernel(path: str, what: str, x2d: torch.Tensor, n: int, k: int, call, fallback, fallback_name: str):
    """``call()``; when it fails to build or launch (:func:`is_kernel_failure`), ``fallback()`` instead, for this call
    and every later one of the same (path, what, rows class, N, K, dtype), logged once as a WARNING naming the path,
    the shape, the error's first line and ``fallback_name``. Other errors propagate unchanged."""
    key = (path, what, rows_class(x2d.shape[0]), n, k, str(x2d.dtype).replace("torch.", ""))
    with KERNEL_FAILURES.lock:
        failed = key in KERNEL_FAILURES.data
    if not failed:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - classified below; anything else is re-raised as it was
            if not is_kernel_failure(e):
                raise
            why = first_line(e)
            with KERNEL_FAILURES.lock:
                KERNEL_FAILURES.data[key] = why
            log_once(("kernel_failure",) + key,
                     "H3 Turbo %s path: %s failed to build or launch for %d rows (class <= %d) x N=%d x K=%d %s (%s); "
                     "this layer shape runs %s from now on", path, what, x2d.shape[0], key[2], n, k, key[5], why,
                     fallback_name, level=logging.WARNING)
    return fallback()


# --------------------------------------------------------------------------- the interface

class ComputePath:
    """Base class of the compute paths (see the module docstring for the contract)."""

    name: ClassVar[str]
    #: output differs from the exactly dequantized weight's GEMM by more than bf16 rounding
    approximate: ClassVar[bool] = False
    #: relative L2 error bound of ``linear`` vs the float64 product with the exact NVFP4 weight (tests)
    error_bound: ClassVar[float] = 1e-2
    #: a GPU kernel path (needs bf16/fp16 CUDA inputs; others run the eager reference, logged once)
    kernel: ClassVar[bool] = True
    #: the weight storage the path computes from: "nvfp4" (ComfyUI-native NVFP4, the NVFP4 loader) or another
    #: loader's format (``int8_block128``: the DMD loader's W8A8); ``reference`` serves every format
    weight_format: ClassVar[str] = "nvfp4"
    #: ``prepare(lean=True)`` keeps less than ``prepare()`` (the loader's ``weights`` input matters)
    has_lean_mode: ClassVar[bool] = False
    settings: Any = None

    def supports(self, device: torch.device) -> tuple[bool, str]:
        raise NotImplementedError

    def prepare(self, packed: PackedNVFP4, lean: bool = False):
        return PreparedPacked(packed)

    def reference_weight(self, prepared, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in ``dtype`` that this path's prepared object holds (the exact dequant)."""
        p = prepared.packed
        return ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, p.out_features, p.in_features, dtype)

    def takes(self, x2d: torch.Tensor) -> bool:
        return not self.kernel or (x2d.device.type == "cuda" and x2d.dtype in (torch.bfloat16, torch.float16))

    def linear(self, x2d: torch.Tensor, prepared) -> torch.Tensor:
        if not self.takes(x2d):
            log_once(("fallback", self.name, str(x2d.dtype), x2d.device.type),
                     "H3 Turbo %s path: input %s on %s is not supported by the kernels; using the reference "
                     "dequantize + F.linear for such inputs", self.name, x2d.dtype, x2d.device.type,
                     level=logging.WARNING)
            return F.linear(x2d, self.reference_weight(prepared, x2d.dtype))
        return self.guarded_linear(x2d, prepared)

    def guarded_linear(self, x2d: torch.Tensor, prepared) -> torch.Tensor:
        """:meth:`kernel_linear`, or the reference computation where its kernel fails to build or launch for this
        layer shape (:func:`run_kernel`)."""
        return run_kernel(self.name, "linear", x2d, prepared.out_features, prepared.in_features,
                          lambda: self.kernel_linear(x2d, prepared),
                          lambda: F.linear(x2d, self.reference_weight(prepared, x2d.dtype)),
                          "the reference computation (dequantize + F.linear)")

    def kernel_linear(self, x2d: torch.Tensor, prepared) -> torch.Tensor:
        return F.linear(x2d, self.reference_weight(prepared, x2d.dtype))

    def lora(self, x2d: torch.Tensor, prepared, lora: "LoRAOperands"):
        """(y2d, route) with base + LoRA computed together, or None for the unfused branch."""
        return None

    def prepared_bytes(self, shapes: list[tuple[int, int]], lean: bool = False) -> int:
        return 0

    def workspace_bytes(self, shapes: list[tuple[int, int]], act_bytes: int = 2) -> int:
        return 0


@dataclass
class LoRAOperands:
    """A Turbo LoRA target in the form the paths take: A [blocks*r, K] and Bc [N, r] in x's dtype (Bc
    contiguous), ``scale`` = strength * alpha / rank, ``nb`` = N / blocks output rows per block,
    ``amax_a`` optional fp32 [blocks*r] (max |A| per row), ``fold_key`` identifies target and strength
    (fp8: the fold stays in the layer's weight slot until another key is needed)."""
    a: torch.Tensor
    bc: torch.Tensor
    scale: float
    nb: int
    amax_a: torch.Tensor | None = None
    fold_key: Any = None
