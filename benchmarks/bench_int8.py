"""W8A8 int8 (TurboH3's 128x128 block recipe) vs bf16 cuBLAS vs the NVFP4 fp8 path, at the four H3 projections.

Columns (one run, same inputs): ``bf16`` F.linear with the bf16 weight (cuBLAS); ``int8`` the pack's ``int8`` path
(Triton: per-call activation block quantization + the fused W8A8 GEMM); ``int8_gemm`` the GEMM alone (activations
quantized beforehand: the quantizer's share); ``int8_int_mm`` the library path (torch._int_mm per 128-wide K slice +
fp32 epilogue; slow on the GPU, listed for the record); ``fp8`` the NVFP4 ``fp8`` path (weights NVFP4 re-expressed as
e4m3, activations fp8 per row, torch._scaled_mm). Time: median of triton.testing.do_bench (CPU dry run: median of
perf_counter). Errors on 1024 rows: relative L2 of W8A8 vs the bf16 GEMM, vs float64 and vs the float64 recipe (kernel
exactness), and of the dequantized weight alone (W8A16), for weights {Gaussian, Student-t(3) tails} x activations
{Gaussian, 1% outlier channels x8}: the 128x128 block scales are set by each tile's amax, so outliers cost accuracy.
Targets (issue 16): int8 <= 0.80x bf16 time at 19 584 rows (sum of the four projections); W8A8 within 2% of bf16.

Run on the GPU machine from the repo root:  python3 benchmarks/bench_int8.py
Env: OUT (result folder, default benchmarks/results), S_LIST (default 19584,37632), REP_MS (default 200), METHODS
(comma list, default bf16,int8,int8_gemm,fp8; add int8_int_mm), TAG (file name suffix), DRY=1 (tiny shapes on the
CPU: a smoke test of this script, not a measurement). Writes bench_int8_h200[_TAG].json and .md.
SWEEP=1: first time the GEMM alone (pre-quantized activations) under every configuration of :data:`SWEEP_CONFIGS`
at the first S of S_LIST, each checked against the autotuned kernel's output, with bf16 in the same loop; writes
bench_int8_h200_sweep[_TAG].json after every shape (a killed run keeps what it measured).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.import_package()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from h3_turbo.formats import nvfp4 as fmt  # noqa: E402
from h3_turbo.kernels import dispatch as dsp  # noqa: E402
from h3_turbo.kernels import int8_block as ib  # noqa: E402
from h3_turbo.kernels.paths.int8 import PATH as INT8  # noqa: E402
from h3_turbo.kernels.paths.int8 import PreparedInt8  # noqa: E402

DRY = os.environ.get("DRY", "0") == "1"
dev = torch.device("cpu" if DRY else "cuda")
OUT = os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results")
S_LIST = [int(s) for s in os.environ.get("S_LIST", "100,300" if DRY else "19584,37632").split(",")]
REP = int(os.environ.get("REP_MS", "200"))
METHODS = [m for m in os.environ.get("METHODS", "bf16,int8,int8_gemm,fp8").split(",") if m]
TAG = os.environ.get("TAG", "dry" if DRY else "")
FNAME = "bench_int8_h200" + (f"_{TAG}" if TAG else "")
# [N, K] of the four projections of one H3 block (docs/h3-facts.md); the dry run: small, K % 128 != 0, K % 16 == 0
SHAPES = {"qkv": (21504, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
if DRY:
    SHAPES = {"qkv": (384, 176), "out": (176, 224), "fc1": (512, 176), "fc2": (176, 272)}
ERR_ROWS = 1024
SWEEP = os.environ.get("SWEEP", "0") == "1"
SWEEP_REP = int(os.environ.get("SWEEP_REP_MS", "60"))


def _c(bm, bn, w, st, **kw):
    return dict({"BM": bm, "BN": bn, "GROUP_M": 8, "num_warps": w, "num_stages": st}, **kw)


#: candidate launch configurations of kernels/int8_triton.py's GEMM (PIPE / TMA / WS / maxnreg: see its docstring)
SWEEP_CONFIGS = [
    _c(128, 128, 8, 3), _c(128, 128, 8, 4), _c(128, 256, 8, 3),
    _c(128, 128, 8, 3, PIPE=True), _c(128, 128, 8, 4, PIPE=True), _c(64, 128, 4, 4, PIPE=True),
    _c(64, 128, 4, 4, maxnreg=168), _c(64, 256, 8, 3), _c(64, 128, 4, 3, maxnreg=128),
    _c(128, 128, 8, 3, TMA=True), _c(128, 128, 8, 4, TMA=True), _c(128, 256, 8, 3, TMA=True),
    _c(128, 128, 8, 4, TMA=True, PIPE=True), _c(64, 128, 4, 4, TMA=True, maxnreg=168),
    _c(128, 128, 8, 4, TMA=True, WS=True), _c(128, 256, 8, 3, TMA=True, WS=True), _c(128, 128, 4, 4, TMA=True, WS=True),
]
if DRY:
    SWEEP_CONFIGS = [_c(32, 32, 4, 1), _c(32, 32, 4, 1, PIPE=True), _c(32, 64, 4, 1, TMA=True)]


def sweep(s: int) -> dict:
    """{shape: {"bf16": ms, "configs": [{config, ms | error, rel_vs_autotuned}], "best": ...}} at s rows."""
    from h3_turbo.kernels import int8_triton as it

    out = {"S": s, "shapes": {}}
    for i, (name, (n, k)) in enumerate(SHAPES.items()):
        w = h3_weight(n, k, 17 * i + s)
        x = h3_act(s, k, 17 * i + s + 1)
        q8 = ib.quantize_weight(w)
        xq, sx = it.quantize_blocks(x)
        ref = it.gemm_quantized(xq, sx, q8, x.dtype)
        row = {"N": n, "K": k, "bf16": bench(lambda: F.linear(x, w)), "autotuned": bench(lambda: it.gemm_quantized(xq, sx, q8, x.dtype)), "configs": []}
        for cfg in SWEEP_CONFIGS:
            it.FORCED["config"] = cfg
            e = {"config": cfg}
            try:
                y = it.gemm_quantized(xq, sx, q8, x.dtype)
                e["rel_vs_autotuned"] = rel(y, ref)
                e["ms"] = bench(lambda: it.gemm_quantized(xq, sx, q8, x.dtype)) if not DRY else 0.0
            except Exception as ex:  # noqa: BLE001 - a config that does not compile is a result
                e["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            finally:
                it.FORCED["config"] = None
            row["configs"].append(e)
            print(name, json.dumps(e), flush=True)
        ok = [e for e in row["configs"] if "ms" in e and e.get("rel_vs_autotuned", 1) < 1e-2]
        if ok:
            best = min(ok, key=lambda e: e["ms"])
            row["best"] = best
            row["best_to_bf16"] = best["ms"] / row["bf16"]
        out["shapes"][name] = row
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "bench_int8_h200_sweep" + (f"_{TAG}" if TAG else "") + ".json"), "w") as f:
            json.dump(out, f, indent=1)
    rows = out["shapes"].values()
    if all("best" in r for r in rows):
        out["sum_best_to_bf16"] = sum(r["best"]["ms"] for r in rows) / sum(r["bf16"] for r in rows)
        out["sum_autotuned_to_bf16"] = sum(r["autotuned"] for r in rows) / sum(r["bf16"] for r in rows)
    with open(os.path.join(OUT, "bench_int8_h200_sweep" + (f"_{TAG}" if TAG else "") + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    print("sweep:", json.dumps({k: v for k, v in out.items() if k != "shapes"}), flush=True)
    return out


def bench(fn) -> float:
    if DRY:
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    from triton.testing import do_bench

    return float(do_bench(fn, rep=REP, return_mode="median"))


def h3_weight(n, k, seed, dist="gauss"):
    """bf16 [n, k]: Gaussian (std 0.02) or Student-t(3) tails (the same scale), on the device."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.randn(n, k, generator=g)
    if dist == "t3":
        z = z / (sum(torch.randn(n, k, generator=g) ** 2 for _ in range(3)) / 3).sqrt() / 1.7
    return (z * 0.02).to(torch.bfloat16).to(dev)


def h3_act(s, k, seed, dist="gauss"):
    """bf16 [s, k]: unit Gaussian, or with 1% outlier channels x8 (``outlier``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(s, k, generator=g)
    if dist == "outlier":
        x[:, torch.randperm(k, generator=g)[: max(1, k // 100)]] *= 8.0
    return x.to(torch.bfloat16).to(dev)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def run_shape(name, n, k, s, seed):
    w = h3_weight(n, k, seed)
    x = h3_act(s, k, seed + 1)
    q8 = ib.quantize_weight(w)
    pr8 = PreparedInt8(q8)
    res = {"shape": name, "N": n, "K": k, "S": s, "ms": {}, "flops": 2 * s * n * k}
    fp8 = None
    if "fp8" in METHODS:
        qn, bs, gs = fmt.quantize(w)
        fp8 = dsp.prepare(dsp.PackedNVFP4(qn, bs, gs, n, k), "fp8")
    fns = {
        "bf16": lambda: F.linear(x, w),
        "int8": lambda: INT8.linear(x, pr8),
        "int8_int_mm": lambda: ib.int_mm_linear(x, q8),
        "fp8": lambda: dsp.linear(x, fp8, "fp8"),
    }
    if "int8_gemm" in METHODS and not DRY:
        from h3_turbo.kernels import int8_triton as it

        xq, sx = it.quantize_blocks(x)
        res["ms"]["int8_quant"] = bench(lambda: it.quantize_blocks(x))

        fns["int8_gemm"] = lambda: it.gemm_quantized(xq, sx, q8, x.dtype)
    for m in METHODS:
        if m in fns and not (DRY and m == "int8_gemm"):
            res["ms"][m] = bench(fns[m])
    res["err"] = {}
    for wd in ("gauss", "t3"):
        we = w if wd == "gauss" else h3_weight(n, k, seed, "t3")
        qe = q8 if wd == "gauss" else ib.quantize_weight(we)
        for xd in ("gauss", "outlier"):
            xs = h3_act(min(s, ERR_ROWS), k, seed + 2, xd)
            ybf = F.linear(xs, we)
            y8 = INT8.linear(xs, PreparedInt8(qe))
            e = {"int8_vs_bf16": rel(y8, ybf), "int8_vs_fp64": rel(y8, xs.double() @ we.double().t()),
                 "int8_vs_recipe_fp64": rel(y8, ib.recipe_fp64(xs, qe)),
                 "w8a16_vs_bf16": rel(F.linear(xs, ib.dequantize(qe, xs.dtype)), ybf)}
            if fp8 is not None and wd == "gauss":
                e["fp8_vs_bf16"] = rel(dsp.linear(xs, fp8, "fp8"), ybf)
            res["err"][f"w_{wd}/x_{xd}"] = e
    return res


def main():
    if not DRY and not torch.cuda.is_available():
        sys.exit("bench_int8: needs a CUDA GPU (or DRY=1 for the CPU smoke run)")
    if SWEEP:
        sweep(S_LIST[0])
    results = []
    for s in S_LIST:
        for i, (name, (n, k)) in enumerate(SHAPES.items()):
            r = run_shape(name, n, k, s, seed=17 * i + s)
            results.append(r)
            print(json.dumps(r), flush=True)
    summary = {}
    for s in S_LIST:
        rs = [r for r in results if r["S"] == s]
        tot = {m: sum(r["ms"].get(m, float("nan")) for r in rs) for m in rs[0]["ms"]}
        summary[s] = {"ms": tot, "ratio_to_bf16": {m: v / tot["bf16"] for m, v in tot.items() if "bf16" in tot},
                      "max_int8_vs_bf16": {c: max(r["err"][c]["int8_vs_bf16"] for r in rs) for c in rs[0]["err"]}}
    s0 = S_LIST[0]
    targets = {"int8_le_0.80x_bf16_at_%d" % s0: summary[s0]["ratio_to_bf16"].get("int8", float("nan")) <= 0.80,
               "w8a8_within_2pct_of_bf16 (gaussian weights and activations)":
                   all(v["max_int8_vs_bf16"]["w_gauss/x_gauss"] <= 0.02 for v in summary.values())}
    env = {"device": torch.cuda.get_device_name() if not DRY else platform.processor() or "cpu",
           "torch": torch.__version__, "dry": DRY, "rep_ms": REP}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, FNAME + ".json"), "w") as f:
        json.dump({"env": env, "results": results, "summary": summary, "targets": targets}, f, indent=1)
    methods = [m for m in ["bf16", "int8", "int8_gemm", "int8_quant", "int8_int_mm", "fp8"] if m in results[0]["ms"]]
    lines = [f"# W8A8 int8 vs bf16 vs fp8 (NVFP4) at the four H3 projections{' (DRY run on the CPU: not a measurement)' if DRY else ''}",
             "", f"{env}", "", "| S | shape | " + " | ".join(f"{m} ms" for m in methods) + " | int8/bf16 | "
             + " | ".join(f"int8 vs bf16 {c}" for c in results[0]["err"]) + " |",
             "|---|---|" + "---|" * (len(methods) + 1 + len(results[0]["err"]))]
    for r in results:
        ratio = r["ms"].get("int8", float("nan")) / r["ms"]["bf16"] if "bf16" in r["ms"] else float("nan")
        lines.append(f"| {r['S']} | {r['shape']} [{r['N']}, {r['K']}] | " + " | ".join(f"{r['ms'][m]:.3f}" for m in methods)
                     + f" | {ratio:.3f}x | " + " | ".join(f"{e['int8_vs_bf16']:.4f}" for e in r["err"].values()) + " |")
    lines += ["", "| S | " + " | ".join(f"{m} ms (sum)" for m in methods) + " | " + " | ".join(f"{m}/bf16" for m in methods) + " |",
              "|---|" + "---|" * (2 * len(methods))]
    for s, v in summary.items():
        lines.append(f"| {s} | " + " | ".join(f"{v['ms'][m]:.3f}" for m in methods) + " | "
                     + " | ".join(f"{v['ratio_to_bf16'].get(m, float('nan')):.3f}x" for m in methods) + " |")
    lines += ["", "Targets: " + ", ".join(f"{k}: {'met' if ok else 'NOT met'}" for k, ok in targets.items())]
    with open(os.path.join(OUT, FNAME + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
