"""Issue 9 benchmark: the 8-bit attention kernel (``kernels/attention/int8_kernels.py``: INT8 Q K^T, FP8 P V,
Triton) against exact cuDNN SDPA on one GPU (H200), at H3 shapes.

Inputs from ``benchmarks/_common.py: h3_qkv`` (shared with bench_attention.py): 56 heads x 128, bf16, q/k per-head RMS-normalised times a per-channel gain
in [1, 1.5), strided [1, 56, S, 128] views of one [S, 3*7168] qkv buffer, v cloned (core's layout).

Columns per S: ``cudnn`` = ``kernels.attention.exact.sdpa_with('CUDNN_ATTENTION', q, k, v)`` ([1, H, S, D]
out; what ``exact`` runs on Hopper), and each 8-bit config, called as the override does for H3
(``out_layout='blhd'``: [1, S, 7168] written directly), every pre-pass INCLUDED (K/V statistics and
quantization, and Q quantization with QPRE). A ``null`` config entry is ``tuned``: what ``int8_sage``
runs (``tuned_config`` for the device and S); ``{}`` is DEFAULT_CONFIG.
Time: median of ``triton.testing.do_bench`` (ms). TFLOP/s = 4 S^2 * 56 * 128 / t. ``x_exact`` = time /
cuDNN time in the same run. Accuracy vs float32 attention (``kernels.attention.reference.reference_attention``)
on 8 heads x 512 query rows (all keys): smallest per-head cosine and relative L2. At the first S each
config is also checked against the float64 model of its own quantized math (``sage_reference``) on
2 heads x 256 rows (``vs_model_rel_l2``), and ``tuned`` (or ``{}`` when no ``null`` entry is given) writes
into a NaN-poisoned output whose every element must be finite and close to cuDNN's (``full_*``).
``quant_ms``: the pre-passes alone (``quantize_kv``, plus ``quantize_q`` with QPRE).

Library rows (``LIBS=sage2``, at every S): SageAttention 2's own Hopper kernel
(``sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90``: INT8 Q K^T with per-thread or per-warp Q scales and
smoothed K, FP8 P V with two-level fp32 accumulation; hand-written CUDA with wgmma and TMA), on the same
inputs in core's [1, S, H, D] view ("NHD", no copies; its output is [1, S, H, D] contiguous = core's
[1, S, 7168]), every pre-pass included, the same accuracy columns. SageAttention 2 is not on PyPI: build it
from source (thu-ml/SageAttention; the sm_90a modules ``_qattn_sm90`` and ``_fused`` suffice) and put the built
folder on PYTHONPATH. A missing library
is recorded as an error row, not skipped silently.

Env: SIZES (default 19584,37632,109000), CONFIGS (JSON list of config dicts, default below), TOP (how
many of the fastest configs at the first S run at the larger S; default 2), LIBS (comma list, ``sage2``;
default none), OUT (result folder).
Writes $OUT/bench_attention_int8_h200.json and .md; prints a table last.

Run (GPU, from the repo root): ``OUT=benchmarks/results python3 benchmarks/bench_attention_int8.py``.
"""
import json
import os
import time

import torch
import triton

import _common  # benchmarks/_common.py

_common.import_package()
from h3_turbo.kernels.attention import exact as A  # noqa: E402
from h3_turbo.kernels.attention import int8_kernels as Q  # noqa: E402
from h3_turbo.kernels.attention import reference as REF  # noqa: E402

dev = "cuda"
OUT = os.environ.get("OUT", ".")
HEADS, D = 56, 128
SIZES = [int(s) for s in os.environ.get("SIZES", "19584,37632,109000").split(",")]
BASE = dict(Q.DEFAULT_CONFIG)
DEFAULT_CONFIGS = [          # changes from kernels.attention.int8_kernels.DEFAULT_CONFIG ({} = that default;
    None,                    # null/None = "tuned": tuned_config(device, S), what the override runs)
    {},
    {"MAGIC": False},
    {"num_stages": 2},
    {"BLOCK_M": 128, "num_warps": 8},
    {"TMA": True},
    {"V_MEAN": True},
    {"PV_FP8": False},
]
CONFIGS = json.loads(os.environ["CONFIGS"]) if os.environ.get("CONFIGS") else DEFAULT_CONFIGS
LIBS = [x for x in os.environ.get("LIBS", "").split(",") if x]
TOP = int(os.environ.get("TOP", 2))   # fastest configs at the first S that run at the larger S
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "cudnn": torch.backends.cudnn.version(), "heads": HEADS, "head_dim": D, "default_config": BASE,
       "command": os.environ.get("BENCH_CMD", ""), "sizes": {}}


def cname(cfg):
    if cfg is None:
        return "tuned"
    return "base" if not cfg else ",".join(f"{k}={v}" for k, v in cfg.items())


def h3_qkv(S, seed=0):
    return _common.h3_qkv(S, HEADS, D, dev, seed)


def bench(fn, S):
    rep = 2000 if S > 60000 else (800 if S > 30000 else 400)
    return triton.testing.do_bench(fn, warmup=100, rep=rep, return_mode="median")


def save():
    with open(os.path.join(OUT, "bench_attention_int8_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def load_libraries():
    """{library: its module, or why it cannot run} for each name in LIBS, recorded in res["libraries"]."""
    libs = {}
    for lib in LIBS:
        if lib != "sage2":
            raise SystemExit(f"LIBS: unknown library {lib!r} (known: sage2)")
        try:
            import sageattention
            from sageattention import core as sage_core
            if not getattr(sage_core, "SM90_ENABLED", False):
                raise ImportError("sageattention has no sm90 module (sageattention._qattn_sm90)")
            libs[lib] = sage_core
            res.setdefault("libraries", {})[lib] = {"file": sageattention.__file__}
        except ImportError as e:
            libs[lib] = f"SageAttention 2 not importable: {e}"
            res.setdefault("libraries", {})[lib] = {"error": libs[lib]}
    return libs


def library_rows(q, k, v):
    """(name, fn returning [1, S, H, D], or the reason the library cannot run) per library in LIBS.
    q/k/v: [1, H, S, D] strided views."""
    rows = []
    for lib, mod in LIBRARIES.items():
        if isinstance(mod, str):
            rows.append((lib, mod))
            continue
        qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))     # [1, S, H, D] views of core's buffer
        for gran in ("per_thread", "per_warp"):
            rows.append((f"sage2_sm90_{gran}", lambda gran=gran: mod.sageattn_qk_int8_pv_fp8_cuda_sm90(
                qn, kn, vn, tensor_layout="NHD", qk_quant_gran=gran, pv_accum_dtype="fp32+fp32")))
    return rows


def record_error(S, r, name, e):
    """An error row; a run whose CUDA context died (illegal memory access) is saved and stopped."""
    msg = str(e)
    r[name] = {"error": f"{type(e).__name__}: {msg[:200]} ... {msg[-700:]}"}
    if "illegal memory access" in msg or type(e).__name__ == "AcceleratorError":
        res["aborted"] = f"S={S} {name}: {r[name]['error']}"
        print(S, name, json.dumps(r[name]), flush=True)
        write_md()
        save()
        raise SystemExit(f"stopped (CUDA context lost): {res['aborted']}")


def run_size(S, configs, first):
    torch.manual_seed(S)
    buf, (q, k, v) = h3_qkv(S, seed=S)
    heads_idx = torch.linspace(0, HEADS - 1, 8, device=dev).round().long()
    rows = torch.randperm(S, device=dev)[:512].sort().values
    ref = REF.reference_attention(q, k, v, rows=rows, heads=heads_idx, dtype=torch.float32)   # [8, 512, D]
    flops = 4.0 * S * S * HEADS * D
    r = {"S": S, "flop": flops}
    res["sizes"][str(S)] = r            # by reference: a run that dies mid-size still saves what it measured
    t = bench(lambda: A.sdpa_with("CUDNN_ATTENTION", q, k, v), S)
    o = A.sdpa_with("CUDNN_ATTENTION", q, k, v)
    full_ref = o
    r["cudnn"] = {"ms": t, "tflops": flops / t / 1e9, **REF.accuracy(o[0, heads_idx][:, rows].float(), ref)}
    print(S, "cudnn", json.dumps(r["cudnn"]), flush=True)

    def measure(fn, to_bhsd):
        """Times fn (first call, then do_bench) -> (its output as [1, H, S, D], the columns every row has)."""
        t0 = time.perf_counter()
        o = fn()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        t = bench(fn, S)
        o4 = to_bhsd(o)
        return o4, {"ms": t, "tflops": flops / t / 1e9, "x_exact": t / r["cudnn"]["ms"], "first_call_s": first_s,
                    **REF.accuracy(o4[0, heads_idx][:, rows].float(), ref)}

    for cfg0 in configs:
        name = cname(cfg0)
        cfg = Q.tuned_config(dev, S) if cfg0 is None else cfg0
        try:
            o4, rr = measure(lambda: Q.sage_attention(q, k, v, out_layout="blhd", config=cfg),
                             lambda o: o.view(1, S, HEADS, D).transpose(1, 2))
            if first:
                hs = heads_idx[[0, 5]]
                rs = rows[::2]
                qz = Q.quantize_reference(q[:, hs], k[:, hs], v[:, hs], cfg)
                model = Q.sage_reference(q[:, hs], k[:, hs], v[:, hs], config=cfg, rows=rs, quant=qz)
                rr["vs_model_rel_l2"] = REF.rel_l2(o4[0, hs][:, rs].float(), model)
                rr["model_vs_f32_rel_l2"] = REF.rel_l2(model, REF.reference_attention(q, k, v, rows=rs, heads=hs))
                kv = Q.quantize_kv(k, v, cfg)
                ce = Q._cfg(cfg)
                def prep(ce=ce):
                    kq = Q.quantize_kv(k, v, ce)
                    return kq, Q.quantize_q(q, 0.1, ce, lam=kq["lam"]) if ce["QPRE"] else None

                rr["quant_ms"] = bench(prep, S)
                rr["k8_equal_model"] = bool(torch.equal(kv["k8"][hs][:, :S].float(), qz["k8"]))
                if Q._cfg(cfg)["PV_FP8"]:
                    rr["v8_equal_model"] = bool(torch.equal(kv["vq"][hs][:, :, :S].float().transpose(1, 2), qz["v8"]))
                del kv, qz, model
                if cfg0 is None or (not cfg0 and None not in configs):
                    rr["config"] = Q._cfg(cfg)
                    poison = torch.full((1, S, HEADS * D), float("nan"), device=dev, dtype=torch.bfloat16)
                    o2 = Q.sage_attention(q, k, v, out_layout="blhd", out=poison, config=cfg0).view(1, S, HEADS, D).transpose(1, 2)
                    rr["full_finite"] = bool(torch.isfinite(o2).all())
                    err = ((o2.float() - full_ref.float()).norm(dim=-1) / full_ref.float().norm(dim=-1))
                    rr["full_rel_l2_vs_cudnn"] = REF.rel_l2(o2.float(), full_ref.float())
                    rr["full_max_row_rel_err_vs_cudnn"] = float(err.max())
                    rr["full_deterministic"] = bool(torch.equal(
                        Q.sage_attention(q, k, v, out_layout="blhd", config=cfg0).view(1, S, HEADS, D).transpose(1, 2), o2))
                    del o2, poison, err
            r[name] = rr
        except Exception as e:
            record_error(S, r, name, e)
        print(S, name, json.dumps(r[name]), flush=True)
        o4 = None
        torch.cuda.empty_cache()
    for name, fn in library_rows(q, k, v):
        if isinstance(fn, str):
            r[name] = {"error": fn}
        else:
            try:
                r[name] = measure(fn, lambda o: o.transpose(1, 2))[1]
            except Exception as e:
                record_error(S, r, name, e)
        print(S, name, json.dumps(r[name]), flush=True)
        torch.cuda.empty_cache()
    save()
    del buf, q, k, v, ref, full_ref
    torch.cuda.empty_cache()
    return r


def write_md():
    lines = [f"# bench_attention_int8.py on {res['gpu']}", "",
             f"torch {res['torch']}, triton {res['triton']}, cuDNN {res['cudnn']}. Command: `{res['command']}`", "",
             "| S | method | ms | TFLOP/s | x exact | cos (min) | rel. L2 | vs own model | quant ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for S, r in res["sizes"].items():
        for name, v in r.items():
            if not isinstance(v, dict):
                continue
            if "ms" in v:
                lines.append(f"| {S} | {name} | {v['ms']:.2f} | {v['tflops']:.0f} | {v.get('x_exact', 1.0):.3f} | "
                             f"{v['cos_min']:.6f} | {v['rel_l2']:.2e} | {v.get('vs_model_rel_l2', float('nan')):.1e} | "
                             f"{v.get('quant_ms', float('nan')):.2f} |")
            elif "error" in v:
                lines.append(f"| {S} | {name} | error: {v['error'][:120]} | | | | | | |")
    if res.get("aborted"):
        lines += ["", f"Run stopped (CUDA context lost): {res['aborted']}"]
    with open(os.path.join(OUT, "bench_attention_int8_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    LIBRARIES = load_libraries()
    r0 = run_size(SIZES[0], CONFIGS, True)
    ranked = sorted((c for c in CONFIGS if "ms" in r0.get(cname(c), {})), key=lambda c: r0[cname(c)]["ms"])
    best = ranked[:TOP] + [c for c in ranked if c is not None and c.get("PV_FP8") is False][:1]  # + fastest bf16 PV
    if None in ranked and None not in best:     # the shipped (tuned) configuration runs at every S
        best.append(None)
    res["ranked_at_first_S"] = [cname(c) for c in ranked]
    for S in SIZES[1:]:
        run_size(S, best, False)
    write_md()
    save()
    print()
    print(f"{'S':>7} {'method':<34} {'ms':>8} {'TFLOP/s':>8} {'x_exact':>8} {'cos_min':>9} {'rel_l2':>9} {'model':>8} {'quant':>6}")
    for S, r in res["sizes"].items():
        for name, v in r.items():
            if isinstance(v, dict) and "ms" in v:
                print(f"{S:>7} {name:<34} {v['ms']:8.2f} {v['tflops']:8.0f} {v.get('x_exact', 1.0):8.3f} "
                      f"{v['cos_min']:9.6f} {v['rel_l2']:9.2e} {v.get('vs_model_rel_l2', float('nan')):8.1e} "
                      f"{v.get('quant_ms', float('nan')):6.2f}")
            elif isinstance(v, dict) and "error" in v:
                print(f"{S:>7} {name:<34} ERROR {v['error'][:150]}")
    chk = "tuned" if None in CONFIGS else "base"
    base = res["sizes"][str(SIZES[0])].get(chk, {})
    print(f"full-output check ({chk}):", {k: base.get(k) for k in ("full_finite", "full_rel_l2_vs_cudnn",
                                                              "full_max_row_rel_err_vs_cudnn", "full_deterministic",
                                                              "k8_equal_model", "v8_equal_model")})
