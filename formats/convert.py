"""Convert checkpoints to the ComfyUI-native NVFP4 layout, streaming one tensor (or one layer) at a time.

- ModelOpt / LightX2V / whole-file ``_quantization_metadata`` -> per-layer ``comfy_quant`` (bit-preserving
  for packed codes and block scales: nibble swap and the "to_blocked" swizzle only move bits;
  LightX2V's ``weight_global_scale`` becomes ``weight_scale_2 = 1/weight_global_scale`` computed in
  float64 and rounded once to fp32, ``input_global_scale`` -> ``input_scale`` likewise, ``alpha`` is
  dropped after a consistency check).
- BF16/FP16/FP32 -> NVFP4 for the selected layers (default: the 4 x (layers + refiner) block
  projections), with :func:`h3_turbo.formats.nvfp4.quantize` (= comfy-kitchen's quantizer bit for bit).

:func:`iter_native` yields ``(key, tensor)`` in ComfyUI key names without prefix; peak memory is one
input layer plus its output. :func:`write_native` writes those pairs to a safetensors file whose header
is planned from the input header first, so the output is never held in memory either.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from . import nvfp4
from .detect import NEVER_QUANTIZE, Detection, detect
from .safetensors_io import CheckpointError, open_tensors, read_header

log = logging.getLogger("h3_turbo")

NATIVE_MARKER = json.dumps({"format": "nvfp4"}).encode()
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DROP_METADATA = ("_quantization_metadata", "nvfp4_nibble_order", "nvfp4_scale_layout")


def marker_tensor(conf: dict | None = None) -> torch.Tensor:
    """uint8 bytes of the per-layer JSON (default ``{"format": "nvfp4"}``)."""
    raw = NATIVE_MARKER if conf is None else json.dumps(conf).encode()
    return torch.tensor(list(raw), dtype=torch.uint8)


@dataclass
class Plan:
    """What :func:`iter_native` will do: the layers it quantizes (plain input) and the source format."""

    det: Detection
    quantize: list[str]            # stems quantized from float weights
    convert: list[str]             # stems converted from a foreign NVFP4 scheme (or metadata)
    nibble_order: str
    scale_layout: str


def select_layers(det: Detection, include: list[str] | None = None, exclude: list[str] | None = None) -> list[str]:
    """Stems to quantize in a plain file: default the block projections; ``include`` / ``exclude`` are
    shell globs on the stem (``blocks.*.mlp.*``). Refuses layers core's detector reads (condition_proj,
    time_embedder.*) with :class:`CheckpointError`; only 2-D float ``.weight`` tensors qualify."""
    hdr = read_header(det.path)
    T = {k[len(det.prefix):]: t for k, t in hdr.tensors.items() if k.startswith(det.prefix)}
    cands = [k[:-len(".weight")] for k, t in T.items()
             if k.endswith(".weight") and len(t.shape) == 2 and t.dtype in ("BF16", "F16", "F32")]
    if include:
        stems = [s for s in cands if any(fnmatch.fnmatchcase(s, p) for p in include)]
        bad = [s for s in stems if s in NEVER_QUANTIZE]
        if bad:
            raise CheckpointError(det.path, f"--include selects {bad}: core's H3 detector reads the input width "
                                            "from these weights; they must stay unquantized", expected="no match")
    else:
        stems = det.config.projection_stems() if det.config else []
    if exclude:
        stems = [s for s in stems if not any(fnmatch.fnmatchcase(s, p) for p in exclude)]
    for s in stems:
        t = T.get(f"{s}.weight")
        if t is None:
            raise CheckpointError(det.path, "layer to quantize is missing", key=f"{s}.weight")
        if t.shape[1] % 16:
            raise CheckpointError(det.path, f"in_features {t.shape[1]} is not a multiple of 16",
                                  key=f"{s}.weight", expected="K % 16 == 0")
    return sorted(set(stems), key=stems.index)


def make_plan(det: Detection, include=None, exclude=None, nibble_order: str | None = None,
              scale_layout: str | None = None) -> Plan:
    """Plan a conversion of a detected file. ``nibble_order`` / ``scale_layout`` override the detection."""
    det.raise_if_errors()
    no = nibble_order or det.nibble_order
    sl = scale_layout or det.scale_layout
    if det.format in ("bf16", "fp16", "fp32", "mixed-plain"):
        return Plan(det, select_layers(det, include, exclude), [], "hi_first", "swizzled")
    if include or exclude:
        raise CheckpointError(det.path, f"--include/--exclude apply to plain checkpoints; this one is {det.format}")
    return Plan(det, [], list(det.quant_layers), no, sl)


def _native_from_foreign(det: Detection, stem: str, get: Callable[[str], torch.Tensor], present: set[str],
                         nibble_order: str, scale_layout: str) -> dict[str, torch.Tensor]:
    """One NVFP4 layer in ``det.format`` -> native tensors {suffix: tensor}."""
    q = det.quant_layers[stem]
    out: dict[str, torch.Tensor] = {}
    w = get("weight")
    if det.format in ("modelopt", "lightx2v") and nibble_order == "lo_first":
        w = nvfp4.swap_nibbles(w)
    pn, pk2 = nvfp4.packed_shape(q.n, q.k)
    if tuple(w.shape) != (pn, pk2):
        wp = torch.zeros((pn, pk2), dtype=torch.uint8)
        wp[:w.shape[0], :w.shape[1]] = w
        w = wp
    out["weight"] = w.contiguous()
    bs = get("weight_scale").contiguous()
    bs = bs.view(torch.uint8) if bs.dtype != torch.uint8 else bs
    if det.format == "modelopt" and scale_layout == "linear":
        bs = nvfp4.to_blocked(bs)
    out["weight_scale"] = bs.view(torch.float8_e4m3fn).contiguous()
    if det.format == "lightx2v":
        wg = get("weight_global_scale").double().reshape(())
        out["weight_scale_2"] = (1.0 / wg).float()
        ins = None
        if "input_global_scale" in present:
            ins = (1.0 / get("input_global_scale").double().reshape(()))
        elif "input_absmax" in present:
            ins = get("input_absmax").double().reshape(()) / (nvfp4.F8_E4M3_MAX * nvfp4.F4_E2M1_MAX)
        if ins is not None:
            out["input_scale"] = ins.float()
            if "alpha" in present:
                a = float(get("alpha").double().reshape(()))
                want = float(ins) / float(wg)
                if not math.isclose(a, want, rel_tol=1e-4):
                    log.warning("%s: %s.alpha = %g but input_scale*weight_scale_2 = %g (alpha dropped; core "
                                "recomputes it)", det.path, stem, a, want)
    else:
        out["weight_scale_2"] = get("weight_scale_2").float().reshape(())
        if "input_scale" in present:
            out["input_scale"] = get("input_scale").float().reshape(())
    if "pre_quant_scale" in present:
        out["pre_quant_scale"] = get("pre_quant_scale")
    conf = None
    if det.format == "comfy_metadata":
        conf = json.loads(det.metadata["_quantization_metadata"])["layers"].get(stem)
    if det.format == "comfy_native":
        out["comfy_quant"] = get("comfy_quant")
    else:
        out["comfy_quant"] = marker_tensor(conf)
    if "bias" in present:
        out["bias"] = get("bias")
    return out


def _metadata_markers(det: Detection) -> dict[str, dict]:
    """Whole-file metadata entries of layers in other core formats (fp8, int8...): they get a per-layer
    ``comfy_quant`` too, since the whole-file metadata is dropped."""
    if det.format != "comfy_metadata" or not det.other_quant:
        return {}
    layers = json.loads(det.metadata["_quantization_metadata"])["layers"]
    return {s: layers[s] for s in det.other_quant}


def iter_native(plan: Plan, progress: Callable[[int, int], None] | None = None,
                device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the native checkpoint as ``(key, tensor)`` (no prefix), reading the input tensor by tensor.

    ``progress(done, total)`` is called after each quantized/converted layer. ``device`` is where
    quantization math runs (results are moved back to CPU; the cuda math is the same fp32 IEEE
    sequence, but bit-identity to comfy-kitchen is tested on CPU only).
    """
    det = plan.det
    work = set(plan.quantize) | set(plan.convert)
    total, done = len(work), 0
    hdr = read_header(det.path)
    pfx = det.prefix
    keys = [k[len(pfx):] for k in hdr.tensors if k.startswith(pfx)]
    stems_suffixes: dict[str, set[str]] = {}
    for k in keys:
        stem, _, suf = k.rpartition(".")
        if stem in work:
            stems_suffixes.setdefault(stem, set()).add(suf)
    emitted: set[str] = set()
    markers = _metadata_markers(det)
    with open_tensors(det.path, header=hdr) as f:
        for k in keys:
            stem, _, suf = k.rpartition(".")
            if stem in work:
                if stem in emitted:
                    continue
                emitted.add(stem)
                if stem in plan.quantize:
                    w = f.get_tensor(pfx + k if suf == "weight" else pfx + stem + ".weight")
                    q, bs, s = nvfp4.quantize(w.to(device))
                    del w
                    layer = {"weight": q.cpu(), "weight_scale": bs.cpu(), "weight_scale_2": s.cpu(),
                             "comfy_quant": marker_tensor()}
                    if "bias" in stems_suffixes[stem]:
                        layer["bias"] = f.get_tensor(pfx + stem + ".bias")
                else:
                    present = stems_suffixes[stem]
                    layer = _native_from_foreign(det, stem, lambda s_: f.get_tensor(f"{pfx}{stem}.{s_}"), present,
                                                 plan.nibble_order, plan.scale_layout)
                for s_ in ("weight", "bias", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale",
                           "comfy_quant"):
                    if s_ in layer:
                        yield f"{stem}.{s_}", layer[s_]
                done += 1
                if progress is not None:
                    progress(done, total)
                continue
            yield k, f.get_tensor(pfx + k)
            if suf == "weight" and stem in markers:
                yield f"{stem}.comfy_quant", marker_tensor(markers[stem])


def native_metadata(plan: Plan) -> dict[str, str]:
    """Output ``__metadata__``: the input's (minus whole-file quant metadata) plus provenance."""
    meta = {k: v for k, v in plan.det.metadata.items() if k not in DROP_METADATA}
    meta["h3_turbo_source_format"] = plan.det.format
    if plan.det.format in ("modelopt", "lightx2v"):
        meta["h3_turbo_source_nibble_order"] = plan.nibble_order
        meta["h3_turbo_source_scale_layout"] = plan.scale_layout
    if plan.quantize:
        meta["h3_turbo_quantized_layers"] = str(len(plan.quantize))
    return meta


def load_native_state_dict(path: str, progress=None, device="cpu", include=None, exclude=None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, str], Plan]:
    """Validate ``path`` and return ``(state_dict, metadata, plan)`` in the ComfyUI-native layout.

    Raises :class:`CheckpointError` before returning anything when the file is damaged or not H3.
    """
    det = detect(read_header(path))
    det.raise_if_errors()
    plan = make_plan(det, include, exclude)
    sd = dict(iter_native(plan, progress=progress, device=device))
    return sd, native_metadata(plan), plan


def write_safetensors_stream(out_path: str, items: Iterator[tuple[str, torch.Tensor]],
                             plan: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> int:
    """Write tensors to ``out_path`` in the order of ``plan`` [(key, st_dtype, shape)], header first.

    Each item from ``items`` must match the next plan entry (key, dtype, shape), else ValueError and
    the partial file is removed. Returns bytes written. Writes to ``out_path + ".part"`` then renames.
    """
    hdr: dict = {"__metadata__": metadata} if metadata else {}
    off = 0
    from .safetensors_io import DTYPE_BYTES

    for key, dt, shape in plan:
        nb = math.prod(shape) * DTYPE_BYTES[dt]
        hdr[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    tmp = out_path + ".part"
    i = 0
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for key, t in items:
                if i >= len(plan):
                    raise ValueError(f"unplanned tensor {key}")
                pk, pdt, pshape = plan[i]
                if key != pk or _ST_DTYPES.get(t.dtype) != pdt or tuple(t.shape) != tuple(pshape):
                    raise ValueError(f"tensor {key} {_ST_DTYPES.get(t.dtype)} {list(t.shape)} does not match the "
                                     f"planned {pk} {pdt} {list(pshape)}")
                b = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                f.write(b.numpy().tobytes())
                i += 1
            if i != len(plan):
                raise ValueError(f"only {i} of {len(plan)} planned tensors were produced")
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return 8 + len(raw) + off


def output_plan(plan: Plan) -> list[tuple[str, str, tuple[int, ...]]]:
    """The (key, dtype, shape) list :func:`iter_native` will yield, computed from the header only."""
    det = plan.det
    hdr = read_header(det.path)
    pfx = det.prefix
    T = {k[len(pfx):]: t for k, t in hdr.tensors.items() if k.startswith(pfx)}
    work = set(plan.quantize) | set(plan.convert)
    markers = _metadata_markers(det)
    out, seen = [], set()
    for k, t in T.items():
        stem, _, suf = k.rpartition(".")
        if stem not in work:
            out.append((k, t.dtype, t.shape))
            if suf == "weight" and stem in markers:
                out.append((f"{stem}.comfy_quant", "U8", (len(json.dumps(markers[stem]).encode()),)))
            continue
        if stem in seen:
            continue
        seen.add(stem)
        if stem in plan.quantize:
            n, kk = T[f"{stem}.weight"].shape
            present = {"bias"} if f"{stem}.bias" in T else set()
            conf_len = len(NATIVE_MARKER)
            pq = None
        else:
            q = det.quant_layers[stem]
            n, kk = q.n, q.k
            present = set(q.suffixes)
            if det.format == "comfy_native":
                conf_len = T[f"{stem}.comfy_quant"].shape[0]
            elif det.format == "comfy_metadata":
                conf_len = len(json.dumps(json.loads(det.metadata["_quantization_metadata"])["layers"][stem]).encode())
            else:
                conf_len = len(NATIVE_MARKER)
            pq = T.get(f"{stem}.pre_quant_scale")
        out.append((f"{stem}.weight", "U8", nvfp4.packed_shape(n, kk)))
        if "bias" in present:
            out.append((f"{stem}.bias", T[f"{stem}.bias"].dtype, T[f"{stem}.bias"].shape))
        out.append((f"{stem}.weight_scale", "F8_E4M3", nvfp4.scale_shape(n, kk)))
        out.append((f"{stem}.weight_scale_2", "F32", ()))
        if "input_scale" in present or (det.format == "lightx2v" and
                                        ({"input_global_scale", "input_absmax"} & present)):
            out.append((f"{stem}.input_scale", "F32", ()))
        if pq is not None:
            out.append((f"{stem}.pre_quant_scale", pq.dtype, pq.shape))
        out.append((f"{stem}.comfy_quant", "U8", (conf_len,)))
    return out


def write_native(in_path: str, out_path: str, include=None, exclude=None, nibble_order=None, scale_layout=None,
                 progress=None, device="cpu") -> Plan:
    """Convert or quantize ``in_path`` into a ComfyUI-native NVFP4 file at ``out_path`` (streaming).

    Raises :class:`CheckpointError` for damaged / non-H3 input and refuses ``out_path == in_path``.
    """
    if os.path.abspath(in_path) == os.path.abspath(out_path):
        raise CheckpointError(in_path, "output path equals the input path", expected="a different file")
    if os.path.isdir(out_path):
        raise CheckpointError(out_path, "output path is a directory", expected="a file name, e.g. DIR/model_nvfp4.safetensors")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise CheckpointError(out_path, f"output folder {out_dir} does not exist", expected="an existing folder")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(in_path, f"--device {device} asked for, but no CUDA GPU is available here",
                              expected="--device cpu")
    det = detect(read_header(in_path))
    det.raise_if_errors()
    plan = make_plan(det, include, exclude, nibble_order, scale_layout)
    if not plan.quantize and not plan.convert:
        raise CheckpointError(in_path, f"nothing to write: no layer matched --include {include or []} "
                                       f"/ --exclude {exclude or []}", expected="at least one layer to quantize")
    write_safetensors_stream(out_path, iter_native(plan, progress=progress, device=device), output_plan(plan),
                             native_metadata(plan))
    return plan


def native_to_foreign(sd: dict[str, torch.Tensor], fmt: str, nibble_order: str = "lo_first",
                      scale_layout: str = "linear", prefix: str = "") -> dict[str, torch.Tensor]:
    """Re-express a native state dict in a foreign layout (test fixtures, interop): the inverse of the
    conversion above for every layer carrying ``comfy_quant``.

    fmt: "modelopt" (``weight_scale`` plain [N, K/16] when ``scale_layout == "linear"``, else swizzled;
    ``input_scale`` kept) or "lightx2v" (swizzled scales; ``weight_global_scale = 1/weight_scale_2``,
    and when ``input_scale`` exists ``input_global_scale = 1/input_scale`` and ``alpha``). Nibbles are
    swapped when ``nibble_order == "lo_first"``. Returns a new dict with ``prefix`` on every key.
    """
    stems = [k[:-len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant")]
    out: dict[str, torch.Tensor] = {}
    skip = set()
    for s in stems:
        w = sd[f"{s}.weight"]
        n, k = w.shape[0], w.shape[1] * 2
        skip |= {f"{s}.{x}" for x in ("weight", "weight_scale", "weight_scale_2", "input_scale", "comfy_quant")}
        out[f"{s}.weight"] = nvfp4.swap_nibbles(w) if nibble_order == "lo_first" else w.clone()
        bs = sd[f"{s}.weight_scale"].view(torch.uint8)
        if fmt == "modelopt" and scale_layout == "linear":
            bs = nvfp4.from_blocked(bs, n, k // 16).contiguous()
        out[f"{s}.weight_scale"] = bs.view(torch.float8_e4m3fn).clone()
        ws2 = sd[f"{s}.weight_scale_2"].float().reshape(())
        ins = sd.get(f"{s}.input_scale")
        if fmt == "modelopt":
            out[f"{s}.weight_scale_2"] = ws2.clone()
            if ins is not None:
                out[f"{s}.input_scale"] = ins.float().reshape(()).clone()
        elif fmt == "lightx2v":
            out[f"{s}.weight_global_scale"] = (1.0 / ws2.double()).float()
            if ins is not None:
                out[f"{s}.input_global_scale"] = (1.0 / ins.double()).float().reshape(())
                out[f"{s}.alpha"] = (ins.double() * ws2.double()).float().reshape(())
        else:
            raise ValueError(f"unknown foreign format {fmt!r}")
    for k, v in sd.items():
        if k not in skip:
            out[k] = v
    return {prefix + k: v for k, v in out.items()}
