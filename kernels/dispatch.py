"""The one interface the runtime uses to run an NVFP4 linear on a compute path.

Each path (``reference``, ``exact``, ``fp8``, ``blackwell_fp4``) is a module in ``kernels/paths/``; the
registry (:mod:`.registry`) orders and resolves them. This module adds what is common to every path:

- :func:`resolve_compute` (the registry's :func:`~.registry.resolve`);
- :func:`prepare`: validate the packed storage, then the path's load-time work;
- :func:`linear`: ``y = x @ W^T (+ bias)`` for x [..., K], returning [..., N] in x.dtype;
- :func:`linear_with_lora`: ``base(x) (+ bias) + scale * B(A(x))`` with a block-diagonal qkv LoRA as
  ``qkv_blocks`` rank-r products (formula: docs/h3-facts.md, "Turbo LoRA"); the branch sees x itself,
  never a smoothed x. A path computes base and LoRA together where it can (weight-side fold, fused
  epilogue); otherwise the unfused branch here adds ``h = A(x)`` and ``addmm_`` per block. Every call
  counts its route in :data:`LORA_ROUTES`. The NVFP4 storage is never modified. A path's combined kernel
  that fails to build or launch for a shape sends that shape to the unfused branch, logged once
  (:func:`.paths.base.run_kernel`);
- :func:`lora_reference`: the float64 reference of the above (tests, benchmarks);
- memory: :func:`prepared_bytes`, :func:`workspace_bytes`, :func:`release_workspace`.

Errors: an impossible or unknown compute path raises :class:`h3_turbo.errors.NoCapablePathError`
(never a silent fallback); shape mismatches raise ValueError. Inputs the kernels do not take (fp32,
CPU) run the reference computation, logged once; so does a layer shape whose kernel fails to build or
launch (the compiler's text never becomes the user's error).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import state
from . import nvfp4_ref as ref
from . import registry
from .paths.base import LoRAOperands, PackedNVFP4, PreparedPacked, release_work_buffers, run_kernel
from .paths.exact import PreparedExact
from .paths.fp8 import PreparedFP8

__all__ = ["PackedNVFP4", "PreparedPacked", "PreparedExact", "PreparedFP8", "LORA_ROUTES", "resolve_compute",
           "prepare", "linear", "linear_with_lora", "lora_reference", "prepared_bytes", "workspace_bytes",
           "release_workspace"]

#: how linear_with_lora computed each call, by route (diagnostics, benchmarks, tests): "fused_epilogue",
#: "full_fold", "tiled_fold", "fp8_slot", "fp8_percall", "fp8_lean_fold", "unfused"
_ROUTES = state.Counters("lora_routes")
LORA_ROUTES = _ROUTES.data


def resolve_compute(requested: str, device: torch.device) -> tuple[str, str]:
    """(path, reason) that ``requested`` ("auto" or a registered path) runs on ``device``: see
    :func:`.registry.resolve`."""
    return registry.resolve(requested, device)


def prepare(packed: PackedNVFP4, path: str, lean: bool = False):
    """Load-time work for ``path``; returns the object :func:`linear` takes. ``lean``: keep no per-layer copy
    (the path derives its weight per call; same output bit for bit). Raises ValueError on malformed storage
    (naming the field) or, for the kernel paths, NaN block scales."""
    packed.validate()
    p = registry.get(path)
    if p.weight_format != "nvfp4" and path != "reference":
        raise registry.NoCapablePathError(f"unknown path {path!r} for NVFP4 weights (it computes from "
                                          f"{p.weight_format} weights; NVFP4 paths: {', '.join(registry.paths_for())})")
    return p.prepare(packed, lean=lean)


def _linear2d(x2d: torch.Tensor, prepared, path: str) -> torch.Tensor:
    if type(prepared) is PreparedPacked and path in ("exact", "fp8"):
        path = "reference"   # a reference-prepared weight runs the reference computation
    return registry.get(path).linear(x2d, prepared)


def linear(x: torch.Tensor, prepared, path: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a prepared NVFP4 weight.

    x: [..., K] bf16/fp16 (other dtypes and CPU tensors run the reference computation, logged once).
    Returns [..., N] in x.dtype. Raises ValueError when x's last dim is not in_features.
    """
    k = prepared.in_features
    if x.shape[-1] != k:
        raise ValueError(f"linear: input last dim {x.shape[-1]} != in_features {k}")
    lead = x.shape[:-1]
    out = _linear2d(x.reshape(-1, k), prepared, path)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, prepared.out_features)


def _lora_blocks(A, B, n, qkv_blocks):
    if A.dim() != 2 or B.dim() != 2:
        raise ValueError(f"LoRA A {tuple(A.shape)} and B {tuple(B.shape)} must both be 2-D ([R, K] and [N, R])")
    if qkv_blocks not in (1, 3):
        raise ValueError(f"qkv_blocks must be 1 or 3, got {qkv_blocks}")
    rt = A.shape[0]
    if rt % qkv_blocks:
        raise ValueError(f"LoRA A has {rt} rows, not divisible by qkv_blocks={qkv_blocks}")
    r = rt // qkv_blocks
    if n % qkv_blocks:
        raise ValueError(f"out_features {n} not divisible by qkv_blocks={qkv_blocks}")
    nb = n // qkv_blocks
    if B.shape[0] != n or B.shape[1] not in (r, rt):
        raise ValueError(f"LoRA B shape {tuple(B.shape)}: expected [{n}, {rt}] (block-diagonal) or [{n}, {r}]")
    if B.shape[1] == r:
        bc = B
    else:  # diagonal blocks of the block-diagonal up matrix
        bc = torch.cat([B[i * nb:(i + 1) * nb, i * r:(i + 1) * r] for i in range(qkv_blocks)], 0)
    return r, nb, bc


def linear_with_lora(x: torch.Tensor, prepared, path: str, A: torch.Tensor, B: torch.Tensor, scale: float,
                     qkv_blocks: int = 1, bias: torch.Tensor | None = None,
                     amax_a: torch.Tensor | None = None, fold_key=None) -> torch.Tensor:
    """base(x) (+ bias) + scale * B(A(x)) with a block-diagonal qkv LoRA as ``qkv_blocks`` rank-r products.

    A: lora_down [qkv_blocks*r, K]; B: lora_up [N, qkv_blocks*r] block-diagonal (off-diagonal blocks are
    ignored) or compact [N, r] (block i of N/qkv_blocks rows uses h[:, i*r:(i+1)*r]); scale: alpha/r
    times strength; amax_a: optional fp32 [qkv_blocks*r] = max |A| per row (the caller's cache; fp8 fold);
    fold_key: identifies the adapter target (fp8 keeps the fold in its weight slot until another key).
    Which route a path takes: its module's docstring (``kernels/paths/``). Returns [..., N] in x.dtype.
    Raises ValueError on shape mismatches.
    """
    n, k = prepared.out_features, prepared.in_features
    if x.shape[-1] != k or A.shape[1] != k:
        raise ValueError(f"linear_with_lora: x {tuple(x.shape)} / A {tuple(A.shape)} do not match in_features {k}")
    r, nb, bc = _lora_blocks(A, B, n, qkv_blocks)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    a = A.to(x2d.dtype)
    bc = bc.to(x2d.dtype).contiguous()
    out = None
    p = registry.get(path)
    if p.kernel and p.takes(x2d):
        ops = LoRAOperands(a, bc, float(scale), nb, amax_a, fold_key)
        got = run_kernel(path, "base + LoRA", x2d, n, k, lambda: p.lora(x2d, prepared, ops), lambda: None,
                         "the unfused LoRA branch")
        if got is not None:
            out, route = got
            _ROUTES.incr(route)
    if out is None:
        _ROUTES.incr("unfused")
        h = F.linear(x2d, a)                                             # [M, blocks*r]
        out = _linear2d(x2d, prepared, path)
        for i in range(qkv_blocks):
            out[:, i * nb:(i + 1) * nb].addmm_(h[:, i * r:(i + 1) * r], bc[i * nb:(i + 1) * nb].t(),
                                               alpha=float(scale))
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, n)


def lora_reference(x, packed_or_prepared, A, B, scale, qkv_blocks: int = 1, path: str | None = None) -> torch.Tensor:
    """Unfused float64 reference of base + scale * B(A(x)) (tests, benchmarks): [..., N] float64. For a
    prepared weight, ``path`` names its compute path (default: guessed from the prepared type)."""
    p = packed_or_prepared
    if isinstance(p, PackedNVFP4):
        w = ref.dequant_fp64(p.qdata, p.block_scale, p.global_scale, p.out_features, p.in_features)
    else:
        if path is None:
            path = "exact" if isinstance(p, PreparedExact) else "fp8" if isinstance(p, PreparedFP8) else "reference"
        w = registry.get(path).reference_weight(p, torch.float32).double()
    n = w.shape[0]
    r, nb, bc = _lora_blocks(A, B, n, qkv_blocks)
    xd = x.reshape(-1, x.shape[-1]).double()
    out = xd @ w.t()
    h = xd @ A.double().t()
    for i in range(qkv_blocks):
        out[:, i * nb:(i + 1) * nb] += scale * (h[:, i * r:(i + 1) * r] @ bc[i * nb:(i + 1) * nb].double().t())
    return out.reshape(*x.shape[:-1], n)


def prepared_bytes(shapes: list[tuple[int, int]], path: str, lean: bool = False) -> int:
    """GPU bytes :func:`prepare` adds per model for ``path`` beside the packed weights (shapes: logical
    [N, K] of every NVFP4 layer; ``lean``: the lean weight mode)."""
    return registry.get(path).prepared_bytes(shapes, lean=lean)


def workspace_bytes(shapes: list[tuple[int, int]], path: str, act_bytes: int = 2) -> int:
    """GPU bytes of the per-process buffers ``path`` reuses across layers (allocated at first use, kept until
    :func:`release_workspace`). ``act_bytes``: bytes per activation element (bf16/fp16: 2). The buffers are
    shared by every model of the process and freed when a model using them is unloaded; each model counts
    them, so two H3 models loaded at once over-reserve."""
    return registry.get(path).workspace_bytes(shapes, act_bytes)


def release_workspace() -> int:
    """Drop the reused per-call buffers of every device (allocated again at the next call that needs them);
    returns the bytes released. Called when ComfyUI unloads a model that uses the kernels."""
    return release_work_buffers()
