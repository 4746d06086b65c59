"""A fused H3 DiT block for the ``fp8`` compute path, installed through core's block override (issue 21).

Core's ``MiniMaxH3Model._forward`` runs block i as ``transformer_options["patches_replace"]["dit"][("double_block",
i)](args, {"original_block": ...})`` when that entry exists (``comfy/ldm/minimax/model.py``, ComfyUI 0.33),
with ``args`` = {img, t_emb, mod_segments, rope_freqs, transformer_options}. :func:`apply` puts
:class:`FusedBlockPatch` there on a clone of the MODEL. For a call it serves, the patch computes the block from the
block's own modules (its AdaLN projection, norm weights, the pack's NVFP4 layers on the ``fp8`` path, core's
``optimized_attention`` with the MODEL's attention override) with the fused producers of
:mod:`h3_turbo.kernels.fused` (core's comfy-kitchen q/k RMSNorm + RoPE arithmetic and its copy of v in one launch)::

    mods = block.adaln_proj(t_emb)                                  # 6 x [R, hidden]
    x8, sx = norm_mod(x, norm1, shift_msa, scale_msa)               # one pass: e4m3 + row scales
    qkv = fp8_gemm(x8, sx, W_qkv)                                   # torch._scaled_mm rowwise
    v = qk_norm_rope(qkv, ...); attention(q, k, v)                 # core's rms_rope_split_half_ + v.clone()
    y = fp8_gemm(quant_rows(attn_out), W_out)
    x8, sx = norm_mod(x, norm2, shift_mlp, scale_mlp, residual=(y, gate_msa))   # x += y * gate, in place
    a8, sa = swiglu(fp8_gemm(x8, sx, W_fc1))                         # [gate; up] -> e4m3
    gate_residual_(x, fp8_gemm(a8, sa, W_fc2), gate_mlp)             # x += y * gate, in place

The formula is core's block with the ``fp8`` path's activation quantization moved into the producers; what differs
from the unfused fp8 run is only where bf16 roundings happen (the producers compute in fp32 and quantize once;
both gated residual updates are core's arithmetic bit for bit). Approximate like the ``fp8`` path itself (bounds:
docs/kernels.md, "Fused DiT block").

Served calls: a CUDA bf16/fp16 stream, every projection of the block on compute ``fp8`` and usable by the kernels
(``runtime.ops.kernel_blocker``: NVFP4 weight, no weight patch, no low-VRAM offload, no grad), no
``pre_quant_scale``, norm weights unpatched and on the device, rope given, not training, no forward wrapper on
``attn`` / ``mlp``. Every other call runs the block it replaced (core's, or an entry that was there before: chained,
not overwritten), each reason logged once. A projection whose forward is wrapped (the Turbo LoRA branch, a foreign
patch) gets its input in bf16 through its own forward, logged once, unless the wrapper is the pack's Turbo branch
offering its fused operands: then the adapter is folded into the layer's e4m3 weight slot (the fp8 path's
``fp8_slot`` route) and the pre-quantized input is used (the branch sees the block's unsmoothed activation: the
producer's input is what core would hand the layer).

With the MODEL's attention override the pack's ``int8_sage``, the RMSNorm + RoPE launch also quantizes Q per row and
the K/V statistics follow it (``qk_norm_rope_sage``), the backend's kernel runs here (``sage_attention_prequantized``)
and writes out_proj's e4m3 input (:func:`_sage_route`; faster than core's attention call with that override,
docs/kernels.md).

Across a block boundary: when the entry core calls
for block i + 1 is also a plain fused-block patch, block i returns x without its final gated residual and leaves
(y, gate_mlp) to that patch, whose first producer applies it (``norm_mod(residual=...)``, the arithmetic of
``gate_residual_``, so the same bits) while it normalizes: one read and write of the stream less per boundary. Core's
loop (0.33 and later) hands each block's output straight to the next block's entry. The residual is kept in the
forward's own ``transformer_options`` (concurrent forwards, e.g. CFG halves on several GPUs, have their own); a block
that cannot serve the call applies it first, the last block never leaves one, and within a forward a block or stream
tensor other than the one it was left for is a RuntimeError naming the hook. One left in the dict by a forward that
stopped between two blocks is dropped by the next forward (another ``t_emb``), logged once.

The block's structure is checked once per block at install (:func:`structure_problem`): a mismatch is a
RuntimeError naming the ComfyUI version and the hook. ComfyUI is imported lazily.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from ..kernels import fused as fk
from ..logs import log, log_once

#: the node/API values: ``off`` (core's block everywhere), ``fp8`` (the fused block where it serves)
CHOICES = ("off", "fp8")
HOOK = 'transformer_options["patches_replace"]["dit"][("double_block", i)]'
#: attributes of core's blocks the fused block reads (checked at install)
_BLOCK_ATTRS = ("norm1", "norm2", "attn", "mlp", "adaln_proj")
_ATTN_ATTRS = ("qkv_proj", "q_norm", "k_norm", "out_proj", "heads", "head_dim")
_MLP_ATTRS = ("fc1", "fc2")
#: names core's forwards use (their code objects' co_names): the structure the fused block reproduces
_BLOCK_NAMES = {"adaln_proj", "norm1", "norm2", "_mod_scale_shift", "_mod_gate", "attn", "mlp"}
_ATTN_NAMES = {"qkv_proj", "rms_rope_split_half_", "optimized_attention", "out_proj"}
_MLP_NAMES = {"linear_input_act", "fc1", "fc2"}


def core_version() -> str:
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def _names(fn) -> set[str]:
    code = getattr(fn, "__code__", None)
    return set(code.co_names) if code is not None else set()


def swiglu_problem() -> str | None:
    """None if core's ``INPUT_ACT_EAGER["swiglu"]`` computes silu(first half) * second half (the [gate; up] order
    the fused kernel assumes), else what it computes. Checked on a probe tensor."""
    import comfy.ops

    fn = getattr(comfy.ops, "INPUT_ACT_EAGER", {}).get("swiglu")
    if fn is None:
        return "comfy.ops.INPUT_ACT_EAGER has no 'swiglu'"
    probe = torch.tensor([[-1.5, 0.25, 2.0, 0.5, -3.0, 1.25]], dtype=torch.float32)
    got = fn(probe.clone())
    want = fk.swiglu_ref(probe, torch.float32)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
        return f"INPUT_ACT_EAGER['swiglu'] of {probe.tolist()} is {got.tolist()}, not silu(gate) * up = {want.tolist()}"
    return None


def structure_problem(block) -> str | None:
    """None if ``block`` has the structure the fused block reproduces (core's ``DiTBlock`` of ComfyUI 0.33:
    attributes, the names its forwards use, qkv/fc1 widths, the SwiGLU [gate; up] order), else the first
    difference found."""
    for a in _BLOCK_ATTRS:
        if not hasattr(block, a):
            return f"{type(block).__name__} has no attribute {a!r}"
    for a in _ATTN_ATTRS:
        if not hasattr(block.attn, a):
            return f"block.attn ({type(block.attn).__name__}) has no attribute {a!r}"
    for a in _MLP_ATTRS:
        if not hasattr(block.mlp, a):
            return f"block.mlp ({type(block.mlp).__name__}) has no attribute {a!r}"
    for what, fn, need in (("DiTBlock.forward", type(block).forward, _BLOCK_NAMES),
                           ("Attention.forward", type(block.attn).forward, _ATTN_NAMES),
                           ("MLP.forward", type(block.mlp).forward, _MLP_NAMES)):
        miss = need - _names(fn)
        if miss:
            return f"{what} no longer uses {sorted(miss)}"
    at, mlp = block.attn, block.mlp
    inner = int(at.heads) * int(at.head_dim)
    hidden = block.norm1.weight.shape[0] if getattr(block.norm1, "weight", None) is not None else None
    if at.qkv_proj.out_features != 3 * inner:
        return f"qkv_proj has {at.qkv_proj.out_features} outputs, expected 3 * heads * head_dim = {3 * inner}"
    if at.out_proj.in_features != inner:
        return f"out_proj takes {at.out_proj.in_features} inputs, expected {inner}"
    if mlp.fc1.out_features != 2 * mlp.fc2.in_features:
        return f"fc1 has {mlp.fc1.out_features} outputs, expected 2 * fc2's {mlp.fc2.in_features} inputs"
    if hidden is not None and (at.qkv_proj.in_features != hidden or mlp.fc1.in_features != hidden):
        return f"norm width {hidden} != qkv_proj/fc1 input width {at.qkv_proj.in_features}/{mlp.fc1.in_features}"
    if int(getattr(block.adaln_proj, "expand", 6)) != 6:
        return f"adaln_proj.expand is {block.adaln_proj.expand}, expected 6 chunks"
    return swiglu_problem()


# --------------------------------------------------------------------------- the fp8 path's operands

def _fp8_weight(prepared, device, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8 e4m3 [Npad, K], sw fp32 [1, Npad]) of the ``fp8`` path for this layer: the base weight (lora None) or
    W + s * B @ A (``lora``: :class:`kernels.paths.base.LoRAOperands` with a ``fold_key``), resident or lean:
    ``FP8Path.weight_operands``, the one accessor of the fp8 weight."""
    from ..kernels.paths import fp8

    return fp8.PATH.weight_operands(prepared, device, lora)


def _can_fold(prepared, nb: int) -> bool:
    from ..kernels import triton_nvfp4 as tk
    from ..kernels.paths import fp8

    if not fp8.PATH.settings.lora_fold or getattr(prepared, "packed", None) is None \
            or getattr(prepared, "amax_w", None) is None:
        return False
    return tk.fold_bn(nb) is not None


# --------------------------------------------------------------------------- per-call plan

def _layer_plan(m, x, where: str) -> tuple[str, Any]:
    """How the fused block runs projection ``m`` for stream ``x``: ("fp8", None) the pre-quantized input on the base
    weight; ("fold", hook) the Turbo branch's adapter folded into the weight slot; ("module", why) the layer's own
    forward on a bf16 input; ("core", why) the whole block must run core's."""
    from .ops import kernel_blocker

    if getattr(m, "_h3_path", None) != "fp8":
        return "core", f"{where} is not on compute=fp8 (path {getattr(m, '_h3_path', None)!r})"
    why = kernel_blocker(m, x)
    if why is not None:
        return "core", f"{where}: {why}"
    if getattr(m, "pre_quant_scale", None) is not None:
        return "core", f"{where} has a pre_quant_scale"
    fwd = m.__dict__.get("forward")
    if fwd is None:
        return "fp8", None
    ops_of = getattr(fwd, "h3turbo_lora_operands", None)
    if ops_of is not None:
        return "fold", fwd
    return "module", f"{where}'s forward is wrapped ({getattr(fwd, '__name__', type(fwd).__name__)})"


def _norm_blocker(norm, x, where: str) -> str | None:
    w = getattr(norm, "weight", None)
    if len(getattr(norm, "weight_function", ())) or len(getattr(norm, "bias_function", ())):
        return f"{where} has a weight patch"
    # core's mixed-precision RMSNorm casts its weight per call by class (a no-op for a resident weight of the
    # stream's device); ComfyUI's low-VRAM mode marks the layers it offloads with ``prev_comfy_cast_weights``
    if hasattr(norm, "prev_comfy_cast_weights") or getattr(norm, "comfy_force_cast_weights", False):
        return f"{where} is offloaded by ComfyUI's low-VRAM mode"
    if w is not None and w.device != x.device:
        return f"{where} weight on {w.device}, stream on {x.device}"
    return None


class FusedBlockPatch:
    """The ``patches_replace["dit"][("double_block", i)]`` entry of one block: ``patch(args, extra) -> {"img": x}``.

    ``block``: core's DiTBlock (held weakly); ``prev``: the entry that was installed before (called with this
    block's fused forward as its ``original_block``) or None; ``ops``: :data:`kernels.fused.TRITON` (CUDA) or
    :data:`kernels.fused.EAGER` (CPU tests); ``devices``: stream device types it serves (default CUDA).
    ``calls`` / ``delegated``: counters of fused / handed-on calls; ``deferred``: fused calls that left their final
    gated residual to the next block (module docstring).
    """

    def __init__(self, block, index: int, prev: Callable | None = None, ops=fk.TRITON,
                 devices: tuple[str, ...] = ("cuda",)):
        self._block = weakref.ref(block)
        self.index = int(index)
        self.prev = prev
        self.ops = ops
        self.devices = tuple(devices)
        self.calls = 0
        self.delegated = 0
        self.routes: dict[str, int] = {}
        self.deferred = 0                         # calls that left their final gated residual to the next block

    def __call__(self, args: dict, extra: dict):
        original = extra["original_block"]

        def inner(a):
            return self.run(a, original)

        if self.prev is not None:
            return self.prev(args, dict(extra, original_block=inner))
        return inner(args)

    # ---- decision
    def blocker(self, block, x, args) -> str | None:
        """Why this call cannot run fused (None: it can)."""
        import comfy.model_management as mm

        if block is None:
            return "the block was freed"
        if x.device.type not in self.devices:
            return f"stream on {x.device.type}"
        if x.dtype not in (torch.bfloat16, torch.float16):
            return f"stream dtype {x.dtype} (the fused block takes bf16/fp16)"
        if x.dim() != 2 or x.stride(1) != 1:
            return f"stream shape {tuple(x.shape)} strides {x.stride()} (expected [S, hidden] row-major)"
        if mm.in_training or torch.is_grad_enabled() and x.requires_grad:
            return "training / grad"
        if args.get("rope_freqs") is None:
            return "no rope table (core's non-rope attention branch)"
        at = block.attn
        hd = int(at.head_dim)
        if hd < 2 or hd & (hd - 1):
            return f"head_dim {hd} is not a power of two (the fused RMSNorm+RoPE kernel's tile)"
        why = fk.rope_table_problem(x.shape[0], hd, args["rope_freqs"])
        if why is not None:
            return why
        if args["rope_freqs"].device != x.device:
            return f"rope table on {args['rope_freqs'].device}, stream on {x.device}"
        if getattr(at.q_norm, "weight", None) is None or getattr(at.k_norm, "weight", None) is None:
            return "q_norm / k_norm without a weight"
        for name in ("attn", "mlp"):
            if "forward" in getattr(block, name).__dict__:
                return f"block.{name}'s forward is wrapped"
        for name in ("norm1", "norm2"):
            why = _norm_blocker(getattr(block, name), x, name)
            if why is not None:
                return why
        for qn in ("q_norm", "k_norm"):
            why = _norm_blocker(getattr(block.attn, qn), x, f"attn.{qn}")
            if why is not None:
                return why
        try:       # core's modulation rows (an int or a per-token index tensor per segment) as the kernels' row table
            t_emb = args["t_emb"]
            fk.segment_rows(args["mod_segments"], x.shape[0], x.device,
                            limit=t_emb.shape[0] * int(getattr(block.adaln_proj, "modalities", 3)))
        except ValueError as e:
            return f"mod_segments the fused block does not take ({e}; ComfyUI {core_version()})"
        return None

    def _take_pending(self, x, args: dict) -> "_Pending | None":
        """The gated residual the previous block left in this forward's ``transformer_options`` (None if none),
        taken out of it. The slot is per forward (core builds ``transformer_options`` per model call; CFG halves on
        several GPUs run in threads with their own), so concurrent forwards never see each other's. One left there
        by an earlier forward with the same dict (another ``t_emb`` object: it stopped between two blocks, e.g. on an
        exception) is dropped, logged once. A RuntimeError if it was left in this forward for another block or
        another stream tensor: something ran between the two blocks, so the stream lacks the update (deferral is
        then off for the process)."""
        to = args.get("transformer_options")
        p = to.pop(_PENDING_KEY, None) if isinstance(to, dict) else None
        if p is None:
            return None
        if p.t_emb is not args.get("t_emb"):
            log_once(("fused_pending_stale",), "H3 Turbo fused block: a gated residual left by an earlier forward "
                     "that stopped between two blocks was dropped (this forward does not use it)")
            return None
        if p.index != self.index or p.x is not x:
            _DEFER_OFF.append(f"block {self.index} got another stream tensor than block {p.index - 1} returned")
            got = "another block" if p.index != self.index else "another stream tensor"
            raise RuntimeError(f"fused blocks: block {p.index - 1} left its gated residual to block {p.index}, but "
                               f"{got} (block {self.index}) was called next: something ran between the two blocks "
                               f"(ComfyUI {core_version()}, hook {HOOK}). Deferral is now off for this process; run "
                               "the prompt again.")
        return p

    def _next_for_defer(self, args: dict) -> "FusedBlockPatch | None":
        """The patch of block ``index + 1`` when this call may leave its final gated residual to it: core calls both
        entries directly (the entry for this
        block is this patch, the one for block ``index + 1`` that patch), both are plain fused-block entries (nothing
        chained around either), and the call's ``transformer_options`` holds no residual yet; else None."""
        if _DEFER_OFF or self.prev is not None:
            return None
        to = args.get("transformer_options")
        if not isinstance(to, dict) or _PENDING_KEY in to:
            return None
        dit = (to.get("patches_replace") or {}).get("dit", {})
        nxt = dit.get(("double_block", self.index + 1))
        if dit.get(("double_block", self.index)) is self and isinstance(nxt, FusedBlockPatch) and nxt.prev is None \
                and nxt.index == self.index + 1 and nxt.ops is self.ops:
            return nxt
        return None

    def run(self, args: dict, original: Callable):
        block = self._block()
        x = args["img"]
        pending = self._take_pending(x, args)
        why = self.blocker(block, x, args)
        plans = None
        if why is None:
            plans = {}
            for name, m in (("attn.qkv_proj", block.attn.qkv_proj), ("attn.out_proj", block.attn.out_proj),
                            ("mlp.fc1", block.mlp.fc1), ("mlp.fc2", block.mlp.fc2)):
                plan = _layer_plan(m, x, name)
                if plan[0] == "core":
                    why = plan[1]
                    break
                plans[name] = plan
        if why is not None:
            log_once(("fused_block", why), "H3 Turbo fused block: %s -> the block it replaced runs (core's or the "
                     "previous override)", why)
            if pending is not None:       # the previous block's update first: the stream core's block gets is whole
                pending.apply()
            self.delegated += 1
            return original(args)
        for name, (kind, info) in plans.items():
            if kind == "module":
                log_once(("fused_block_module", name, info), "H3 Turbo fused block: %s -> that projection gets a "
                         "bf16 input through its own forward", info)
        self.calls += 1
        nxt = self._next_for_defer(args)
        out = fused_forward(block, x, args["t_emb"], args["mod_segments"], args["rope_freqs"],
                            args.get("transformer_options", {}), plans, self.ops, self.routes, pending=pending,
                            defer_to=nxt, layer_index=self.index)
        if nxt is not None and _PENDING_KEY in args["transformer_options"]:
            self.deferred += 1
        return {"img": out}


class _Pending:
    """A block's final gated residual ``x += y * gate[rows]`` left for the next block's first producer
    (``norm_mod(residual=(y, gate))``: the same arithmetic, so the same bits, one pass over the stream less)."""

    __slots__ = ("x", "y", "gate", "rows", "ops", "t_emb", "index")

    def __init__(self, x, y, gate, rows, ops, t_emb, index):
        self.x, self.y, self.gate, self.rows, self.ops = x, y, gate, rows, ops
        self.t_emb = t_emb        # the forward it belongs to (core makes t_emb once per forward)
        self.index = index        # the block it is left for

    def apply(self) -> None:
        self.ops.gate_residual_(self.x, self.y, self.gate, self.rows)
        self.release()

    def take(self) -> tuple:
        """(y, gate) for ``norm_mod(residual=...)``; the object lets go of its tensors (y is freed once used)."""
        r = (self.y, self.gate)
        self.release()
        return r

    def release(self) -> None:
        self.x = self.y = self.gate = None


#: why leaving a block's gated residual to the next block is off in this process (empty: it is on)
_DEFER_OFF: list[str] = []
#: the ``transformer_options`` key of the forward's left residual (one at a time: block i leaves it, i + 1 takes it)
_PENDING_KEY = "h3turbo_fused_pending_residual"



# --------------------------------------------------------------------------- the fused forward

def _eps(norm, x) -> float:
    return float(norm.eps) if norm.eps is not None else float(torch.finfo(x.dtype).eps)


def _weight(norm, x) -> torch.Tensor:
    """The norm's weight on x's device in x's dtype (what core's cast-weights RMSNorm multiplies by)."""
    import comfy.model_management as mm

    w = getattr(norm, "weight", None)
    if w is None:
        return torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
    return mm.cast_to(w, dtype=x.dtype, device=x.device)


def _project(m, plan, x8s, bf16_input: Callable[[], torch.Tensor], probe, ops, routes) -> torch.Tensor:
    """One projection: plan "fp8" / "fold" uses the pre-quantized ``x8s`` = (x8, sx) (a callable producing it);
    "module" calls the layer on ``bf16_input()``. A Turbo hook that cannot fold for this call (adapter offloaded,
    tile constraint) also goes through the layer's forward (the branch then runs its own route)."""
    from ..kernels.paths.base import LoRAOperands
    from .ops import prepared as ops_prepared

    kind, info = plan
    if kind == "fold":
        prepared = ops_prepared(m, "fp8")
        ops_ = info.h3turbo_lora_operands(probe)
        if ops_ is not None:
            a, bc, coef, blocks, amax_a, key = ops_
            nb = m.out_features // int(blocks)
            if key is not None and _can_fold(prepared, nb):
                lo = LoRAOperands(a, bc, float(coef), nb, amax_a, key)
                w8, sw = _fp8_weight(prepared, probe.device, lo)
                info.h3turbo_count()
                routes["fold"] = routes.get("fold", 0) + 1
                x8, sx = x8s()
                return ops.gemm(x8, sx, w8, sw, m.out_features, probe.dtype)
        log_once(("fused_block_fold", type(m).__name__), "H3 Turbo fused block: the Turbo branch cannot fold into the "
                 "fp8 weight slot for this call -> the projection runs through the branch on a bf16 input")
        kind = "module"
    if kind == "module":
        routes["module"] = routes.get("module", 0) + 1
        return m(bf16_input())
    routes["fp8"] = routes.get("fp8", 0) + 1
    w8, sw = _fp8_weight(ops_prepared(m, "fp8"), probe.device)
    x8, sx = x8s()
    return ops.gemm(x8, sx, w8, sw, m.out_features, probe.dtype)


#: device type -> why the fused int8_sage route failed in this process (then the override runs unfused)
_SAGE_OFF: dict[str, str] = {}
#: device type -> why the Gluon attention kernel failed in this process (the fused route then uses the Triton kernel)
_GLUON_OFF: dict[str, str] = {}
def _int8_kernels():
    from ..kernels.attention import int8_kernels

    return int8_kernels


def _dequantized(x8, sx, dtype):
    """bf16 input for a projection whose Turbo branch cannot take the e4m3 attention output (logged once)."""
    log_once(("fused_sage_dequant",), "H3 Turbo fused block: out_proj takes a bf16 input this call -> the int8_sage "
             "output is dequantized from e4m3 for it")
    return (x8.float() * sx).to(dtype)


def _gluon_config(c: dict, device, tokens: int = 0) -> dict:
    """``c`` with the Gluon attention kernel (``kernels.fused.SETTINGS["sage_gluon"]``, "auto" or True): from
    ``kernels.fused.GLUON_WS_TOKENS`` tokens on, its warp-specialized form (BLOCK_M 128: two consumer warpgroups and
    a TMA warp, ``num_stages`` K/V slots = ``GLUON_WS_STAGES``), below it the 4-warp form (BLOCK_M 64);
    or ``c`` unchanged with the reason logged once when this device / Triton cannot run it or ``c`` is not the
    configuration it implements."""
    from ..kernels.attention import int8_gluon, int8_kernels

    why = _GLUON_OFF.get(torch.device(device).type) or int8_gluon.available(device)
    g = dict(c, GLUON=True, MAXNREG=None, Q_ROW=True, QPRE=True)
    if tokens >= fk.GLUON_WS_TOKENS:
        g.update(BLOCK_M=128, num_warps=4, num_stages=fk.GLUON_WS_STAGES)
    else:
        g.update(BLOCK_M=64, num_warps=4)
    if why is None:
        try:
            int8_kernels._cfg(g)
        except ValueError as e:
            why = str(e)
    if why is not None:
        setting = fk.SETTINGS["sage_gluon"]
        # "auto" (the default) on a GPU it is not written for is the expected case: INFO; True asked for it: WARNING
        log_once(("sage_gluon", why), "H3 Turbo fused block: SETTINGS['sage_gluon'] is %r but the Gluon attention "
                 "kernel cannot run (%s) -> the Triton kernel", setting, why,
                 level=logging.WARNING if setting is True else logging.INFO)
        return c
    return g


def _sage_route(transformer_options, x, head_dim: int, ops):
    """(override, config) when the MODEL's attention override is the pack's ``int8_sage`` and its kernel can take this
    block's call fused (:func:`kernels.fused.qk_norm_rope_sage` + ``sage_attention_prequantized``); else None (core's
    attention call with that override). The reason an ``int8_sage`` call is not taken is logged once."""
    ov = transformer_options.get("optimized_attention_override")
    if ov is None or getattr(ov, "backend", None) != "int8_sage":
        return None
    from ..kernels.attention import int8_sage

    if not isinstance(ov, int8_sage.Int8SageAttention):
        return None
    if not hasattr(ops, "qk_norm_rope_sage"):
        why = f"the {getattr(ops, 'name', type(ops).__name__)} ops have no qk_norm_rope_sage"
    elif x.device.type in _SAGE_OFF:
        why = f"the fused route failed earlier in this process ({_SAGE_OFF[x.device.type]})"
    else:
        why = ov.kernel_problem(x.device, x.dtype, head_dim)
    if why is None:
        why, c = ov.config_for(x.device, x.shape[0])
        if why is None and (c["V_MEAN"] or not c["PV_FP8"]):
            why = "its configuration has V_MEAN on or PV_FP8 off"
        if why is None and fk.SETTINGS["sage_gluon"]:
            c = _gluon_config(c, x.device, x.shape[0])
    if why is not None:
        log_once(("fused_sage", why), "H3 Turbo fused block: int8_sage attention not fused into the block (%s) -> "
                 "core's attention call with the int8_sage override", why)
        return None
    log_once(("fused_sage_on", x.device.type), "H3 Turbo fused block: int8_sage attention fused into the block (Q "
             "quantized per row and head by the RMSNorm + RoPE launch, K/V statistics from it, e4m3 output for "
             "out_proj)")
    return ov, c


def _guard_passes(guard, layer, qkv, heads, dh, freqs, qw, kw, eps, k4, v4, res, fp8_out, balance) -> bool:
    """The int8_sage route's accuracy guard (``kernels/attention/guard.py``) on this block's first call of a shape: the
    exact q of the sampled rows from qkv's q columns (unchanged by ``qk_norm_rope_sage``) by the eager RMSNorm + RoPE
    (with ``balance`` the balanced weights, matching k4 = k / l), the route's output rows (dequantized from e4m3 with
    ``fp8_out``); True when the block passes or was checked."""
    from ..kernels.attention.exact import shape_key

    key = shape_key(k4, k4)
    if not guard.needs_check(layer, key):
        return True
    if balance:
        from ..kernels.attention import balance as bal

        qw, kw, _ = bal.fold_into_norm_weights(qw, kw, 2 * int(freqs.shape[-3]))
    s, inner = qkv.shape[0], heads * dh
    rows = guard.sample(s, qkv.device)
    qr = fk.qk_norm_rope_ref(qkv[rows], heads, dh, freqs[:, rows], qw, kw, eps)[:, :inner]
    q_rows = qr.reshape(-1, heads, dh).transpose(0, 1).unsqueeze(0)
    if fp8_out:
        o8, so = res
        o = o8.view(torch.uint8)[rows].view(o8.dtype).float() * so[rows]    # rows of e4m3 gathered as bytes
    else:
        o = res[0, rows].float()
    approx = o.reshape(-1, heads, dh).transpose(0, 1).unsqueeze(0)
    return guard.check(layer, key, q_rows, k4, v4, approx)


def _attention_wrapper(attn) -> Callable:
    """How core's ``Attention.forward`` hands q / k / v to ``optimized_attention``: wrapped in
    ``AttentionTensorContainer`` (ComfyUI versions whose forward names it, e.g. 0.33) or as plain tensors."""
    if "AttentionTensorContainer" in _names(type(attn).forward):
        from comfy.ldm.modules.attention import AttentionTensorContainer

        return AttentionTensorContainer
    return lambda t: t


def fused_forward(block, x, t_emb, mod_segments, rope_freqs, transformer_options, plans, ops, routes=None,
                  pending: _Pending | None = None, defer_to: FusedBlockPatch | None = None,
                  layer_index: int | None = None):
    """The fused block's forward (module docstring); x [S, hidden] is updated in place and returned. ``pending``: the
    previous block's final gated residual, applied by this block's first producer (``norm_mod(residual=...)``);
    ``defer_to``: the next block's patch, which gets this block's final gated residual instead of
    ``gate_residual_`` here (x is then returned without it). ``layer_index``: the block's index, the layer key of the
    attention override's accuracy guard (``kernels/attention/guard.py``)."""
    import comfy.model_management as mm
    import comfy.ops
    from comfy.ldm.modules.attention import optimized_attention

    routes = {} if routes is None else routes
    routes_before = dict(routes)
    comfy.ops.run_every_op()
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)
    s = x.shape[0]
    rows = fk.segment_rows(mod_segments, s, x.device, limit=shift_msa.shape[0])
    n1, n2, at, mlp = block.norm1, block.norm2, block.attn, block.mlp
    w1, w2 = _weight(n1, x), _weight(n2, x)
    e1, e2 = _eps(n1, x), _eps(n2, x)

    if pending is not None and pending.rows is not rows:
        pending.apply()     # another segment table than the previous block's (not in core's loop): its own rows
        pending = None
    # attention: [the previous block's gated residual +] norm1 + modulation -> qkv
    res0 = [] if pending is None else [pending]     # taken by the producer that runs (y freed after its pass)
    had_pending, pending = pending is not None, None

    def qkv_fp8():
        return ops.norm_mod(x, w1, e1, shift_msa, scale_msa, rows, residual=res0.pop().take() if res0 else None)

    def qkv_bf16():
        return ops.norm_mod(x, w1, e1, shift_msa, scale_msa, rows, out="bf16",
                            residual=res0.pop().take() if res0 else None)

    qkv = _project(at.qkv_proj, plans["attn.qkv_proj"], qkv_fp8, qkv_bf16, x, ops, routes)
    if had_pending and res0:
        raise RuntimeError("fused block: the qkv producer did not run (the previous block's gated residual was not "
                           "applied)")
    heads, dh = int(at.heads), int(at.head_dim)
    inner = heads * dh
    qw = mm.cast_to(at.q_norm.weight, device=x.device)
    kw = mm.cast_to(at.k_norm.weight, device=x.device)
    sage = _sage_route(transformer_options, x, dh, ops)
    ov = transformer_options.get("optimized_attention_override")
    guard = getattr(ov, "guard", None) if layer_index is not None else None
    layer = guard.layer(transformer_options, block_index=layer_index) if guard is not None else None
    if sage is not None and guard is not None and guard.runs_exact(layer):
        sage = None         # this block failed the guard: core's attention call, which the override runs exact
    if sage is not None:
        # int8_sage: its Q quantization and K/V statistics come out of the RMSNorm + RoPE launch, its kernel runs
        # here and writes e4m3 for an fp8 out_proj (a failure disables this route, logged once, and reruns the block:
        # x is not modified before the fc1 producer, except by the previous block's gated residual applied above)
        override, cfg = sage
        # q x l, k / l per channel from the norm weights (exact: l = 2^n), computed inside the RMSNorm + RoPE launch
        # from the weights this call reads (no cache an in-place LoRA patch could leave stale); bf16 only
        bal = bool(cfg["BALANCE"])
        if bal and qkv.dtype != torch.bfloat16:
            bal = False
            log_once(("fused_balance_dtype", str(qkv.dtype)), "H3 Turbo fused block: the q / k balance needs bf16 "
                     "activations (k / l is stored in them), got %s -> the route runs without it (rotation and "
                     "guard stay on)", qkv.dtype)
        failed, stage = None, "producer"
        try:
            prep = ops.qk_norm_rope_sage(qkv, heads, dh, rope_freqs, qw, kw, _eps(at.q_norm, x), rotate=cfg["ROTATE"],
                                         balance=bal, rot_mma=cfg["ROT_MMA"])
            stage = "kernel"
            k4 = qkv[:, inner:2 * inner].view(s, heads, dh).transpose(0, 1).unsqueeze(0)
            v4 = qkv[:, 2 * inner:].view(s, heads, dh).transpose(0, 1).unsqueeze(0)
            fp8_out = plans["attn.out_proj"][0] != "module"
            res = _int8_kernels().sage_attention_prequantized(prep["q8"], prep["qs"], k4, v4, prep["ksum"],
                                                              prep["vamax"], config=cfg, out_fp8=fp8_out)
            stage = "guard"
            passed = guard is None or _guard_passes(guard, layer, qkv, heads, dh, rope_freqs, qw, kw,
                                                    _eps(at.q_norm, x), k4, v4, res, fp8_out, bal)
        except Exception as e:  # noqa: BLE001 - e.g. a Triton build failure on this GPU
            failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if failed is not None:
            # outside the except block (its traceback would keep the attempt's buffers alive): free them, count the
            # qkv projection once (a Turbo branch folded into qkv counts this call twice: a one-time failure) and
            # rerun the block (x is unchanged so far): after a failure of the opt-in Gluon kernel (e.g. a Triton whose
            # Gluon differs) with the route on the Triton kernel, else without the route
            if cfg.get("GLUON") and stage == "kernel":
                _GLUON_OFF[x.device.type] = failed
                log_once(("sage_gluon_failed", failed), "H3 Turbo fused block: the Gluon attention kernel failed (%s) "
                         "-> this process runs the fused route with the Triton kernel", failed, level=logging.WARNING)
            else:
                _SAGE_OFF[x.device.type] = failed
                log_once(("fused_sage_failed", failed), "H3 Turbo fused block: the fused int8_sage route failed in its "
                         "%s (%s) -> this process runs qk_norm_rope + the int8_sage override instead", stage, failed,
                         level=logging.WARNING)
            qkv = prep = k4 = v4 = None
            routes.clear()
            routes.update(routes_before)
            # x holds the previous block's gated residual now (applied by the qkv producer): not passed again
            return fused_forward(block, x, t_emb, mod_segments, rope_freqs, transformer_options, plans, ops, routes,
                                 defer_to=defer_to, layer_index=layer_index)
        if not passed:
            # the guard failed this block: exact from now on; rerun it (x unchanged so far but for the residual
            # applied above, as after a failure)
            qkv = prep = k4 = v4 = res = None
            routes.clear()
            routes.update(routes_before)
            return fused_forward(block, x, t_emb, mod_segments, rope_freqs, transformer_options, plans, ops, routes,
                                 defer_to=defer_to, layer_index=layer_index)
        override.calls += 1
        routes["sage"] = routes.get("sage", 0) + 1
        del qkv, prep, k4, v4
        if fp8_out:
            o8, so = res
            y = _project(at.out_proj, plans["attn.out_proj"], lambda: (o8, so),
                         lambda: _dequantized(o8, so, x.dtype), x, ops, routes)
        else:
            y = _project(at.out_proj, plans["attn.out_proj"], None, lambda: res[0], x, ops, routes)
        del res
    else:
        # core's rms_rope_split_half_ on the q / k columns in place; v read from the qkv buffer like q and k (no copy)
        v = ops.qk_norm_rope(qkv, heads, dh, rope_freqs, qw, kw, _eps(at.q_norm, x))
        q = qkv[:, :inner].view(s, heads, dh)
        k = qkv[:, inner:2 * inner].view(s, heads, dh)
        wrap = _attention_wrapper(at)
        qc = wrap(q.transpose(0, 1).unsqueeze(0))
        kc = wrap(k.transpose(0, 1).unsqueeze(0))
        vc = wrap(v.transpose(0, 1).unsqueeze(0))
        del q, k, v
        to = transformer_options if guard is None else guard.block_options(transformer_options, layer_index)
        out = optimized_attention(qc, kc, vc, heads, mask=None, skip_reshape=True,
                                  transformer_options=to).squeeze(0)
        del qkv
        y = _project(at.out_proj, plans["attn.out_proj"], lambda: ops.quant_rows(out), lambda: out, x, ops, routes)
        del out

    # gated residual + norm2 + modulation -> fc1 (the residual update happens exactly once, in whichever producer runs)
    done = []

    def fc1_fp8():
        done.append(1)
        return ops.norm_mod(x, w2, e2, shift_mlp, scale_mlp, rows, residual=(y, gate_msa))

    def fc1_bf16():
        done.append(1)
        return ops.norm_mod(x, w2, e2, shift_mlp, scale_mlp, rows, out="bf16", residual=(y, gate_msa))

    hmid = _project(mlp.fc1, plans["mlp.fc1"], fc1_fp8, fc1_bf16, x, ops, routes)
    if not done:
        raise RuntimeError("fused block: the fc1 producer did not run (the gated residual was not applied)")
    del y

    # SwiGLU -> fc2, gated residual
    y2 = _project(mlp.fc2, plans["mlp.fc2"], lambda: ops.swiglu(hmid),
                  lambda: comfy.ops.INPUT_ACT_EAGER["swiglu"](hmid), x, ops, routes)
    del hmid
    if defer_to is not None:
        transformer_options[_PENDING_KEY] = _Pending(x, y2, gate_mlp, rows, ops, t_emb, defer_to.index)
    else:
        ops.gate_residual_(x, y2, gate_mlp, rows)
    return x


# --------------------------------------------------------------------------- install

def resolve(mode: str, device: torch.device | str) -> tuple[bool, str]:
    """(install?, reason) for ``mode`` in :data:`CHOICES` on ``device``. ``fp8`` on a non-CUDA device installs
    nothing (the block would never serve). ValueError for an unknown mode."""
    if mode not in CHOICES:
        raise ValueError(f"fused blocks: mode {mode!r}; expected one of {', '.join(CHOICES)}")
    if mode == "off":
        return False, "off"
    dev = torch.device(device)
    if dev.type != "cuda":
        return False, f"device {dev} is not CUDA (the fused block runs Triton kernels and torch._scaled_mm)"
    if fk.triton is None:
        return False, f"Triton is not importable ({fk._TRITON_ERROR})"
    return True, "requested"


def install(model_patcher, ops=fk.TRITON, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Put a :class:`FusedBlockPatch` at ``("double_block", i)`` of every DiT block of ``model_patcher`` (a
    ModelPatcher, changed in place: pass a clone), chaining an entry already there. Returns the number of blocks.
    RuntimeError if a block's structure is not the one the fused block reproduces (naming the ComfyUI version and
    the hook)."""
    dm = model_patcher.model.diffusion_model
    blocks = getattr(dm, "blocks", None)
    if blocks is None:
        raise RuntimeError(f"fused blocks: {type(dm).__name__} has no .blocks (ComfyUI {core_version()}, {HOOK})")
    to = model_patcher.model_options.get("transformer_options", {})
    existing = to.get("patches_replace", {}).get("dit", {})
    n = 0
    for i, block in enumerate(blocks):
        why = structure_problem(block)
        if why is not None:
            raise RuntimeError(f"fused blocks: blocks.{i} differs from the DiT block the fused block reproduces "
                               f"({why}); ComfyUI {core_version()}, hook {HOOK}. Use fused=off.")
        prev = existing.get(("double_block", i))
        if isinstance(prev, FusedBlockPatch):
            prev = prev.prev          # re-installing replaces our own entry, keeps what it chained
        model_patcher.set_model_patch_replace(FusedBlockPatch(block, i, prev, ops, devices), "dit", "double_block", i)
        n += 1
    return n


def apply(model, mode: str):
    """A clone of ComfyUI MODEL ``model`` with the fused blocks installed (``mode="fp8"`` on a CUDA load device),
    or an unchanged clone (``off``, or a device they cannot serve: logged once). ValueError for an unknown mode;
    RuntimeError from :func:`install` on a core whose block differs."""
    ok, why = resolve(mode, model.load_device)
    m = model.clone()
    if not ok:
        if mode != "off":
            log_once(("fused_apply", why), "H3 Turbo fused blocks: not installed (%s); core's blocks run", why,
                     level=logging.WARNING)
        return m
    n = install(m)
    log.info("H3 Turbo fused blocks: %d DiT blocks fused for compute=fp8 (approximate like fp8; calls it does not "
             "serve run core's block, reasons logged once)", n)
    return m
