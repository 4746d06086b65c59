"""``inspect``, ``quantize`` and ``convert`` commands of ``python -m h3_turbo.tools`` (no ComfyUI needed)."""
from __future__ import annotations

import json
import os
import sys

from ..formats import convert as conv
from ..formats.detect import check_block_scales, detect
from ..formats.safetensors_io import CheckpointError, read_header
from . import inspect_lora


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.3f} GiB)"


def inspect_file(path: str, scan_scales: bool = True) -> tuple[dict, list[str]]:
    """Inspect ``path``: returns (report dict, findings as text). Container errors become one finding. TurboH3
    DMD checkpoints (release folders, shard indexes, Diffusers / Int8Linear files) go to ``release.inspect_dmd``;
    a LoRA adapter is inspected as a Turbo LoRA (:func:`h3_turbo.tools.inspect_lora.inspect_turbo_lora`, report
    ``kind`` "turbo_lora"); anything else as a diffusion model."""
    from .release import inspect_dmd, is_dmd_path

    if is_dmd_path(path):
        return inspect_dmd(path)
    try:
        hdr = read_header(path)
    except CheckpointError as e:
        return {"path": path, "ok": False, "format": None}, [f"[error] {e}"]
    if inspect_lora.looks_like_lora(hdr.tensors):
        return inspect_lora.inspect_turbo_lora(path)
    det = detect(hdr)
    if scan_scales and det.model == "h3" and not det.errors:
        check_block_scales(path, det)  # every tensor's values, the loader's and quantize's check
    scan = det.value_scan
    c = det.config
    proj = set(c.projection_stems()) if c else set()
    rep = {
        "path": path,
        "file_bytes": hdr.file_size,
        "model": det.looks_like,
        "format": det.format,
        "prefix": det.prefix,
        "nibble_order": f"{det.nibble_order} ({det.nibble_order_source})" if det.is_quantized else None,
        "scale_layout": f"{det.scale_layout} ({det.scale_layout_source})" if det.is_quantized else None,
        "config": None if c is None else {
            "hidden": c.hidden, "heads": c.heads, "head_dim": c.head_dim, "ffn": c.ffn, "layers": c.layers,
            "refiner_layers": c.refiner_layers, "text_dim": c.text_dim, "latents_dim": c.latents_dim,
            "audio_latents_dim": c.audio_latents_dim, "form": c.form},
        "tensors": len(hdr.tensors),
        "tensors_by_dtype": dict(sorted(det.dtype_counts.items())),
        "layers_nvfp4": len(det.quant_layers),
        "block_projections": len(proj),
        "block_projections_nvfp4": len(proj & set(det.quant_layers)),
        "layers_other_quant": len(det.other_quant),
        "parameter_bytes": det.param_bytes,
        "nvfp4_packed_bytes": det.packed_bytes,
        "values_checked": None if scan is None else {"tensors": scan.tensors, "bytes": scan.bytes,
                                                     "seconds": round(scan.seconds, 3)},
        "errors": len(det.errors),
        "warnings": sum(1 for f in det.findings if f.level == "warning"),
        "ok": not det.errors,
    }
    return rep, [str(f) for f in det.findings]


def cmd_inspect(args) -> int:
    rep, findings = inspect_file(args.file, scan_scales=not args.no_scan)
    if args.json:
        print(json.dumps(dict(rep, findings=findings), indent=2))
    elif rep.get("kind") == "dmd":
        from .release import print_dmd_report

        print_dmd_report(rep, findings)
    elif rep.get("kind") == "turbo_lora":
        inspect_lora.print_report(rep, findings)
    else:
        print(f"file: {rep['path']}")
        if rep.get("file_bytes") is not None:
            print(f"size: {_gib(rep['file_bytes'])}")
            print(f"model: {rep['model']}")
            print(f"format: {rep['format']}" + (f"  (nibbles {rep['nibble_order']}, block scales {rep['scale_layout']})"
                                                 if rep["nibble_order"] else ""))
            print(f"key prefix: '{rep['prefix']}'")
            c = rep["config"]
            if c:
                print(f"H3 config: hidden {c['hidden']}, heads {c['heads']} x {c['head_dim']}, ffn {c['ffn']}, "
                      f"blocks {c['layers']} + refiner {c['refiner_layers']}, text_dim {c['text_dim']}, "
                      f"latents {c['latents_dim']}/{c['audio_latents_dim']}, {c['form']}")
            print(f"tensors: {rep['tensors']}  by dtype: " +
                  ", ".join(f"{k} {v}" for k, v in rep["tensors_by_dtype"].items()))
            print(f"layers: nvfp4 {rep['layers_nvfp4']} (block projections {rep['block_projections_nvfp4']}/"
                  f"{rep['block_projections']}), other quantized {rep['layers_other_quant']}")
            print(f"parameter bytes: {_gib(rep['parameter_bytes'])}; nvfp4 packed bytes: {_gib(rep['nvfp4_packed_bytes'])}")
            v = rep.get("values_checked")
            if v:
                print(f"values checked: {v['tensors']} tensors, {v['bytes'] / 2**30:.3f} GiB in {v['seconds']:.2f} s")
        print(f"findings: {len(findings)}" + ("" if findings else " (none)"))
        for f in findings:
            print("  " + f)
        print("RESULT: " + ("OK" if rep["ok"] else "ERRORS"))
    return 0 if rep["ok"] else 1


def _progress(done: int, total: int) -> None:
    if done == total or done % 16 == 0:
        print(f"\r  {done}/{total} layers", end="\n" if done == total else "", file=sys.stderr, flush=True)


def _write(args, *, want_plain: bool) -> int:
    try:
        det = detect(read_header(args.input))
        det.raise_if_errors()
        plain = det.scheme.is_plain
        if want_plain and not plain:
            raise CheckpointError(args.input, f"already quantized ({det.format}); use `convert` instead")
        if not want_plain and plain:
            raise CheckpointError(args.input, f"a plain {det.format} checkpoint; use `quantize` instead")
        plan = conv.write_native(args.input, args.output, include=getattr(args, "include", None),
                                 exclude=getattr(args, "exclude", None),
                                 nibble_order=getattr(args, "nibble_order", None),
                                 scale_layout=getattr(args, "scale_layout", None),
                                 progress=_progress, device=getattr(args, "device", "cpu"))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = len(plan.quantize) or len(plan.convert)
    what = "quantized" if plan.quantize else f"converted from {plan.det.format}"
    extra = "" if plan.quantize else f" (nibbles {plan.nibble_order}, scales {plan.scale_layout})"
    print(f"wrote {args.output}: {n} NVFP4 layers {what}{extra}, {_gib(os.path.getsize(args.output))}")
    return 0


def cmd_quantize(args) -> int:
    return _write(args, want_plain=True)


def cmd_convert(args) -> int:
    return _write(args, want_plain=False)


def add_parsers(sub) -> None:
    p = sub.add_parser("inspect", help="an H3 model: format, H3 config, sizes; a Turbo LoRA: layout, targets, ranks, "
                                       "alpha, contract, SHA-256, published or not; every finding (exit 1 on errors)")
    p.add_argument("file", help="a .safetensors file: an H3 diffusion model or a Turbo LoRA")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--no-scan", action="store_true", help="skip reading the tensors' values (header-only checks)")
    p.set_defaults(func=cmd_inspect)
    q = sub.add_parser("quantize", help="BF16/FP16/FP32 H3 -> ComfyUI-native NVFP4 (streaming)")
    q.add_argument("input")
    q.add_argument("output")
    q.add_argument("--include", action="append", metavar="GLOB",
                   help="quantize layers whose name matches (e.g. 'blocks.*.mlp.*'); default: the block projections")
    q.add_argument("--exclude", action="append", metavar="GLOB", help="do not quantize matching layers")
    q.add_argument("--device", default="cpu", help="where the quantization math runs (cpu, cuda)")
    q.set_defaults(func=cmd_quantize)
    c = sub.add_parser("convert", help="ModelOpt / LightX2V / metadata NVFP4 -> ComfyUI-native (bit-preserving)")
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--nibble-order", choices=("hi_first", "lo_first"), help="override the detected/assumed order")
    c.add_argument("--scale-layout", choices=("linear", "swizzled"), help="override the detected/assumed layout")
    c.set_defaults(func=cmd_convert)
