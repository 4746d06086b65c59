"""Validate, convert and build an H3 MODEL (a ComfyUI ModelPatcher) from a checkpoint file.

Order of work (a failed load builds nothing and touches no loaded model):
1. resolve ``compute`` (an impossible request fails first: :class:`h3_turbo.errors.NoCapablePathError`);
2. read and validate the safetensors header, detect the format and the H3 sizes (``formats.detect``);
3. stream the file into the ComfyUI-native layout in memory (``formats.convert.iter_native``): native
   files pass through, foreign NVFP4 files are converted bit-preservingly, BF16/FP16/FP32 files get their
   208 block projections quantized (ComfyUI progress bar); every tensor read is value-checked there
   (``formats.values``: NaN / Inf, negative block scales), the check ``inspect`` and ``quantize`` run too;
4. check the converted scales (:func:`check_values`);
5. build core's H3 with core's loader ``comfy.sd.load_diffusion_model_state_dict`` and the pack's
   operations (:func:`h3_turbo.runtime.ops.make_operations`: core keeps H3's fp32 island in fp32 only
   with them), then install the compute path and report the resident size to ComfyUI (packed weights +
   the path's prepared copies + its reused work buffers).
"""
from __future__ import annotations

import os

import torch

from .. import state
from ..adapters import contracts
from ..errors import CheckpointError, NoCapablePathError
from ..formats import values
from ..formats.convert import iter_native, make_plan, native_metadata
from ..formats.detect import Detection, detect
from ..formats.safetensors_io import read_header
from ..kernels import dispatch, registry
from ..logs import log, log_once
from .ops import install_compute, make_operations
from . import prologue


def resolve_compute(requested: str, device: torch.device) -> tuple[str, str]:
    """Compute path for ``requested`` on ``device``: ``(path, reason)`` (:func:`h3_turbo.kernels.registry.resolve`).
    NoCapablePathError (a ValueError and a RuntimeError) for an unknown name or a path the device cannot run."""
    try:
        return registry.resolve(requested, device)
    except NoCapablePathError as e:
        if requested in registry.choices():   # the device cannot run it: say which input asked for it
            raise NoCapablePathError(f"compute={requested}: {e}") from None
        raise


def kernel_extra_bytes(shapes: list[tuple[int, int]], path: str) -> int:
    """GPU bytes the compute path's prepared copies add per model (shapes: logical [N, K] of every NVFP4 layer)."""
    return dispatch.prepared_bytes(shapes, path)


def check_values(path: str, sd: dict[str, torch.Tensor], det: Detection) -> None:
    """Value checks on the native state dict before building, for what conversion computed (the input was
    checked as it was read): block scales (``formats.values.problems``) and global scales finite and > 0.
    Raises :class:`CheckpointError` naming the key."""
    for stem in det.quant_layers:
        bs = sd.get(f"{stem}.weight_scale")
        bad = values.problems(bs, block_scale=True) if bs is not None else []
        if bad:
            raise CheckpointError(path, "; ".join(bad), key=f"{stem}.weight_scale")
        for s in ("weight_scale_2", "input_scale"):
            v = sd.get(f"{stem}.{s}")
            if v is not None:
                x = float(v.float().reshape(-1)[0])
                if not (x > 0 and x != float("inf")):
                    raise CheckpointError(path, f"{s} is {x}", key=f"{stem}.{s}", expected="a finite number > 0")


ADALN_CHOICES = ("auto", "resident", "table")
#: ``adaln=auto`` keeps the AdaLN weights resident when the model fits the free device memory with this margin
ADALN_MARGIN_BYTES = 4 << 30
ADALN_MARGIN_FRACTION = 0.10


def _need_and_free(resident_bytes: int, device) -> tuple[int, int]:
    """(bytes needed: ``resident_bytes`` + 10 % + 4 GiB, ComfyUI's free memory on ``device``): the margin both ``auto``
    choices (``adaln``, ``weights``) keep."""
    import comfy.model_management as mm

    return int(resident_bytes * (1 + ADALN_MARGIN_FRACTION)) + ADALN_MARGIN_BYTES, int(mm.get_free_memory(device))


def resolve_adaln(requested: str, diffusion_model, device, model_bytes: int) -> tuple[str, str]:
    """``(mode, reason)`` for the loader's ``adaln`` input: ``resident`` (core's modules on the device), ``table``
    (:mod:`h3_turbo.runtime.adaln_memo`: the weights in CPU memory, rows per timestep group) or, for ``auto``,
    ``resident`` on the CPU or when ``model_bytes`` + 10 % + 4 GiB fit the device's free memory, else ``table``.
    A pruned curve-form checkpoint (``adaln_t_table``) is always ``resident`` (left to core). ValueError for an
    unknown name."""
    if requested not in ADALN_CHOICES:
        raise ValueError(f"adaln={requested!r}: expected one of {', '.join(ADALN_CHOICES)}")
    if getattr(diffusion_model, "use_adaln_curves", False):
        return "resident", "pruned checkpoint (adaln_t_table curve form): its AdaLN is small, left to core"
    if requested != "auto":
        return requested, "requested"
    if torch.device(device).type == "cpu":
        return "resident", "CPU: the weights already live in CPU memory"
    need, free = _need_and_free(model_bytes, device)
    if need <= free:
        return "resident", f"model {model_bytes / 2**30:.1f} GiB + margin fits {free / 2**30:.1f} GiB free"
    return "table", f"model {model_bytes / 2**30:.1f} GiB + margin exceeds {free / 2**30:.1f} GiB free"


WEIGHTS_CHOICES = ("auto", "lean", "resident")


def resolve_weights(requested: str, cpath: str, device, model_bytes: int,
                    shapes: list[tuple[int, int]]) -> tuple[str, str]:
    """``(mode, reason)`` for the loader's ``weights`` input on compute path ``cpath``: ``resident`` (the path's
    per-layer prepared copies, e.g. fp8's e4m3 weights) or ``lean`` (none: each call derives the weight from the
    packed NVFP4 storage into one reused buffer; the same output bit for bit). ``auto``: ``resident`` when
    ``model_bytes`` + the prepared copies + the work buffers, plus 10 % and 4 GiB, fit the device's free memory,
    else ``lean``. A path without a lean mode (exact, reference, blackwell_fp4: no per-layer copies) is ``lean``
    whatever is asked. ValueError for an unknown name."""
    if requested not in WEIGHTS_CHOICES:
        raise ValueError(f"weights={requested!r}: expected one of {', '.join(WEIGHTS_CHOICES)}")
    p = registry.get(cpath)
    if not p.has_lean_mode:
        return "lean", f"compute={cpath} keeps no per-layer weight copies (the weights input changes nothing)"
    if requested != "auto":
        return requested, "requested"
    if torch.device(device).type == "cpu":
        return "resident", "CPU: the kernels do not run here"
    copies = dispatch.prepared_bytes(shapes, cpath) - dispatch.prepared_bytes(shapes, cpath, lean=True)
    need, free = _need_and_free(model_bytes + copies + dispatch.workspace_bytes(shapes, cpath), device)
    nums = (f"model {model_bytes / 2**30:.1f} GiB + {copies / 2**30:.1f} GiB {cpath} copies + margin = "
            f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    return ("resident", f"fits: {nums}") if need <= free else ("lean", f"does not fit: {nums}")


def install_kernels(mp, cpath: str, weights: str, load_device, shapes: list[tuple[int, int]],
                    what: str) -> tuple[int, str, int, int]:
    """Put the NVFP4 projections of the built MODEL ``mp`` on kernel path ``cpath`` (``install_compute``) with the
    weight mode ``resolve_weights`` picks for ``weights``, and set the size ComfyUI reserves: packed weights + the
    kernels' prepared copies + their reused work buffers. ``shapes``: the [N, K] of the NVFP4 projections; ``what``
    names the checkpoint in the log. Returns (layers installed, weights mode, prepared bytes, work-buffer bytes)."""
    wmode, wreason = resolve_weights(weights, cpath, load_device, int(mp.model_size()), shapes)
    n = install_compute(mp, cpath, weights=wmode)
    extra = dispatch.prepared_bytes(shapes, cpath, lean=wmode == "lean")
    work_b = dispatch.workspace_bytes(shapes, cpath)
    mp.size = int(mp.model_size()) + extra + work_b
    log_once(("installed", what, cpath, wmode), "H3 Turbo loader: %d NVFP4 projections use compute=%s, weights=%s "
             "-> %s (%s): +%.2f GiB prepared weights, +%.2f GiB work buffers on the GPU", n, cpath, weights, wmode,
             wreason, extra / 2**30, work_b / 2**30)
    return n, wmode, extra, work_b


def load_h3_model(path: str, compute: str = "auto", disable_dynamic: bool = False, keep_fp32_island: bool = True,
                  adaln: str = "auto", weights: str = "auto"):
    """Validate, convert and build an H3 MODEL (a ComfyUI ModelPatcher) from ``path``.

    ``adaln`` (:func:`resolve_adaln`): ``table`` keeps the AdaLN weights in CPU memory and computes their output
    once per timestep group, cached on disk per (model, schedule) (:mod:`h3_turbo.runtime.adaln_memo`).
    ``weights`` (:func:`resolve_weights`): ``lean`` keeps no per-layer prepared copies of the compute path (fp8:
    no e4m3 copy; the weight is derived per call, the same output bit for bit).
    Raises :class:`CheckpointError` (damaged / not H3 / bad values), NoCapablePathError (impossible ``compute``)
    or ValueError (unknown ``adaln`` / ``weights``) before anything is built.
    """
    if adaln not in ADALN_CHOICES:
        raise ValueError(f"adaln={adaln!r}: expected one of {', '.join(ADALN_CHOICES)}")
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights={weights!r}: expected one of {', '.join(WEIGHTS_CHOICES)}")
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    load_device = mm.get_torch_device()
    cpath, reason = resolve_compute(compute, load_device)
    log_once(("compute", compute, str(load_device), cpath),
             "H3 Turbo loader: compute=%s -> %s on %s (%s)", compute, cpath, load_device, reason)

    det = detect(read_header(path))
    det.raise_if_errors()
    for f in det.findings:
        if f.level == "warning":
            log.warning("%s: %s", path, f)
    plan = make_plan(det)
    work = len(plan.quantize) + len(plan.convert)
    pbar = comfy.utils.ProgressBar(max(work, 1))
    qdev = load_device if (plan.quantize and torch.device(load_device).type == "cuda") else "cpu"
    if plan.quantize:
        log.info("%s: %s checkpoint, quantizing %d layers to NVFP4 on %s", path, det.format, len(plan.quantize), qdev)
    elif not det.is_native:
        log.info("%s: converting %s (%d layers; nibbles %s [%s], scales %s [%s]) to the ComfyUI-native layout",
                 path, det.format, len(plan.convert), plan.nibble_order, det.nibble_order_source,
                 plan.scale_layout, det.scale_layout_source)
    try:
        sd = dict(iter_native(plan, progress=lambda d, t: pbar.update_absolute(d, t), device=qdev,
                              drop=det.unused_stems))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(path, f"cannot quantize: {e}") from None
    check_values(path, sd, det)
    packed = sum(sd[f"{s}.{x}"].nbytes for s in set(plan.quantize) | set(plan.convert)
                 for x in ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")
                 if f"{s}.{x}" in sd)
    model_options = {}
    if keep_fp32_island:
        model_options["custom_operations"] = make_operations(load_device)
    kernels = cpath != "reference"
    extra = work_b = 0
    if kernels and not disable_dynamic:
        # DynamicVRAM streams every weight per call (comfy_cast_weights), which the kernels cannot use:
        # build with the classic ModelPatcher so the projections stay resident on the GPU.
        log_once(("classic", cpath), "H3 Turbo loader: compute=%s uses ComfyUI's classic ModelPatcher "
                 "(resident weights) instead of DynamicVRAM streaming", cpath)
    mp = comfy.sd.load_diffusion_model_state_dict(sd, model_options=model_options, metadata=native_metadata(plan),
                                                  disable_dynamic=disable_dynamic or kernels)
    if mp is None:
        raise CheckpointError(path, "ComfyUI could not detect the model type of the converted state dict")
    mp.cached_patcher_init = (_reload, (path, compute, keep_fp32_island, adaln, weights))
    prologue.install(mp)
    amode, areason = resolve_adaln(adaln, mp.model.diffusion_model, load_device, int(mp.model_size()))
    adaln_off = 0
    if amode == "table":
        from . import adaln_memo

        adaln_off = adaln_memo.install(mp, adaln_memo.model_hash(path))
        mp.size = 0                                   # recomputed without the AdaLN modules
    log_once(("adaln", path, adaln, amode), "H3 Turbo loader: adaln=%s -> %s (%s)%s", adaln, amode, areason,
             f"; {adaln_off / 2**30:.2f} GiB of AdaLN weights kept in CPU memory" if adaln_off else "")
    wmode = None
    if not kernels and weights != "auto":
        log_once(("weights_ignored", cpath, weights), "H3 Turbo loader: weights=%s has no effect with compute=%s (it "
                 "keeps no per-layer weight copies)", weights, cpath)
    if kernels:
        if not keep_fp32_island:
            raise RuntimeError(f"compute={cpath} needs the H3 Turbo operations (keep_fp32_island=True)")
        shapes = [(q.n, q.k) for q in det.quant_layers.values()]
        _, wmode, extra, work_b = install_kernels(mp, cpath, weights, load_device, shapes, path)
    contracts.attach(mp, None, compute=cpath, compute_reason=reason, source_format=det.format,
                     checkpoint=os.path.basename(path), packed_bytes=packed, adaln=amode, weights=wmode)
    state.record_loaded_model(path, format=det.format, compute=cpath, packed_bytes=packed,
                              bytes=int(mp.model_size()), layers_nvfp4=work,
                              kernel_extra_bytes=extra, kernel_workspace_bytes=work_b, weights=wmode)
    return mp


def _reload(path, compute, keep_fp32_island=True, adaln="auto", weights="auto", disable_dynamic=False):
    """``cached_patcher_init`` factory (core calls it with ``disable_dynamic=True`` for delegates)."""
    return load_h3_model(path, compute, disable_dynamic=disable_dynamic, keep_fp32_island=keep_fp32_island,
                         adaln=adaln, weights=weights)
