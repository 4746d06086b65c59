"""Record SHA-256 hashes that a behaviour-preserving change must leave unchanged (not a pytest module).

    TRITON_INTERPRET=1 python tests/golden/record.py OUT.json

Hashes: the tiny demo's saved latents through real ComfyUI (compute reference, Turbo 4-step and
Turbo off), the Triton kernels' outputs under the interpreter on fixed inputs (exact: prepare, fused
GEMM with and without LoRA, tiled and full strategies; fp8: prepare, row quantization), and
``inspect``'s findings on every file of the reliability corpus. Compare two runs with ``diff``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def _h(t) -> str:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous()
        if t.dtype in (torch.float8_e4m3fn, torch.bfloat16):
            t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int16)
        return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
    return hashlib.sha256(repr(t).encode()).hexdigest()[:16]


def kernels() -> dict:
    from h3_turbo.kernels import dispatch as dsp
    from h3_turbo.kernels import triton_nvfp4 as tk
    from h3_turbo.formats import nvfp4
    try:
        from h3_turbo.kernels.paths.exact import PATH as EXACT
    except ImportError:  # before the registry existed
        class EXACT:
            tiled = staticmethod(dsp._exact_tiled)
            full = staticmethod(dsp._exact_full)

    out = {}
    g = torch.Generator().manual_seed(0)
    n, k, m = 192, 160, 37
    w = torch.randn(n, k, generator=g) * 0.05
    q, bs, gs = nvfp4.quantize(w.to(torch.bfloat16))
    p = dsp.PackedNVFP4(q, bs, gs, n, k)
    x = (torch.randn(m, k, generator=g)).to(torch.bfloat16)
    pe = dsp.prepare(p, "exact")
    # the exact path keeps no copy since issue 17 (it reads the native storage): its prepared state is the scale
    out["exact.prepare"] = [_h(pe.gs)] if not hasattr(pe, "qs") else [_h(pe.qs), _h(pe.scales), _h(pe.gs)]
    wq = (q, bs) if not hasattr(pe, "qs") else (pe.qs, pe.scales)
    out["exact.gemm"] = _h(tk.gemm_exact(x, *wq, pe.gs, n, k))
    a = (torch.randn(3 * 8, k, generator=g) * 0.05).to(torch.bfloat16)
    bc = (torch.randn(n, 8, generator=g) * 0.05).to(torch.bfloat16)
    h = torch.nn.functional.linear(x, a)
    out["exact.gemm_lora"] = _h(tk.gemm_exact(x, *wq, pe.gs, n, k, lora=(h, bc, 0.5, n // 3)))
    out["exact.tiled_lora"] = _h(EXACT.tiled(x, pe, lora=(a, bc, 0.5, n // 3)))
    out["exact.full"] = _h(EXACT.full(x, pe))
    wbuf = torch.empty(n, k, dtype=torch.bfloat16)
    tk.fold_weight(q, bs, gs.float().reshape(1), n, k, wbuf, lora=(a, bc, 0.5, n // 3))
    out["exact.fold_lora"] = _h(wbuf)
    pf = dsp.prepare(p, "fp8")
    out["fp8.prepare"] = [_h(pf.w8), _h(pf.sw), _h(pf.amax_w)]
    if "lean" in __import__("inspect").signature(dsp.prepare).parameters:   # issue 17: lean fp8 = resident bytes
        pl = dsp.prepare(p, "fp8", lean=True)
        w8l, swl = __import__("h3_turbo.kernels.paths.fp8", fromlist=["PATH"]).PATH.weight_operands(pl, "cpu")
        out["fp8.lean_weight"] = [_h(w8l[:n]), _h(swl)]
    x8, sx = tk.quant_rows_fp8(x)
    out["fp8.quant_rows"] = [_h(x8), _h(sx)]
    pr = dsp.prepare(p, "reference")
    out["reference.linear"] = _h(dsp.linear(x, pr, "reference"))
    out["reference.lora"] = _h(dsp.linear_with_lora(x, pr, "reference", a, bc, 0.5, 3))
    return out


def demo_and_inspect() -> dict:
    from h3_turbo.harness import boot, find_comfyui
    from h3_turbo.tools.fixtures import make_fixtures
    from h3_turbo.tools import inspect_ckpt
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import corpus

    out = {}
    tmp = tempfile.mkdtemp(prefix="h3golden_")
    fx = make_fixtures(os.path.join(tmp, "models"))
    runner = boot(str(find_comfyui()), cpu=True)
    runner.add_models_dir(os.path.join(tmp, "models"))
    wf = json.loads((Path(__file__).resolve().parents[2] / "example_workflows/api/h3turbo_tiny_demo.json").read_text())
    for tag, turbo, steps in (("4step", None, 0), ("none", "none", 4)):
        prompt = json.loads(json.dumps(wf))
        if turbo:
            prompt["2"]["inputs"]["turbo"] = turbo
            prompt["5"]["inputs"]["steps"] = steps
        lat = runner.run_latents(prompt, ("11", "12"))
        out[f"demo.{tag}"] = [_h(v) for v in lat]
    cdir = os.path.join(tmp, "corpus")
    files = dict(corpus.build_model_corpus(fx, cdir))
    for name, path in sorted(files.items()):
        rep, findings = inspect_ckpt.inspect_file(path)
        rep = {k: v for k, v in rep.items() if k not in ("path", "values_checked")}  # values_checked: timings
        out[f"inspect.{name}"] = _h(json.dumps([rep, [f.replace(path, "<path>") for f in findings]], sort_keys=True, default=str))
    return out


if __name__ == "__main__":
    res = {"kernels": kernels()}
    res.update(demo_and_inspect())
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(json.dumps(res, indent=1, sort_keys=True))
