"""Per-model attention backends for H3 through core ComfyUI's attention override (issue 9).

Core ComfyUI runs H3's attention (``comfy/ldm/minimax/model.py: Attention.forward``) as
``optimized_attention(q, k, v, heads, mask=None, skip_reshape=True, transformer_options=...)``
with q, k, v wrapped in ``AttentionTensorContainer`` ([1, heads, S, 128] strided views of the
qkv buffer). The ``wrap_attn`` decorator (``comfy/ldm/modules/attention.py``) looks up
``transformer_options["optimized_attention_override"]``, takes the containers and calls
``override(func, q, k, v, heads, **kwargs)`` where ``func`` is core's own attention function and
``kwargs`` still hold ``_inside_attn_wrapper=True`` (so ``func(...)`` never re-enters the override).

On CUDA, core's SDPA path (``comfy.ops.scaled_dot_product_attention``) forces the backend priority
FLASH (PyTorch's FA2) > cuDNN > EFFICIENT > MATH. On Hopper, cuDNN's SDPA is 1.7-1.8x faster at H3
shapes (``shared/bench/anchor_sdpa_backend.json``: 17.8 vs 30.7 ms per block at S = 19 584). The
``exact`` backend here therefore measures the exact SDPA backends once per (device, shape bucket,
dtype) on the first real call, caches the fastest, and runs SDPA with that backend first. All
candidates compute the same function (softmax(q k^T * scale) v) up to bf16 rounding; nothing is
quantised. On CPU (and for inputs it does not handle) it calls core's ``func`` unchanged.

This module needs only torch (no ComfyUI import), so it is testable on the CPU and importable by
the benchmark on a machine without ComfyUI's package layout.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

log = logging.getLogger("h3_turbo")

# Node backend names. ``auto`` resolves to ``exact`` on every device: the 8-bit backend is approximate,
# so the user opts into it by name. ``int8_sage``: kernels/attention_int8.py (INT8 Q.K, FP8 P.V; on the
# H200 0.78-0.79x exact's time at 19 584 tokens, 0.77x at 37 632, 0.67-0.69x at 109 000, per-head cosine >= 0.9990 vs float32:
# benchmarks/results/bench_attention_int8_h200.md); unsupported inputs run ``exact`` (logged once).
AUTO = "auto"
EXACT = "exact"
SDPA_CORE = "sdpa_core"
INT8_SAGE = "int8_sage"
BACKENDS: tuple[str, ...] = (AUTO, EXACT, SDPA_CORE, INT8_SAGE)

# Exact SDPA candidates, in the order they are tried (and the fallback order behind the winner).
CANDIDATES: tuple[str, ...] = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")

_LOGGED: set[Hashable] = set()


def _log_once(key: Hashable, level: int, msg: str, *args) -> None:
    """``log.log(level, msg, *args)`` the first time ``key`` is seen in this process."""
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    log.log(level, msg, *args)


def resolve_backend(name: str) -> str:
    """Map a node backend name to the one that runs: ``auto`` -> ``exact``; others unchanged.

    Raises ValueError naming the accepted values for an unknown name.
    """
    if name == AUTO:
        return EXACT
    if name not in BACKENDS:
        raise ValueError(f"H3TurboAttention: unknown backend {name!r}; expected one of {list(BACKENDS)}")
    return name


def length_bucket(n: int) -> int:
    """Shape bucket of a sequence length: the next power of two >= n (n >= 1), e.g. 19584 -> 32768."""
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {n}")
    return 1 << (int(n) - 1).bit_length()


def shape_key(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """Cache key of an SDPA call on [B, H, L, D] tensors: (device, dtype, B*H, D, bucket(Lq), bucket(Lk))."""
    b, h, lq, d = q.shape
    return (str(q.device), q.dtype, int(b) * int(h), int(d), length_bucket(lq), length_bucket(k.shape[-2]))


def cuda_event_timer(reps: int = 2) -> Callable[[Callable[[], Any]], float]:
    """Timer for :class:`BackendChooser`: the fastest of ``reps`` runs of ``fn``, in seconds, measured
    with CUDA events on the current stream (the caller has already run ``fn`` once as warm-up)."""

    def timer(fn: Callable[[], Any]) -> float:
        best = math.inf
        for _ in range(reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        return best

    return timer


@dataclass
class Choice:
    """Outcome of one measurement: ``backend`` (None if no candidate is usable), seconds per usable
    candidate, the reason each other candidate was rejected, and each compared candidate's relative L2
    distance to the closest other candidate's output sample."""

    backend: str | None
    seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    distance: dict[str, float] = field(default_factory=dict)


def output_sample(out: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """float32 copy of about ``rows`` evenly strided rows (dim -2) of every head of ``out`` [..., L, D]."""
    stride = max(1, out.shape[-2] // rows)
    return out[..., ::stride, :].float().clone()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 if both are zero, inf if only b is)."""
    num = (a.double() - b.double()).norm().item()
    den = b.double().norm().item()
    return (0.0 if num == 0 else math.inf) if den == 0 else num / den


class BackendChooser:
    """Measures candidates once per key and caches the fastest one that computes the right thing.

    ``choose(key, candidates, run)``: on the first call for ``key``, for each candidate ``c`` in order:
    ``run(c)`` once (warm-up: compilation, cuDNN plan building). A candidate that raises is rejected;
    so is one whose warm-up output is a tensor holding a NaN or inf. Then ``timer(lambda: run(c))``
    gives its seconds. When two or more candidates returned tensors, their outputs are compared on a
    strided row sample (:func:`output_sample`): a candidate whose relative L2 distance to every other
    one exceeds ``agree_tol`` is rejected as wrong. (Exact bf16 SDPA backends agree to ~3e-3 at H3
    shapes; on the H200 PyTorch's EFFICIENT_ATTENTION returned finite but wrong values at S = 109 000,
    0.24 from cuDNN and FA2 in every row, and NaN on other inputs.) If no two candidates agree, none is
    chosen. Returns the usable candidate with the smallest time (first in order on ties), or None.
    Later calls with the same key return the cached choice without running anything. The outcome is
    logged once per key at INFO (at WARNING when a candidate was rejected as wrong or none is usable).
    """

    def __init__(self, timer: Callable[[Callable[[], Any]], float], agree_tol: float = 2e-2):
        self.timer = timer
        self.agree_tol = agree_tol
        self.choices: dict[Hashable, Choice] = {}

    def choose(self, key: Hashable, candidates: Sequence[str], run: Callable[[str], Any]) -> str | None:
        hit = self.choices.get(key)
        if hit is not None:
            return hit.backend
        ch = Choice(None)
        samples: dict[str, torch.Tensor] = {}
        for c in candidates:
            try:
                out = run(c)
                if isinstance(out, torch.Tensor):
                    if not bool(torch.isfinite(out).all()):
                        raise FloatingPointError("non-finite output")
                    samples[c] = output_sample(out)
                del out
                ch.seconds[c] = float(self.timer(lambda c=c: run(c)))
            except Exception as e:  # unsupported shape/dtype/device for this backend, or a bad output
                samples.pop(c, None)
                ch.errors[c] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        wrong = False
        if len(samples) >= 2:
            for c in samples:
                ch.distance[c] = min(rel_l2(samples[c], samples[o]) for o in samples if o != c)
            for c in samples:
                if not ch.distance[c] <= self.agree_tol:
                    wrong = True
                    ch.errors[c] = (f"wrong result: rel. L2 {ch.distance[c]:.3g} from the closest other candidate "
                                    f"(tolerance {self.agree_tol:g}; {1e3 * ch.seconds.pop(c):.2f} ms)")
        if ch.seconds:
            ch.backend = min(ch.seconds, key=lambda c: (ch.seconds[c], list(candidates).index(c)))
        self.choices[key] = ch
        times = ", ".join(f"{c} {1e3 * s:.2f} ms" for c, s in ch.seconds.items())
        errs = "; ".join(f"{c} unusable ({e})" for c, e in ch.errors.items())
        log.log(logging.WARNING if (wrong or ch.backend is None) else logging.INFO,
                "H3 Turbo attention: exact backend for %s: %s (%s%s)", key, ch.backend, times,
                ("; " + errs) if errs else "")
        return ch.backend


def _sdp_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


def sdpa_with(name: str, q, k, v, scale=None, fallbacks: Sequence[str] = ()) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, scale=scale)`` (no mask, not causal) with SDPA backend
    ``name`` (an ``SDPBackend`` member name) first, then ``fallbacks`` in order. With no fallbacks it
    raises RuntimeError if ``name`` cannot run these inputs. q, k, v: [B, H, L, D]; returns [B, H, Lq, D]."""
    from torch.nn.attention import sdpa_kernel

    order = [_sdp_backend(n) for n in (name, *[f for f in fallbacks if f != name])]
    kw = {} if scale is None else {"scale": scale}
    with sdpa_kernel(order, set_priority=True):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False, **kw)


@dataclass
class CoreCall:
    """One call of core's attention, ``func(q, k, v, heads, mask=None, **kwargs)``, as [B, H, L, D] views."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float | None
    skip_output_reshape: bool


def parse_core_call(args: tuple, kwargs: dict, devices: Sequence[str]) -> CoreCall | str:
    """Read the arguments core's ``wrap_attn`` hands an override (``comfy/ldm/modules/attention.py``):
    q, k, v [B, L, heads*D] (or [B, heads, L, D] with ``skip_reshape``), ``heads``, an optional mask.
    Returns the q/k/v as [B, H, L, D] (views wherever the strides allow) with ``scale`` and ``skip_output_reshape``, or, for
    a call an override should hand on, the reason as a string: another call signature, non-tensors, a
    device type not in ``devices``, a mask, grouped-query attention, mixed dtypes/devices, heads < 1, or
    inputs of another rank/width."""
    if len(args) < 4:
        return "non-standard call signature"
    if len(args) > 5:
        return "positional arguments past mask"
    q, k, v, heads = args[:4]
    mask = args[4] if len(args) > 4 else kwargs.get("mask")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "inputs are not tensors"
    if q.device.type not in devices:
        return f"device type {q.device.type!r}"
    if mask is not None:
        return "attention mask given"
    if kwargs.get("enable_gqa", False):
        return "grouped-query attention"
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        return "q/k/v dtype or device differ"
    heads = int(heads)
    if heads < 1:
        return f"heads={heads} (expected >= 1)"
    if kwargs.get("skip_reshape", False):
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            return "skip_reshape inputs are not 4-D"
    else:
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or q.shape[-1] % heads or k.shape[-1] != q.shape[-1] \
                or v.shape[-1] != q.shape[-1]:
            return "inputs are not [B, L, heads*D]"
        dh = q.shape[-1] // heads
        q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, dh).transpose(1, 2) for t in (q, k, v))
    return CoreCall(q, k, v, kwargs.get("scale", None), bool(kwargs.get("skip_output_reshape", False)))


class ExactAttention:
    """Core attention override ``override(func, q, k, v, heads, **kwargs)`` running exact SDPA with the
    fastest backend measured on this device (see module docstring).

    Inputs as core's ``attention_pytorch``: ``skip_reshape=True``: q, k, v [B, heads, L, D];
    otherwise [B, L, heads*D]. Output: [B, Lq, heads*D] (``skip_output_reshape=False``) or
    [B, heads, Lq, D]; dtype of q. Handled: no mask, no GQA, 4-D inputs of one dtype and device.
    Everything else (and every call on a device type not in ``devices``) is passed to core's ``func``
    unchanged, with one INFO log line per reason.

    ``chooser``: shared :class:`BackendChooser` (default: a process-wide one with CUDA-event timing).
    ``devices``: device types that take the SDPA path (default ``("cuda",)``; tests pass ``("cpu",)``
    with ``candidates=("MATH",)`` to check the layout handling on the CPU).
    ``calls``/``delegated``: counters of calls handled here / passed to ``func``.
    """

    backend = EXACT

    def __init__(self, chooser: BackendChooser | None = None, candidates: Sequence[str] = CANDIDATES,
                 devices: Sequence[str] = ("cuda",)):
        self.chooser = chooser if chooser is not None else _default_chooser()
        self.candidates = tuple(candidates)
        self.devices = tuple(devices)
        self.calls = 0
        self.delegated = 0

    def _delegate(self, reason: str, func, args, kwargs):
        _log_once(("delegate", reason), logging.INFO,
                  "H3 Turbo attention 'exact': %s -> core's attention path (%s)", reason,
                  getattr(func, "__name__", func))
        self.delegated += 1
        return func(*args, **kwargs)

    def __call__(self, func: Callable, *args, **kwargs):
        call = parse_core_call(args, kwargs, self.devices)
        if isinstance(call, str):
            return self._delegate(call, func, args, kwargs)
        q, k, v = call.q, call.k, call.v
        b, heads, _, dim_head = q.shape
        scale = call.scale
        best = self.chooser.choose(shape_key(q, k), self.candidates,
                                   lambda c: sdpa_with(c, q, k, v, scale=scale))
        if best is None:
            return self._delegate("no exact SDPA backend runs these inputs (see the measurement log)",
                                  func, args, kwargs)
        self.calls += 1
        out = sdpa_with(best, q, k, v, scale=scale, fallbacks=self.candidates)
        if not call.skip_output_reshape:
            out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
        return out


_CHOOSER: BackendChooser | None = None
_EXACT: ExactAttention | None = None


def _default_chooser() -> BackendChooser:
    global _CHOOSER
    if _CHOOSER is None:
        _CHOOSER = BackendChooser(cuda_event_timer(reps=2))
    return _CHOOSER


def exact_override() -> ExactAttention:
    """The process-wide ``exact`` override (one measurement cache for every model that uses it)."""
    global _EXACT
    if _EXACT is None:
        _EXACT = ExactAttention()
    return _EXACT


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows=None, heads=None,
                        dtype=torch.float32) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in ``dtype`` for q/k/v [1, H, L, D], on a sample: query ``rows``
    (index tensor, default all) of ``heads`` (index tensor, default all). Returns [h, r, D]."""
    hs = torch.arange(q.shape[1], device=q.device) if heads is None else heads
    out = []
    for h in hs.tolist():
        qh = q[0, h] if rows is None else q[0, h, rows]
        s = (qh.to(dtype) @ k[0, h].to(dtype).T) / math.sqrt(q.shape[-1])
        out.append(torch.softmax(s, dim=-1) @ v[0, h].to(dtype))
    return torch.stack(out)


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Per-head cosine (min over heads) and relative L2 of ``out`` [h, r, D] against ``ref`` (same shape)."""
    o = out.double().flatten(1)
    r = ref.double().flatten(1)
    cos = torch.nn.functional.cosine_similarity(o, r, dim=-1)
    return {"cos_min": float(cos.min()), "rel_l2": float((o - r).norm() / r.norm())}

