"""Process-wide runtime state read by ``GET /h3turbo/ready``: cheap to read, updated by the nodes.

Thread-safe (ComfyUI runs prompts on a worker thread and serves HTTP on the event loop).
Nothing here hashes or loads files.
"""
from __future__ import annotations

import threading
import time

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
    """A deep-enough copy of the state for JSON responses."""
    with _lock:
        return {
            "current_turbo": _state["current_turbo"],
            "current_turbo_at": _state["current_turbo_at"],
            "loaded_models": {k: dict(v) for k, v in _state["loaded_models"].items()},
            "resident_turbos": {k: dict(v) for k, v in _state["resident_turbos"].items()},
            "available_turbos": [dict(i) for i in _state["available_turbos"]],
        }
