"""The Gluon ``int8_sage`` attention kernel (``kernels/attention/int8_gluon.py``, config ``GLUON``) against the
Triton kernel in the tuned Hopper configuration, on the same prequantized inputs (the fused block's route:
``sage_attention_prequantized``, Q quantized per row, K/V from their partial statistics), per length:

- ``ms_*``: kernel time (CUDA events, median of 50 after 10 warm-up calls) of ``sage_attention_prequantized`` with
  the e4m3 output (what the block runs) and with the bf16 output, Triton vs Gluon (BLOCK_M 64, 4 warps,
  BLOCK_N 128); ``ratio_*`` = Gluon / Triton in the same run.
- ``ms_quantize_kv_*``: the K/V pre-kernel for each (the Gluon kernel's V has its keys permuted within each 32;
  ``quantize_kv_gluon_v_is_plain_v_moved`` checks it is the plain V moved, bit for bit).
- agreement: the two kernels' bf16 outputs (relative L2, max abs), e4m3 outputs (fraction of equal bytes, row
  scales equal) and each one's accuracy on 512 sampled query rows against float32 attention
  (``reference_attention``: per-head cosine min / mean, relative L2).

Env: OUT (folder, default benchmarks/results), TAG (default attention_gluon_h200), LENGTHS (comma list, default
19584,37632), WS_STAGES (comma list of K/V slot counts of the warp-specialized form, default 2,3), NOSKIP=1 (each
warp-specialized row also with ``int8_gluon.WS_SKIP_EMPTY`` off, ``gluon_ws<n>_noskip``: the A/B of the empty
consumer's protocol-only path; it only differs at lengths whose last query tile has <= 64 rows), ABAB=N (then N
interleaved rounds of the warp-specialized variants, 10 calls each per round in a rotating order: ``abab_ms_*``,
medians over the rounds), DRY=1 (CPU: inputs and reference only, no kernels). Saves ``$OUT/$TAG.json`` after every
step.

Run (GPU, torch and Triton only): ``OUT=benchmarks/results WS_STAGES=2 python3 benchmarks/bench_attention_gluon.py``;
CPU check: ``DRY=1 OUT=/tmp/dry python benchmarks/bench_attention_gluon.py``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_median_ms as bench, h3_qkv, import_package, q_row_codes  # noqa: E402

import_package()
from h3_turbo.kernels.attention import int8_kernels as K  # noqa: E402
from h3_turbo.kernels.attention.reference import accuracy, reference_attention  # noqa: E402

DRY = bool(os.environ.get("DRY"))
DEV = "cuda" if torch.cuda.is_available() and not DRY else "cpu"
OUT = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
TAG = os.environ.get("TAG", "attention_gluon_h200")
LENGTHS = [int(x) for x in os.environ.get("LENGTHS", "256" if DRY else "19584,37632").split(",")]
HEADS, HD = (4, 128) if DRY else (int(os.environ.get("HEADS", 56)), 128)
WS_STAGES = [int(x) for x in os.environ.get("WS_STAGES", "2,3").split(",") if x]
NOSKIP = os.environ.get("NOSKIP") == "1"
ABAB = int(os.environ.get("ABAB", 0))
RES: dict = {"env": {}, "steps": {}, "errors": []}


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{TAG}.json").write_text(json.dumps(RES, indent=1, default=str))


def one_length(L: int) -> dict:
    _, (q, k, v) = h3_qkv(L, HEADS, HD, DEV, seed=1)
    q8, qs = q_row_codes(q)
    kc, vc = k[0].transpose(0, 1), v[0].transpose(0, 1)                # [L, H, D] strided views
    ksum, vamax = K.kv_partial_stats(kc, vc) if not DRY else (kc.float().sum(0)[None], vc.float().abs().amax(0)[None])
    rows = torch.linspace(0, L - 1, min(512, L), device=DEV).long()
    ref = reference_attention(q, k, v, rows=rows, dtype=torch.float32)           # [H, r, D]
    out: dict = {"L": L, "heads": HEADS, "head_dim": HD}
    if DRY:
        out["dry"] = "inputs and reference built; kernels need a Hopper GPU"
        return out
    tuned = K.tuned_config(DEV, L)
    cfgs = {"triton": tuned,
            "gluon_m64": dict(tuned, GLUON=True, BLOCK_M=64, num_warps=4, MAXNREG=None)}
    for st in WS_STAGES:
        cfgs[f"gluon_ws{st}"] = dict(tuned, GLUON=True, BLOCK_M=128, num_warps=4, MAXNREG=None, num_stages=st)
        if NOSKIP:     # the same kernel with int8_gluon.WS_SKIP_EMPTY off (an empty consumer computes masked rows)
            cfgs[f"gluon_ws{st}_noskip"] = cfgs[f"gluon_ws{st}"]
    out["configs"] = cfgs

    # the K/V pre-kernel alone: plain V vs V with its keys in the Gluon kernel's order (the same codes, moved)
    qa = K.quantize_kv(k, v, dict(cfgs["triton"], QPRE=True, Q_ROW=True), parts=(ksum, vamax))
    qb = K.quantize_kv(k, v, dict(cfgs["gluon_m64"], Q_ROW=True), parts=(ksum, vamax))
    from h3_turbo.kernels.attention.int8_gluon import v_key_columns

    moved = torch.empty_like(qa["vq"].view(torch.uint8))
    moved[..., v_key_columns(qa["n_kpad"]).to(DEV)] = qa["vq"].view(torch.uint8)
    out["quantize_kv_gluon_v_is_plain_v_moved"] = bool(torch.equal(qb["vq"].view(torch.uint8), moved))
    out["ms_quantize_kv_triton"] = bench(lambda: K.quantize_kv(k, v, dict(cfgs["triton"], QPRE=True, Q_ROW=True),
                                                               parts=(ksum, vamax)))
    out["ms_quantize_kv_gluon"] = bench(lambda: K.quantize_kv(k, v, dict(cfgs["gluon_m64"], Q_ROW=True),
                                                              parts=(ksum, vamax)))
    RES["steps"][str(L)] = out
    save()

    def run(c, fp8):
        return K.sage_attention_prequantized(q8, qs, k, v, ksum, vamax, config=c, out_fp8=fp8)

    def as_heads(t):
        return t[rows].view(-1, HEADS, HD).transpose(0, 1).float()

    base_bf16 = run(cfgs["triton"], False)[0]
    base_f8, base_sx = run(cfgs["triton"], True)
    out["acc_triton_bf16"] = accuracy(as_heads(base_bf16), ref)
    out["acc_triton_fp8"] = accuracy(as_heads(base_f8.float() * base_sx), ref)
    from h3_turbo.kernels.attention import int8_gluon as G

    for name, c in cfgs.items():
        G.WS_SKIP_EMPTY = not name.endswith("_noskip")
        try:
            o16 = run(c, False)[0]
            o8, sx = run(c, True)
            torch.cuda.synchronize()
            if name != "triton":
                d = (o16.float() - base_bf16.float())
                out[f"{name}_vs_triton"] = {
                    "bf16_rel_l2": float(d.norm() / base_bf16.float().norm()), "bf16_max_abs": float(d.abs().max()),
                    "bf16_equal_frac": float((o16 == base_bf16).double().mean()),
                    "fp8_equal_byte_frac": float((o8.view(torch.uint8) == base_f8.view(torch.uint8)).double().mean()),
                    "row_scales_equal": bool(torch.equal(sx, base_sx))}
                out[f"acc_{name}_bf16"] = accuracy(as_heads(o16), ref)
                out[f"acc_{name}_fp8"] = accuracy(as_heads(o8.float() * sx), ref)
            out[f"ms_{name}_fp8"] = bench(lambda: run(c, True))
            out[f"ms_{name}_bf16"] = bench(lambda: run(c, False))
            if name != "triton":
                out[f"ratio_{name}_fp8"] = out[f"ms_{name}_fp8"] / out["ms_triton_fp8"]
                out[f"ratio_{name}_bf16"] = out[f"ms_{name}_bf16"] / out["ms_triton_bf16"]
        except Exception as e:  # noqa: BLE001 - recorded, the other configurations still run
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
            RES["errors"].append({"L": L, "config": name, "trace": traceback.format_exc()[-4000:]})
        G.WS_SKIP_EMPTY = True
        RES["steps"][str(L)] = out
        save()
    if ABAB and DEV == "cuda":
        # interleaved A/B of the warp-specialized variants (each round: every variant once, 10 calls each, in a
        # rotating order), so that the card's drift under its power cap falls on every variant alike
        names = [nm for nm in cfgs if nm.startswith("gluon_ws")]
        times: dict = {nm: [] for nm in names}
        for r in range(ABAB):
            for nm in names[r % len(names):] + names[:r % len(names)]:
                G.WS_SKIP_EMPTY = not nm.endswith("_noskip")
                times[nm].append(bench(lambda: run(cfgs[nm], True), warmup=2, rep=10))
        G.WS_SKIP_EMPTY = True
        for nm, ts in times.items():
            ts = sorted(ts)
            out[f"abab_ms_{nm}_fp8"] = ts[len(ts) // 2]
        base = out.get(f"abab_ms_{names[0]}_fp8")
        for nm in names[1:]:
            out[f"abab_ratio_{names[0]}_to_{nm}"] = base / out[f"abab_ms_{nm}_fp8"]
        out["abab_rounds"] = ABAB
        save()
    tflop = 4 * L * L * HD * HEADS / 1e12
    for key in [x for x in out if x.startswith("ms_")]:
        out[key.replace("ms_", "tflops_")] = tflop / (out[key] / 1e3)
    return out


def main():
    import triton

    RES["env"] = {"torch": torch.__version__, "triton": triton.__version__, "device": DEV,
                  "gpu": torch.cuda.get_device_name() if DEV == "cuda" else None, "dry": DRY}
    t0 = time.time()
    for L in LENGTHS:
        try:
            RES["steps"][str(L)] = one_length(L)
        except Exception:  # noqa: BLE001
            RES["errors"].append({"L": L, "trace": traceback.format_exc()[-4000:]})
        RES["elapsed_s"] = time.time() - t0
        save()
        print(json.dumps(RES["steps"].get(str(L)), default=str)[:3000], flush=True)
    print("errors:", len(RES["errors"]), flush=True)
    for e in RES["errors"]:
        print(e["trace"][-1500:], flush=True)


if __name__ == "__main__":
    main()
