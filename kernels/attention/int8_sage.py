"""The ``int8_sage`` attention backend (opt-in, approximate): the 8-bit Triton kernel of
:mod:`.int8_kernels` (INT8 Q K^T, FP8 P V) as a core attention override.

Contract: :class:`Int8SageAttention` takes core's call (``override(func, q, k, v, heads, **kwargs)``,
see :mod:`.base`) for CUDA bf16/fp16 inputs with head dim 64 or 128, no mask, no GQA, on a GPU with FP8
tensor cores (compute capability >= 8.9), Triton importable; output in core's layout and q's dtype.
Every other call (and a call whose kernel raises) runs the ``exact`` backend instead, each reason logged
once. Tested bound against float32 attention: :attr:`Int8SageBackend.tolerance`; measured accuracy and
speed: ``docs/attention.md``. Triton is imported on first use only.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from ... import state
from ...logs import log_once
from . import exact
from .base import AttentionBackend, Tolerance, device_reason, parse_core_call

NAME = "int8_sage"
DEVICES: tuple[str, ...] = ("cuda",)      # device types the process-wide override runs the kernel on


def _kernels():
    from . import int8_kernels

    return int8_kernels


def _no_fp8_reason(dev: torch.device) -> str | None:
    """The fallback reason for a CUDA GPU without FP8 tensor cores (compute capability < 8.9), else None."""
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        cap = "%d.%d" % torch.cuda.get_device_capability(dev)
        return f"GPU compute capability {cap} has no FP8 tensor cores"
    return None


class Int8SageAttention:
    """Core attention override ``override(func, q, k, v, heads, **kwargs)`` (see
    :class:`.exact.ExactAttention` for the contract) running :func:`.int8_kernels.sage_attention`.

    Handled: q/k/v on a device type in ``devices`` (default ``("cuda",)``), one dtype in bf16/fp16,
    head dim 64 or 128, no mask, no GQA, ``skip_reshape`` 4-D [B, heads, L, D] or 3-D [B, L, heads*D]
    inputs, Triton importable. Output as core's: [B, Lq, heads*D] (``skip_output_reshape=False``,
    written directly by the kernel) or [B, heads, Lq, D]. Everything else goes to ``fallback`` (default:
    the process-wide ``exact`` override), with one INFO log line per reason; so does a CUDA GPU without
    FP8 tensor cores (compute capability < 8.9, fp8 P V) and a call whose kernel raises (build failure).
    ``calls``/``fallbacks``: counters. ``config``: launch configuration (default None:
    :func:`.int8_kernels.tuned_config` per call). ``guard``: a :class:`.guard.LayerGuard` (the process-wide override
    has one): each layer is checked on its first call of a shape against exact attention on sampled rows, and a
    failing layer runs ``fallback`` from then on (that call included); None: no check.
    """

    backend = NAME

    def __init__(self, fallback: Callable | None = None, devices: Sequence[str] = DEVICES,
                 config: dict | None = None, guard=None):
        self.fallback = fallback if fallback is not None else exact.exact_override()
        self.devices = tuple(devices)
        self.config = _kernels()._cfg(config) if config is not None else None    # None: tuned_config per call
        if self.config is not None and self.config["GLUON"]:
            raise ValueError("int8_sage: config GLUON is not an override configuration (the Gluon kernel serves the "
                             "fused block's route only: kernels.fused.SETTINGS['sage_gluon'])")
        self.guard = guard
        self.calls = 0
        self.fallbacks = 0

    def kernel_problem(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why the 8-bit kernel cannot take inputs of ``dtype`` / ``head_dim`` on ``device`` (Triton, the device
        type, dtype, head dim), or None. Used by this override and by the fused block's producer route."""
        K = _kernels()
        if K.triton is None:
            return f"triton unavailable ({K._TRITON_ERROR})"
        if device.type not in self.devices:
            return device_reason(device)
        if dtype not in K.SUPPORTED_DTYPES:
            return f"dtype {dtype} (8-bit kernel takes bf16/fp16)"
        if head_dim not in K.SUPPORTED_HEAD_DIMS:
            return f"head dim {head_dim} (8-bit kernel takes {K.SUPPORTED_HEAD_DIMS})"
        return None

    def config_for(self, device: torch.device, lk: int) -> tuple[str | None, dict]:
        """(None or why a GPU without FP8 tensor cores cannot run it, the launch configuration for ``lk`` keys)."""
        K = _kernels()
        c = self.config if self.config is not None else K.tuned_config(device, lk)
        return (_no_fp8_reason(device) if c["PV_FP8"] else None), c

    def _fall(self, reason: str, func, args, kwargs):
        log_once(("attention", NAME, reason), "H3 Turbo attention 'int8_sage': %s -> exact attention", reason,
                 level=logging.INFO)
        self.fallbacks += 1
        return self.fallback(func, *args, **kwargs)

    def __call__(self, func: Callable, *args, **kwargs):
        K = _kernels()
        if K.triton is None:
            return self._fall(f"triton unavailable ({K._TRITON_ERROR})", func, args, kwargs)
        call = parse_core_call(args, kwargs, self.devices)
        if isinstance(call, str):
            return self._fall(call, func, args, kwargs)
        q4, k4, v4 = call.q, call.k, call.v
        guard = self.guard
        layer = guard.layer(kwargs.get("transformer_options")) if guard is not None else None
        if guard is not None and guard.runs_exact(layer):
            return self.fallback(func, *args, **kwargs)
        B, H, Lq, D = q4.shape
        why = self.kernel_problem(q4.device, q4.dtype, D)
        if why is not None:
            return self._fall(why, func, args, kwargs)
        if k4.shape[:2] != (B, H) or v4.shape != k4.shape or k4.shape[-1] != D:
            return self._fall("q/k/v shapes differ (GQA or mismatched layout)", func, args, kwargs)
        if Lq < 1 or k4.shape[2] < 1:
            return self._fall("empty sequence", func, args, kwargs)
        no_fp8, c = self.config_for(q4.device, k4.shape[2])
        if no_fp8 is not None:
            return self._fall(no_fp8, func, args, kwargs)
        layout = "bhld" if call.skip_output_reshape else "blhd"
        try:
            out = K.sage_attention(q4, k4, v4, scale=call.scale, out_layout=layout, config=c)
        except Exception as e:   # e.g. a Triton build failure on this GPU/driver: say so once, run exact
            return self._fall(f"8-bit kernel failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
                              func, args, kwargs)
        if guard is not None:
            from .exact import shape_key
            from .guard import out_rows

            key = shape_key(q4, k4)
            if guard.needs_check(layer, key):
                rows = guard.sample(Lq, q4.device)
                if not guard.check(layer, key, q4[:, :, rows], k4, v4, out_rows(out, rows, H, layout == "bhld"),
                                   call.scale):
                    return self.fallback(func, *args, **kwargs)
        self.calls += 1
        return out


def int8_override() -> Int8SageAttention:
    """The process-wide ``int8_sage`` override (:data:`h3_turbo.state.ATTENTION_INT8`; falls back to
    :func:`.exact.exact_override`), with a per-layer :class:`.guard.LayerGuard`."""
    from .guard import LayerGuard

    return state.ATTENTION_INT8.get(lambda: Int8SageAttention(guard=LayerGuard(NAME)))


class Int8SageBackend(AttentionBackend):
    """``int8_sage``: :func:`int8_override` on the model; approximate, so never what ``auto`` picks."""

    name = NAME
    summary = ("8-bit attention (INT8 Q.K with q/k balanced per channel and Hadamard-rotated, FP8 P.V; approximate, ~4% "
               "relative error per call; each layer checked once, a failing layer runs exact; faster than exact on "
               "Hopper, docs/attention.md); needs a GPU with FP8 (sm_89+), else exact.")
    approximate = True
    fallback = "exact"
    apply_note = ("8-bit attention (int8_sage: INT8 Q.K with q/k balanced per channel and Hadamard-rotated, FP8 P.V) "
                  "on this MODEL: approximate, ~4% relative per attention call; each attention layer is checked against exact attention on its first "
                  "call of a shape and runs exact from then on if it fails; inputs it does not take run exact attention")
    # bf16 inputs, vs float32 attention (fp8 P V: ~4 % relative L2 on H3-like inputs)
    tolerance = Tolerance(rel_l2=0.06, cos_min=0.998, dtype=torch.bfloat16)
    reference_dtype = torch.float32
    cpu_env = {"TRITON_INTERPRET": "1"}       # the Triton kernels run on the CPU only interpreted

    def supports(self, device):
        K = _kernels()
        if K.triton is None:
            return False, f"triton unavailable ({K._TRITON_ERROR})"
        dev = torch.device(device)
        if dev.type not in DEVICES:
            return False, device_reason(dev)
        if K.tuned_config(dev, 1)["PV_FP8"]:
            no_fp8 = _no_fp8_reason(dev)
            if no_fp8 is not None:
                return False, no_fp8
        return True, ""

    def override(self) -> Int8SageAttention:
        return int8_override()


    def cpu_override(self) -> Int8SageAttention:
        """The kernel on CPU tensors (needs ``TRITON_INTERPRET=1`` before Triton is imported), falling back
        to :func:`.exact.cpu_exact`."""
        return Int8SageAttention(fallback=exact.cpu_exact(), devices=("cpu",))


BACKEND = Int8SageBackend()
