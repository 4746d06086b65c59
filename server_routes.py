"""The pack's HTTP route: ``GET /h3turbo/ready`` (also served as ``/api/h3turbo/ready`` by ComfyUI).

The handler only reads cached state (``h3_turbo.state`` and the Turbo LoRA scanner's status): it never
hashes or loads a file. Turbo files are found by :mod:`h3_turbo.adapters.scan` in a background thread
started by :func:`register_routes` (and re-started, or queued behind a running scan, by ``?rescan=1``, at most
every ``RESCAN_MIN_INTERVAL_S``).

Response (JSON object; README "Hot API" is the user-facing copy of this list):
  ``ready`` (bool: the pack's nodes are registered and the first listing of the loras folders is done),
  ``available_turbos`` (list of {file, path, bytes, variant, source, nfe, shift_video, shift_audio, sha256,
  expected_sha256, verified, error}, plus official_name for a file recognized by its hash; ``verified``: True = the SHA-256 is a published one, False = an official
  file name whose content differs from its published SHA-256 (or cannot be read: ``error`` says why), None =
  no published SHA-256 to compare with, or the hash is still pending; ``error``: why the file cannot be used,
  from its header, its hash and the checks of Apply H3 Turbo LoRA, ``adapters/scan.py``; unreadable
  ``.safetensors`` files are listed with source "unreadable"), ``resident_turbos`` ({SHA-256: {variant,
  file (last used under), files (every name it was read under), bytes, device, layout, verified}}, ``verified``
  as in available_turbos), ``current_turbo`` (str),
  ``current_turbo_at`` (unix s or null), ``loaded_models`` ({path: {format, compute, bytes, packed_bytes,
  layers_nvfp4, kernel_extra_bytes, kernel_workspace_bytes, loaded_at}}), ``adapter_loads`` ({loads, hits,
  evictions}: Turbo LoRA file reads / cache hits / evictions), ``scan`` (the background scanner: {state,
  started_at, listed_at, finished_at, pending_hashes, files_seen, error, scans_started, scans_completed,
  requested}, and for ``?rescan=1`` ``rescan``: "started", "queued" or "throttled" (+ ``retry_in_s``); the listing
  a started or queued re-scan gives is complete once ``scans_completed >= requested``), ``nodes``
  (registered node ids of the pack), ``time`` (the server's unix time of this answer), ``device`` ({name, type}), ``versions``
  ({h3_turbo, comfyui, torch}).
"""
from __future__ import annotations

import time

from . import state
from .logs import log

ROUTE = "/h3turbo/ready"
RESCAN_MIN_INTERVAL_S = 5.0
AUTO_RESCAN_S = 30.0

_registered = False
_static: dict = state.Store("ready_route_static").data   # versions and device, read once
_last_rescan = 0.0


def _static_info() -> dict:
    """Device and versions, computed once (torch/cuda queries are not free)."""
    if _static:
        return _static
    from . import __version__

    info = {"versions": {"h3_turbo": __version__}, "device": {"name": None, "type": None}}
    try:
        import comfyui_version

        info["versions"]["comfyui"] = comfyui_version.__version__
    except ImportError:
        info["versions"]["comfyui"] = None
    try:
        import torch

        info["versions"]["torch"] = torch.__version__
    except ImportError:
        info["versions"]["torch"] = None
    try:
        import comfy.model_management as mm

        dev = mm.get_torch_device()
        info["device"] = {"name": mm.get_torch_device_name(dev), "type": getattr(dev, "type", str(dev))}
    except Exception as e:  # reported, not raised: the route must answer
        info["device"] = {"name": None, "type": None, "error": f"{type(e).__name__}: {e}"}
    _static.update(info)
    return _static


#: "node_classes": the callable register_routes was given; "ids": the registered node ids, once known
_NODES = state.Store("ready_route_nodes")


def _node_ids() -> list[str]:
    """Ids of the pack's node classes that ComfyUI's registry maps to these very classes."""
    with _NODES.lock:
        if _NODES.data.get("ids"):
            return list(_NODES.data["ids"])
        node_classes = _NODES.data.get("node_classes")
    if node_classes is None:
        return []
    try:
        import nodes  # ComfyUI's

        ids = []
        for cls in node_classes():
            nid = cls.GET_SCHEMA().node_id
            if nodes.NODE_CLASS_MAPPINGS.get(nid) is cls:
                ids.append(nid)
    except Exception as e:
        log.debug("h3_turbo: node registry not readable yet: %s", e)
        return []
    with _NODES.lock:
        _NODES.data["ids"] = sorted(ids)
    return sorted(ids)


def ready_payload() -> dict:
    """The JSON body of ``GET /h3turbo/ready`` (cheap: cached state only)."""
    from . import state
    from .adapters.scan import SCANNER

    snap = state.snapshot()
    scan = SCANNER.status()
    node_ids = _node_ids()
    body = {
        "ready": bool(node_ids) and scan["listed_at"] is not None,
        # the scanner's own list (hash-verified) wins over other writers of state.available_turbos
        "available_turbos": SCANNER.items() if scan["listed_at"] is not None else snap["available_turbos"],
        "resident_turbos": snap["resident_turbos"],
        "current_turbo": snap["current_turbo"],
        "current_turbo_at": snap["current_turbo_at"],
        "loaded_models": snap["loaded_models"],
        "adapter_loads": _adapter_loads(),
        "scan": scan,
        "nodes": node_ids,
        "time": time.time(),
    }
    body.update(_static_info())
    return body


def _adapter_loads() -> dict:
    """Turbo LoRA residency counters (``adapters.residency.LOAD_STATS``): ``loads`` = adapter files read
    from disk, ``hits`` = requests served from the resident cache, ``evictions``."""
    try:
        from .adapters.residency import LOAD_STATS

        return dict(LOAD_STATS)
    except Exception as e:  # reported, not raised: the route must answer
        return {"error": f"{type(e).__name__}: {e}"}


def register_routes(server=None, node_classes=None) -> bool:
    """Add ``GET /h3turbo/ready`` to ``PromptServer.instance.routes`` and start the Turbo LoRA scan.

    Idempotent. Returns False (logged once) when there is no PromptServer (in-process harness runs):
    the scan still starts so ``state`` is filled. ``server`` overrides ``PromptServer.instance`` (tests).
    ``node_classes``: a callable returning the pack's node classes (the extension passes
    ``nodes.all_nodes``), reported under ``nodes`` once ComfyUI has registered them.
    """
    global _registered, _last_rescan
    from .adapters.scan import SCANNER

    if node_classes is not None:
        with _NODES.lock:
            _NODES.data["node_classes"] = node_classes

    SCANNER.start()
    _last_rescan = time.monotonic()
    if _registered:
        return True
    if server is None:
        try:
            from server import PromptServer

            server = getattr(PromptServer, "instance", None)
        except ImportError:
            server = None
    if server is None:
        log.info("h3_turbo: no ComfyUI PromptServer in this process; %s not registered", ROUTE)
        return False
    from aiohttp import web

    async def h3turbo_ready(request):
        global _last_rescan
        now = time.monotonic()
        forced = request.query.get("rescan") in ("1", "true", "yes")
        # ?rescan=1 at most every RESCAN_MIN_INTERVAL_S (it starts a scan, or queues one behind the running one:
        # scan.requested says which; else scan.rescan = "throttled" with the seconds to wait); otherwise a background
        # re-scan when the last one is older than AUTO_RESCAN_S (headers + stat only; hashes are cached per
        # path+size+mtime), so files added or replaced in the loras folders show up without a restart. The answer
        # is never delayed.
        outcome = None
        if now - _last_rescan >= (RESCAN_MIN_INTERVAL_S if forced else AUTO_RESCAN_S):
            _last_rescan = now
            outcome = "started" if SCANNER.start() else "queued"
        payload = ready_payload()
        if forced:
            payload["scan"]["rescan"] = outcome or "throttled"
            if outcome is None:
                payload["scan"]["retry_in_s"] = round(RESCAN_MIN_INTERVAL_S - (now - _last_rescan), 3)
        return web.json_response(payload, dumps=_dumps)

    server.routes.get(ROUTE)(h3turbo_ready)
    _registered = True
    log.info("h3_turbo: registered GET %s", ROUTE)
    return True


def _dumps(obj) -> str:
    import json

    return json.dumps(obj, default=str)
