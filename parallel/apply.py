"""What ``H3 Turbo Multi-GPU`` does to a MODEL (needs ComfyUI): pick the worker count and return a clone whose sampling
runs on the workers (:mod:`.pool`), or the MODEL itself for one GPU."""
from __future__ import annotations

import torch

from ..errors import SequenceParallelError
from ..logs import log, log_once
from . import engine
from .recipe import SP_OPTIONS_KEY, WRAPPER_KEY


def model_heads(model) -> int:
    """The attention head count of an H3 MODEL's DiT blocks (SequenceParallelError for another model)."""
    dm = getattr(getattr(model, "model", None), "diffusion_model", None)
    blocks = getattr(dm, "blocks", None)
    if dm is None or type(dm).__name__ != "MiniMaxH3Model" or not blocks:
        raise SequenceParallelError(f"H3 Turbo Multi-GPU: the MODEL is {type(dm).__name__ if dm is not None else '?'}, "
                                    "expected core's MiniMax H3 (MiniMaxH3Model)")
    return int(blocks[0].attn.heads)


def choose_world(gpus: int, device_type: str, visible: int, heads: int) -> tuple[int, str]:
    """(worker count, why). ``gpus`` 0 = every visible GPU (the largest count <= visible that divides ``heads``, so
    3 visible GPUs and 56 heads give 2, logged); an explicit count must divide ``heads`` and, on CUDA, be visible. On
    the CPU (ComfyUI --cpu) ``gpus`` > 1 means that many gloo worker processes (for tests); 0 means one."""
    if gpus == 0:
        if visible <= 1:
            return 1, f"{visible} {'GPU' if device_type == 'cuda' else 'device'} visible"
        fits = engine.ulysses_degrees(heads, visible)
        n = fits[-1] if fits else 1
        why = f"all {visible} visible GPUs" if n == visible else \
            f"{n} of the {visible} visible GPUs (the largest count that divides the {heads} heads)"
        return n, why
    if device_type == "cuda" and gpus > visible:
        raise SequenceParallelError(f"H3 Turbo Multi-GPU: gpus={gpus}, but {visible} GPU(s) are visible to ComfyUI")
    if gpus > 1:
        engine.check_degree(gpus, heads)
    return gpus, f"gpus={gpus}" + (" gloo processes on the CPU" if device_type != "cuda" else "")


def apply(model, gpus: int = 0, profile: bool = False):
    """The MODEL for ``gpus`` (see :func:`choose_world`): ``model`` itself for one worker (the plain path, logged),
    else a clone carrying the Multi-GPU OUTER_SAMPLE wrapper (first of its kind) and ``model_options["h3_turbo_sp"]``.
    Refuses (SequenceParallelError) before cloning: no yunchang, a count that does not divide the heads, a core
    without the per-block hook, a MODEL without ``cached_patcher_init``."""
    import comfy.model_management as mm

    heads = model_heads(model)
    dev = mm.get_torch_device()
    device_type = torch.device(dev).type
    visible = torch.cuda.device_count() if device_type == "cuda" else 1
    world, why = choose_world(int(gpus), device_type, visible, heads)
    if world == 1:
        log_once(("sp_plain", why), "H3 Turbo Multi-GPU: one worker (%s): the plain single-device path runs", why)
        return model
    engine.require_yunchang()
    missing = engine.core_hook_missing()
    if missing:
        try:
            import comfyui_version

            ver = comfyui_version.__version__
        except Exception:  # noqa: BLE001
            ver = "unknown"
        raise SequenceParallelError(f"H3 Turbo Multi-GPU: this ComfyUI ({ver}) cannot be sharded: {missing}. The node was "
                                    "checked against ComfyUI 0.33's comfy/ldm/minimax/model.py (docs/multigpu.md)")
    if not getattr(model, "cached_patcher_init", None):
        raise SequenceParallelError(
            "H3 Turbo Multi-GPU: this MODEL has no cached_patcher_init (core's re-creation hook), so the workers cannot "
            "load it. Load it with core's Load Diffusion Model or the pack's H3 loaders")
    from .pool import outer_sample_wrapper

    m = model.clone()
    m.model_options[SP_OPTIONS_KEY] = {"world": world, "device": device_type, "profile": bool(profile)}
    to = dict(m.model_options.get("transformer_options") or {})
    wrappers = dict(to.get("wrappers") or {})
    rest = {k: list(v) for k, v in (wrappers.get("outer_sample") or {}).items() if k != WRAPPER_KEY}
    wrappers["outer_sample"] = {WRAPPER_KEY: [outer_sample_wrapper], **rest}
    to["wrappers"] = wrappers
    m.model_options["transformer_options"] = to
    log.info("H3 Turbo Multi-GPU: %d workers (%s), Ulysses degree %d over %d heads (%d per worker)", world, why, world,
             heads, heads // world)
    return m
