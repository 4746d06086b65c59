"""Launch settings of ``triton_nvfp4.fold_weight`` (the per-call weight of the exact "full" strategy and of the
fp8 + Turbo LoRA fold) on one GPU, at the four H3 projection shapes.

For each setting: bit-exactness of the no-LoRA bf16 output against ``nvfp4_ref.dequant_exact``, time (median of
``triton.testing.do_bench``) for bf16 / bf16+LoRA / e4m3+LoRA outputs, and the achieved bandwidth counting the
packed weight read (N*K/2 + N*K/16 bytes) plus the output written (2 or 1 byte per element). A device-to-device
copy of the bf16 weight gives the bandwidth ceiling in the same run.

Run on the GPU machine from the repo root:  python3 benchmarks/bench_fold.py   (writes bench_fold_h200.json/.md
under OUT, default benchmarks/results)
"""
from __future__ import annotations

import itertools
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (benchmarks/_common.py)

_common.import_package()

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from h3_turbo.formats import nvfp4 as fmt  # noqa: E402
from h3_turbo.kernels import nvfp4_ref as ref  # noqa: E402
from h3_turbo.kernels import triton_nvfp4 as tk  # noqa: E402

dev = torch.device("cuda")
OUT = os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results")
SHAPES = {"qkv": (21504, 5376, 3), "out": (5376, 7168, 1), "fc1": (28672, 5376, 1), "fc2": (5376, 14336, 1)}
KEYS = ("warps", "bn", "kb_per", "stages")
GRID = [dict(warps=w, bn=bn, kb_per=kb, stages=st)
        for w, bn, kb, st in itertools.product((4, 8), (64, 128), (4, 0), (2, 3))]
REP = int(os.environ.get("REP_MS", "50"))
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": __import__("triton").__version__,
       "rows": []}
default = dict(tk.FOLD_CFG)
for name, (n, k, blocks) in SHAPES.items():
    torch.manual_seed(n)
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    q, bs, gs = fmt.quantize(w)
    gs = gs.float().reshape(1).to(dev)
    want = ref.dequant_exact(q, bs, gs, n, k)
    amax_w = want.float().abs().amax(dim=1)
    A = (torch.randn(blocks * 128, k, device=dev) * 0.02).to(torch.bfloat16)
    Bc = (torch.randn(n, 128, device=dev) * 0.02).to(torch.bfloat16)
    lora = (A, Bc, 1.0, n // blocks, A.abs().amax(dim=1).float())
    ob = torch.empty((n, k), device=dev, dtype=torch.bfloat16)
    o8 = torch.empty((n, k), device=dev, dtype=torch.float8_e4m3fn)
    so = torch.empty((n,), device=dev)
    copy_ms = do_bench(lambda: ob.copy_(want), warmup=20, rep=REP, return_mode="median")
    packed_bytes = n * k // 2 + n * k // 16
    row = {"shape": name, "N": n, "K": k, "copy_bf16_ms": copy_ms,
           "copy_GBps": 2 * 2 * n * k / copy_ms / 1e6, "configs": []}
    for cfg in GRID:
        tk.FOLD_CFG.update(cfg)
        c = dict(cfg)
        try:
            ob.fill_(float("nan"))
            tk.fold_weight(q, bs, gs, n, k, ob)
            c["bitexact"] = bool(torch.equal(ob.view(torch.int16), want.view(torch.int16)))
            for mode, fn, ob_bytes in (
                    ("bf16", lambda: tk.fold_weight(q, bs, gs, n, k, ob), 2),
                    ("bf16_lora", lambda: tk.fold_weight(q, bs, gs, n, k, ob, lora=lora), 2),
                    ("fp8_lora", lambda: tk.fold_weight(q, bs, gs, n, k, o8, lora=lora, amax_w=amax_w,
                                                        scale_out=so), 1)):
                ms = do_bench(fn, warmup=20, rep=REP, return_mode="median")
                c[f"{mode}_ms"] = ms
                c[f"{mode}_GBps"] = (packed_bytes + ob_bytes * n * k) / ms / 1e6
        except Exception as e:  # noqa: BLE001
            c["error"] = repr(e)[:400]
        row["configs"].append(c)
        print(name, json.dumps(c), flush=True)
    tk.FOLD_CFG.update(default)
    res["rows"].append(row)
    del w, q, bs, want, A, Bc, ob, o8
    torch.cuda.empty_cache()
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "bench_fold_h200.json"), "w") as f:
    json.dump(res, f, indent=1)
lines = [f"# fold_weight launch settings on {res['gpu']} (torch {res['torch']}, triton {res['triton']})", "",
         "Best setting per shape and output (ms, GB/s counting packed read + output write; copy = bf16 D2D copy).", "",
         "| shape | copy ms (GB/s) | mode | best ms | GB/s | setting | default setting ms |", "|---|---|---|---|---|---|---|"]
for row in res["rows"]:
    ok = [c for c in row["configs"] if "error" not in c and c.get("bitexact")]
    for mode in ("bf16", "bf16_lora", "fp8_lora"):
        if not ok:
            continue
        best = min(ok, key=lambda c: c[f"{mode}_ms"])
        d = [c for c in ok if all(c[kk] == default[kk] for kk in KEYS)]
        lines.append(f"| {row['shape']} | {row['copy_bf16_ms']:.3f} ({row['copy_GBps']:.0f}) | {mode} | "
                     f"{best[mode + '_ms']:.3f} | {best[mode + '_GBps']:.0f} | "
                     f"{ {kk: best[kk] for kk in KEYS} } | "
                     f"{d[0][mode + '_ms']:.3f} |" if d else "-")
bad = [(r["shape"], c) for r in res["rows"] for c in r["configs"] if "error" in c or not c.get("bitexact")]
lines += ["", f"Settings with an error or not bit-exact: {len(bad)}", *[f"- {s}: {c}" for s, c in bad[:20]]]
with open(os.path.join(OUT, "bench_fold_h200.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines), flush=True)
