"""A per-layer accuracy guard for approximate (8-bit) attention: each attention layer is checked on its first call of
a shape against exact attention on sampled query rows; a layer that fails runs exact attention from then on.

Contract: :class:`LayerGuard` is held by an approximate override (``int8_sage``'s, ``auto8``'s) and by the fused
block's ``int8_sage`` route. Per call the holder asks :meth:`LayerGuard.layer` for the layer (``("block", i)`` when
the caller knows the block index ``i``: the fused blocks, or ``transformer_options["block_index"]`` as other core
models set it; else ``("call", n)``, the n-th attention call of the forward, a forward being recognised by the
identity of its ``transformer_options`` and of their ``sigmas``, which core's sampler sets per model call;
``("call", None)`` without them). :meth:`LayerGuard.runs_exact` says whether the layer failed earlier; :meth:`LayerGuard.check`, on the first call
of a (layer, shape key), computes exact attention (``F.scaled_dot_product_attention`` in the inputs' dtype) for
:data:`ROWS` evenly spaced query rows of every head only and compares the approximate output's rows with it: the
layer fails when a (batch, head)'s cosine is below :data:`COS_MIN` (0.997) or the relative L2 over the sample is above
:data:`REL_L2_MAX` (10 %), or the output is not finite. A failure is logged once per layer (WARNING, the layer and the
numbers); a summary line (INFO, WARNING when a layer runs exact) says how many of the checked layers run 8-bit, once
per forward that checked a layer, at the next forward's first call (:meth:`LayerGuard.summary` gives it at any time).
The holder then runs its exact fallback for that call and every later call of the layer. Torch only.
"""
from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import Hashable

import torch

from ...logs import log, log_once

#: the transformer_options key :meth:`LayerGuard.block_options` sets
BLOCK_KEY = "h3t_attention_block"
COS_MIN = 0.997
REL_L2_MAX = 0.10
ROWS = 256


@dataclass
class Verdict:
    layer: Hashable
    shape: Hashable
    ok: bool
    cos_min: float
    rel_l2: float


def sample_rows(lq: int, n: int = ROWS, device=None) -> torch.Tensor:
    """``min(n, lq)`` evenly spaced query rows of ``lq`` (both ends included), int64."""
    n = max(1, min(int(n), int(lq)))
    return torch.linspace(0, lq - 1, n, device=device).round().long().unique()


def out_rows(out: torch.Tensor, rows: torch.Tensor, heads: int, bhld: bool) -> torch.Tensor:
    """The rows ``rows`` of an attention output in core's layout ([B, H, L, D] with ``bhld``, else [B, L, H*D]) as
    [B, H, r, D]."""
    if bhld:
        return out[:, :, rows]
    b, _, hd = out.shape
    return out[:, rows].view(b, rows.numel(), heads, hd // heads).transpose(1, 2)


def measure(approx_rows: torch.Tensor, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float | None = None) -> tuple[float, float]:
    """(min per-(batch, head) cosine, relative L2) of ``approx_rows`` [B, H, r, D] against exact attention of the
    query rows ``q_rows`` [B, H, r, D] (k/v [B, H, Lk, D]), computed by SDPA in q's dtype; float64 measures. A
    non-finite output gives (nan, inf)."""
    kw = {} if scale is None else {"scale": float(scale)}
    ref = torch.nn.functional.scaled_dot_product_attention(q_rows, k.to(q_rows.dtype), v.to(q_rows.dtype), **kw)
    o = approx_rows.double().flatten(2)
    r = ref.double().flatten(2)
    if not bool(torch.isfinite(o).all()):
        return math.nan, math.inf
    cos = torch.nn.functional.cosine_similarity(o, r, dim=-1)
    den = r.norm()
    rel = float((o - r).norm() / den) if float(den) > 0 else (0.0 if float(o.norm()) == 0 else math.inf)
    return float(cos.min()), rel


class LayerGuard:
    """Per-layer check of an approximate attention backend (module docstring). ``name``: the backend in the logs;
    ``rows``/``cos_min``/``rel_l2_max``: the sample size and bounds. State: ``verdicts`` {(layer, shape):
    :class:`Verdict`}, ``exact`` {layer: the failing :class:`Verdict`}, ``checks`` (number of checks run)."""

    def __init__(self, name: str, rows: int = ROWS, cos_min: float = COS_MIN, rel_l2_max: float = REL_L2_MAX):
        self.name = name
        self.rows = int(rows)
        self.cos_min = float(cos_min)
        self.rel_l2_max = float(rel_l2_max)
        self.verdicts: dict[tuple, Verdict] = {}
        self.exact: dict[Hashable, Verdict] = {}
        self.checks = 0
        self._sigmas = None          # weakref to the current forward's sigmas tensor
        self._options = None         # id() of the current forward's transformer_options
        self._ordinal = 0
        self._new = 0                # verdicts since the last summary line

    # ---- which layer
    def layer(self, transformer_options: dict | None, block_index: int | None = None) -> Hashable:
        """The layer of this call (module docstring); advances the forward's call counter. A new forward: another
        ``sigmas`` tensor or another ``transformer_options`` dict (core builds one per model call). Options made by
        :meth:`block_options` give their block without counting (the fused block counted the call)."""
        to = transformer_options if isinstance(transformer_options, dict) else {}
        tagged = to.get(BLOCK_KEY)
        if block_index is None and isinstance(tagged, int):
            return ("block", tagged)
        sig = to.get("sigmas")
        if isinstance(sig, torch.Tensor):
            cur = self._sigmas() if self._sigmas is not None else None
            if cur is not sig or self._options != id(to):
                if self._new:
                    self.log_summary()
                self._sigmas = weakref.ref(sig)
                self._options = id(to)
                self._ordinal = 0
            n = self._ordinal
            self._ordinal += 1
        else:
            n = None
        if block_index is None:
            bi = to.get("block_index")
            block_index = bi if isinstance(bi, int) and not isinstance(bi, bool) else None
        return ("block", int(block_index)) if block_index is not None else ("call", n)

    @staticmethod
    def block_options(transformer_options: dict, block_index: int) -> dict:
        """A copy of ``transformer_options`` naming block ``block_index`` for the guard of the override it is handed to
        (the fused blocks' attention call through core)."""
        return dict(transformer_options, **{BLOCK_KEY: int(block_index)})

    def runs_exact(self, layer: Hashable) -> bool:
        return layer in self.exact

    def needs_check(self, layer: Hashable, shape: Hashable) -> bool:
        return layer not in self.exact and (layer, shape) not in self.verdicts

    # ---- the check
    def sample(self, lq: int, device=None) -> torch.Tensor:
        """The query rows a check compares (:func:`sample_rows` with ``rows``)."""
        return sample_rows(lq, self.rows, device)

    def check(self, layer: Hashable, shape: Hashable, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              approx_rows: torch.Tensor, scale: float | None = None) -> bool:
        """Check this call: ``q_rows`` / ``approx_rows`` [B, H, r, D] the exact q and the approximate output at the
        rows of :meth:`sample`, k/v [B, H, Lk, D] core's tensors; record and return whether the layer passes. A failure
        is logged once and makes :meth:`runs_exact` true for the layer."""
        cos, rel = measure(approx_rows, q_rows, k, v, scale)
        rows = q_rows.shape[2]
        ok = cos >= self.cos_min and rel <= self.rel_l2_max
        vd = Verdict(layer, shape, ok, cos, rel)
        self.verdicts[(layer, shape)] = vd
        self.checks += 1
        self._new += 1
        if not ok:
            self.exact[layer] = vd
            log_once(("attention_guard", self.name, id(self), layer),
                     "H3 Turbo attention guard (%s): layer %s fails on %s: min per-head cosine %.5f (bound %.3f), "
                     "relative L2 %.2f%% (bound %.0f%%) on %d sampled query rows x every head -> exact attention for "
                     "this layer from now on", self.name, _fmt(layer), shape, cos, self.cos_min, 100 * rel,
                     100 * self.rel_l2_max, rows, level=logging.WARNING)
        return ok

    # ---- reporting
    def layers(self) -> tuple[set, set]:
        """(layers checked, layers running exact)."""
        return {lay for lay, _ in self.verdicts}, set(self.exact)

    def summary(self) -> str:
        seen, ex = self.layers()
        worst = sorted(self.exact.values(), key=lambda vd: vd.cos_min)
        tail = "; exact: " + ", ".join(f"{_fmt(vd.layer)} (cos {vd.cos_min:.4f}, rel L2 {100 * vd.rel_l2:.1f}%)"
                                       for vd in worst) if worst else ""
        return (f"H3 Turbo attention guard ({self.name}): {len(seen) - len(ex)} of {len(seen)} checked attention layers "
                f"run 8-bit{tail}")

    def log_summary(self) -> None:
        log.log(logging.WARNING if self.exact else logging.INFO, "%s", self.summary())
        self._new = 0


def _fmt(layer) -> str:
    kind, n = layer
    return f"{kind} {n}" if n is not None else f"{kind} (no forward info)"
