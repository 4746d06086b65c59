"""Process-wide state of the pack, in one place.

Two kinds:

- the runtime picture read by ``GET /h3turbo/ready`` (:func:`set_current_turbo`, :func:`record_loaded_model`,
  ..., :func:`snapshot`): cheap to read, updated by the nodes;
- named :class:`Store` objects, each the one home of a cache, counter set or buffer pool that a module
  keeps between calls (adapter residency, file hashes, LoRA routes, kernel work buffers, the attention
  chooser, ...). Every store has ``clear()`` and ``snapshot()``; :func:`clear_all` resets all of them
  (tests, model unload) and :func:`stores_snapshot` reports them.

Thread-safe (ComfyUI runs prompts on a worker thread and serves HTTP on the event loop). Nothing here
hashes or loads files; standard library only.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Hashable

_lock = threading.Lock()
_state: dict = {
    "current_turbo": "none",         # adapter used by the most recent sampling run
    "current_turbo_at": None,
    "loaded_models": {},             # path -> {"format", "compute", "bytes", ...}
    "resident_turbos": {},           # content key -> {"variant", "file", "bytes", "device"}
    "available_turbos": [],          # last scan of the loras folder: [{"variant", "file", "sha256", "verified"}]
}


def set_current_turbo(name: str) -> None:
    """Record the Turbo adapter (alias or file) used by the sampling run that just started ('none' if off)."""
    with _lock:
        _state["current_turbo"] = name or "none"
        _state["current_turbo_at"] = time.time()


def record_loaded_model(path: str, **info) -> None:
    """Record an H3 model loaded by the pack (format, compute path, packed bytes...)."""
    with _lock:
        _state["loaded_models"][path] = dict(info, loaded_at=time.time())


def record_resident_turbo(key: str, **info) -> None:
    with _lock:
        _state["resident_turbos"][key] = dict(info)


def drop_resident_turbo(key: str) -> None:
    with _lock:
        _state["resident_turbos"].pop(key, None)


def set_available_turbos(items: list[dict]) -> None:
    with _lock:
        _state["available_turbos"] = [dict(i) for i in items]


def snapshot() -> dict:
    """A deep-enough copy of the runtime picture for JSON responses."""
    with _lock:
        return {
            "current_turbo": _state["current_turbo"],
            "current_turbo_at": _state["current_turbo_at"],
            "loaded_models": {k: dict(v) for k, v in _state["loaded_models"].items()},
            "resident_turbos": {k: dict(v) for k, v in _state["resident_turbos"].items()},
            "available_turbos": [dict(i) for i in _state["available_turbos"]],
        }


# --------------------------------------------------------------------------- named stores

class Store:
    """A named dict (or OrderedDict) of process state under a re-entrant lock.

    ``data`` is the mapping itself (its identity never changes: :meth:`clear` empties it in place, after
    calling ``on_clear(data)`` so an owner can release what the entries hold). ``snapshot()`` gives
    ``{"entries": n}`` or what ``describe(data)`` returns.
    """

    def __init__(self, name: str, ordered: bool = False, on_clear: Callable[[dict], Any] | None = None,
                 describe: Callable[[dict], dict] | None = None):
        self.name = name
        self.lock = threading.RLock()
        self.data: dict = collections.OrderedDict() if ordered else {}
        self.on_clear = on_clear
        self.describe = describe
        _STORES[name] = self

    def clear(self) -> None:
        with self.lock:
            if self.on_clear is not None and self.data:
                self.on_clear(self.data)
            self.data.clear()

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.describe(self.data)) if self.describe else {"entries": len(self.data)}


class KeySet(Store):
    """A set of keys (stored as a dict): :meth:`add_new` is True the first time a key is added."""

    def add_new(self, key: Hashable) -> bool:
        with self.lock:
            if key in self.data:
                return False
            self.data[key] = True
            return True


class _Counts(dict):
    """A dict whose missing keys read as 0 (without being inserted); ``update`` sets, as for any dict."""

    def __missing__(self, key):
        return 0


class Counters(Store):
    """Named counters: :meth:`incr`, ``counts`` (a copy); ``data`` reads 0 for a counter never incremented."""

    def __init__(self, name: str, keys: tuple[str, ...] = ()):
        super().__init__(name, describe=lambda d: dict(d))
        self.data = _Counts({k: 0 for k in keys})
        self._keys = keys

    def incr(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.data[key] = self.data[key] + n

    def __getitem__(self, key: str) -> int:
        return self.data[key]

    def clear(self) -> None:
        with self.lock:
            self.data.clear()
            self.data.update({k: 0 for k in self._keys})

    @property
    def counts(self) -> dict[str, int]:
        with self.lock:
            return dict(self.data)


class Slot(Store):
    """One lazily built object (e.g. the attention chooser): :meth:`get` builds it with ``factory`` once."""

    def get(self, factory: Callable[[], Any]) -> Any:
        with self.lock:
            obj = self.data.get("value")
            if obj is None:
                obj = self.data["value"] = factory()
            return obj


_STORES: dict[str, Store] = {}

#: keys already logged by :func:`h3_turbo.logs.log_once`
LOGGED = KeySet("logged")
#: E2M1 value tables of :func:`h3_turbo.formats.nvfp4.dequantize`, per (device, dtype)
NVFP4_LUT = Store("nvfp4_lut")

# Attention backends (``kernels/attention/``): cleared, each is rebuilt on next use (the exact chooser measures
# its SDPA candidates again; models already patched keep the override object they were given).
#: the exact backend's :class:`~h3_turbo.kernels.attention.exact.BackendChooser` (one measurement cache)
ATTENTION_CHOOSER = Slot("attention_chooser", describe=lambda d: {
    "measured": len(d["value"].choices) if d.get("value") is not None else 0})
#: the process-wide ``exact`` override (:func:`~h3_turbo.kernels.attention.exact.exact_override`)
ATTENTION_EXACT = Slot("attention_exact")
#: the process-wide ``int8_sage`` override (:func:`~h3_turbo.kernels.attention.int8_sage.int8_override`)
ATTENTION_INT8 = Slot("attention_int8_sage")
#: the process-wide ``cudnn_fp8`` override (:func:`~h3_turbo.kernels.attention.cudnn_fp8.cudnn_fp8_override`)
ATTENTION_CUDNN_FP8 = Slot("attention_cudnn_fp8")
#: the process-wide ``auto8`` override (:func:`~h3_turbo.kernels.attention.auto8.auto8_override`: its choices)
ATTENTION_AUTO8 = Slot("attention_auto8")
#: (device, BLOCK_N) -> the [16, BLOCK_N] e4m3 ones tile of the 8-bit kernel's tensor-core row sum
ATTENTION_FP8_ONES = Store("attention_fp8_ones")


def store(name: str) -> Store:
    """The store registered as ``name`` (KeyError naming the known ones otherwise)."""
    try:
        return _STORES[name]
    except KeyError:
        raise KeyError(f"no state store {name!r}; known: {sorted(_STORES)}") from None


def clear_all() -> None:
    """Clear every store (caches, counters, buffers). The runtime picture is kept."""
    for s in list(_STORES.values()):
        s.clear()


def stores_snapshot() -> dict[str, dict]:
    """``{name: store.snapshot()}`` for every store."""
    return {name: s.snapshot() for name, s in sorted(_STORES.items())}
