"""What an attention backend is (:class:`AttentionBackend`) and the call convention its override reads
(:func:`parse_core_call`). Torch only; nothing here imports ComfyUI.

Core ComfyUI runs H3's attention as ``optimized_attention(q, k, v, heads, mask=None, skip_reshape=True,
transformer_options=...)``; its ``wrap_attn`` decorator (``comfy/ldm/modules/attention.py``) finds
``transformer_options["optimized_attention_override"]`` and calls ``override(func, q, k, v, heads,
**kwargs)``, where ``func`` is core's own attention function and ``kwargs`` hold
``_inside_attn_wrapper=True`` (so ``func(...)`` never re-enters the override). A backend installs such
an override on a cloned ModelPatcher; see ``docs/EXTENDING.md`` to add one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .reference import accuracy, reference_attention


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
        return device_reason(q.device)
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


def device_reason(device: torch.device | str) -> str:
    """The reason an override gives for a device type it does not take: ``"device type 'cpu'"``."""
    return f"device type {torch.device(device).type!r}"


@dataclass(frozen=True)
class Tolerance:
    """A backend's bound against its eager reference, stated for q/k/v of ``dtype``: relative L2 at most
    ``rel_l2`` and per-head cosine at least ``cos_min`` (:func:`~.reference.accuracy`)."""
    rel_l2: float
    cos_min: float
    dtype: torch.dtype

    def holds(self, acc: Mapping[str, float]) -> bool:
        return acc["rel_l2"] <= self.rel_l2 and acc["cos_min"] >= self.cos_min


class AttentionBackend:
    """One attention backend of the ``H3TurboAttention`` node. Subclass it in one module of this package,
    set the attributes, implement :meth:`supports` and :meth:`override` (or :meth:`apply`), and list the
    module in ``registry.MODULES``.

    Attributes: ``name`` (the node's combo value; never rename: saved workflows store it);
    ``summary`` (its sentence in the node's description); ``approximate`` (False: the same function as
    core's attention up to the input dtype's rounding); ``fallback``: what runs the inputs the override
    does not take, each reason logged once (``"core"``: core's own ``func``; ``"exact"``: the exact
    backend; None: it takes every input); ``tolerance``/``reference_dtype``: the bound of its output
    against :meth:`reference`, as checked by the tests on the CPU; ``cpu_env``: environment variables its
    own path needs on the CPU (the tests rerun it in a subprocess with them); ``needs_comfy``: its
    override needs ComfyUI importable.
    """

    name: str = ""
    summary: str = ""
    approximate: bool = False
    fallback: str | None = "core"
    tolerance: Tolerance = Tolerance(1e-6, 1.0 - 1e-9, torch.float32)
    reference_dtype: torch.dtype = torch.float64
    cpu_env: Mapping[str, str] = {}
    needs_comfy: bool = False
    #: logged (INFO) each time :meth:`apply` puts the backend on a MODEL (approximate backends say what they trade)
    apply_note: str = ""

    def available(self) -> tuple[bool, str]:
        """(True, "") if the backend can be offered in this process at all (its optional dependency imports); else
        (False, why): the registry then leaves it out of the combo and logs why once. Default: always."""
        return True, ""

    def supports(self, device: torch.device | str) -> tuple[bool, str]:
        """(True, "") if the installed override runs this backend's own path for inputs on ``device``;
        else (False, the reason it logs when it hands such a call to its fallback)."""
        raise NotImplementedError

    def override(self) -> Callable[..., Any]:
        """The object :meth:`apply` installs as ``optimized_attention_override``."""
        raise NotImplementedError

    def apply(self, patcher) -> None:
        """Make the (already cloned) ComfyUI ModelPatcher ``patcher`` run this backend: set its
        ``model_options["transformer_options"]["optimized_attention_override"]``; logs :attr:`apply_note`."""
        if self.apply_note:
            from ...logs import log

            log.info("H3TurboAttention: %s", self.apply_note)
        patcher.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = self.override()

    def cpu_override(self) -> Callable[..., Any]:
        """An override that runs this backend's own path (not its fallback) on CPU tensors, for the tests."""
        return self.override()

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Eager softmax(q k^T / sqrt(D)) v in ``reference_dtype``: q/k/v [1, H, L, D] -> [H, L, D]."""
        return reference_attention(q, k, v, dtype=self.reference_dtype)

    def check(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        """``accuracy`` of ``out`` [1, H, L, D] against :meth:`reference`, plus ``ok`` (within ``tolerance``)."""
        acc = accuracy(out[0], self.reference(q, k, v))
        return dict(acc, ok=self.tolerance.holds(acc))

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r}>"
