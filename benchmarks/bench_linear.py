"""NVFP4 linear on one GPU (H200): bf16 cuBLAS vs core's NVFP4 path vs our exact / fp8 paths, with
and without the Turbo LoRA branch, at the four H3 projection shapes.

Columns: ``bf16`` F.linear on the dequantized weight; ``core_nvfp4`` comfy-kitchen dequantize_nvfp4 +
bf16 GEMM (core on Hopper; if comfy-kitchen is absent, ``dq_bf16``: our Triton dequant + F.linear, the
core-equivalent, is reported instead and the JSON says so); ``exact_fused`` (Triton dequant-GEMM);
``exact_tiled`` (row-tile dequant on a side stream overlapped with cuBLAS); ``exact`` (what dispatch
picks); ``fp8`` (W8A8 _scaled_mm + Triton activation quant); ``exact_lora`` / ``fp8_lora`` (rank 128,
qkv: 3 x 128 block-diagonal). Time: median of triton.testing.do_bench; TFLOP/s counts 2*S*K*N (LoRA
flops not counted); ratio to bf16 from the same run; error vs a float64 reference on the first rows.

Run on the GPU machine from the repo root:  python3 benchmarks/bench_linear.py
Env: OUT (result folder, default benchmarks/results), S_LIST (comma list), REP_MS (default 200), METHODS (comma
list, default all), TAG (file name suffix), SKIP_CHECKS=1 / CHECK_FUSED=0 (skip all / the fused-kernel GPU checks).
Writes bench_linear_h200.json and bench_linear_h200.md.
"""
from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (benchmarks/_common.py)

_common.import_package()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from h3_turbo.formats import nvfp4 as fmt  # noqa: E402
from h3_turbo.kernels import dispatch as dsp  # noqa: E402
from h3_turbo.kernels import nvfp4_ref as ref  # noqa: E402
from h3_turbo.kernels import triton_nvfp4 as tk  # noqa: E402
from h3_turbo.kernels.paths import fp8 as fp8_path  # noqa: E402
from h3_turbo.kernels.paths.exact import PATH as EXACT  # noqa: E402
from h3_turbo.kernels.paths.fp8 import PATH as FP8  # noqa: E402

try:
    import comfy_kitchen as ck
except Exception as e:  # noqa: BLE001
    ck = None
    CK_ERR = repr(e)
else:
    CK_ERR = None

dev = torch.device("cuda")
OUT = os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results")
S_LIST = [int(s) for s in os.environ.get("S_LIST", "4096,19584,37632").split(",")]
REP = int(os.environ.get("REP_MS", "200"))
METHODS = [m for m in os.environ.get("METHODS", "").split(",") if m]   # empty: all
TAG = os.environ.get("TAG", "")
SKIP_CHECKS = os.environ.get("SKIP_CHECKS", "0") == "1"
CHECK_FUSED = os.environ.get("CHECK_FUSED", "1") == "1"   # 0: skip the fused-kernel checks (autotuning is slow)
FNAME = "bench_linear_h200" + (f"_{TAG}" if TAG else "")
SHAPES = {"qkv": (21504, 5376, 3), "out": (5376, 7168, 1), "fc1": (28672, 5376, 1), "fc2": (5376, 14336, 1)}
RANK = 128
SAMPLE = 256


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def bench(fn):
    return do_bench(fn, warmup=30, rep=REP, return_mode="median")


def quantize(w):
    if ck is not None:
        gs = (w.abs().amax().float() / 2688).reshape(())
        q, bs = ck.quantize_nvfp4(w, gs)
        return q, bs, gs
    return fmt.quantize(w)


res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": __import__("triton").__version__, "comfy_kitchen": getattr(ck, "__version__", None),
       "comfy_kitchen_error": CK_ERR, "rep_ms": REP, "lora_rank": RANK,
       "resolve_auto": dsp.resolve_compute("auto", dev), "checks": {}, "rows": []}
print(json.dumps({k: res[k] for k in ("gpu", "torch", "triton", "comfy_kitchen", "resolve_auto")}), flush=True)

# ----------------------------------------------------------------------------- correctness on the GPU
torch.manual_seed(0)
chk = res["checks"]
try:
    for (n, k) in ([] if SKIP_CHECKS else [(21504, 5376), (5376, 14336), (300, 208)]):
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        q, bs, gs = quantize(w) if k % 16 == 0 and n % 16 == 0 else fmt.quantize(w)
        p = dsp.PackedNVFP4(q, bs, gs, n, k)
        pe = dsp.prepare(p, "exact")
        want = ref.dequant_exact(q, bs, gs, n, k)
        got = tk.fold_weight(q, bs, pe.gs, n, k, torch.empty(n, k, device=dev, dtype=torch.bfloat16))
        c = {"triton_dequant_bitexact": bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))}
        if ck is not None and (n % 16 == 0):
            ckd = ck.dequantize_nvfp4(q, gs, bs, output_type=torch.bfloat16)[:n, :k]
            c["ck_cuda_dequant_mismatch_frac"] = (ckd.view(torch.int16) != want.view(torch.int16)).float().mean().item()
        for m in ((1, 77, 1000, 4099) if CHECK_FUSED else ()):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            o = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            tk.gemm_exact(x, q, bs, pe.gs, n, k, out=o)
            r64 = x.double() @ want.double().t()
            c[f"fused_m{m}_rel"] = rel(o, r64)
            c[f"fused_m{m}_all_finite"] = bool(torch.isfinite(o).all())
            if m >= 1000:
                EXACT.settings.strategy = "tiled"
                c[f"tiled_m{m}_rel"] = rel(dsp.linear(x, pe, "exact"), r64)
                EXACT.settings.strategy = "auto"
        # weight-side fold from the native storage: bit-exact without LoRA; with LoRA vs float64
        fo = torch.full((n, k), float("nan"), device=dev, dtype=torch.bfloat16)
        tk.fold_weight(q, bs, gs.float().reshape(1), n, k, fo)
        c["fold_bitexact"] = bool(torch.equal(fo.view(torch.int16), want.view(torch.int16)))
        if n % 3 == 0 and (n // 3) % 16 == 0:
            A = (torch.randn(3 * 128, k, device=dev) * 0.02).to(torch.bfloat16)
            Bc = (torch.randn(n, 128, device=dev) * 0.02).to(torch.bfloat16)
            tk.fold_weight(q, bs, gs.float().reshape(1), n, k, fo, lora=(A, Bc, 0.9, n // 3))
            w64 = want.double()
            for i in range(3):
                w64[i * (n // 3):(i + 1) * (n // 3)] += 0.9 * (Bc[i * (n // 3):(i + 1) * (n // 3)].double()
                                                            @ A[i * 128:(i + 1) * 128].double())
            c["fold_lora_rel"] = rel(fo, w64)
            pe8 = dsp.prepare(p, "fp8")
            x = torch.randn(2048, k, device=dev).to(torch.bfloat16)
            r64l = dsp.lora_reference(x[:SAMPLE], pe, A, Bc, 0.9, 3)
            o8 = fp8_path.fold_per_call(x, pe8, (A, Bc, 0.9, n // 3, None))
            c["fp8_fold_lora_rel"] = rel(o8[:SAMPLE], r64l)
            c["fp8_base_rel"] = rel(dsp.linear(x[:SAMPLE], pe8, "fp8"), x[:SAMPLE].double() @ want.double().t())
            c["exact_full_lora_rel"] = rel(EXACT.full(x, pe, lora=(A, Bc, 0.9, n // 3))[:SAMPLE], r64l)
            del A, Bc, pe8, w64
        del fo
        x = torch.randn(333, k, device=dev).to(torch.bfloat16)
        x8, sx = tk.quant_rows_fp8(x)
        x8r, sxr = ref.quantize_rows_fp8(x)
        c["fp8_actquant_mismatch_frac"] = (x8.view(torch.uint8) != x8r.view(torch.uint8)).float().mean().item()
        c["fp8_actscale_maxrel"] = ((sx - sxr).abs() / sxr).max().item()
        chk[f"{n}x{k}"] = c
        print("check", n, k, json.dumps(c), flush=True)
        del w, q, bs, p, pe, want, got
except Exception as e:  # noqa: BLE001
    chk["error"] = repr(e)[:2000]
    print("CHECK ERROR", repr(e)[:2000], flush=True)
torch.cuda.empty_cache()

# ----------------------------------------------------------------------------- timings
for S in S_LIST:
    for name, (N, K, blocks) in SHAPES.items():
        row = {"S": S, "shape": name, "N": N, "K": K}
        fl = 2.0 * S * K * N
        try:
            torch.manual_seed(S + N)
            w = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
            q, bs, gs = quantize(w)
            del w
            p = dsp.PackedNVFP4(q, bs, gs, N, K)
            pe = dsp.prepare(p, "exact")
            t0 = time.time()
            p8 = dsp.prepare(p, "fp8")
            torch.cuda.synchronize()
            row["fp8_prepare_s"] = time.time() - t0
            wq = ref.dequant_exact(q, bs, gs, N, K)                 # the exact bf16 weight
            x = torch.randn(S, K, device=dev).to(torch.bfloat16)
            A = (torch.randn(blocks * RANK, K, device=dev) * 0.02).to(torch.bfloat16)
            B = (torch.randn(N, RANK, device=dev) * 0.02).to(torch.bfloat16)  # compact block-diag up
            lscale = 1.0
            r64 = x[:SAMPLE].double() @ wq.double().t()
            r64l = dsp.lora_reference(x[:SAMPLE], pe, A, B, lscale, blocks)
            meth = {
                "bf16": lambda: F.linear(x, wq),
                "dq_bf16": lambda: F.linear(x, tk.fold_weight(q, bs, pe.gs, N, K, torch.empty(N, K, device=dev,
                                                                                              dtype=torch.bfloat16))),
            }
            if ck is not None:
                meth["core_nvfp4"] = lambda: F.linear(x, ck.dequantize_nvfp4(q, gs, bs, output_type=torch.bfloat16))

            def exact_with(strategy, lora=False):
                def f():
                    EXACT.settings.strategy = strategy
                    try:
                        if lora:
                            return dsp.linear_with_lora(x, pe, "exact", A, B, lscale, blocks, amax_a=amax_a)
                        return dsp.linear(x, pe, "exact")
                    finally:
                        EXACT.settings.strategy = "auto"
                return f

            def fp8_lora(fold=True, key=None, switch=False):
                tick = [0]

                def f():
                    FP8.settings.lora_fold = fold
                    try:
                        k_ = key
                        if switch:  # every call needs another fold: the adapter-switch cost, worst case
                            tick[0] += 1
                            k_ = ("switch", tick[0] % 2)
                        return dsp.linear_with_lora(x, p8, "fp8", A, B, lscale, blocks, amax_a=amax_a, fold_key=k_)
                    finally:
                        FP8.settings.lora_fold = True
                return f
            amax_a = A.abs().amax(dim=1).float()   # cached per adapter target by the runtime branch
            meth["exact_fused"] = exact_with("fused")
            meth["exact_tiled"] = exact_with("tiled")
            meth["exact_full"] = exact_with("full")
            meth["exact"] = exact_with("auto")
            meth["fp8"] = lambda: dsp.linear(x, p8, "fp8")
            meth["exact_lora"] = exact_with("auto", lora=True)
            meth["exact_tiled_lora"] = exact_with("tiled", lora=True)
            meth["exact_full_lora"] = exact_with("full", lora=True)
            meth["exact_fused_lora"] = exact_with("fused", lora=True)
            meth["fp8_lora"] = fp8_lora(True, key=("turbo", S, name))    # the runtime branch: fold kept in the slot
            meth["fp8_lora_percall"] = fp8_lora(True)                      # no key: fold per call into a buffer
            meth["fp8_lora_switch"] = fp8_lora(True, switch=True)          # a refold on every call
            meth["fp8_lora_unfused"] = fp8_lora(False)
            if METHODS:
                meth = {a: b for a, b in meth.items() if a in METHODS}
            for mname, fn in meth.items():
                try:
                    o = fn()
                    ms = bench(fn)
                    row[f"{mname}_ms"] = ms
                    row[f"{mname}_tflops"] = fl / (ms * 1e-3) / 1e12
                    want = r64l if "lora" in mname else r64
                    row[f"{mname}_rel"] = rel(o[:SAMPLE], want)
                    row[f"{mname}_maxabs"] = (o[:SAMPLE].double() - want).abs().max().item()
                    del o
                except Exception as e:  # noqa: BLE001
                    row[f"{mname}_error"] = repr(e)[:500]
            bf = row.get("bf16_ms")
            for mname in meth:
                if bf and f"{mname}_ms" in row:
                    row[f"{mname}_ratio"] = row[f"{mname}_ms"] / bf
            if "exact_fused_ms" in row and "exact_fused_lora_ms" in row:
                row["lora_overhead_exact_fused"] = row["exact_fused_lora_ms"] / row["exact_fused_ms"] - 1
            if "exact_ms" in row and "exact_lora_ms" in row:
                row["lora_overhead_exact"] = row["exact_lora_ms"] / row["exact_ms"] - 1
            if "fp8_ms" in row and "fp8_lora_ms" in row:
                row["lora_overhead_fp8"] = row["fp8_lora_ms"] / row["fp8_ms"] - 1
            for st in ("tiled", "full"):
                if f"exact_{st}_ms" in row and f"exact_{st}_lora_ms" in row:
                    row[f"lora_overhead_exact_{st}"] = row[f"exact_{st}_lora_ms"] / row[f"exact_{st}_ms"] - 1
            for v in ("unfused", "percall", "switch"):
                if "fp8_ms" in row and f"fp8_lora_{v}_ms" in row:
                    row[f"lora_overhead_fp8_{v}"] = row[f"fp8_lora_{v}_ms"] / row["fp8_ms"] - 1
            if "fp8_ms" in row:
                o8 = dsp.linear(x[:SAMPLE], p8, "fp8")
                oe = dsp.linear(x[:SAMPLE], pe, "exact")
                row["fp8_vs_exact_rel"] = rel(o8, oe)
            del x, A, B, p, pe, p8, wq, q, bs
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:1000]
        torch.cuda.empty_cache()
        res["rows"].append(row)
        print("row", json.dumps(row), flush=True)
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, FNAME + ".json"), "w") as f:
            json.dump(res, f, indent=1)

# ----------------------------------------------------------------------------- write
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, FNAME + ".json"), "w") as f:
    json.dump(res, f, indent=1)
cols = ["bf16", "core_nvfp4" if ck is not None else "dq_bf16", "exact_fused", "exact_tiled", "exact_full", "exact",
        "fp8", "exact_lora", "exact_tiled_lora", "exact_full_lora", "exact_fused_lora", "fp8_lora", "fp8_lora_percall", "fp8_lora_switch", "fp8_lora_unfused"]
cols = [c for c in cols if any(f"{c}_ms" in r for r in res["rows"])]
lines = [f"# NVFP4 linear on {res['gpu']} (torch {res['torch']}, triton {res['triton']})", "",
         "ms = median of triton.testing.do_bench; (x) = ratio to bf16 in the same run; TFLOP/s counts 2*S*K*N;",
         f"rel = relative Frobenius error vs float64 on the first {SAMPLE} rows (bf16 vs the exact NVFP4 weight;",
         "LoRA columns vs the float64 unfused branch). LoRA: rank 128, qkv as 3 x 128 block-diagonal.", "",
         "| S | shape | " + " | ".join(cols) + " | fp8 vs exact |",
         "|---|---|" + "---|" * len(cols) + "---|"]
OVH = ("exact", "exact_tiled", "exact_full", "exact_fused", "fp8", "fp8_percall", "fp8_switch", "fp8_unfused")
lora_lines = ["", "| S | shape | " + " | ".join(f"LoRA overhead {c}" for c in OVH) + " |", "|---|---|" + "---|" * len(OVH)]
for r in res["rows"]:
    cells = []
    for c in cols:
        if f"{c}_ms" in r:
            cells.append(f"{r[c + '_ms']:.3f} ms ({r.get(c + '_ratio', 0):.3f}x, {r[c + '_tflops']:.0f} TF/s, "
                         f"rel {r[c + '_rel']:.1e})")
        else:
            cells.append("error" if (f"{c}_error" in r or "error" in r) else "-")
    cells.append(f"{r.get('fp8_vs_exact_rel', float('nan')):.3%}")
    lines.append(f"| {r['S']} | {r['shape']} [{r['N']}x{r['K']}] | " + " | ".join(cells) + " |")
    ov = [r.get(f"lora_overhead_{c}") for c in OVH]
    lora_lines.append(f"| {r['S']} | {r['shape']} | " + " | ".join("-" if v is None else f"{v:+.1%}" for v in ov) + " |")
lines += lora_lines + ["", "GPU checks: " + json.dumps(res["checks"])]
with open(os.path.join(OUT, FNAME + ".md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), flush=True)
