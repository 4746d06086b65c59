"""The compute-path registry: which NVFP4 paths exist, in which order ``auto`` tries them, and which one
a request resolves to on a device.

- :data:`PATHS`: name -> :class:`~.paths.base.ComputePath`, in ``auto``'s priority (fastest first);
  ``reference`` is last and runs everywhere.
- :func:`choices`: the loader's ``compute`` combo (``auto`` + every path).
- :func:`resolve`: ``(path, reason)`` for a request on a device; an explicit path the device cannot run,
  or an unknown name, raises :class:`h3_turbo.errors.NoCapablePathError` with the reason; ``auto`` logs
  its choice once per device, with every faster path's reason for not being picked.

Add a path: one module in ``kernels/paths/`` exporting ``PATH``, plus its line in :data:`PATHS`
(docs/EXTENDING.md).
"""
from __future__ import annotations

import torch

from ..errors import NoCapablePathError
from ..logs import log_once
from .paths import base, blackwell_fp4, exact, fp8, int8, reference
from .paths.base import ComputePath

AUTO = "auto"
#: auto's priority order (the first path the device supports wins)
PATHS: dict[str, ComputePath] = {p.name: p for p in (blackwell_fp4.PATH, fp8.PATH, exact.PATH, int8.PATH,
                                                     reference.PATH)}
#: the order the loader's combo lists them in
DISPLAY_ORDER = ("exact", "fp8", "int8", "reference", "blackwell_fp4")


def paths_for(weight_format: str = "nvfp4") -> dict[str, ComputePath]:
    """The registered paths that compute from ``weight_format`` weights (``reference`` serves every format)."""
    return {n: p for n, p in PATHS.items() if p.weight_format == weight_format or n == "reference"}


def choices(weight_format: str = "nvfp4") -> tuple[str, ...]:
    """A loader's ``compute`` combo: ``auto`` then every registered path for its weight format."""
    own = paths_for(weight_format)
    return (AUTO,) + tuple(n for n in DISPLAY_ORDER if n in own) + tuple(n for n in own if n not in DISPLAY_ORDER)


def get(name: str) -> ComputePath:
    """The path named ``name``; NoCapablePathError naming the known paths otherwise."""
    try:
        return PATHS[name]
    except KeyError:
        raise NoCapablePathError(f"unknown path {name!r} (compute paths: {', '.join(PATHS)})") from None


def _sm(device) -> str:
    cc = base.capability(device)
    return f"sm_{cc[0]}{cc[1]}"


def resolve(requested: str, device: torch.device, weight_format: str = "nvfp4") -> tuple[str, str]:
    """Map a requested compute mode to the path this device runs: ``(path, reason)``. Paths of another
    ``weight_format`` than the loader's are unknown names (NoCapablePathError)."""
    if weight_format != "nvfp4":
        return _resolve_other(requested, torch.device(device), weight_format)
    if requested not in choices():
        raise NoCapablePathError(f"compute={requested!r}; expected one of {', '.join(choices())}")
    device = torch.device(device)
    if requested == "reference":
        return "reference", "requested"
    if device.type != "cuda":
        if requested == AUTO:
            reason = f"device {device} is not CUDA: pure-torch reference (dequantize + F.linear)"
            log_once(("auto", str(device)), "H3 Turbo compute: reference (%s)", reason)
            return "reference", reason
        raise NoCapablePathError(f"compute {requested!r} needs a CUDA GPU, but the device is {device}; "
                                 f"use 'reference' or 'auto'")
    if requested != AUTO:
        ok, why = PATHS[requested].supports(device)
        if not ok:
            raise NoCapablePathError(f"compute {requested!r} cannot run on {device} ({_sm(device)}): {why}")
        return requested, why
    why_not = []
    for name, path in paths_for().items():
        if name == "reference":
            continue
        ok, why = path.supports(device)
        if ok:
            log_once(("auto", str(device)), "H3 Turbo compute on %s: %s (%s)", device, name, why)
            return name, why
        why_not.append(f"{name}: {why}")
    reason = (f"no fast path on {_sm(device)} (Triton {'present' if base.has_triton() else 'missing'}; "
              + "; ".join(why_not) + ")")
    log_once(("auto", str(device)), "H3 Turbo compute on %s: reference (%s)", device, reason)
    return "reference", reason


def _resolve_other(requested: str, device: torch.device, weight_format: str) -> tuple[str, str]:
    """``resolve`` for a non-NVFP4 weight format: an explicit path runs where its ``supports`` says so (CPU
    included); ``auto`` picks the first capable one on CUDA and ``reference`` on other devices."""
    names = choices(weight_format)
    if requested not in names:
        raise NoCapablePathError(f"compute={requested!r}; expected one of {', '.join(names)}")
    if requested == "reference":
        return "reference", "requested"
    if requested != AUTO:
        ok, why = PATHS[requested].supports(device)
        if not ok:
            raise NoCapablePathError(f"compute {requested!r} cannot run on {device}: {why}")
        return requested, why
    why_not = []
    if device.type == "cuda":
        for name, path in paths_for(weight_format).items():
            if name == "reference":
                continue
            ok, why = path.supports(device)
            if ok:
                log_once(("auto", weight_format, str(device)), "H3 Turbo compute (%s weights) on %s: %s (%s)",
                         weight_format, device, name, why)
                return name, why
            why_not.append(f"{name}: {why}")
    reason = (f"device {device} is not CUDA: dequantize + F.linear" if device.type != "cuda"
              else "no capable path (" + "; ".join(why_not) + ")")
    log_once(("auto", weight_format, str(device)), "H3 Turbo compute (%s weights) on %s: reference (%s)",
             weight_format, device, reason)
    return "reference", reason
