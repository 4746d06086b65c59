"""The ordered registry of attention backends behind the ``H3TurboAttention`` node.

:data:`MODULES` lists the backend modules of this package in combo order; each defines ``BACKEND``, an
:class:`~.base.AttentionBackend`. :func:`choices` is the node's combo (``auto`` first), :func:`resolve`
maps a combo value to a backend name (``auto`` -> :data:`DEFAULT`, the exact backend: approximate
backends are opt-in by name), :func:`get` returns the backend, :func:`apply` gives a ModelPatcher clone
that runs it. Unknown names raise ValueError listing the accepted ones. To add a backend:
``docs/EXTENDING.md``.
"""
from __future__ import annotations

import importlib

from ...logs import log
from .base import AttentionBackend

AUTO = "auto"
DEFAULT = "exact"                                   # what ``auto`` runs on every device
MODULES: tuple[str, ...] = ("exact", "sdpa_core", "int8_sage", "cudnn_fp8", "auto8")

_BACKENDS: dict[str, AttentionBackend] = {}


def register(backend: AttentionBackend) -> AttentionBackend:
    """Add ``backend`` at the end of the combo. Raises ValueError for a name that is empty, ``auto`` or
    already registered, a ``fallback`` other than None, ``"core"`` or a registered backend's name, or an
    object that is not an :class:`~.base.AttentionBackend`."""
    if not isinstance(backend, AttentionBackend):
        raise ValueError(f"attention registry: {backend!r} is not an AttentionBackend")
    name = backend.name
    if not name or name == AUTO or name in _BACKENDS:
        raise ValueError(f"attention registry: backend name {name!r} is empty, reserved or already registered "
                         f"({list(_BACKENDS)})")
    if backend.fallback not in (None, "core") and backend.fallback not in _BACKENDS:
        raise ValueError(f"attention registry: backend {name!r} falls back to {backend.fallback!r}, "
                         f"which is not registered before it")
    _BACKENDS[name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a backend added by :func:`register` (tests). KeyError if it is not registered."""
    del _BACKENDS[name]


def names() -> tuple[str, ...]:
    """Registered backend names, in combo order."""
    return tuple(_BACKENDS)


def backends() -> tuple[AttentionBackend, ...]:
    """Registered backends, in combo order."""
    return tuple(_BACKENDS.values())


def choices() -> list[str]:
    """The node's combo: ``auto``, then every registered name."""
    return [AUTO, *_BACKENDS]


def resolve(name: str) -> str:
    """Map a node backend name to the one that runs: ``auto`` -> :data:`DEFAULT`; others unchanged.

    Raises ValueError naming the accepted values for an unknown name.
    """
    if name == AUTO:
        return DEFAULT
    if name not in _BACKENDS:
        raise ValueError(f"H3TurboAttention: unknown backend {name!r}; expected one of {choices()}")
    return name


def get(name: str) -> AttentionBackend:
    """The backend that runs for node value ``name`` (``auto`` included); ValueError as :func:`resolve`."""
    return _BACKENDS[resolve(name)]


def description() -> str:
    """The node's description: one sentence per backend (its ``summary``), ``auto`` named at the default."""
    parts = ["Attention backend for this model only."]
    for b in _BACKENDS.values():
        parts.append(f"{AUTO + ' = ' if b.name == DEFAULT else ''}{b.name}: {b.summary}")
    return " ".join(parts)


def apply(model, name: str):
    """Return a clone of ComfyUI MODEL ``model`` whose attention runs backend ``name`` (a :func:`choices`
    value). Only the clone's ``model_options["transformer_options"]["optimized_attention_override"]``
    changes; ``model`` and other clones are untouched. Raises ValueError for an unknown name (before
    cloning)."""
    backend = get(name)
    m = model.clone()
    to = m.model_options.setdefault("transformer_options", {})
    if "optimized_attention_override" in to:
        log.info("H3TurboAttention: replacing the attention override already set on this MODEL (%s)",
                 getattr(to["optimized_attention_override"], "__name__", type(to["optimized_attention_override"]).__name__))
    backend.apply(m)
    return m


#: backends of :data:`MODULES` left out of the combo because :meth:`~.base.AttentionBackend.available` said no:
#: {name: reason} (each logged once at import)
UNAVAILABLE: dict[str, str] = {}

for _module in MODULES:
    _b = importlib.import_module(f".{_module}", __package__).BACKEND
    _ok, _why = _b.available()
    if _ok:
        register(_b)
    else:
        UNAVAILABLE[_b.name] = _why
        log.info("H3TurboAttention: backend %r not offered: %s", _b.name, _why)
del _module, _b, _ok, _why
