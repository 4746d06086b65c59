"""The ``auto8`` attention backend (opt-in, approximate): per shape bucket, the fastest 8-bit backend whose output
passes an accuracy gate on the call's own inputs, else ``exact``.

Contract: :class:`Auto8Attention` is a core attention override. On the first call of a shape bucket
(:func:`.exact.shape_key`: device, dtype, B*H, D, next power of two of Lq and Lk) it runs the ``exact`` backend and
every candidate (:data:`CANDIDATES` that are registered and whose ``supports`` accepts the device) on those inputs;
a candidate passes when it ran its own path for the call (its ``calls`` counter moved: a fallback does not count),
its output is finite and its per-head cosine against exact's output is >= ``cos_min`` (0.998) for every head.
Candidates are timed like exact's SDPA candidates (CUDA events, best of 2 after the measured call). The choice,
with each candidate's cosine, time and rejection reason, is cached per bucket and logged once (WARNING when none
passes: exact then runs that bucket). Later calls of the bucket run the chosen backend's override directly. What
the gate measures is one call's inputs: a later call in the same bucket with other statistics is not re-checked by
it; the per-layer guard (``guard``, :mod:`.guard`) then checks each layer on its first call of a shape and runs a
failing layer exact from then on (the candidates run without their own guards).
``calls`` counts the calls an 8-bit candidate ran, ``by_backend`` every call by the backend that ran it.
``exact`` stays what the node's ``auto`` runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ... import state
from ...logs import log, log_once
from . import exact
from .base import AttentionBackend, Tolerance, device_reason, parse_core_call

NAME = "auto8"
#: 8-bit candidates in preference order on ties. cudnn_fp8 is not one: per-tensor e4m3 scales fail the stress corpus'
#: qk_outlier / k_bias / massive / sharp cases (docs/attention.md, "Outlier stress corpus"); it stays an explicit,
#: guarded opt-in backend.
CANDIDATES: tuple[str, ...] = ("int8_sage",)
COS_MIN = 0.998


def head_cosines(out: torch.Tensor, ref: torch.Tensor, heads: int, bhld: bool) -> torch.Tensor:
    """Per-(batch, head) cosine of two attention outputs in core's layout: [B, H, L, D] (``bhld``) or [B, L, H*D]."""
    if not bhld:
        b, l, hd = out.shape
        out = out.view(b, l, heads, hd // heads).transpose(1, 2)
        ref = ref.view(b, l, heads, hd // heads).transpose(1, 2)
    o = out.double().flatten(2)
    r = ref.double().flatten(2)
    return torch.nn.functional.cosine_similarity(o, r, dim=-1).flatten()


@dataclass
class Auto8Choice:
    backend: str                                   # the chosen backend ("exact" when no candidate passed)
    cos_min: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


class Auto8Attention:
    """Core attention override choosing an 8-bit backend per shape bucket (module docstring).

    ``candidates``: {name: override} in preference order (default: the registered :data:`CANDIDATES` whose backend
    ``supports`` the call's device, their process-wide overrides); ``exact_override``: the reference and fallback
    (default: the process-wide exact override); ``timer``: seconds of a callable (default CUDA events, best of 2);
    ``cos_min``: the gate. ``choices``: the cache {shape key: :class:`Auto8Choice`}; ``calls``: counter by backend.
    """

    backend = NAME

    def __init__(self, candidates: dict[str, Callable] | None = None, exact_override: Callable | None = None,
                 timer: Callable[[Callable[[], Any]], float] | None = None, cos_min: float = COS_MIN,
                 devices: Sequence[str] = ("cuda",), guard=None):
        self._candidates = candidates
        self.exact = exact_override if exact_override is not None else exact.exact_override()
        self.timer = timer if timer is not None else exact.cuda_event_timer(reps=2)
        self.cos_min = float(cos_min)
        self.devices = tuple(devices)
        self.choices: dict = {}
        self.guard = guard
        self._unguarded: dict[str, Callable] = {}
        self.calls = 0
        self.by_backend: dict[str, int] = {}

    def candidates(self, device) -> dict[str, Callable]:
        if self._candidates is not None:
            return self._candidates
        from . import registry

        out = {}
        for name in CANDIDATES:
            if name in registry.names():
                b = registry.get(name)
                if b.supports(device)[0]:
                    ov = b.override()
                    if getattr(ov, "guard", None) is not None:      # auto8's own guard checks the layer
                        if name not in self._unguarded:
                            import copy

                            self._unguarded[name] = copy.copy(ov)
                            self._unguarded[name].guard = None
                        ov = self._unguarded[name]
                    out[name] = ov
        return out

    def _choose(self, key, func, args, kwargs, call) -> Auto8Choice:
        heads = int(args[3])
        bhld = bool(kwargs.get("skip_output_reshape", False))
        ref = self.exact(func, *args, **kwargs)
        ch = Auto8Choice("exact")
        for name, ov in self.candidates(call.q.device).items():
            before = getattr(ov, "calls", None)
            try:
                out = ov(func, *args, **kwargs)
            except Exception as e:  # noqa: BLE001
                ch.rejected[name] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                continue
            if before is None or getattr(ov, "calls", before) == before:
                ch.rejected[name] = "did not run its own path for these inputs (fell back)"
                continue
            if not bool(torch.isfinite(out).all()):
                ch.rejected[name] = "non-finite output"
                continue
            cos = float(head_cosines(out, ref, heads, bhld).min())
            ch.cos_min[name] = cos
            del out
            if not cos >= self.cos_min:
                ch.rejected[name] = f"per-head cosine {cos:.5f} < {self.cos_min}"
                continue
            ch.seconds[name] = float(self.timer(lambda ov=ov: ov(func, *args, **kwargs)))
        if ch.seconds:
            order = list(ch.seconds)
            ch.backend = min(order, key=lambda n: (ch.seconds[n], order.index(n)))
        self.choices[key] = ch
        desc = ", ".join(f"{n}: cos {ch.cos_min[n]:.5f}" + (f", {1e3 * ch.seconds[n]:.2f} ms" if n in ch.seconds else "")
                         for n in ch.cos_min)
        rej = "; ".join(f"{n} rejected ({r})" for n, r in ch.rejected.items())
        log.log(logging.INFO if ch.seconds else logging.WARNING,
                "H3 Turbo attention 'auto8' for %s: %s (%s%s%s)", key, ch.backend, desc or "no candidate measured",
                "; " if rej else "", rej)
        return ch

    def __call__(self, func: Callable, *args, **kwargs):
        call = parse_core_call(args, kwargs, self.devices)
        if isinstance(call, str):
            log_once(("attention", NAME, call), "H3 Turbo attention 'auto8': %s -> exact attention", call)
            self.by_backend["exact"] = self.by_backend.get("exact", 0) + 1
            return self.exact(func, *args, **kwargs)
        key = exact.shape_key(call.q, call.k)
        ch = self.choices.get(key)
        if ch is None:
            ch = self._choose(key, func, args, kwargs, call)
            # the measurement already computed exact's output once; run the choice for this call's result
        guard = self.guard
        layer = guard.layer(kwargs.get("transformer_options")) if guard is not None else None
        if ch.backend == "exact" or (guard is not None and guard.runs_exact(layer)):
            self.by_backend["exact"] = self.by_backend.get("exact", 0) + 1
            return self.exact(func, *args, **kwargs)
        out = self.candidates(call.q.device)[ch.backend](func, *args, **kwargs)
        if guard is not None and guard.needs_check(layer, key):
            from .guard import out_rows

            heads = int(args[3])
            rows = guard.sample(call.q.shape[2], call.q.device)
            if not guard.check(layer, key, call.q[:, :, rows], call.k, call.v,
                               out_rows(out, rows, heads, call.skip_output_reshape), call.scale):
                self.by_backend["exact"] = self.by_backend.get("exact", 0) + 1
                return self.exact(func, *args, **kwargs)
        self.by_backend[ch.backend] = self.by_backend.get(ch.backend, 0) + 1
        self.calls += 1
        return out


def auto8_override() -> Auto8Attention:
    """The process-wide ``auto8`` override (:data:`h3_turbo.state.ATTENTION_AUTO8`), with a per-layer
    :class:`.guard.LayerGuard`."""
    from .guard import LayerGuard

    return state.ATTENTION_AUTO8.get(lambda: Auto8Attention(guard=LayerGuard(NAME)))


class Auto8Backend(AttentionBackend):
    """``auto8``: the fastest 8-bit backend passing the accuracy gate per shape bucket; opt-in by name."""

    name = NAME
    summary = ("the fastest 8-bit backend passing the stress corpus (int8_sage, rotated Q/K) whose output keeps a per-head cosine "
               ">= 0.998 against exact on the first call of each shape (measured once, logged); else exact.")
    approximate = True
    fallback = "exact"
    apply_note = (f"auto8 on this MODEL: per shape, the fastest 8-bit attention passing a per-head cosine >= "
                  f"{COS_MIN:.3f} gate against exact (approximate); else exact")
    # the CPU check: int8_sage (Triton interpreted) on CPU tensors, under the gate
    tolerance = Tolerance(rel_l2=0.10, cos_min=0.995, dtype=torch.bfloat16)
    reference_dtype = torch.float32
    cpu_env = {"TRITON_INTERPRET": "1"}

    def supports(self, device):
        dev = torch.device(device)
        return (True, "") if dev.type == "cuda" else (False, device_reason(dev))

    def override(self) -> Auto8Attention:
        return auto8_override()


    def cpu_override(self) -> Auto8Attention:
        """The chooser on CPU tensors: the candidate the CPU override of ``int8_sage`` (needs ``TRITON_INTERPRET=1``),
        reference :func:`.exact.cpu_exact`, a timer that counts wall time, a
        :class:`.guard.LayerGuard` as the process-wide override's."""
        import time

        from . import int8_sage

        def wall(fn):
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

        from .guard import LayerGuard

        return Auto8Attention(candidates={"int8_sage": int8_sage.BACKEND.cpu_override()},
                              exact_override=exact.cpu_exact(), timer=wall, devices=("cpu",), guard=LayerGuard(NAME))


BACKEND = Auto8Backend()
