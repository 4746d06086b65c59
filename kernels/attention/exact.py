"""The ``exact`` attention backend: exact SDPA with the SDPA backend measured fastest on this device.

Contract: :class:`ExactAttention` is a core attention override (``override(func, q, k, v, heads,
**kwargs)``, see :mod:`.base`). For CUDA inputs it handles (no mask, no GQA, one dtype and device) it
measures the exact SDPA candidates (:data:`CANDIDATES`) once per (device, shape bucket, dtype) on the
first real call (:class:`BackendChooser`), caches the fastest one that agrees with the others, and runs
``F.scaled_dot_product_attention`` with it first. All candidates compute softmax(q k^T * scale) v up to
the input dtype's rounding; nothing is quantised. Output: core's layout and q's dtype. Everything else
(every call on the CPU, masks, GQA, ...) goes to core's ``func`` unchanged, each reason logged once.
Why a measurement (core forces FA2 first; cuDNN is faster on Hopper): ``docs/attention.md``.

Torch only (no ComfyUI import): testable on the CPU and importable by the benchmarks.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from ... import state
from ...logs import log, log_once
from .base import AttentionBackend, Tolerance, device_reason, parse_core_call
from .reference import rel_l2

NAME = "exact"

# Exact SDPA candidates, in the order they are tried (and the fallback order behind the winner).
CANDIDATES: tuple[str, ...] = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def default_candidates() -> tuple[str, ...]:
    """:data:`CANDIDATES`, then ``"FA3"`` (FlashAttention-3's bf16 forward, :mod:`.fa3`) when the optional
    ``fa3-fwd`` wheel imports; when it does not, that is logged once (INFO)."""
    from . import fa3

    why = fa3.available()
    if why is None:
        return CANDIDATES + (fa3.NAME,)
    log_once(("attention", NAME, "fa3"), "H3 Turbo attention 'exact': FlashAttention-3 is not a candidate (%s; "
             "optional: pip install h3_turbo[fa3], Hopper GPUs)", why, level=logging.INFO)
    return CANDIDATES


def run_candidate(name: str, q, k, v, scale=None, fallbacks: Sequence[str] = ()) -> torch.Tensor:
    """One exact candidate on [B, H, L, D] inputs: ``"FA3"`` (:func:`.fa3.attention`) or an SDPA backend
    (:func:`sdpa_with` with the SDPA ``fallbacks``)."""
    if name == "FA3":
        from . import fa3

        return fa3.attention(q, k, v, scale=scale)
    return sdpa_with(name, q, k, v, scale=scale, fallbacks=[f for f in fallbacks if f != "FA3"])
DEVICES: tuple[str, ...] = ("cuda",)      # device types the process-wide override takes the SDPA path on


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


class BackendChooser:
    """Measures candidates once per key and caches the fastest one that computes the right thing.

    ``choose(key, candidates, run)``: on the first call for ``key``, for each candidate ``c`` in order:
    ``run(c)`` once (warm-up: compilation, cuDNN plan building). A candidate that raises is rejected;
    so is one whose warm-up output is a tensor holding a NaN or inf. Then ``timer(lambda: run(c))``
    gives its seconds. When two or more candidates returned tensors, their outputs are compared on a
    strided row sample (:func:`output_sample`): a candidate whose relative L2 distance to every other
    one exceeds ``agree_tol`` is rejected as wrong (an SDPA backend can return finite but wrong values:
    ``docs/attention.md``). If no two candidates agree, none is chosen. Returns the usable candidate with the smallest time (first in order on ties), or None.
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


class ExactAttention:
    """Core attention override ``override(func, q, k, v, heads, **kwargs)`` running exact SDPA with the
    fastest backend measured on this device (see module docstring).

    Inputs as core's ``attention_pytorch``: ``skip_reshape=True``: q, k, v [B, heads, L, D];
    otherwise [B, L, heads*D]. Output: [B, Lq, heads*D] (``skip_output_reshape=False``) or
    [B, heads, Lq, D]; dtype of q. Handled: no mask, no GQA, 4-D inputs of one dtype and device.
    Everything else (and every call on a device type not in ``devices``) is passed to core's ``func``
    unchanged, with one INFO log line per reason.

    ``chooser``: shared :class:`BackendChooser` (default: a process-wide one with CUDA-event timing).
    ``candidates``: default :func:`default_candidates` (the SDPA backends, and FlashAttention-3 where installed).
    ``devices``: device types that take the SDPA path (default ``("cuda",)``; tests pass ``("cpu",)``
    with ``candidates=("MATH",)`` to check the layout handling on the CPU).
    ``calls``/``delegated``: counters of calls handled here / passed to ``func``.
    """

    backend = NAME

    def __init__(self, chooser: BackendChooser | None = None, candidates: Sequence[str] | None = None,
                 devices: Sequence[str] = DEVICES):
        self.chooser = chooser if chooser is not None else _default_chooser()
        self._candidates = tuple(candidates) if candidates is not None else None
        self.devices = tuple(devices)
        self.calls = 0
        self.delegated = 0

    @property
    def candidates(self) -> tuple[str, ...]:
        """The candidates measured per shape (:func:`default_candidates` resolved on the first call that takes the
        SDPA path, so a process that never does, e.g. on the CPU, neither imports nor logs FA3)."""
        if self._candidates is None:
            self._candidates = default_candidates()
        return self._candidates

    def _delegate(self, reason: str, func, args, kwargs):
        log_once(("attention", NAME, reason), "H3 Turbo attention 'exact': %s -> core's attention path (%s)",
                 reason, getattr(func, "__name__", func), level=logging.INFO)
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
                                   lambda c: run_candidate(c, q, k, v, scale=scale))
        if best is None:
            return self._delegate("no exact SDPA backend runs these inputs (see the measurement log)",
                                  func, args, kwargs)
        self.calls += 1
        out = run_candidate(best, q, k, v, scale=scale, fallbacks=self.candidates)
        if not call.skip_output_reshape:
            out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
        return out




def _default_chooser() -> BackendChooser:
    """The process-wide chooser (:data:`h3_turbo.state.ATTENTION_CHOOSER`), CUDA-event timing."""
    return state.ATTENTION_CHOOSER.get(lambda: BackendChooser(cuda_event_timer(reps=2)))


def exact_override() -> ExactAttention:
    """The process-wide ``exact`` override (:data:`h3_turbo.state.ATTENTION_EXACT`: one measurement cache
    for every model that uses it)."""
    return state.ATTENTION_EXACT.get(ExactAttention)


def cpu_exact(**kwargs) -> ExactAttention:
    """An :class:`ExactAttention` whose SDPA path runs on the CPU (``MATH``, the only SDPA backend there,
    untimed): the layout handling and the chooser on CPU tensors, for tests and dry benchmark runs."""
    return ExactAttention(chooser=BackendChooser(lambda fn: (fn(), 1.0)[1]), candidates=("MATH",),
                          devices=("cpu",), **kwargs)


class ExactBackend(AttentionBackend):
    """``exact``: :func:`exact_override` on every model; CUDA inputs run SDPA with the measured backend."""

    name = NAME
    summary = ("exact SDPA with the backend measured fastest on this GPU at first use (cuDNN on Hopper); "
               "core's path on CPU.")
    approximate = False
    fallback = "core"
    tolerance = Tolerance(rel_l2=1e-6, cos_min=1.0 - 1e-9, dtype=torch.float32)   # float32 inputs, vs float64

    def supports(self, device):
        dev = torch.device(device)
        return (True, "") if dev.type in DEVICES else (False, device_reason(dev))

    def override(self) -> ExactAttention:
        return exact_override()

    def cpu_override(self) -> ExactAttention:
        return cpu_exact()


BACKEND = ExactBackend()
