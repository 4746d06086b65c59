"""Issue 9 benchmark: H3 attention backends on one GPU (H200), and one whole H3 forward core vs ``exact``.

Part A, per S in $SIZES (default 19584,37632,109000): 56 heads x 128, bf16, q/k per-head RMS-normalised
(times a per-channel gain, as H3's q_norm/k_norm weights), laid out as core builds them (strided
[1, 56, S, 128] views of one [S, 3*7168] qkv buffer; v cloned). Columns:
  core       core's ``optimized_attention`` as H3 calls it (``attention_pytorch``: FA2 flash first)
  exact      the same call with our override (``kernels/attention/exact.py: ExactAttention``) in transformer_options
  flash / cudnn / efficient   one SDPA backend alone
  ck_int8    comfy-kitchen INT8 attention (core's ``attention_comfy_kitchen_int8``), if available
  sage       PyPI sageattention, if importable
Time = median of CUDA-event timings after warm-up; TFLOP/s = 4*S^2*56*128 / t. Accuracy vs float32
attention on a sample (8 heads x 512 query rows, all keys): per-head cosine (min) and relative L2.

Optional parts (off by default): CHOOSER=1 runs the chooser once per S and records its choice and
rejections; FINITE=1 checks each SDPA backend's whole output at the largest S against cuDNN in
NaN-poisoned memory; SENS=1 runs the 960x544x124 forward with core, exact, each SDPA backend and
float32 attention, and reports each output's distance to the float32-attention one.

Part B (FORWARD=1, default): core ComfyUI's own H3 DiT at full shape with random weights
(:func:`random_h3`), BF16, one denoiser forward at 960x544x124 (and 1344x768x124 with
BIG=1): transformer_options {} (core) vs {"optimized_attention_override": ExactAttention()} (exact) vs
{"optimized_attention_override": Int8SageAttention(fallback=<its own ExactAttention>)} (int8_sage, the
tuned config; on the CPU every call falls back to exact).

Env: COMFY (a ComfyUI tree; only comfy/ is imported), CKPATH (comfy_kitchen for this Python), AIMDO
(comfy_aimdo), OUT (result folder, default .), DRY=1 (tiny sizes on the CPU, to check the script).
Writes $OUT/bench_attention_h200.json (after every part) and prints a table last.

Run (GPU): ``COMFY=<ComfyUI> OUT=benchmarks/results python3 benchmarks/bench_attention.py``; CPU check:
``DRY=1 COMFY=$HOME/ComfyUI OUT=/tmp/dry python benchmarks/bench_attention.py``.
"""
import json
import math
import os
import sys
import time

for p in (os.environ.get("AIMDO"), os.environ.get("CKPATH"), os.environ.get("COMFY")):
    if p:
        sys.path.insert(0, p)
DRY = bool(os.environ.get("DRY"))
sys.argv = ["x", "--disable-dynamic-vram"] + (["--cpu"] if DRY else [])
from comfy.cli_args import args  # noqa: E402

args.disable_dynamic_vram = True
if DRY:
    args.cpu = True
import torch  # noqa: E402
import comfy.ldm.modules.attention as core  # noqa: E402

import _common  # noqa: E402  (benchmarks/_common.py)

HERE = os.path.dirname(os.path.abspath(__file__))
_common.import_package()
from h3_turbo.kernels.attention import exact as A  # noqa: E402
from h3_turbo.kernels.attention import int8_sage as Q8  # noqa: E402
from h3_turbo.kernels.attention import reference as REF  # noqa: E402

dev = "cpu" if DRY else "cuda"
OUT = os.environ.get("OUT", ".")
HEADS, D = (4, 32) if DRY else (56, 128)
SIZES = [int(s) for s in os.environ.get("SIZES", "96,200" if DRY else "19584,37632,109000").split(",")]
res = {"gpu": "cpu" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
       "cudnn": torch.backends.cudnn.version(), "heads": HEADS, "head_dim": D,
       "ck_int8_available": bool(getattr(core, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False)),
       "attention": {}, "forward": {}}
try:
    import comfy_kitchen.backends.cuda as _ckc
    res["ck_cuda_ext"] = bool(_ckc._EXT_AVAILABLE)
except Exception as _e:
    res["ck_cuda_ext"] = repr(_e)[:200]


def save():
    with open(os.path.join(OUT, "bench_attention_h200.json"), "w") as f:
        json.dump(res, f, indent=1)


def sync():
    if not DRY:
        torch.cuda.synchronize()


def bench(fn, reps, warmup=1):
    """Median seconds of ``reps`` runs after ``warmup`` runs (CUDA events; host clock on the CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        if DRY:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def h3_qkv(S, seed=0):
    return _common.h3_qkv(S, HEADS, D, dev, seed)


def part_a():
    heads_idx = torch.linspace(0, HEADS - 1, min(8, HEADS), device=dev).round().long()
    sage = None
    try:
        from sageattention import sageattn as sage
    except Exception as e:
        res["sage_import_error"] = repr(e)[:200]
    for S in SIZES:
        torch.manual_seed(S)
        buf, (q, k, v) = h3_qkv(S)
        rows = torch.randperm(S, device=dev)[: min(512, S)].sort().values
        ref = REF.reference_attention(q, k, v, rows=rows, heads=heads_idx, dtype=torch.float32)  # [h, r, D]
        flops = 4.0 * S * S * HEADS * D
        reps = 3 if S > 60000 else 10
        ex = A.ExactAttention(chooser=A.BackendChooser(A.cuda_event_timer(2) if not DRY else (lambda fn: (fn(), 1.0)[1])),
                              **({"candidates": ("MATH",), "devices": ("cpu",)} if DRY else {}))
        methods = {
            "core": lambda: core.optimized_attention(q, k, v, HEADS, mask=None, skip_reshape=True, transformer_options={}),
            "exact": lambda: core.optimized_attention(q, k, v, HEADS, mask=None, skip_reshape=True,
                                                      transformer_options={"optimized_attention_override": ex}),
        }
        if not DRY:
            for name, be in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION")):
                methods[name] = (lambda be=be: A.sdpa_with(be, q, k, v))
            if res["ck_int8_available"]:
                methods["ck_int8"] = lambda: core.attention_comfy_kitchen_int8(q, k, v, HEADS, mask=None, skip_reshape=True)
            if sage is not None:
                methods["sage"] = lambda: sage(q, k, v, tensor_layout="HND", is_causal=False)
        r = {"S": S, "flop": flops, "reps": reps}
        for name, fn in methods.items():
            try:
                if name == "exact":           # first use includes measuring the candidates
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    r["exact_first_call_s"] = time.perf_counter() - t0
                    r["exact_choice"] = {"backend": next(iter(ex.chooser.choices.values())).backend,
                                         "ms": {c: 1e3 * s for c, s in next(iter(ex.chooser.choices.values())).seconds.items()},
                                         "errors": next(iter(ex.chooser.choices.values())).errors}
                t = bench(fn, reps)
                o = fn()
                o = o.view(1, S, HEADS, D).transpose(1, 2) if o.dim() == 3 else o      # -> [1, H, S, D]
                acc = REF.accuracy(o[0, heads_idx][:, rows].float(), ref)
                r[name] = {"ms": 1e3 * t, "tflops": flops / t / 1e12, **acc}
                del o
            except Exception as e:
                r[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(S, name, json.dumps(r[name]), flush=True)
        for name in methods:
            if "ms" in r[name]:
                for base in ("core", "exact"):
                    if "ms" in r.get(base, {}):
                        r[name][f"speedup_vs_{base}"] = r[base]["ms"] / r[name]["ms"]
        res["attention"][str(S)] = r
        save()
        del buf, q, k, v, ref
        if not DRY:
            torch.cuda.empty_cache()


# ------------------------------------------------------------------ Part B: whole H3 forward
def random_h3():
    """Core's own H3 DiT (full size; tiny with DRY=1) with random weights (norm gains 1, biases N(0, 0.01),
    weights N(0, 0.02), seed 0), bf16, eval: returns (model, hidden)."""
    import comfy.ops
    import comfy.ldm.minimax.model as mm

    cfg = dict(hidden_size=64, num_layers=2, token_refiner_num_layers=1, num_attention_heads=2, attention_head_dim=32,
               ffn_hidden_size=96, text_dim=48, timestep_input_dim=32, time_embed_hidden_size=64, time_embed_dim=32,
               rope_inv_freq_len=4) if DRY else {}
    torch.manual_seed(0)
    m = mm.MiniMaxH3Model(dtype=torch.bfloat16, device=dev, operations=comfy.ops.disable_weight_init, **cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or ".norm1." in n or ".norm2." in n or "q_norm" in n or "k_norm" in n:
                p.fill_(1.0)
            elif n.endswith(".bias"):
                p.normal_(0, 0.01)
            else:
                p.normal_(0, 0.02)
        r_ = m.rope.inv_freq
        r_.copy_(1.0 / (10000 ** (torch.arange(r_.numel(), dtype=torch.float32, device=r_.device) / r_.numel())))
    m.requires_grad_(False).eval()
    return m, cfg.get("hidden_size", 5376)


def part_b():
    m, H = random_h3()

    def inputs(w, h, frames, text=300):
        lt = 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2
        at = round(frames / 24 * 40)
        g = torch.Generator(device=dev).manual_seed(1)
        x = [torch.randn(1, 24, lt, h // 16, w // 16, device=dev, generator=g),
             torch.randn(1, 32, 2, at, device=dev, generator=g)]
        return x, torch.randn(1, text, H, device=dev, dtype=torch.bfloat16, generator=g)

    shapes = [(96, 64, 22)] if DRY else [(960, 544, 124)] + ([(1344, 768, 124)] if os.environ.get("BIG") else [])
    reps = 1 if DRY else int(os.environ.get("REPS", 3))
    ex_kw = ({"candidates": ("MATH",), "devices": ("cpu",), "chooser": A.BackendChooser(lambda fn: (fn(), 1.0)[1])}
             if DRY else {})
    ex = A.ExactAttention(**ex_kw)
    for shp in shapes:
        x, ctx = inputs(*shp)
        t = torch.tensor([800.0], device=dev)
        key = "%dx%dx%d" % shp
        rr = {}
        outs = {}
        # the int8_sage backend (tuned config); its own exact fallback keeps ex's counters to exact's runs
        i8 = Q8.Int8SageAttention(fallback=A.ExactAttention(**ex_kw))
        for name, to in (("core", {}), ("exact", {"optimized_attention_override": ex}),
                         ("int8_sage", {"optimized_attention_override": i8})):
            with torch.inference_mode():
                sync()
                t0 = time.perf_counter()
                out = m(x, t, ctx, transformer_options=dict(to))
                sync()
                first = time.perf_counter() - t0
                ts = []
                for _ in range(reps):
                    sync()
                    t0 = time.perf_counter()
                    out = m(x, t, ctx, transformer_options=dict(to))
                    sync()
                    ts.append(time.perf_counter() - t0)
            ts.sort()
            outs[name] = [o.float() for o in out]
            rr[name] = {"median_s": ts[len(ts) // 2], "min_s": ts[0], "first_s": first,
                        "finite": bool(all(torch.isfinite(o).all() for o in out))}
            print(key, name, json.dumps(rr[name]), flush=True)
        rr["speedup"] = rr["core"]["median_s"] / rr["exact"]["median_s"]
        rr["exact_vs_core_rel_l2"] = [float((a - b).norm() / b.norm()) for a, b in zip(outs["exact"], outs["core"])]
        rr["int8_sage_speedup_vs_core"] = rr["core"]["median_s"] / rr["int8_sage"]["median_s"]
        rr["int8_sage_speedup_vs_exact"] = rr["exact"]["median_s"] / rr["int8_sage"]["median_s"]
        rr["int8_sage_vs_exact_rel_l2"] = [float((a - b).norm() / b.norm()) for a, b in zip(outs["int8_sage"], outs["exact"])]
        rr["int8_sage_calls"] = i8.calls
        rr["int8_sage_fallbacks"] = i8.fallbacks
        rr["exact_calls"] = ex.calls
        rr["exact_delegated"] = ex.delegated
        if not DRY:
            rr["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        res["forward"][key] = rr
        save()
        del outs
    res["exact_choices"] = {str(k): {"backend": c.backend, "ms": {n: 1e3 * s for n, s in c.seconds.items()}, "errors": c.errors}
                            for k, c in ex.chooser.choices.items()}
    save()


# ------------------------------------------------------------------ Part C: is the forward difference bf16 noise?
def fixed_override(backend=None, fp32=False):
    """Override computing attention with one SDPA backend, or (fp32=True) in float32 per head with IEEE
    fp32 matmuls (softmax(q k^T / sqrt(D)) v, rounded once to the input dtype). Output as attention_pytorch."""

    def override(func, q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kw):
        assert skip_reshape and not skip_output_reshape and mask is None
        b, h_, L, d = q.shape
        if not fp32:
            o = A.sdpa_with(backend, q, k, v)
            return o.transpose(1, 2).reshape(b, -1, h_ * d)
        out = torch.empty(b, L, h_ * d, device=q.device, dtype=q.dtype)
        for h in range(h_):
            sc = (q[0, h].float() @ k[0, h].float().T) * (1.0 / math.sqrt(d))
            out[0, :, h * d:(h + 1) * d] = (torch.softmax(sc, dim=-1) @ v[0, h].float()).to(q.dtype)
            del sc
        return out

    return override


def part_c():
    """One forward at 960x544x124 with random weights per attention variant; rel. L2 of each output to the
    forward whose attention is computed in float32 (IEEE). Shows whether core (FA2) and exact (cuDNN)
    differ from each other by more than each differs from the fp32-attention forward."""
    torch.backends.cuda.matmul.allow_tf32 = False
    m, H = random_h3()
    w, h, frames = (96, 64, 22) if DRY else (960, 544, 124)
    lt = ((frames - 5) // 17) * 5 + 2
    g = torch.Generator(device=dev).manual_seed(1)
    x = [torch.randn(1, 24, lt, h // 16, w // 16, device=dev, generator=g),
         torch.randn(1, 32, 2, round(frames / 24 * 40), device=dev, generator=g)]
    ctx = torch.randn(1, 300, H, device=dev, dtype=torch.bfloat16, generator=g)
    t = torch.tensor([800.0], device=dev)
    variants = [("fp32_attention", fixed_override(fp32=True)), ("core", None),
                ("exact", A.ExactAttention(**({"candidates": ("MATH",), "devices": ("cpu",),
                                                "chooser": A.BackendChooser(lambda fn: (fn(), 1.0)[1])} if DRY else {})))]
    if not DRY:
        variants += [("flash", fixed_override("FLASH_ATTENTION")), ("cudnn", fixed_override("CUDNN_ATTENTION")),
                     ("efficient", fixed_override("EFFICIENT_ATTENTION"))]
    outs, rc = {}, {}
    for name, ov in variants:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            o = m(x, t, ctx, transformer_options={} if ov is None else {"optimized_attention_override": ov})
        sync()
        outs[name] = [a.float() for a in o]
        rc[name] = {"s": time.perf_counter() - t0}
        print("sens", name, rc[name], flush=True)
    ref = outs["fp32_attention"]
    for name in outs:
        rc[name]["rel_l2_vs_fp32_attention"] = [float((a - b).norm() / b.norm()) for a, b in zip(outs[name], ref)]
        rc[name]["rel_l2_vs_core"] = [float((a - b).norm() / b.norm()) for a, b in zip(outs[name], outs["core"])]
    res["forward_sensitivity_960x544x124"] = rc
    save()
    del m, outs
    if not DRY:
        torch.cuda.empty_cache()


def part_d():
    """Each exact SDPA backend at the largest S over its whole output: written into memory poisoned with
    NaN (a freed NaN tensor of the output's size), and compared row by row with cuDNN. A row is bad if it
    is not finite or its relative error to cuDNN exceeds 0.05 (FA2 vs cuDNN: ~3e-3)."""
    S = SIZES[-1]
    buf, (q, k, v) = h3_qkv(S, seed=7)
    names = ("MATH",) if DRY else ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
    ref = A.sdpa_with(names[0], q, k, v).float()
    rd = {}
    for name in names:
        try:
            p = torch.full(ref.shape, float("nan"), device=dev, dtype=q.dtype)
            del p
            o = A.sdpa_with(name, q, k, v).float()
            bad = ~torch.isfinite(o)
            err = (o - ref).norm(dim=-1) / ref.norm(dim=-1)              # [1, H, S]
            rows = (bad.any(-1) | ~(err <= 0.05))[0]
            rd[name] = {"nonfinite": int(bad.sum()), "bad_rows": int(rows.sum()), "rows": HEADS * S,
                        "median_row_rel_err_vs_first": float(err.nan_to_num(9.0).median())}
            del o, bad, err
        except Exception as e:
            rd[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print("rows", S, name, rd[name], flush=True)
    res[f"rows_vs_{names[0]}_S{S}"] = rd
    save()
    del buf, q, k, v, ref


def part_e():
    """The chooser itself on this GPU: one ExactAttention call per S (first use measures), its choice,
    rejections and the candidates' output distances (as attention_chooser_check_h200.json)."""
    for S in SIZES:
        buf, (q, k, v) = h3_qkv(S, seed=S)
        ex = A.ExactAttention(**({"candidates": ("MATH",), "devices": ("cpu",)} if DRY else {}),
                              chooser=A.BackendChooser(A.cuda_event_timer(2) if not DRY else (lambda fn: (fn(), 1.0)[1])))
        sync()
        t0 = time.perf_counter()
        out = ex(None, q, k, v, HEADS, mask=None, skip_reshape=True)
        sync()
        c = next(iter(ex.chooser.choices.values()))
        res.setdefault("chooser", {})[str(S)] = {
            "backend": c.backend, "ms": {n: 1e3 * t for n, t in c.seconds.items()}, "errors": c.errors,
            "distance": c.distance, "first_call_s": time.perf_counter() - t0, "finite": bool(torch.isfinite(out).all())}
        print("chooser", S, json.dumps(res["chooser"][str(S)]), flush=True)
        save()
        del buf, q, k, v, out


if __name__ == "__main__":
    if os.environ.get("ATTN", "1") == "1":
        part_a()
    if os.environ.get("CHOOSER", "0") == "1":
        part_e()
    if os.environ.get("FINITE", "0") == "1":
        part_d()
    if os.environ.get("SENS", "0") == "1":
        part_c()
    if os.environ.get("FORWARD", "1") == "1":
        try:
            part_b()
        except Exception as e:
            res["forward_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            save()
            raise
    print()
    print(f"{'S':>7} {'method':<10} {'ms':>9} {'TFLOP/s':>8} {'x core':>7} {'x exact':>8} {'cos_min':>10} {'rel_l2':>9}")
    for S, r in res["attention"].items():
        for name, v in r.items():
            if name == "exact_choice":
                continue
            if isinstance(v, dict) and "ms" in v:
                print(f"{S:>7} {name:<10} {v['ms']:9.2f} {v['tflops']:8.1f} {v.get('speedup_vs_core', float('nan')):7.2f} "
                      f"{v.get('speedup_vs_exact', float('nan')):8.2f} {v['cos_min']:10.7f} {v['rel_l2']:9.2e}")
            elif isinstance(v, dict) and "error" in v:
                print(f"{S:>7} {name:<10} ERROR {v['error'][:90]}")
        print(f"{S:>7} exact chose {r.get('exact_choice')} first call {r.get('exact_first_call_s', float('nan')):.2f} s")
    for key, rr in res["forward"].items():
        print(f"forward {key}: core {rr['core']['median_s']:.3f} s, exact {rr['exact']['median_s']:.3f} s, "
              f"speedup {rr['speedup']:.3f}, rel_l2 {rr['exact_vs_core_rel_l2']}, exact calls {rr['exact_calls']}; "
              f"int8_sage {rr['int8_sage']['median_s']:.3f} s ({rr['int8_sage_speedup_vs_core']:.3f}x core, "
              f"{rr['int8_sage_speedup_vs_exact']:.3f}x exact, rel_l2 to exact {rr['int8_sage_vs_exact_rel_l2']}, "
              f"{rr['int8_sage_calls']} calls, {rr['int8_sage_fallbacks']} fell back)")
    if "forward_error" in res:
        print("forward error:", res["forward_error"])
    print(json.dumps({"ok": True}))
