"""What every checkpoint scheme shares: the header as schemes see it, the claim evidence, the scheme
base classes and the NVFP4 per-layer code the quantized schemes have in common.

- :class:`HeaderView`: a safetensors :class:`~h3_turbo.formats.safetensors_io.Header` without its key
  prefix, with each stem's key suffixes and the tiny tensors :func:`~h3_turbo.formats.detect.detect`
  read. Schemes only read it.
- :class:`Scheme`: one checkpoint format (``name``, ``claims``, ``detect_layers``, ``validate``,
  ``to_native``, ``from_native``). :class:`NVFP4Scheme` implements the parts the NVFP4 formats share;
  a subclass states its required/optional key suffixes and overrides the few hooks where its layout
  differs (``layer_stems``, ``layer_format``, ``read_layout``, ``native_*``).

Nothing here imports :mod:`~h3_turbo.formats.detect` or :mod:`~h3_turbo.formats.convert` (they import
the schemes). Layouts and their public sources: ``docs/formats.md``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable

import torch

from ...model_facts import KEY_PREFIXES
from .. import nvfp4
from ..nvfp4 import roundup
from ..safetensors_io import CheckpointError, Header, TensorInfo, open_tensors

if TYPE_CHECKING:  # pragma: no cover
    from ..convert import Plan
    from ..detect import Detection

#: tensors up to this many elements are read by detect (per-layer JSON, scalar scales)
SMALL_NUMEL = 4096
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
SCALE_DTYPES = ("F8_E4M3", "U8")
#: key suffixes that belong to a quantized layer in any scheme
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant",
                  "weight_global_scale", "input_global_scale", "alpha", "input_absmax")
#: formats core's ``QUANT_ALGOS`` knows (ComfyUI ``comfy/quant_ops.py``); only nvfp4 is validated in depth
CORE_QUANT_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8", "int8_tensorwise",
                      "convrot_w4a4", "asym_w4a8_int8", "awq_w4a16")
#: the per-layer JSON of a native NVFP4 layer (``P.comfy_quant``)
NATIVE_MARKER = json.dumps({"format": "nvfp4"}).encode()
#: the native tensors of one NVFP4 layer, in the order they are written
NATIVE_SUFFIXES = ("weight", "bias", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "comfy_quant")
PROJECTION_KEY = re.compile(r"^(blocks|token_refiner\.blocks)\.\d+\.(attn\.(qkv|out)_proj|mlp\.fc[12])\.weight$")
#: :meth:`NVFP4Scheme.layer_format` result for a layer whose marker could not be read (error already recorded)
SKIP = object()


def marker_tensor(conf: dict | None = None) -> torch.Tensor:
    """uint8 bytes of the per-layer JSON (default ``{"format": "nvfp4"}``)."""
    raw = NATIVE_MARKER if conf is None else json.dumps(conf).encode()
    return torch.tensor(list(raw), dtype=torch.uint8)


def split_key(key: str) -> tuple[str, str]:
    """stem, suffix for a parameter key (``a.b.weight_scale`` -> ``a.b``, ``weight_scale``)."""
    stem, _, suf = key.rpartition(".")
    return stem, suf


def strip_prefix(names: list[str]) -> str:
    """The key prefix of a diffusion-model state dict (one of ``model_facts.KEY_PREFIXES``, or "")."""
    for p in KEY_PREFIXES:
        if f"{p}video_patch_proj.weight" in names:
            return p
    for p in KEY_PREFIXES:
        if sum(1 for n in names if n.startswith(p)) > len(names) // 2:
            return p
    return ""


@dataclass
class HeaderView:
    """A header as schemes read it. ``tensors``: key without prefix -> :class:`TensorInfo` (file order);
    ``outside``: keys that do not carry the prefix (ignored); ``small``: tiny tensors read by
    :meth:`read_small` (key without prefix -> CPU tensor); ``problems``: (message, key) of header-level
    errors found while parsing (detect reports them)."""

    path: str
    prefix: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    outside: list[str] = field(default_factory=list)
    small: dict[str, torch.Tensor] = field(default_factory=dict)
    problems: list[tuple[str, str | None]] = field(default_factory=list)

    @classmethod
    def of(cls, header: Header) -> "HeaderView":
        names = list(header.tensors)
        prefix = strip_prefix(names)
        tensors, outside = {}, []
        for n in names:
            if prefix and not n.startswith(prefix):
                outside.append(n)
                continue
            tensors[n[len(prefix):]] = header.tensors[n]
        return cls(header.path, prefix, tensors, dict(header.metadata), outside)

    def read_small(self, header: Header) -> None:
        """Read the tiny quantization tensors (``comfy_quant`` JSON, scalar scales) into :attr:`small`.
        Raises :class:`CheckpointError` when the (already validated) file cannot be read."""
        want = [k for k, t in self.tensors.items() if t.numel <= SMALL_NUMEL and split_key(k)[1] in QUANT_SUFFIXES
                and split_key(k)[1] not in ("pre_quant_scale",)]
        if not want:
            return
        try:
            with open_tensors(header.path, header=header) as f:
                for k in want:
                    self.small[k] = f.get_tensor(self.prefix + k)
        except Exception as e:  # container already validated; anything here is a real read error
            raise CheckpointError(header.path, f"cannot read small tensors: {e}") from None

    @cached_property
    def suffixes(self) -> dict[str, set[str]]:
        """stem -> the key suffixes present for it."""
        out: dict[str, set[str]] = {}
        for k in self.tensors:
            stem, suf = split_key(k)
            out.setdefault(stem, set()).add(suf)
        return out

    def stems_with(self, suffix: str) -> set[str]:
        return {s for s, ss in self.suffixes.items() if suffix in ss}

    @cached_property
    def meta_layers(self) -> dict:
        """``__metadata__["_quantization_metadata"]["layers"]`` (ComfyUI's whole-file quantization map),
        {} when absent or malformed (malformed adds a :attr:`problems` entry)."""
        raw = self.metadata.get("_quantization_metadata")
        if raw is None:
            return {}
        try:
            layers = json.loads(raw).get("layers", {})
            if not isinstance(layers, dict):
                raise ValueError("'layers' is not an object")
        except (ValueError, AttributeError) as e:
            self.problems.append((f"__metadata__['_quantization_metadata'] is not valid JSON with a 'layers' "
                                  f"object ({e})", "__metadata__"))
            return {}
        return layers

    @cached_property
    def nvfp4_stems(self) -> set[str]:
        """Stems carrying NVFP4 tensors: a ``weight_scale_2``, or a uint8 ``weight`` with a ``weight_scale``."""
        return {s for s, ss in self.suffixes.items() if "weight_scale_2" in ss or
                ("weight_scale" in ss and "weight" in ss and self.tensors[f"{s}.weight"].dtype == "U8")}

    @property
    def quant_marked(self) -> bool:
        """True when anything marks a layer quantized: a ``comfy_quant`` or ``weight_global_scale`` key, NVFP4
        tensors (:attr:`nvfp4_stems`) or whole-file metadata layers. Every quantized scheme's claim needs one
        of these; a plain file has none."""
        return bool(self.stems_with("comfy_quant") or self.stems_with("weight_global_scale") or self.nvfp4_stems
                    or self.meta_layers)

    @cached_property
    def projection_dtypes(self) -> dict[str, int]:
        """safetensors dtype -> count over the block projections' ``.weight`` keys."""
        dts: dict[str, int] = {}
        for k, t in self.tensors.items():
            if PROJECTION_KEY.match(k):
                dts[t.dtype] = dts.get(t.dtype, 0) + 1
        return dts


@dataclass(frozen=True)
class Evidence:
    """Why a scheme claims a file: ``reason`` (one phrase, shown in errors) and the ``stems`` it marks."""

    reason: str
    stems: frozenset = frozenset()

    def __str__(self) -> str:
        return self.reason


def stems_evidence(stems: set[str], what: str) -> Evidence | None:
    """Evidence "N layers <what> (e.g. <first stem>)" for a non-empty set of stems, else None."""
    if not stems:
        return None
    return Evidence(f"{len(stems)} layer(s) {what} (e.g. {min(stems)})", frozenset(stems))


@dataclass
class QuantLayer:
    """One NVFP4 layer. n, k: logical [out, in]. suffixes: the key suffixes present for the stem."""

    stem: str
    scheme: str
    n: int
    k: int
    suffixes: tuple[str, ...]
    scale_layout: str = "swizzled"
    packed_bytes: int = 0


def scalar_ok(det: "Detection", view: HeaderView, key: str, what: str, positive: bool = True) -> float | None:
    """Check that ``key`` (when present) is one finite (positive) float; record an error otherwise."""
    t = view.tensors.get(key)
    if t is None:
        return None
    if t.numel != 1 or t.dtype not in FLOAT_DTYPES:
        det.error(f"{what} is {t.dtype} {list(t.shape)}", key)
        det.findings[-1].message += " (expected one fp32 value, shape [] )"
        return None
    v = view.small.get(key)
    if v is None:
        return None
    v = float(v.float().reshape(-1)[0])
    if not (v == v and abs(v) != float("inf")):
        det.error(f"{what} is {v} (expected a finite positive number)", key)
    elif positive and v <= 0:
        det.error(f"{what} is {v} (expected > 0)", key)
    return v


def read_nibble_order(det: "Detection") -> None:
    """Nibble order from ``__metadata__["nvfp4_nibble_order"]``, else ASSUMED lo_first with a warning
    (for formats whose packing is not fixed: ModelOpt, LightX2V)."""
    no = det.metadata.get("nvfp4_nibble_order")
    if no in ("hi_first", "lo_first"):
        det.nibble_order, det.nibble_order_source = no, "metadata"
    else:
        det.nibble_order, det.nibble_order_source = "lo_first", "assumed"
        det.warn(f"{det.format}: nibble order not stated in metadata; ASSUMED lo_first (element 2j in the low "
                 "nibble, the NVIDIA/PyTorch float4_e2m1fn_x2 convention). If images are garbage, re-convert with "
                 "`python -m h3_turbo.tools convert IN OUT --nibble-order hi_first`")


def native_layer_entries(T: dict[str, TensorInfo], stem: str, n: int, k: int, bias: bool, input_scale: bool,
                         pre_quant: TensorInfo | None, conf_len: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, safetensors dtype, shape) of one native NVFP4 layer, in :data:`NATIVE_SUFFIXES` order."""
    out = [(f"{stem}.weight", "U8", nvfp4.packed_shape(n, k))]
    if bias:
        out.append((f"{stem}.bias", T[f"{stem}.bias"].dtype, T[f"{stem}.bias"].shape))
    out.append((f"{stem}.weight_scale", "F8_E4M3", nvfp4.scale_shape(n, k)))
    out.append((f"{stem}.weight_scale_2", "F32", ()))
    if input_scale:
        out.append((f"{stem}.input_scale", "F32", ()))
    if pre_quant is not None:
        out.append((f"{stem}.pre_quant_scale", pre_quant.dtype, pre_quant.shape))
    out.append((f"{stem}.comfy_quant", "U8", (conf_len,)))
    return out


def native_stems(sd: dict[str, torch.Tensor]) -> list[str]:
    """Stems of a native state dict that carry ``comfy_quant`` (any core format), in key order."""
    return [k[:-len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant")]


class Scheme:
    """One checkpoint format. Subclasses set ``name`` (the ``Detection.format`` string) and implement:

    - ``claims(view) -> Evidence | None``: header only, no findings; None when the file is not this format;
    - ``detect_layers(det, view)``: fill ``det.quant_layers`` / ``det.other_quant`` / nibble order and scale
      layout, with findings (runs before the H3 config is read);
    - ``validate(det, view)``: this format's per-layer findings (runs after the config checks);
    - ``to_native(plan, stem, get, present, device)``: one layer's native tensors {suffix: tensor} from
      ``get(suffix)`` (reads one input tensor); ``present`` = the layer's suffixes in the file;
    - ``native_entries(det, T, stem)``: the (key, dtype, shape) list ``to_native`` yields, from the header;
    - ``from_native(sd, metadata=None, **options) -> (sd, metadata)``: this format written from a native
      state dict (tests, fixtures, interop).

    Flags: ``is_plain`` (float weights, quantized by ``to_native``), ``is_native`` (already ComfyUI's
    layout), ``detects_layout`` (nibble order / scale layout are read from metadata or shapes, reported in
    the converted file's provenance).
    """

    name = "?"
    is_plain = False
    is_native = False
    detects_layout = False

    def __repr__(self) -> str:
        return f"<scheme {self.name}>"

    def claims(self, view: HeaderView) -> Evidence | None:
        raise NotImplementedError

    def detect_layers(self, det: "Detection", view: HeaderView) -> None:
        pass

    def validate(self, det: "Detection", view: HeaderView) -> None:
        pass

    def to_native(self, plan: "Plan", stem: str, get: Callable[[str], torch.Tensor], present: set[str],
                  device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def native_entries(self, det: "Detection", T: dict[str, TensorInfo], stem: str) -> list:
        raise NotImplementedError

    def other_layer_markers(self, det: "Detection") -> dict[str, dict]:
        """Layers in other core formats (fp8, int8, ...) that need their own ``comfy_quant`` in the native file."""
        return {}

    def from_native(self, sd: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, **options
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        raise NotImplementedError


class NVFP4Scheme(Scheme):
    """An NVFP4 format: per layer a uint8 ``weight`` [N, K/2], e4m3 ``weight_scale`` and a tensor scale.

    Subclasses set ``required`` / ``optional`` (key suffixes of one layer besides ``bias``) and implement
    ``layer_stems(view)`` (the stems the format marks; ``claims`` is "that set is not empty"). Hooks:
    ``layer_format`` (the layer's core format, default "nvfp4"), ``read_layout`` (nibble order / scale
    layout, default fixed hi_first + swizzled), ``check_scalars``, ``native_weight``,
    ``native_block_scales``, ``native_tensor_scales``, ``native_marker``, ``native_marker_len``,
    ``native_has_input_scale``.
    """

    required: frozenset = frozenset({"weight", "weight_scale", "weight_scale_2"})
    optional: frozenset = frozenset({"input_scale", "pre_quant_scale"})
    alpha_is_quant_key = False    # an ``alpha`` key outside a quantized layer is an orphan (else a LoRA alpha)
    marks = "carry NVFP4 tensors"  # evidence wording

    def layer_stems(self, view: HeaderView) -> set[str]:
        raise NotImplementedError

    def claims(self, view: HeaderView) -> Evidence | None:
        return stems_evidence(self.layer_stems(view), self.marks)

    # ------------------------------------------------------------------ detection
    def layer_format(self, det: "Detection", view: HeaderView, stem: str):
        """Core format of one marked layer ("nvfp4", another core format, None), or :data:`SKIP`."""
        return "nvfp4"

    def read_layout(self, det: "Detection", view: HeaderView) -> None:
        pass

    def detect_layers(self, det: "Detection", view: HeaderView) -> None:
        T = view.tensors
        for s in sorted(self.layer_stems(view)):
            fmt = self.layer_format(det, view, s)
            if fmt is SKIP:
                continue
            if fmt != "nvfp4":
                if fmt in CORE_QUANT_FORMATS:
                    det.warn(f"layer is quantized as {fmt!r} (core loads it; this pack only validates nvfp4)", s)
                    det.other_quant.add(s)
                else:
                    det.error(f"unknown quantization format {fmt!r} (expected nvfp4)", s)
                continue
            if f"{s}.weight" not in T:
                det.error("quantized layer has no weight tensor", f"{s}.weight")
                continue
            w = T[f"{s}.weight"]
            if w.dtype != "U8" or len(w.shape) != 2:
                det.error(f"NVFP4 weight is {w.dtype} {list(w.shape)} (expected uint8 [N, K/2])", f"{s}.weight")
                continue
            det.quant_layers[s] = QuantLayer(s, self.name, w.shape[0], w.shape[1] * 2,
                                             tuple(sorted(view.suffixes.get(s, ()))))
        self.read_layout(det, view)
        for q in det.quant_layers.values():
            q.scale_layout = det.scale_layout

    # ------------------------------------------------------------------ validation
    def check_scalars(self, det: "Detection", view: HeaderView, stem: str, present: set[str]) -> None:
        scalar_ok(det, view, f"{stem}.weight_scale_2", "weight_scale_2")
        scalar_ok(det, view, f"{stem}.input_scale", "input_scale")

    def validate(self, det: "Detection", view: HeaderView) -> None:
        T, fmt = view.tensors, self.name
        req, opt = self.required, self.optional
        quant_stems = set(det.quant_layers)
        for k in T:
            stem, suf = split_key(k)
            if suf in QUANT_SUFFIXES and stem not in quant_stems and stem not in det.other_quant:
                if suf == "alpha" and not self.alpha_is_quant_key:
                    continue
                det.error(f"orphan quantization key: layer '{stem}' is not marked NVFP4 ({fmt})", k)
        for s, q in det.quant_layers.items():
            present = set(q.suffixes)
            for miss in sorted(req - present):
                det.error(f"missing {miss} for an NVFP4 layer ({fmt})", f"{s}.{miss}")
            for extra in sorted(present - req - opt - {"bias"}):
                det.error(f"extra key for an NVFP4 layer in {fmt} format", f"{s}.{extra}")
            w = T[f"{s}.weight"]
            st = T.get(f"{s}.weight_scale")
            if st is not None:
                if st.dtype not in SCALE_DTYPES:
                    det.error(f"block scales are {st.dtype} (expected F8_E4M3, or U8 bytes of e4m3)", f"{s}.weight_scale")
                pn, pk = w.shape[0], w.shape[1] * 2
                swz = (roundup(pn, 128), roundup(pk // 16, 4))
                lin = (q.n, roundup(q.k, 16) // 16)
                want = lin if q.scale_layout == "linear" else swz
                if tuple(st.shape) != want:
                    det.error(f"block-scale shape {list(st.shape)} (expected {list(want)}: "
                              f"{'plain [N, K/16]' if q.scale_layout == 'linear' else 'swizzled [roundup(N,128), roundup(K/16,4)]'}"
                              f" for weight {list(w.shape)})", f"{s}.weight_scale")
                q.packed_bytes = w.nbytes + (roundup(pn, 128) * roundup(pk // 16, 4))
            else:
                q.packed_bytes = w.nbytes
            q.packed_bytes += 4 + 19  # weight_scale_2 + the comfy_quant JSON core keeps ({"format": "nvfp4"})
            if f"{s}.input_scale" in T:
                q.packed_bytes += 4
            pq = T.get(f"{s}.pre_quant_scale")
            if pq is not None:
                if pq.dtype not in FLOAT_DTYPES or pq.shape != (q.k,):
                    det.error(f"pre_quant_scale is {pq.dtype} {list(pq.shape)} (expected float [{q.k}])",
                              f"{s}.pre_quant_scale")
                q.packed_bytes += pq.nbytes
            self.check_scalars(det, view, s, present)

    # ------------------------------------------------------------------ conversion to native
    def native_weight(self, w: torch.Tensor, plan: "Plan") -> torch.Tensor:
        return w

    def native_block_scales(self, bs: torch.Tensor, plan: "Plan") -> torch.Tensor:
        """uint8 block-scale bytes as stored -> swizzled uint8 bytes."""
        return bs

    def native_tensor_scales(self, det: "Detection", stem: str, get: Callable, present: set[str], out: dict) -> None:
        out["weight_scale_2"] = get("weight_scale_2").float().reshape(())
        if "input_scale" in present:
            out["input_scale"] = get("input_scale").float().reshape(())

    def native_marker(self, det: "Detection", stem: str, get: Callable) -> torch.Tensor:
        return marker_tensor()

    def native_marker_len(self, det: "Detection", T: dict[str, TensorInfo], stem: str) -> int:
        return len(NATIVE_MARKER)

    def native_has_input_scale(self, present: set[str]) -> bool:
        return "input_scale" in present

    def to_native(self, plan, stem, get, present, device="cpu"):
        """One layer -> native {suffix: tensor}: packed codes hi-first and padded to [roundup(N,16),
        roundup(K,16)/2], block scales e4m3 swizzled, ``weight_scale_2`` / ``input_scale`` fp32 [], the
        layer's ``comfy_quant``; ``pre_quant_scale`` and ``bias`` copied. Bit-preserving except where a
        subclass computes a scale (LightX2V)."""
        det = plan.det
        q = det.quant_layers[stem]
        out: dict[str, torch.Tensor] = {}
        w = self.native_weight(get("weight"), plan)
        pn, pk2 = nvfp4.packed_shape(q.n, q.k)
        if tuple(w.shape) != (pn, pk2):
            wp = torch.zeros((pn, pk2), dtype=torch.uint8)
            wp[:w.shape[0], :w.shape[1]] = w
            w = wp
        out["weight"] = w.contiguous()
        bs = get("weight_scale").contiguous()
        bs = bs.view(torch.uint8) if bs.dtype != torch.uint8 else bs
        bs = self.native_block_scales(bs, plan)
        out["weight_scale"] = bs.view(torch.float8_e4m3fn).contiguous()
        self.native_tensor_scales(det, stem, get, present, out)
        if "pre_quant_scale" in present:
            out["pre_quant_scale"] = get("pre_quant_scale")
        out["comfy_quant"] = self.native_marker(det, stem, get)
        if "bias" in present:
            out["bias"] = get("bias")
        return out

    def native_entries(self, det, T, stem):
        q = det.quant_layers[stem]
        present = set(q.suffixes)
        return native_layer_entries(T, stem, q.n, q.k, "bias" in present, self.native_has_input_scale(present),
                                    T.get(f"{stem}.pre_quant_scale"), self.native_marker_len(det, T, stem))


def swap_if_lo_first(w: torch.Tensor, plan: "Plan") -> torch.Tensor:
    """Packed codes in ``plan.nibble_order`` -> hi_first (ComfyUI's order)."""
    return nvfp4.swap_nibbles(w) if plan.nibble_order == "lo_first" else w
