"""The ``cudnn_fp8`` attention backend (opt-in, approximate): cuDNN's FP8 SDPA through nvidia-cudnn-frontend's
Python graph API (``pygraph.sdpa_fp8``), an optional extra of the pack (``pip install h3_turbo[cudnn]``).

Contract: :class:`CudnnFP8Attention` is a core attention override (``override(func, q, k, v, heads, **kwargs)``,
:mod:`.base`). It runs CUDA bf16/fp16 inputs with head dim 64 or 128, no mask, no GQA, on compute capability
>= 9.0, the frontend importable. Each of q, k, v gets one per-tensor power-of-two scale ``s = 448 / 2^ceil(log2
amax)`` (amax measured on the device, no host sync; a power of two makes ``x * s`` exact before the e4m3
rounding) and is cast to e4m3 in [B, L, H, D] memory. The softmax probabilities are scaled by 448 into e4m3
(``scale_s``; P <= 1). The output is FP8: on Hopper cuDNN builds FP8 SDPA only with an FP8 output (a bf16 output
is Blackwell-only); its scale is v's (``|o| <= amax|v|``: a convex combination of v's rows never clips).
:meth:`CudnnFP8Attention.attention_fp8` returns that e4m3 output with its descale for the fp8 out_proj
(``runtime.fused_block``); the override dequantizes it to q's dtype in core's layout.

Every other call (CPU, other dtypes or head dims, masks, GQA, an older GPU, a shape cuDNN refuses, a missing
frontend) runs the ``exact`` backend instead, each reason logged once, so those calls are bit-identical to
``exact``. Without the frontend the backend is not registered (absent from the node's combo), logged once.
Accuracy on the GPU (not testable on a CPU): docs/attention.md; :func:`emulate_sdpa_fp8` is an eager model of the
quantization steps (CPU tests of the scale plumbing and of the accuracy gate).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import torch

from ... import state
from ...logs import log_once
from . import exact
from .base import AttentionBackend, Tolerance, device_reason, parse_core_call

NAME = "cudnn_fp8"
DEVICES: tuple[str, ...] = ("cuda",)
HEAD_DIMS = (64, 128)
E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: the smallest amax a scale is derived from (an all-zero tensor gets the scale of 2^-20)
AMAX_FLOOR = 2.0 ** -20

_FRONTEND: dict = {}


def frontend():
    """The ``cudnn`` module of nvidia-cudnn-frontend, or None when it does not import (reason: :func:`frontend_error`)."""
    if "mod" not in _FRONTEND:
        try:
            import cudnn  # noqa: PLC0415

            if not hasattr(cudnn, "pygraph"):
                raise ImportError("module 'cudnn' has no pygraph (not nvidia-cudnn-frontend)")
            _FRONTEND["mod"], _FRONTEND["err"] = cudnn, None
        except Exception as e:  # noqa: BLE001
            _FRONTEND["mod"], _FRONTEND["err"] = None, f"{type(e).__name__}: {e}"
    return _FRONTEND["mod"]


def frontend_error() -> str | None:
    frontend()
    return _FRONTEND["err"]


def po2_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 [1] on x's device: ``448 / 2^ceil(log2(max(amax|x|, AMAX_FLOOR)))`` (device-side, no host sync)."""
    mn, mx = torch.aminmax(x)
    amax = torch.maximum(mx.float().abs(), mn.float().abs()).clamp_min(AMAX_FLOOR).reshape(1)
    return FP8_MAX / torch.exp2(torch.ceil(torch.log2(amax)))


def to_e4m3_blhd(x4: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x4 [B, H, L, D] (any strides) times ``s`` (a power of two: exact) -> e4m3 [B, L, H, D] contiguous."""
    b, h, l, d = x4.shape
    out = torch.empty((b, l, h, d), device=x4.device, dtype=E4M3)
    out.copy_(x4.transpose(1, 2) * s.to(x4.dtype))
    return out


def emulate_sdpa_fp8(q4, k4, v4, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager float32 model of the FP8 SDPA as this backend configures it: q/k/v [B, H, L, D] quantized per tensor
    (:func:`po2_scale`), S = (q8 k8^T) * dq * dk * scale, P = softmax(S) quantized to e4m3 with scale 448,
    O = (P8 v8) / 448 * dv, quantized to e4m3 with v's scale. Returns ``(o8 e4m3 [B, H, L, D], descale fp32 [1])``,
    O ~= o8 * descale. (cuDNN's kernel differs in accumulation order and in where it rounds the running softmax; this
    models the quantization of its inputs, probabilities and output.)"""
    d = q4.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    sq, sk, sv = po2_scale(q4), po2_scale(k4), po2_scale(v4)
    q8 = (q4.float() * sq).to(E4M3).float()
    k8 = (k4.float() * sk).to(E4M3).float()
    v8 = (v4.float() * sv).to(E4M3).float()
    s = (q8 @ k8.transpose(-1, -2)) * (scale / (sq * sk))
    p8 = (torch.softmax(s, dim=-1) * FP8_MAX).to(E4M3).float()
    o = (p8 @ v8) / FP8_MAX                      # in v8 units: |o| <= 448
    return o.clamp(-FP8_MAX, FP8_MAX).to(E4M3), 1.0 / sv


class _Graph:
    """One built cuDNN FP8 SDPA graph for (device, B, H, Lq, Lk, D, scale) with its workspace."""

    def __init__(self, cudnn, device, b, h, lq, lk, d, attn_scale):
        dt = cudnn.data_type
        gr = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)
        sq = (lq * h * d, d, h * d, 1)           # [B, H, L, D] dims over [B, L, H, D] memory
        sk = (lk * h * d, d, h * d, 1)
        q = gr.tensor(uid=0, dim=(b, h, lq, d), stride=sq, data_type=dt.FP8_E4M3)
        k = gr.tensor(uid=1, dim=(b, h, lk, d), stride=sk, data_type=dt.FP8_E4M3)
        v = gr.tensor(uid=2, dim=(b, h, lk, d), stride=sk, data_type=dt.FP8_E4M3)
        sc = [gr.tensor(uid=5 + i, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt.FLOAT) for i in range(6)]
        o, _stats, amax_s, amax_o = gr.sdpa_fp8(q=q, k=k, v=v, descale_q=sc[0], descale_k=sc[1], descale_v=sc[2],
                                                descale_s=sc[3], scale_s=sc[4], scale_o=sc[5], generate_stats=False,
                                                attn_scale=float(attn_scale), use_causal_mask=False)
        o.set_uid(3).set_output(True).set_dim((b, h, lq, d)).set_stride(sq).set_data_type(dt.FP8_E4M3)
        for t, uid in ((amax_s, 11), (amax_o, 12)):
            t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(dt.FLOAT)
        gr.validate()
        gr.build_operation_graph()
        gr.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        gr.check_support()
        gr.build_plans()
        self.graph = gr
        self.workspace = torch.empty(max(1, gr.get_workspace_size()), dtype=torch.uint8, device=device)
        self.consts = {8: torch.full((1,), 1.0 / FP8_MAX, device=device), 9: torch.full((1,), FP8_MAX, device=device),
                       11: torch.zeros(1, device=device), 12: torch.zeros(1, device=device)}
        self.handle = cudnn.create_handle()
        self.cudnn = cudnn


class CudnnFP8Attention:
    """Core attention override running cuDNN's FP8 SDPA (module docstring). ``fallback``: what runs every call it
    does not take (default: the process-wide ``exact`` override); ``devices``: device types it serves.
    ``calls`` / ``fallbacks``: counters; ``graphs``: built graphs by shape (a shape cuDNN refused maps to its reason).
    ``guard``: a :class:`.guard.LayerGuard` (the process-wide override has one): a layer whose output fails it on its
    first call of a shape runs ``fallback`` from then on (that call included); None: no check."""

    backend = NAME

    def __init__(self, fallback: Callable | None = None, devices: Sequence[str] = DEVICES, emulate: bool = False,
                 guard=None):
        self.fallback = fallback if fallback is not None else exact.exact_override()
        self.devices = tuple(devices)
        self.emulate = bool(emulate)      # tests: :func:`emulate_sdpa_fp8` instead of the cuDNN graph (CPU)
        self.guard = guard
        self.calls = 0
        self.fallbacks = 0
        self.graphs: dict = {}

    def _fall(self, reason: str, func, args, kwargs):
        log_once(("attention", NAME, reason), "H3 Turbo attention 'cudnn_fp8': %s -> exact attention", reason,
                 level=logging.INFO)
        self.fallbacks += 1
        return self.fallback(func, *args, **kwargs)

    def refuse(self, q4, k4, v4) -> str | None:
        """Why these [B, H, L, D] inputs cannot run here (None: they can, once a graph builds)."""
        if frontend() is None and not self.emulate:
            return f"nvidia-cudnn-frontend not importable ({frontend_error()})"
        if q4.dtype not in (torch.bfloat16, torch.float16):
            return f"dtype {q4.dtype} (FP8 SDPA takes bf16/fp16 inputs)"
        b, h, lq, d = q4.shape
        if d not in HEAD_DIMS:
            return f"head dim {d} (cudnn_fp8 takes {HEAD_DIMS})"
        if k4.shape[:2] != (b, h) or v4.shape != k4.shape or k4.shape[-1] != d:
            return "q/k/v shapes differ (GQA or mismatched layout)"
        if lq < 1 or k4.shape[2] < 1:
            return "empty sequence"
        if q4.device.type == "cuda":
            cc = torch.cuda.get_device_capability(q4.device)
            if cc < (9, 0):
                return f"GPU compute capability {cc[0]}.{cc[1]} (cuDNN FP8 SDPA needs 9.0+)"
        elif not self.emulate:
            return device_reason(q4.device)
        return None

    def _graph(self, q4, k4, scale):
        b, h, lq, d = q4.shape
        key = (str(q4.device), b, h, lq, k4.shape[2], d, float(scale))
        g = self.graphs.get(key)
        if g is None:
            try:
                with torch.cuda.device(q4.device):
                    g = _Graph(frontend(), q4.device, b, h, lq, k4.shape[2], d, scale)
            except Exception as e:  # noqa: BLE001 - cuDNN refuses this shape/GPU: remembered, exact runs it
                g = f"cuDNN could not build an FP8 SDPA graph for {key[1:]} ({type(e).__name__}: " \
                    f"{str(e).splitlines()[0][:200] if str(e) else ''})"
            self.graphs[key] = g
        return g

    def attention_fp8(self, q4, k4, v4, scale: float | None = None):
        """FP8 SDPA of [B, H, L, D] inputs: ``(o8 e4m3 [B, Lq, H*D], descale fp32 [1])`` with o ~= o8 * descale, or
        the reason string when these inputs cannot run (:meth:`refuse`, or cuDNN refused the shape)."""
        why = self.refuse(q4, k4, v4)
        if why is not None:
            return why
        b, h, lq, d = q4.shape
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        if self.emulate:
            o8, descale = emulate_sdpa_fp8(q4, k4, v4, scale)
            return o8.transpose(1, 2).reshape(b, lq, h * d), descale
        g = self._graph(q4, k4, scale)
        if isinstance(g, str):
            return g
        sq, sk, sv = po2_scale(q4), po2_scale(k4), po2_scale(v4)
        q8, k8, v8 = to_e4m3_blhd(q4, sq), to_e4m3_blhd(k4, sk), to_e4m3_blhd(v4, sv)
        o8 = torch.empty((b, lq, h, d), device=q4.device, dtype=E4M3)
        pack = {0: q8, 1: k8, 2: v8, 3: o8, 5: 1.0 / sq, 6: 1.0 / sk, 7: 1.0 / sv, 10: sv, **g.consts}
        g.cudnn.set_stream(g.handle, torch.cuda.current_stream(q4.device).cuda_stream)
        g.graph.execute(pack, g.workspace, handle=g.handle)
        return o8.view(b, lq, h * d), 1.0 / sv

    def __call__(self, func: Callable, *args, **kwargs):
        call = parse_core_call(args, kwargs, self.devices)
        if isinstance(call, str):
            return self._fall(call, func, args, kwargs)
        q4, k4, v4 = call.q, call.k, call.v
        guard = self.guard
        layer = guard.layer(kwargs.get("transformer_options")) if guard is not None else None
        if guard is not None and guard.runs_exact(layer):
            return self.fallback(func, *args, **kwargs)
        try:
            got = self.attention_fp8(q4, k4, v4, call.scale)
        except Exception as e:  # noqa: BLE001 - a launch failure on this GPU/driver: say so once, run exact
            got = f"FP8 SDPA failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        if isinstance(got, str):
            return self._fall(got, func, args, kwargs)
        o8, descale = got
        b, h, lq, d = q4.shape
        out = (o8.to(q4.dtype) * descale.to(q4.dtype))           # [B, Lq, H*D]; descale is a power of two: exact
        if call.skip_output_reshape:
            out = out.view(b, lq, h, d).transpose(1, 2)
        if guard is not None:
            from .exact import shape_key
            from .guard import out_rows

            key = shape_key(q4, k4)
            if guard.needs_check(layer, key):
                rows = guard.sample(lq, q4.device)
                if not guard.check(layer, key, q4[:, :, rows], k4, v4,
                                   out_rows(out, rows, h, call.skip_output_reshape), call.scale):
                    return self.fallback(func, *args, **kwargs)
        self.calls += 1
        return out


def cudnn_fp8_override() -> CudnnFP8Attention:
    """The process-wide ``cudnn_fp8`` override (:data:`h3_turbo.state.ATTENTION_CUDNN_FP8`), with a per-layer
    :class:`.guard.LayerGuard`."""
    from .guard import LayerGuard

    return state.ATTENTION_CUDNN_FP8.get(lambda: CudnnFP8Attention(guard=LayerGuard(NAME)))


class CudnnFP8Backend(AttentionBackend):
    """``cudnn_fp8``: :func:`cudnn_fp8_override` on the model; approximate, opt-in by name; registered only when
    nvidia-cudnn-frontend imports (:meth:`available`)."""

    name = NAME
    summary = ("cuDNN FP8 attention (nvidia-cudnn-frontend; per-tensor FP8 q/k/v/P/output, approximate: ~7% relative "
               "error per call on well-spread inputs, more with outlier channels; each layer checked once, a failing "
               "layer runs exact); needs sm_90+, else exact.")
    approximate = True
    fallback = "exact"
    apply_note = ("cuDNN FP8 attention (cudnn_fp8) on this MODEL: approximate, ~7% relative per attention call; "
                  "each attention layer is checked against exact attention on its first call of a shape and runs "
                  "exact from then on if it fails; inputs it does not take run exact attention")
    # the CPU check runs the eager model of the kernel's quantization (emulate_sdpa_fp8), bf16 inputs vs float32
    tolerance = Tolerance(rel_l2=0.10, cos_min=0.995, dtype=torch.bfloat16)
    reference_dtype = torch.float32

    def available(self) -> tuple[bool, str]:
        ok = frontend() is not None
        return ok, "" if ok else f"nvidia-cudnn-frontend not importable ({frontend_error()}); install h3_turbo[cudnn]"

    def supports(self, device):
        dev = torch.device(device)
        if frontend() is None:
            return False, f"nvidia-cudnn-frontend not importable ({frontend_error()})"
        if dev.type not in DEVICES:
            return False, device_reason(dev)
        cc = torch.cuda.get_device_capability(dev)
        if cc < (9, 0):
            return False, f"GPU compute capability {cc[0]}.{cc[1]} (cuDNN FP8 SDPA needs 9.0+)"
        return True, ""

    def override(self) -> CudnnFP8Attention:
        return cudnn_fp8_override()


    def cpu_override(self) -> CudnnFP8Attention:
        """The override's own path on CPU tensors with the eager model of the kernel (:func:`emulate_sdpa_fp8`: the
        scales, layouts and dequantization of the real path; the cuDNN kernel itself is GPU-only), falling back to
        :func:`.exact.cpu_exact`."""
        return CudnnFP8Attention(fallback=exact.cpu_exact(), devices=("cpu",), emulate=True)


BACKEND = CudnnFP8Backend()
