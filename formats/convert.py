"""Convert checkpoints to the ComfyUI-native NVFP4 layout, streaming one tensor (or one layer) at a time.

What happens to a layer is its format's business (``det.scheme``, see :mod:`h3_turbo.formats.registry`):
foreign NVFP4 layouts (ModelOpt, LightX2V, whole-file ``_quantization_metadata``) are re-expressed with
per-layer ``comfy_quant`` (bit-preserving for packed codes and block scales; LightX2V's reciprocal global
scales are inverted in float64 and rounded once to fp32); plain BF16/FP16/FP32 files have the selected
layers (default: the 4 x (layers + refiner) block projections) quantized with
:func:`h3_turbo.formats.nvfp4.quantize` (= comfy-kitchen's quantizer bit for bit).

:func:`make_plan` -> :class:`Plan`; :func:`iter_native` yields ``(key, tensor)`` in ComfyUI key names without
prefix (peak memory: one input layer plus its output); :func:`write_native` writes them to a safetensors
file whose header is planned from the input header first (:func:`output_plan`), so the output is never held
in memory either. Damaged or non-H3 input raises :class:`CheckpointError` before anything is produced.
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..model_facts import NEVER_QUANTIZE
from . import registry, values
from .detect import Detection, detect
from .safetensors_io import CheckpointError, open_tensors, read_header
from .schemes.base import NATIVE_MARKER, NATIVE_SUFFIXES, marker_tensor  # noqa: F401 (re-exported)

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DROP_METADATA = ("_quantization_metadata", "nvfp4_nibble_order", "nvfp4_scale_layout")


@dataclass
class Plan:
    """What :func:`iter_native` will do: the layers it quantizes (plain input) and the source format."""

    det: Detection
    quantize: list[str]            # stems quantized from float weights
    convert: list[str]             # stems converted from a foreign NVFP4 scheme (or metadata)
    nibble_order: str
    scale_layout: str

    @property
    def converts(self) -> bool:
        """True when the file is re-expressed from another layout (not native, not quantized from floats)."""
        return bool(self.convert) and not self.det.scheme.is_native


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
    if det.scheme.is_plain:
        return Plan(det, select_layers(det, include, exclude), [], "hi_first", "swizzled")
    if include or exclude:
        raise CheckpointError(det.path, f"--include/--exclude apply to plain checkpoints; this one is {det.format}")
    return Plan(det, [], list(det.quant_layers), no, sl)


def iter_native(plan: Plan, progress: Callable[[int, int], None] | None = None, device: str | torch.device = "cpu",
                drop: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the native checkpoint as ``(key, tensor)`` (no prefix), reading the input tensor by tensor.

    ``progress(done, total)`` is called after each quantized/converted layer. ``device`` is where
    quantization math runs (results are moved back to CPU; the cuda math is the same fp32 IEEE
    sequence, but bit-identity to comfy-kitchen is tested on CPU only). Every tensor read is value-checked
    (:mod:`h3_turbo.formats.values`): a NaN / Inf value or a negative block scale raises
    :class:`CheckpointError` naming the tensor, before its layer is yielded. ``drop``: layer stems left out
    (not read).
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
    markers = det.scheme.other_layer_markers(det)
    with open_tensors(det.path, header=hdr) as raw:
        f = values.CheckedReader(raw, det.path, values.block_scale_keys(det))
        for k in keys:
            stem, _, suf = k.rpartition(".")
            if stem in drop:
                continue
            if stem in work:
                if stem in emitted:
                    continue
                emitted.add(stem)
                layer = det.scheme.to_native(plan, stem, lambda s_: f.get_tensor(f"{pfx}{stem}.{s_}"),
                                             stems_suffixes[stem], device)
                for s_ in NATIVE_SUFFIXES:
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
    if plan.det.scheme.detects_layout:
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
    markers = det.scheme.other_layer_markers(det)
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
        out += det.scheme.native_entries(det, T, stem)
    return out


def write_native(in_path: str, out_path: str, include=None, exclude=None, nibble_order=None, scale_layout=None,
                 progress=None, device="cpu") -> Plan:
    """Convert or quantize ``in_path`` into a ComfyUI-native NVFP4 file at ``out_path`` (streaming).

    Raises :class:`CheckpointError` for damaged / non-H3 input and refuses an ``out_path`` that is the input
    file itself, by file identity (``os.path.samefile``: also through symlinks, hard links or ``..``).
    """
    if os.path.exists(out_path) and os.path.exists(in_path) and os.path.samefile(in_path, out_path):
        raise CheckpointError(in_path, f"the output {out_path} is this same file (compared by file identity, "
                                       "through links)", expected="a different output file")
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
    """A native state dict re-expressed in format ``fmt`` (test fixtures, interop): the tensors of
    ``registry.get(fmt).from_native(sd, nibble_order=..., scale_layout=...)`` with ``prefix`` on every key
    (its metadata is dropped; call ``from_native`` for it). ValueError for an unknown ``fmt``."""
    out, _ = registry.get(fmt).from_native(sd, nibble_order=nibble_order, scale_layout=scale_layout)
    return {prefix + k: v for k, v in out.items()}
