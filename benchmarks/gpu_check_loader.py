"""GPU check of the loader's pieces at full H3 sizes (run on a CUDA machine; not part of the test suite).

1. ``formats.nvfp4.quantize`` on CUDA is bit-identical to the CPU result (the loader quantizes BF16
   files on the GPU), and its speed on the four projection shapes.
2. The H3 Turbo operations (``runtime.ops.make_operations``) on real-size NVFP4 projections: core's
   forward (dequantize + bf16 matmul) vs the ``exact`` / ``fp8`` paths routed through
   ``kernels.dispatch`` (``install``-style ``_h3_path``): max relative error vs a float64 reference and
   median time.

Needs ComfyUI's ``comfy`` package, comfy-kitchen and comfy-aimdo on PYTHONPATH and the repo importable
as ``h3_turbo``. Prints one JSON line per measurement.
"""
from __future__ import annotations

import json
import sys
import time

import torch


def _t(fn, n=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - s)
    ts.sort()
    return ts[len(ts) // 2]


def quantize_check():
    from h3_turbo.formats import nvfp4

    g = torch.Generator().manual_seed(0)
    for name, (n, k) in {"qkv": (21504, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}.items():
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        w[7] *= 50
        q0, b0, s0 = nvfp4.quantize(w)
        wc = w.cuda()
        q1, b1, s1 = nvfp4.quantize(wc)
        same = bool(torch.equal(q0, q1.cpu()) and torch.equal(b0.view(torch.uint8), b1.cpu().view(torch.uint8))
                    and torch.equal(s0, s1.cpu()))
        dt = _t(lambda: nvfp4.quantize(wc), n=3)
        print(json.dumps({"check": "quantize_cuda_vs_cpu", "layer": name, "shape": [n, k], "bit_identical": same,
                          "cuda_ms": round(dt * 1e3, 2)}), flush=True)


def ops_check():
    from comfy_kitchen.tensor import QuantizedTensor  # noqa: F401

    from h3_turbo.formats import nvfp4
    from h3_turbo.runtime.ops import make_operations

    dev = torch.device("cuda")
    ops = make_operations(dev, compute_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    marker = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    for name, (n, k) in {"fc1": (28672, 5376), "fc2": (5376, 14336)}.items():
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        q, bs, s = nvfp4.quantize(w)
        lin = ops.Linear(k, n, bias=False, device=dev, dtype=None)
        lin.load_state_dict({"weight": q.to(dev), "weight_scale": bs.to(dev), "weight_scale_2": s.to(dev),
                             "comfy_quant": marker}, strict=False)
        x = (torch.randn(4096, k, generator=g)).to(torch.bfloat16).to(dev)
        wd = nvfp4.dequantize_fp64(q, s, bs)
        ref = (x.double().cpu() @ wd.t()).to(dev)
        res = {}
        for path in ("reference", "exact", "fp8"):
            lin._h3_path = None if path == "reference" else path
            lin._h3_cache = None
            try:
                y = lin(x)
                err = float(((y.double() - ref).norm() / ref.norm()))
                dt = _t(lambda: lin(x))
                res[path] = {"rel_err_vs_fp64": err, "ms": round(dt * 1e3, 3),
                             "used_kernels": lin._h3_cache is not None}
            except Exception as e:  # report, do not hide
                res[path] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"check": "ops_paths", "layer": name, "shape": [n, k], "M": 4096, **res}), flush=True)


if __name__ == "__main__":
    if "--ops-only" not in sys.argv:
        quantize_check()
    if "--quant-only" not in sys.argv:
        ops_check()
