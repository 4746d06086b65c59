"""The Turbo LoRA as a runtime branch beside the (bf16 / NVFP4 / INT8) base projections.

For every target projection P (208 on the full H3):

    y = P(x) + strength * (alpha / rank) * B @ (A @ x)        (docs/h3-facts.md#turbo-lora-layout, #lora-on-quantized-layers)

``x`` is the activation ENTERING the layer: the branch wraps ``P.forward`` from outside (an instance
attribute, as core's ``comfy/weight_adapter/bypass.py`` does), so smoothing applied inside the layer's
own forward (``pre_quant_scale``, NVFP4 input quantization) never reaches the branch, and the base
weights are never merged or touched.

Numerics: operands bf16 (the adapter's dtype), or fp32 when the activation is fp32 (CPU runs); the
GEMMs accumulate in fp32 (torch's bf16 GEMMs do); the second GEMM adds into y in its epilogue
(``addmm_``, beta=1, alpha=strength*alpha/rank: one rounding of y + delta in y's dtype). Fused qkv
with block-diagonal B runs as three rank-r products written into the Q/K/V column slices of y
(strided GEMM output: no rank-3r product, no [s, 3*inner] temporary).

Fused route: when the wrapped layer is one of the pack's NVFP4 layers running a GPU kernel path (it
implements ``runtime.layer.FusedLoRALinear``), nothing wrapped its forward
before us, the layer accepts the call (``h3turbo_fusable``: GPU kernel path, no patch/offload, no
``pre_quant_scale``) and the adapter tensors are on the activation's device, base + branch are computed together by
``kernels.dispatch.linear_with_lora``: the same formula with the update folded into the per-call weight
(``exact``) or kept folded in the layer's e4m3 weight until the adapter/strength changes (``fp8``). Otherwise
(or if the layer still answers None) the unfused route below runs. Either route counts the target for the
coverage checks.

MLP-level fc2 (docs/h3-facts.md#lora-on-quantized-layers, #newer-core): core's ``comfy.ops.linear_input_act``
computes ``fc2(swiglu(fc1(x)))`` without calling ``fc2.forward`` for INT8 tensor-wise weights (comfy-kitchen's
fused kernel) and, in newer cores, for plain weights on its fp16 fast path (``runtime.core_compat``). For such
blocks the fc2 branch is applied at the MLP level instead: the MLP's forward is wrapped, the fc1
output (with its own branch) is captured by the fc1 wrapper, and the branch adds
``B2 @ (A2 @ swiglu(h))`` (core's ``INPUT_ACT_EAGER["swiglu"]``) to the MLP output. This is the same
input fc2 sees on every path. Cost: the swiglu activation is materialized for the branch.

Coverage: every wrapper counts its executions; :meth:`TurboBranch.check_coverage` raises naming the
targets that did not run (a foreign patch took over a layer's forward, injection skipped...).

No ComfyUI import at module level (comfy is imported lazily for the INT8 activation and injections).
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch
import torch.nn.functional as F

from ..errors import CoverageError as TurboCoverageError
from ..logs import log_once
from ..runtime.core_compat import fc2_bypass_reason
from ..runtime.layer import fusable_check

log = logging.getLogger("h3_turbo")

_MISSING = object()
_SHOW = 8




class TargetParams(torch.nn.Module):
    """Adapter tensors of one target as parameters (so ComfyUI's ModelPatcher can move/count them).

    ``A`` [R, in]; ``B0`` [out, R] or ``B0..B2`` [out/3, R/3] (block-diagonal qkv). ``coef`` = alpha/rank.
    """

    def __init__(self, A: torch.Tensor, Bs: list[torch.Tensor], coef: float, out_features: int):
        super().__init__()
        self.A = torch.nn.Parameter(A, requires_grad=False)
        for j, b in enumerate(Bs):
            setattr(self, f"B{j}", torch.nn.Parameter(b, requires_grad=False))
        self.splits = len(Bs)
        self.coef = float(coef)
        self.out_features = int(out_features)
        self.in_features = int(A.shape[1])
        self.rank = int(A.shape[0])

    def bs(self) -> list[torch.Tensor]:
        return [getattr(self, f"B{j}") for j in range(self.splits)]


class AdapterModule(torch.nn.Module):
    """All targets of one Turbo LoRA, bf16, as an nn.Module (for ComfyUI memory management).

    ``targets``: ordered target names; ``get(target)`` -> TargetParams.
    """

    def __init__(self, lora):
        super().__init__()
        self.targets: list[str] = list(lora.targets.keys())
        self.params = torch.nn.ModuleDict()
        for t, tl in lora.targets.items():
            self.params[t.replace(".", "__")] = TargetParams(tl.A, tl.b_parts(), tl.scale, tl.B.shape[0])
        self.nbytes = sum(p.numel() * p.element_size() for p in self.parameters())

    def get(self, target: str) -> TargetParams:
        return self.params[target.replace(".", "__")]

    def shapes(self) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
        """{target: ((R, in), (out, R))} in canonical fused form."""
        return {t: ((p.rank, p.in_features), (p.out_features, p.rank)) for t in self.targets
                for p in [self.get(t)]}

    def param_device(self) -> torch.device:
        """Where the adapter tensors are now (ComfyUI's ModelPatcher sets a `device` attribute on the module)."""
        return next(self.parameters()).device


def _cast(t: torch.Tensor, device, dtype) -> torch.Tensor:
    if t.device == device and t.dtype == dtype:
        return t
    return t.to(device=device, dtype=dtype, non_blocking=True)


def operand_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 when the activation is fp32 (CPU runs), else bf16 (the adapter's own dtype)."""
    return torch.float32 if x.dtype == torch.float32 else torch.bfloat16


def apply_branch_(y: torch.Tensor, x: torch.Tensor, p: TargetParams, coef: float) -> torch.Tensor:
    """``y += coef * B @ (A @ x)`` in place; returns y.

    x [..., in] (any float dtype), y [..., out] (the base output). ``coef`` = strength * alpha / rank.
    When y has the operand dtype and is contiguous, the add is fused into the second GEMM
    (``addmm_``, beta=1: fp32 accumulation of y + coef*B@t, one rounding), writing straight into y's
    Q/K/V column slices for block-diagonal qkv (strided output, no temporary). Else: temporary + ``add_``.
    """
    op = operand_dtype(x)
    dev = x.device
    t = F.linear(x if x.dtype == op else x.to(op), _cast(p.A, dev, op))
    bs = [_cast(b, dev, op) for b in p.bs()]
    n = len(bs)
    r = t.shape[-1] // n
    o = y.shape[-1] // n
    if y.dtype == op and y.is_contiguous():
        y2 = y.view(-1, y.shape[-1])
        t2 = t.reshape(-1, t.shape[-1])
        if n == 1:
            y2.addmm_(t2, bs[0].t(), alpha=coef)
        else:
            for j, b in enumerate(bs):
                y2[:, j * o:(j + 1) * o].addmm_(t2[:, j * r:(j + 1) * r], b.t(), alpha=coef)
        return y
    if n == 1:
        y.add_(F.linear(t, bs[0]), alpha=coef)
        return y
    for j, b in enumerate(bs):
        y[..., j * o:(j + 1) * o].add_(F.linear(t[..., j * r:(j + 1) * r], b), alpha=coef)
    return y


def fused_operands(p: TargetParams, x: torch.Tensor):
    """(A, Bc, amax_a, key) for a fused layer call (``h3turbo_lora_forward`` of the loader's layers), or None when the
    adapter tensors are not on x's device (ComfyUI offloaded them: the unfused branch casts per call instead).

    A [R, in] and Bc [out, R/splits] (the diagonal blocks of a block-diagonal qkv B stacked; B0 itself when
    splits == 1) in x's dtype (bf16/fp16; else the operand dtype); amax_a fp32 [R] = max_k |A[r, k]| (the fp8 fold's row-scale bound); key
    names these tensors (a weak reference to ``p`` and their storage) for the fp8 path's folded-weight slot.
    Cached on ``p`` per (device, dtype, storage): one extra [out, R/3] copy for qkv targets, [R] floats otherwise.
    """
    if p.A.device != x.device:
        p.__dict__.pop("_h3_fused", None)   # the adapter moved off this device: keep no copies of it here
        return None
    op = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else operand_dtype(x)
    bs = p.bs()
    key = (x.device, op, p.A.data_ptr(), tuple(b.data_ptr() for b in bs))
    c = p.__dict__.get("_h3_fused")
    if c is not None and c[0] == key:
        return c[1]
    a = _cast(p.A, x.device, op)
    bc = _cast(bs[0], x.device, op) if len(bs) == 1 else torch.cat([_cast(b, x.device, op) for b in bs], 0)
    bc = bc.contiguous()
    ops = (a, bc, a.abs().amax(dim=1).float(), (weakref.ref(p), a.data_ptr(), bc.data_ptr(), op))
    p.__dict__["_h3_fused"] = (key, ops)
    return ops


def apply_branch_unfused_(y: torch.Tensor, x: torch.Tensor, p: TargetParams, coef: float) -> torch.Tensor:
    """Reference variant of :func:`apply_branch_` with a temporary and ``add_`` (benchmarks/tests)."""
    op = operand_dtype(x)
    t = F.linear(x.to(op), _cast(p.A, x.device, op))
    bs = [_cast(b, x.device, op) for b in p.bs()]
    r, o = t.shape[-1] // len(bs), y.shape[-1] // len(bs)
    for j, b in enumerate(bs):
        y[..., j * o:(j + 1) * o].add_(F.linear(t[..., j * r:(j + 1) * r], b), alpha=coef)
    return y


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    import comfy.ops  # the same eager activation core uses for fc2's input

    return comfy.ops.INPUT_ACT_EAGER["swiglu"](h)


class TurboBranch:
    """The branch of one adapter at one strength, injectable into an H3 ``diffusion_model``.

    ``adapter``: AdapterModule; ``strength``: float; ``name``: alias or file (for messages).
    Counters: ``counts[target]`` = executions since :meth:`reset` (thread-safe enough: one prompt at a
    time). ``mlp_level`` lists fc2 targets applied at the MLP level (INT8 fused path).
    """

    def __init__(self, adapter: AdapterModule, strength: float, name: str = "turbo"):
        self.adapter = adapter
        self.strength = float(strength)
        self.name = name
        self.targets = list(adapter.targets)
        self._index = {t: i for i, t in enumerate(self.targets)}
        self.counts = [0] * len(self.targets)
        self.run_counts = [0] * len(self.targets)
        # targets that must run inside EVERY diffusion-model call: the DiT blocks. The token refiner runs
        # once per sampling run when core's extra_conds refines the text (model_base MiniMaxH3), so it is
        # checked per run (check_run_coverage).
        self.call_targets = [t for t in self.targets if not t.startswith("token_refiner.")]
        self._records: list[tuple] = []  # (module, previous instance attr or _MISSING, our fn)
        self.mlp_level: list[str] = []
        self._lock = threading.Lock()
        self.injected = False
        self._live = [False]
        self.fused_calls = 0  # layer calls whose branch ran fused with the loader's kernel path

    # ---- counters -------------------------------------------------------------------------------
    def reset(self) -> None:
        """Reset the per-model-call counters."""
        self.counts = [0] * len(self.targets)

    def reset_run(self) -> None:
        """Reset the per-call and the per-sampling-run counters."""
        self.counts = [0] * len(self.targets)
        self.run_counts = [0] * len(self.targets)

    def count_of(self, target: str) -> int:
        return self.counts[self._index[target]]

    def missing(self, per_run: bool = False) -> list[str]:
        """Targets with zero executions: all targets since :meth:`reset_run` (``per_run``), else the DiT
        block targets since :meth:`reset`."""
        if per_run:
            return [t for t, c in zip(self.targets, self.run_counts) if c == 0]
        return [t for t in self.call_targets if self.counts[self._index[t]] == 0]

    def check_run_coverage(self) -> None:
        """Raise TurboCoverageError naming every target that did not run during the sampling run."""
        miss = self.missing(per_run=True)
        if miss:
            more = f" (+{len(miss) - _SHOW} more)" if len(miss) > _SHOW else ""
            hint = ""
            if all(t.startswith("token_refiner.") for t in miss):
                hint = (" The token refiner did not run with this model: the text conditioning arrived already "
                        "refined (hidden-size), so the adapter's refiner part was not applied to it.")
            raise TurboCoverageError(
                f"Turbo LoRA {self.name!r}: the branch did not run on {len(miss)} of {len(self.targets)} targets "
                f"during this sampling run [{', '.join(miss[:_SHOW])}{more}].{hint}")

    def check_coverage(self) -> None:
        """Raise TurboCoverageError naming every DiT block target whose branch did not run since :meth:`reset`."""
        miss = self.missing()
        if miss and len(miss) == len(self.call_targets):
            raise TurboCoverageError(
                f"Turbo LoRA {self.name!r}: no branch ran in this diffusion-model call ({len(miss)} block targets). "
                "The call was served without running the blocks (a denoiser cache such as EasyCache/LazyCache: "
                "Turbo and denoiser caching cannot be combined), or the injection was skipped.")
        if miss:
            more = f" (+{len(miss) - _SHOW} more)" if len(miss) > _SHOW else ""
            raise TurboCoverageError(
                f"Turbo LoRA {self.name!r}: the branch did not run on {len(miss)} of the {len(self.call_targets)} "
                f"DiT-block targets in this model call [{', '.join(miss[:_SHOW])}{more}]. Another node or patch "
                "replaced those layers' forward (or the injection was skipped), so the adapter would be silently incomplete. "
                "Remove the conflicting patch or apply the Turbo LoRA after it.")

    # ---- injection --------------------------------------------------------------------------------
    def _wrap(self, module, fn) -> None:
        prev = module.__dict__.get("forward", _MISSING)
        module.forward = fn
        self._records.append((module, prev, fn))

    def inject(self, diffusion_model) -> None:
        """Wrap every target's forward (idempotent). Targets are validated beforehand (residency.install); a
        missing module raises AttributeError here, after undoing the wrappers already installed."""
        with self._lock:
            if self.injected:
                return
            coef_s = self.strength
            capture: dict[str, dict] = {}
            reasons = {}
            for t in self.targets:
                if t.endswith(".mlp.fc2"):
                    why = fc2_bypass_reason(diffusion_model.get_submodule(t))
                    if why is not None:
                        reasons[t[: -len(".mlp.fc2")]] = why
            mlp_blocks = set(reasons)   # blocks whose fc2 branch runs at the MLP level
            self.mlp_level = [f"{b}.mlp.fc2" for b in sorted(mlp_blocks)]
            self._live = live = [True]  # this injection's wrappers pass through once ejected
            for why in sorted(set(reasons.values())):
                log_once(("turbo_mlp_level", why), "Turbo LoRA %s: %d fc2 layers may be computed by core without "
                         "their forward (%s); their branch is applied at the MLP level", self.name,
                         sum(1 for r in reasons.values() if r == why), why)
            try:
                for t in self.targets:
                    module = diffusion_model.get_submodule(t)
                    p = self.adapter.get(t)
                    idx = self._index[t]
                    coef = coef_s * p.coef
                    block = t.rsplit(".", 2)[0] if t.endswith((".mlp.fc1", ".mlp.fc2")) else None
                    if block in mlp_blocks and t.endswith(".mlp.fc2"):
                        self._inject_mlp_level(diffusion_model, block, p, idx, coef,
                                               capture.setdefault(block, {}), live)
                        continue
                    capt = block in mlp_blocks and t.endswith(".mlp.fc1")
                    slot = capture.setdefault(block, {}) if capt else None
                    # the loader's NVFP4 layers compute base + branch together (kernels.dispatch.linear_with_lora),
                    # but only when nothing else wrapped the layer's forward before us
                    fusable = fusable_check(module)
                    self._wrap(module, self._make_fn(module.forward, p, idx, coef, slot, live, fusable))
            except BaseException:
                self._restore()
                raise
            self.injected = True

    def _make_fn(self, orig, p, idx, coef, slot, live, fusable=None):
        counts_ref = self
        splits = p.splits
        fused = fusable.__self__.h3turbo_lora_forward if fusable is not None else None

        def turbo_lora_forward(x, *args, **kwargs):
            y = None
            if fused is not None and live[0] and not args and not kwargs and fusable(x):
                ops = fused_operands(p, x)
                if ops is not None:
                    y = fused(x, ops[0], ops[1], coef, splits, ops[2], ops[3])
                    if y is not None:
                        counts_ref.fused_calls += 1
            if y is None:
                y = orig(x, *args, **kwargs)
                if not live[0]:
                    return y
                y = apply_branch_(y, x, p, coef)
            counts_ref.counts[idx] += 1
            counts_ref.run_counts[idx] += 1
            if slot is not None:
                slot["h"] = y
            return y

        if fused is not None and slot is None:
            def lora_operands(x):
                """For a caller that computes this layer itself from its own copy of ``x`` (``runtime.fused_block``):
                (A, Bc, coef, blocks, amax_a, key) when the fused route would serve ``x``, else None. The caller
                then calls :func:`count` once it computed base + branch."""
                if not live[0] or not fusable(x):
                    return None
                ops = fused_operands(p, x)
                return None if ops is None else (ops[0], ops[1], coef, splits, ops[2], ops[3])

            def count():
                counts_ref.fused_calls += 1
                counts_ref.counts[idx] += 1
                counts_ref.run_counts[idx] += 1

            turbo_lora_forward.h3turbo_lora_operands = lora_operands
            turbo_lora_forward.h3turbo_count = count
        return turbo_lora_forward

    def _inject_mlp_level(self, dm, block, p, idx, coef, slot, live) -> None:
        mlp = dm.get_submodule(f"{block}.mlp")
        orig = mlp.forward
        counts_ref = self

        def turbo_lora_mlp_forward(x, *args, **kwargs):
            slot.clear()
            out = orig(x, *args, **kwargs)
            h = slot.pop("h", None)
            if h is None or not live[0]:  # fc1 did not go through our wrapper: leave fc2 uncounted -> coverage error
                return out
            counts_ref.counts[idx] += 1
            counts_ref.run_counts[idx] += 1
            return apply_branch_(out, _swiglu(h), p, coef)

        self._wrap(mlp, turbo_lora_mlp_forward)

    def _restore(self) -> int:
        """Put back every forward we wrapped (reverse order) and forget the records; a forward someone else wrapped
        on top of ours stays, with ours inside it passing straight through (``_live`` off). Returns how many."""
        self._live[0] = False
        stuck = 0
        for module, prev, fn in reversed(self._records):
            if module.__dict__.get("forward") is fn:
                if prev is _MISSING:
                    del module.forward
                else:
                    module.forward = prev
            else:
                stuck += 1
        self._records.clear()
        return stuck

    def eject(self) -> None:
        """Restore every wrapped forward (in reverse order). A forward someone else wrapped on top of ours
        is left in place with ours inside it, ours then passing straight through (logged)."""
        with self._lock:
            stuck = self._restore()
            if stuck:
                log.warning("Turbo LoRA %s: %d layer forwards were re-wrapped by another patch after ours; "
                            "ours stay inside them as inert pass-throughs", self.name, stuck)
            self.injected = False

    # ---- ComfyUI glue (lazy imports) -------------------------------------------------------------
    def patcher_injections(self) -> list:
        """[PatcherInjection] for ``ModelPatcher.set_injections`` (inject on load, eject on unload)."""
        from comfy.patcher_extension import PatcherInjection

        def inject(model_patcher):
            self.inject(model_patcher.model.diffusion_model)

        def eject(model_patcher):
            self.eject()

        return [PatcherInjection(inject=inject, eject=eject)]

    def diffusion_model_wrapper(self):
        """A ``WrappersMP.DIFFUSION_MODEL`` wrapper: reset counters, run, check coverage."""

        def h3turbo_lora_coverage(executor, *args, **kwargs):
            self.reset()
            out = executor(*args, **kwargs)
            self.check_coverage()
            return out

        return h3turbo_lora_coverage

    def outer_sample_wrapper(self, on_start=None):
        """A ``WrappersMP.OUTER_SAMPLE`` wrapper: ``on_start(executor)``, reset run counters, sample, check that
        every target (token refiner included) ran during the run. ``executor.class_obj`` is core's guider."""

        def h3turbo_lora_run(executor, *args, **kwargs):
            if on_start is not None:
                on_start(executor)
            self.reset_run()
            out = executor(*args, **kwargs)
            self.check_run_coverage()
            return out

        return h3turbo_lora_run
