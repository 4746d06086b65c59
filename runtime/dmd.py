"""Load a TurboH3 DMD checkpoint (BF16 Diffusers shards or the W8A8 export) into core's H3 MODEL.

Order of work (a failed load touches no loaded model; every check on the files and inputs runs before anything is
built, only the NVFP4 paths' compute install runs on the built model, and a failure there drops it):
1. resolve ``model_name`` (a file, a shard index or a release folder: :func:`h3_turbo.formats.dmd.find_release`),
   the compute path (``kernels.registry.resolve`` for ``int8_block128`` weights, or for ``nvfp4`` weights with
   :data:`NVFP4_COMPUTE`) and which weights to load (a folder with both: W8A8 for ``int8``, BF16 otherwise);
2. detect and validate the weights from their headers (:func:`~h3_turbo.formats.dmd.detect_dmd`), check the sizes
   ``manifest.json`` records, read the AdaLN table when one is used (:mod:`.adaln`) and check that it fits;
3. stream the weights into core's names (:func:`~h3_turbo.formats.dmd.iter_core`; BF16 projections quantized to
   W8A8 on load for ``compute=int8``, to ComfyUI-native NVFP4 for :data:`NVFP4_COMPUTE`), leaving out the AdaLN weights a table replaces; tensors of 1 MiB and more
   are placeholders while core builds the model and are then streamed into it one at a time (peak memory: the
   model plus one tensor);
4. build core's H3 with core's loader (``comfy.sd.load_diffusion_model_state_dict``) and the operations core itself
   would pick for this state dict (``comfy.ops.pick_operations``), extended by :func:`make_dmd_operations` with
   W8A8 layers (NVFP4: the pack's own operations, :func:`h3_turbo.runtime.ops.make_operations`); then install the
   table (:func:`.adaln.install`), set the compute path (NVFP4: ``install_compute`` as the NVFP4 loader does),
   attach the DMD contract (``adapters/contracts.py``: 4 updates, 12/3, no CFG, re-noise).

With BF16 weights, ``compute=reference`` and ``adaln=none`` the MODEL is the one core's ``UNETLoader`` builds from
the same weights in core naming (tests/test_dmd_comfy.py checks the samples bit for bit).
"""
from __future__ import annotations

import logging
import os

import torch

from .. import state
from ..adapters import contracts
from ..errors import CheckpointError
from ..formats import dmd as fdmd
from ..kernels import int8_block as ib
from ..kernels import registry
from ..kernels.paths import int8 as int8_path
from ..logs import log, log_once
from . import adaln as adaln_mod
from . import prologue

ADALN_AUTO, ADALN_NONE = "auto", "none"
#: the TurboH3 export quantizes the 200 main-block projections (the card): the same for quantize-on-load
QUANTIZED_PROJECTIONS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
#: compute values that quantize the BF16 weights' block projections to NVFP4 on load and run the NVFP4 loader's
#: kernels (``exact``: dequantize-GEMM, ``fp8``: FP8 tensor cores, ``blackwell_fp4``): the pack's fast paths and
#: 11 GB of projections instead of 40 GB, at NVFP4's rounding of the weights
NVFP4_COMPUTE = tuple(n for n in registry.choices("nvfp4") if n not in ("auto", "reference"))


def compute_choices() -> tuple[str, ...]:
    """The loader's ``compute`` values: the W8A8 registry's (``auto``, ``int8``, ``reference``) + :data:`NVFP4_COMPUTE`."""
    return tuple(registry.choices(int8_path.WEIGHT_FORMAT)) + NVFP4_COMPUTE


def _is_projection(key: str) -> bool:
    stem = key[: -len(".weight")] if key.endswith(".weight") else None
    return bool(stem) and key.startswith("blocks.") and stem.split(".", 2)[2] in QUANTIZED_PROJECTIONS


def make_dmd_operations(base, skip_prefixes: tuple[str, ...] = ()):
    """``base`` (the operations core picks for the model, ``comfy.ops.pick_operations``) with a Linear that also
    loads W8A8 layers (``P.weight`` int8 + ``P.int8_scale``: kept as ``int8_weight`` / ``int8_scale`` parameters,
    run on the layer's compute path ``_h3_path``: ``int8`` or the dequantizing ``reference``), and leaves the layers
    under ``skip_prefixes`` (the AdaLN an AdaLN table replaces) without weights instead of reporting them missing.
    Every other layer is ``base``'s, unchanged."""
    import comfy.ops

    base_linear = base.Linear

    class H3TurboDMDOps(base):
        class Linear(base_linear):
            _h3_path = None

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                sk = prefix + fdmd.INT8_SCALE
                if sk in state_dict:
                    q, s = state_dict.pop(prefix + "weight"), state_dict.pop(sk)
                    self.weight = None
                    self.int8_weight = torch.nn.Parameter(q, requires_grad=False)
                    self.int8_scale = torch.nn.Parameter(s.float(), requires_grad=False)
                    super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                  unexpected_keys, error_msgs)
                    for k in (prefix + "int8_weight", prefix + "int8_scale"):
                        if k in missing_keys:
                            missing_keys.remove(k)
                    return
                if skip_prefixes and prefix.startswith(skip_prefixes) and prefix + "weight" not in state_dict:
                    self.weight = None
                    self.bias = None
                    return
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)

            def forward(self, input, *args, **kwargs):
                if getattr(self, "int8_weight", None) is None:
                    return super().forward(input, *args, **kwargs)
                comfy.ops.run_every_op()
                return int8_forward(self, input)

    H3TurboDMDOps.__name__ = "H3TurboDMDOps"
    return H3TurboDMDOps


def int8_forward(m, x: torch.Tensor) -> torch.Tensor:
    """One W8A8 layer: ``int8`` (the W8A8 GEMM) or ``reference`` (dequantize to x's dtype + F.linear), + bias.
    Weight patches (LoRA, hooks) cannot apply to int8 weights: RuntimeError naming the layer."""
    if len(m.weight_function) or len(m.bias_function):
        raise RuntimeError("H3 Turbo DMD: a weight patch (LoRA / hook) targets a W8A8 layer; int8 weights cannot be "
                           "patched (the TurboH3 DMD model takes no LoRA)")
    q, s = m.int8_weight, m.int8_scale
    if q.device != x.device:
        q, s = q.to(x.device), s.to(x.device)
    w = ib.Int8Weight(q, s, ib.Int8Weight.row_group_of(q.shape[0], s.shape[0]))
    pr = int8_path.PreparedInt8(w)
    x2d = x.reshape(-1, x.shape[-1])
    if m._h3_path == "int8":
        y = int8_path.PATH.linear(x2d, pr)
    else:
        y = int8_path.reference_linear(x2d, pr)
    if m.bias is not None:
        y = y + m.bias.to(device=y.device, dtype=y.dtype)
    return y.reshape(*x.shape[:-1], w.out_features)


def _quantize_stream(items, quantize: bool, device, nvfp4: bool = False):
    """Pass ``iter_core`` through, turning the DiT blocks' float projection weights into W8A8 (the recipe of
    ``kernels/int8_block.py``) when ``quantize``, or into ComfyUI-native NVFP4 layers (``weight`` packed E2M1,
    ``weight_scale`` E4M3 block scales, ``weight_scale_2``, ``comfy_quant``: :func:`h3_turbo.formats.nvfp4.quantize`,
    the NVFP4 loader's quantize-on-load) when ``nvfp4``."""
    from ..formats import nvfp4 as fmt
    from ..formats.schemes.base import marker_tensor

    for k, t in items:
        if (quantize or nvfp4) and _is_projection(k) and t.dtype in (torch.bfloat16, torch.float16, torch.float32):
            stem = k[: -len(".weight")]
            if nvfp4:
                try:
                    q, bs, gs = fmt.quantize(t.to(device))
                except ValueError as e:
                    raise CheckpointError(k, f"cannot quantize to NVFP4: {e}") from None
                yield k, q.cpu()
                yield f"{stem}.weight_scale", bs.cpu()
                yield f"{stem}.weight_scale_2", gs.cpu()
                yield f"{stem}.comfy_quant", marker_tensor()
                continue
            w = ib.quantize_weight(t.to(device))
            yield k, w.qdata.cpu()
            yield f"{stem}.{fdmd.INT8_SCALE}", w.scale.cpu()
        else:
            yield k, t


#: tensors from this size on are placeholders while core builds the model, then streamed into it
PLACEHOLDER_BYTES = 1 << 20


def _st_dtype(st: str) -> torch.dtype:
    from ..formats.safetensors_io import torch_dtype

    return torch_dtype(st)


def _nbytes(st: str, shape) -> int:
    from ..formats.safetensors_io import DTYPE_BYTES

    n = DTYPE_BYTES[st]
    for d in shape:
        n *= d
    return n


def _stream_plan(plan: dict, quantize: bool) -> dict:
    """:func:`~h3_turbo.formats.dmd.core_plan` as :func:`_quantize_stream` changes it (block projections int8 +
    ``int8_scale``)."""
    if not quantize:
        return plan
    out = {}
    for k, (dt, shp) in plan.items():
        stem = k[: -len(".weight")] if k.endswith(".weight") else None
        if stem and k.startswith("blocks.") and stem.split(".", 2)[2] in QUANTIZED_PROJECTIONS:
            out[k] = ("I8", shp)
            out[f"{stem}.{fdmd.INT8_SCALE}"] = ("F32", (ib.cdiv(shp[0], ib.BLOCK), ib.cdiv(shp[1], ib.BLOCK)))
        else:
            out[k] = (dt, shp)
    return out


def _layer_key(key: str) -> str:
    """The key :func:`~h3_turbo.formats.dmd.iter_core` reads a W8A8 layer by (its ``weight``)."""
    return key[: -len(fdmd.INT8_SCALE)] + "weight" if key.endswith(fdmd.INT8_SCALE) else key


def _fill(dm, key: str, t: torch.Tensor) -> None:
    """Copy ``t`` into the built model's tensor ``key`` (as ``load_state_dict`` would: ``copy_``, converting dtype);
    W8A8 layers: ``weight`` -> ``int8_weight``, ``int8_scale``."""
    path, _, name = key.rpartition(".")
    mod = dm.get_submodule(path)
    if name == "weight" and getattr(mod, "int8_weight", None) is not None:
        name = "int8_weight"
    dst = getattr(mod, name)
    if tuple(dst.shape) != tuple(t.shape):
        raise CheckpointError(key, f"streamed tensor {list(t.shape)} does not fit the built model's {list(dst.shape)}")
    with torch.no_grad():
        dst.data.copy_(t)


def check_manifest_sizes(rel: fdmd.Release, files: list[str]) -> None:
    """Sizes recorded in the release's manifest.json for the files about to be loaded (cheap; SHA-256 is
    ``verify-release``'s job): CheckpointError naming the file on a mismatch."""
    if rel.manifest is None or rel.root is None:
        return
    from ..tools.release import manifest_entries

    try:
        entries = manifest_entries(rel.manifest)
    except CheckpointError as e:
        log.warning("%s", e)
        return
    for f in files:
        relp = os.path.relpath(f, rel.root)
        e = entries.get(relp)
        if e is not None and e.size is not None and os.path.getsize(f) != e.size:
            raise CheckpointError(f, f"file is {os.path.getsize(f)} bytes, manifest.json records {e.size}",
                                  expected="the released file (re-download; `python -m h3_turbo.tools verify-release "
                                           f"{rel.root}` checks SHA-256 too)")


def _pick_weights(rel: fdmd.Release, cpath: str, nvfp4: bool = False) -> str:
    if nvfp4:
        if not rel.bf16:
            raise CheckpointError(rel.w8a8 or rel.root or "?", f"compute={cpath} quantizes the BF16 weights to NVFP4 "
                                  "on load, and this release / file holds only the W8A8 int8 weights (re-quantizing "
                                  "int8 to NVFP4 would round the weights twice)",
                                  expected="compute=int8 or reference, or the BF16 shards (transformer/)")
        return rel.bf16
    if rel.bf16 and rel.w8a8 and rel.root:
        pick = rel.w8a8 if cpath == "int8" else rel.bf16
        log_once(("dmd-weights", rel.root, cpath), "H3 Turbo DMD loader: %s has BF16 and W8A8 weights; compute=%s "
                 "loads %s", rel.root, cpath, os.path.relpath(pick, rel.root))
        return pick
    return rel.bf16 or rel.w8a8


def _refuse_adaln_lora(mp, table) -> None:
    """A LoRA on the AdaLN keys of a model whose AdaLN is the table: refused before sampling (runtime/adaln_lora.py)."""
    import comfy.patcher_extension as pe

    from . import adaln_lora

    adaln_lora.add_key_slots(mp.model.diffusion_model)
    mp.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, "h3_turbo_adaln_lora", adaln_lora.refuse_wrapper_for(
        f"AdaLN table {os.path.basename(table.path.rstrip('/'))}",
        "Load it with adaln=none on Load TurboH3 DMD Model (the AdaLN from the BF16 weights, when the release has "
        "them)"))


def _table(rel: fdmd.Release, adaln: str, det) -> adaln_mod.AdaLNTable | None:
    if adaln == ADALN_NONE:
        if not det.has_adaln:
            raise CheckpointError(det.path, "adaln=none computes the AdaLN from the weights, but these weights have "
                                            "none (the W8A8 export omits them)",
                                  expected="adaln=auto with the release's adaln/ folder, or an AdaLN table file")
        return None
    if adaln == ADALN_AUTO:
        if rel.adaln is None:
            if det.has_adaln:
                return None
            raise CheckpointError(det.path, "no AdaLN weights and no adaln/ table beside them (no release folder "
                                            f"with adaln/ in this file's folder or up to {fdmd.RELEASE_ROOT_DEPTH} "
                                            "folders above)",
                                  expected="the release folder (with adaln/), or an AdaLN table picked in 'adaln'")
        try:
            if rel.root is not None and rel.root != rel.path:
                log_once(("dmd-release-adaln", rel.path), "Load TurboH3 DMD Model: %s lies in the release folder %s; "
                         "adaln=auto uses its AdaLN table %s", rel.path, rel.root, rel.adaln)
            return adaln_mod.read_table(rel.adaln)
        except CheckpointError as e:
            hint = " Set adaln=none to compute the AdaLN from the BF16 weights." if det.has_adaln else ""
            raise CheckpointError(e.path, e.cause + hint, key=e.key, expected=e.expected) from None
    return adaln_mod.read_table(adaln)


def load_dmd_model(path: str, adaln: str = ADALN_AUTO, compute: str = "auto", disable_dynamic: bool = False):
    """Validate and build the TurboH3 DMD MODEL from ``path`` (file, index or release folder). ``adaln``: ``auto``,
    ``none`` or a table path; ``compute``: :func:`compute_choices` (``auto`` / ``int8`` / ``reference``, or an NVFP4
    path of :data:`NVFP4_COMPUTE` for BF16 weights). Raises CheckpointError (files, table)
    or NoCapablePathError (compute) before anything is built."""
    import comfy.model_management as mm
    import comfy.ops
    import comfy.sd
    import comfy.supported_models
    import comfy.utils

    load_device = mm.get_torch_device()
    rel = fdmd.find_release(path)
    nvfp4 = compute in NVFP4_COMPUTE
    try:
        cpath, reason = registry.resolve(compute, load_device, "nvfp4" if nvfp4 else int8_path.WEIGHT_FORMAT)
    except Exception as e:
        raise type(e)(f"Load TurboH3 DMD Model: compute={compute}: {e}") from None
    weights = _pick_weights(rel, cpath, nvfp4)
    det = fdmd.detect_dmd(weights)
    for f in det.findings:
        if f.level == "warning":
            log.warning("%s: %s", weights, f)
    det.raise_if_errors()
    if nvfp4 and det.int8_layers:
        raise CheckpointError(weights, f"compute={cpath} quantizes BF16 weights to NVFP4 on load; this file holds "
                              f"{len(det.int8_layers)} W8A8 int8 layers", expected="the BF16 shards, or compute=int8")
    if compute == "auto" and cpath == "int8" and not det.int8_layers:
        cpath, reason = "reference", "auto keeps BF16 weights exact (compute=int8 quantizes them to W8A8 on load)"
        log_once(("dmd-auto-bf16", weights), "Load TurboH3 DMD Model: %s: compute=auto -> reference (%s)", weights, reason)
    check_manifest_sizes(rel, det.source.files)
    table = _table(rel, adaln, det)
    cfg = det.config
    if table is not None:
        table.check_fits(cfg.layers, cfg.hidden, need_final=not det.has_final_adaln)
    quantize = cpath == "int8" and not det.int8_layers
    if quantize:
        log.info("%s: BF16 weights, compute=int8: quantizing the %d DiT-block projections to W8A8 (TurboDiffusion's "
                 "128x128 recipe) while loading", weights, 4 * cfg.layers)
    if nvfp4:
        log.info("%s: BF16 weights, compute=%s: quantizing the %d DiT-block projections to NVFP4 while loading",
                 weights, cpath, 4 * cfg.layers)
    qdev = load_device if torch.device(load_device).type == "cuda" else "cpu"
    # core builds the model from a state dict whose large tensors are placeholders (uninitialized, never touched:
    # no memory), then they are streamed into the built model one at a time: peak = the model + one tensor.
    # NVFP4: the projections are quantized in the first pass instead (one BF16 tensor at a time; 0.56 bytes per
    # weight are kept), so that core builds its NVFP4 layers from the real codes and scales.
    plan = _stream_plan(fdmd.core_plan(det, adaln=table is None), quantize)
    big = {k for k, (dt, shp) in plan.items() if _nbytes(dt, shp) >= PLACEHOLDER_BYTES
           and not (nvfp4 and _is_projection(k))}
    sd = dict(_quantize_stream(fdmd.iter_core(det, adaln=table is None, only=set(plan) - big), quantize, qdev, nvfp4))
    for k in big:
        sd[k] = torch.empty(plan[k][1], dtype=_st_dtype(plan[k][0]))
    int8 = quantize or bool(det.int8_layers)
    skip = ()
    if table is not None:
        skip = tuple(f"blocks.{i}.adaln_proj." for i in range(cfg.layers))
        if table.final is not None and not det.has_final_adaln:
            skip += ("final_layer.adaln_proj.",)
    if nvfp4:
        from .ops import make_operations

        model_options = {"custom_operations": make_dmd_operations(make_operations(load_device), skip)}
    else:
        sup = comfy.supported_models.MiniMaxH3.supported_inference_dtypes
        unet_dtype = mm.unet_dtype(model_params=comfy.utils.calculate_parameters(sd), supported_dtypes=sup,
                                   weight_dtype=comfy.utils.weight_dtype(sd))
        manual = mm.unet_manual_cast(unet_dtype, load_device, sup)
        base = comfy.ops.pick_operations(unet_dtype, manual, load_device=load_device)
        model_options = {"custom_operations": make_dmd_operations(base, skip), "dtype": unet_dtype}
    mp = comfy.sd.load_diffusion_model_state_dict(sd, model_options=model_options,
                                                  metadata=fdmd.core_metadata(det),
                                                  disable_dynamic=disable_dynamic or int8 or nvfp4)
    if mp is None:
        raise CheckpointError(weights, "ComfyUI could not detect the model type of the converted state dict")
    prologue.install(mp)
    dm = mp.model.diffusion_model
    pbar = comfy.utils.ProgressBar(max(len(big), 1))
    done = 0
    for k, t in _quantize_stream(fdmd.iter_core(det, adaln=table is None, only=big | {_layer_key(b) for b in big}),
                                 quantize, qdev):
        if k in big:
            _fill(dm, k, t)
            done += 1
            pbar.update_absolute(done, len(big))
    n8 = 0
    for name, mod in dm.named_modules():
        if getattr(mod, "int8_weight", None) is not None:
            mod._h3_path = cpath
            n8 += 1
    if table is not None:
        adaln_mod.install(dm, table)
        _refuse_adaln_lora(mp, table)
    mp.size = mm.module_size(mp.model)
    nq, wmode = 0, None
    if nvfp4:
        from .loading import install_kernels

        shapes = [(int(m.out_features), int(m.in_features)) for name, m in dm.named_modules()
                  if name.startswith("blocks.") and name.split(".", 2)[-1] in QUANTIZED_PROJECTIONS]
        nq, wmode, _, _ = install_kernels(mp, cpath, "auto", load_device, shapes, weights)
        if nq != len(shapes):
            raise RuntimeError(f"Load TurboH3 DMD Model: compute={cpath} installed on {nq} of the {len(shapes)} "
                               "NVFP4 block projections (core did not build them all as NVFP4 layers)")
    mp.cached_patcher_init = (_reload, (path, adaln, compute))
    name = os.path.basename(path.rstrip("/"))
    contracts.attach(mp, contracts.TURBOH3_DMD, compute=cpath, compute_reason=reason, source_format=det.format,
                     checkpoint=name, adaln=(table.describe() if table is not None else "from the weights"),
                     dmd=True, weights=wmode)
    state.record_loaded_model(weights, format=det.format, compute=cpath, bytes=int(mp.model_size()),
                              layers_int8=n8, layers_nvfp4=nq, weights=wmode,
                              adaln=("table" if table is not None else "weights"))
    if det.naming != "diffusers" and rel.manifest is None:
        log_once(("dmd-core-named", weights), "Load TurboH3 DMD Model: %s is a core-named H3 file with no release "
                 "manifest: nothing in it says it is the TurboH3 DMD model, and it is sampled as one (4 updates, "
                 "12/3, re-noise). If it is the base H3, load it with Load H3 NVFP4 Diffusion Model instead.",
                 weights, level=logging.WARNING)
    log_once(("dmd-loaded", weights, cpath, adaln), "Load TurboH3 DMD Model: %s (%s, %s naming, Q/K/V %s) with "
             "compute=%s (%s), %d W8A8 layers, %d NVFP4 layers, AdaLN %s", weights, det.format, det.naming, det.qkv,
             cpath, reason, n8, nq,
             table.describe() if table is not None else "from the weights")
    return mp


def _reload(path, adaln, compute, disable_dynamic=False):
    """``cached_patcher_init`` factory (core calls it with ``disable_dynamic=True`` for delegates)."""
    return load_dmd_model(path, adaln, compute, disable_dynamic=disable_dynamic)


def is_dmd(model_patcher) -> bool:
    """True when the MODEL is a TurboH3 DMD model (loaded by this module)."""
    return bool(contracts.copy_entry(getattr(model_patcher, "model_options", None)).get("dmd"))
