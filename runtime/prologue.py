"""The packed layout's host tensors placed on the device once per layout, for core's H3 forward (a
``DIFFUSION_MODEL`` wrapper).

Every forward, core's ``MiniMaxH3Model._forward`` reads ``minimax_payload["layout"]``, a ``PackedLayout`` that
``extra_conds`` builds once per sampling run (the forward builds one itself when the call has none). It then
converts ``layout.position_ids`` ([S, 3] float64, CPU) to float32 and copies it to the device
(``rope_freqs``), and copies the ``img_update`` / ``audio_update`` masks (bool, CPU) there. These are host
operations and pageable copies in the forward's prologue, before the first DiT block, while the GPU has nothing
queued. The GPU waits for them.

:func:`wrapper` gives core a shallow copy of the layout whose three tensors are already on the forward's device
(float32 position ids, the bool masks). The copy is made once per (layout, device) and kept while the layout lives.
Core's ``.to`` calls on these tensors are then no-ops, and the forward computes from the same numbers, because it
is the same conversion done once. A call without a layout gets one from core's own ``PackedLayout`` for the call's
signature, cached per signature. This happens only when the payload has no keyframes or references: those calls
come with ``extra_conds``' layout, or core builds theirs.

A core whose layout lacks one of these attributes, or whose forward takes no ``minimax_payload``, is left as it is.
The wrapper then passes the call through, and logs the reason once. ``SETTINGS["device_layout"]`` (default True)
switches the wrapper off, for A/B measurements.
"""
from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict

import torch

from ..logs import log_once

WRAPPER_KEY = "h3_turbo_device_layout"
SETTINGS = {"device_layout": True}
_FIELDS = ("position_ids", "img_update", "audio_update")
_MARK = "_h3turbo_device"                 # set on a device copy: the device it is on
_LOCK = threading.Lock()
_ON_DEVICE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # layout -> {device: its device copy}
_BUILT: "OrderedDict[tuple, object]" = OrderedDict()                    # (signature, device) -> device copy
_BUILT_MAX = 4
_OFF: list[str] = []                      # why the wrapper passes every call through (core's layout differs)
STATS = {"placed": 0, "built": 0, "reused": 0}


def signature(dm, x, context) -> tuple | None:
    """Core's layout signature of a call, (text_len, latent_t, lat_h, lat_w, audio_t) of the video padded to the
    patch size as core's forward pads it; None for inputs that are not ([video [1, C, T, H, W], audio [..., T]],
    context [1, L, D])."""
    try:
        v, a = x[0], x[1]
        pt, ph, pw = (int(p) for p in dm.patch_size)
        up = lambda n, p: -(-int(n) // p) * p     # noqa: E731 - pad_to_patch_size rounds each axis up
        return (int(context.shape[1]), up(v.shape[2], pt), up(v.shape[3], ph), up(v.shape[4], pw), int(a.shape[-1]))
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def on_device(layout, device):
    """The device copy of ``layout``: a shallow copy (segments, signature and the other attributes shared) whose
    position ids are float32 on ``device`` and whose update masks are on ``device``; made once per (layout,
    device). Raises AttributeError when the layout lacks one of them."""
    device = torch.device(device)
    if getattr(layout, _MARK, None) == device:
        return layout
    with _LOCK:
        got = _ON_DEVICE.get(layout, {}).get(device)
        if got is not None:
            STATS["reused"] += 1
            return got
    pos, img, aud = (getattr(layout, f) for f in _FIELDS)
    out = copy.copy(layout)
    out.position_ids = pos.to(torch.float32).to(device)     # what core's rope_freqs does to them every forward
    out.img_update = img.to(device)
    out.audio_update = aud.to(device)
    setattr(out, _MARK, device)
    with _LOCK:
        _ON_DEVICE.setdefault(layout, {})[device] = out
        STATS["placed"] += 1
    return out


def _built(sig: tuple, device):
    """Core's ``PackedLayout`` of signature ``sig`` (no keyframes, no references) on ``device``; the last
    ``_BUILT_MAX`` kept."""
    key = (sig, torch.device(device))
    with _LOCK:
        got = _BUILT.get(key)
        if got is not None:
            _BUILT.move_to_end(key)
            STATS["reused"] += 1
            return got
    import comfy.ldm.minimax.model as core

    layout = on_device(core.PackedLayout(*sig), device)
    with _LOCK:
        _BUILT[key] = layout
        STATS["built"] += 1
        while len(_BUILT) > _BUILT_MAX:
            _BUILT.popitem(last=False)
    return layout


def wrapper(executor, x, timestep, context, transformer_options, *args, **kwargs):
    """``WrappersMP.DIFFUSION_MODEL`` wrapper of core's ``_forward(x, timestep, context, transformer_options,
    minimax_payload=None, **kwargs)``: the same call with ``minimax_payload["layout"]`` on the device (see the
    module). A payload whose layout's signature is not the call's (core builds a new one) is passed as it is."""
    if SETTINGS["device_layout"] and not _OFF and not args and "minimax_payload" in kwargs:
        payload = kwargs["minimax_payload"] or {}
        try:
            sig = signature(executor.class_obj, x, context)
            layout = payload.get("layout")
            if layout is not None and sig is not None and getattr(layout, "signature", None) == sig:
                kwargs["minimax_payload"] = {**payload, "layout": on_device(layout, x[0].device)}
            elif layout is None and sig is not None and not payload.get("keyframes") and not payload.get("refs"):
                kwargs["minimax_payload"] = {**payload, "layout": _built(sig, x[0].device)}
        except AttributeError as e:
            _OFF.append(str(e))
            log_once(("device_layout", str(e)), "H3 Turbo: core's H3 packed layout is not the one this pack places "
                     "on the device (%s); every forward's prologue runs as core's", e)
    return executor(x, timestep, context, transformer_options, *args, **kwargs)


def install(model_patcher) -> None:
    """Register :func:`wrapper` on ``model_patcher`` (an H3 MODEL; its clones inherit it)."""
    import comfy.patcher_extension as pe

    model_patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, wrapper)
