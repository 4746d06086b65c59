"""The pack's logger (``h3_turbo``) and its one :func:`log_once`.

Fallbacks and automatic choices are logged once per process, with their reason; the set of keys
already logged lives in :data:`h3_turbo.state.LOGGED` (``state.clear_all()`` forgets it).
"""
from __future__ import annotations

import logging
from typing import Hashable

log = logging.getLogger("h3_turbo")


def log_once(key: Hashable, msg: str, *args, level: int = logging.INFO) -> bool:
    """``log.log(level, msg, *args)`` the first time ``key`` is seen in this process; True if it logged."""
    from . import state

    if not state.LOGGED.add_new(key):
        return False
    log.log(level, msg, *args)
    return True
