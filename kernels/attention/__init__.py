"""Attention backends for H3, set per model through core ComfyUI's attention override.

One module per backend, each defining ``BACKEND`` (an :class:`~.base.AttentionBackend`: name, ``supports``,
``approximate``, how it is applied to a cloned ModelPatcher, its eager reference and tested bound, its
fallback):

- :mod:`.exact`: exact SDPA with the backend measured fastest on this device (``auto`` runs it);
- :mod:`.sdpa_core`: core's registered ``"pytorch"`` attention;
- :mod:`.int8_sage`: the opt-in, approximate 8-bit override; its Triton kernels are :mod:`.int8_kernels`.

:mod:`.registry` orders them (the node's combo) and is re-exported here: :func:`choices`, :func:`resolve`,
:func:`get`, :func:`apply`, ... Shared pieces: :mod:`.base` (core's call convention), :mod:`.reference`
(eager attention and error measures), :mod:`.guard` (the approximate backends' per-layer accuracy check),
:mod:`.stress` (the outlier stress corpus the 8-bit paths are tested on), :mod:`.fa3` (FlashAttention-3, a candidate
of ``exact``). Process state lives in :mod:`h3_turbo.state` (``ATTENTION_*``).
Torch only; ComfyUI is imported by ``sdpa_core`` on use. Adding a backend: ``docs/EXTENDING.md``.
"""
from .registry import AUTO, DEFAULT, apply, backends, choices, description, get, names, register, resolve, unregister

__all__ = ["AUTO", "DEFAULT", "apply", "backends", "choices", "description", "get", "names", "register", "resolve",
           "unregister"]
