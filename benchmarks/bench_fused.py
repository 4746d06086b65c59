"""Issue 21 on one GPU: the fused fp8 producers, the fused DiT block and the cuDNN FP8 attention backend.

Three parts, each saved to ``$OUT/$TAG.json`` after every step (default TAG bench_fused_h200):

1. ``kernels``: every fusion kernel of ``kernels/fused.py`` against the unfused torch sequence it replaces, at
   ROWS (default 19584, 37632) x 5376 (SwiGLU: [rows, 28672] -> [rows, 14336]); CUDA-event medians
   (``triton.testing.do_bench``, return_mode="median"); bytes moved and GB/s; accuracy on 256 sampled rows against
   the float64 reference (relative L2 of the dequantized output, e4m3 code mismatches against the float64 result
   quantized by the fp8 path's formula).
   - ``norm_mod``: torch ``rms_norm`` + per-segment ``mul_/add_`` (core's ``_mod_scale_shift``) + ``quant_rows_fp8``
     vs one ``fused.norm_mod``;
   - ``res_norm_mod``: per-segment ``addcmul_`` (core's ``_mod_gate``) + the above vs ``norm_mod(residual=...)``;
   - ``swiglu``: core's eager SwiGLU + ``quant_rows_fp8`` vs ``fused.swiglu`` (two-pass and one-pass variants);
   - ``gate_residual``: per-segment ``addcmul_`` vs ``fused.gate_residual_`` (and a bit-identity check);
   - ``qk_norm_rope``: core's comfy-kitchen ``rms_rope_split_half_`` + ``v.clone()`` vs one ``fused.qk_norm_rope``
     (a sweep of its rows / warps; ulp distance to kitchen's output, both against the float64 reference);
   - ``sage_chain``: qkv GEMM output -> out_proj's e4m3 input with ``int8_sage`` attention, unfused (qk_norm_rope,
     the backend's Q pre-kernel, K/V statistics + quantization, kernel, bf16 output, ``quant_rows_fp8``) vs fused
     (``qk_norm_rope_sage``, K/V quantization from its sums, ``sage_attention_prequantized`` with e4m3 output);
     the pre-passes alone; the kernel with per-block vs per-row Q scales; accuracy against float32 attention.
2. ``block``: one full-width H3 DiT block (hidden 5376, 56x128 heads, ffn 14336, t_dim 2688; random weights,
   projections quantized by ``formats.nvfp4.quantize`` and loaded into the pack's operations as ComfyUI-native
   NVFP4) at each of ROWS: core's block on compute ``fp8`` (today's path), the fused block, and core's block on
   compute ``exact`` (the reference), each with the ``exact`` attention backend (cuDNN SDPA); Turbo off and on
   (a stand-in for the Turbo branch with the official ranks, qkv 384 / others 128, exposing the branch's fused
   interface: ``h3turbo_lora_forward`` for the unfused block, ``h3turbo_lora_operands`` for the fused one).
   Rows: ``unfused_fp8``, ``fused_fp8``; on CUDA also core's block and the fused block with the ``int8_sage``
   override (``unfused_fp8_int8_sage``, ``fused_fp8_int8_sage``: the producer route). Reports ms/block (median of REPS), the torch-profiler categories (GEMM, attention, the
   harness's own input copy ``memcpy``, everything else = non-GEMM non-attention ms/block), relative L2 of the output and of the block's update (out - x) against ``exact``;
   with FP8_ATTN=1 (default) and the frontend importable also the fused block with ``cudnn_fp8`` attention.
3. ``attention``: ``cudnn_fp8`` (through its override: amax + casts + kernel + dequantize; and the e4m3 output
   alone) vs cuDNN bf16 SDPA at ROWS, 56x128 heads, H3-like q/k/v (``_common.h3_qkv``); per-head cosine (min) and
   relative L2 against float32 attention on 512 sampled query rows; ``auto8``'s choice for the shape.

Env: OUT (folder), TAG, ROWS (comma list), REPS (block medians, default 5), PARTS (comma list of kernels,block,
attention), KERNELS (comma list: part 1 runs only these kernel rows, e.g. ``norm_mod,res_norm_mod``), FP8_ATTN
(0/1), COMFYUI_PATH (a ComfyUI tree; comfy-kitchen importable), DEADLINE (s: parts stop starting new steps after
it, default 280), DRY=1 (CPU: tiny widths, Triton interpreted, timings meaningless:
checks the script end to end).

Run (GPU): ``DEADLINE=270 timeout 330 python3 benchmarks/bench_fused.py``; CPU check:
``DRY=1 OUT=/tmp/dry COMFYUI_PATH=$HOME/ComfyUI python benchmarks/bench_fused.py``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

DRY = bool(os.environ.get("DRY"))
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported
OUT = os.environ.get("OUT", ".")
TAG = os.environ.get("TAG", "bench_fused_h200")
DEADLINE = float(os.environ.get("DEADLINE", 280))
T0 = time.perf_counter()
os.makedirs(OUT, exist_ok=True)
RES: dict = {"dry": DRY, "errors": {}, "log": [], "kernels": {}, "block": {}, "attention": {}, "env": {}}


def now() -> float:
    return time.perf_counter() - T0


def save():
    with open(os.path.join(OUT, f"{TAG}.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


from _common import collect_logs  # noqa: E402

collect_logs(RES["log"], 400)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.import_package()
if os.environ.get("COMFYUI_PATH"):
    from h3_turbo.harness import comfyui_first_on_path  # noqa: E402

    comfyui_first_on_path(os.environ["COMFYUI_PATH"])
from comfy.cli_args import args as _comfy_args  # noqa: E402  (before comfy.model_management is imported)

_comfy_args.cpu = DRY
_comfy_args.highvram = not DRY

CUDA = torch.cuda.is_available() and not DRY
DEV = torch.device("cuda" if CUDA else "cpu")
BF16 = torch.bfloat16
HID, HEADS, HD, FFN, TDIM = (5376, 56, 128, 14336, 2688) if not DRY else (256, 2, 128, 384, 64)
ROWS = [int(r) for r in os.environ.get("ROWS", "67,150" if DRY else "19584,37632").split(",") if r]
REPS = int(os.environ.get("REPS", 2 if DRY else 5))
PARTS = os.environ.get("PARTS", "kernels,block,attention").split(",")
KERNELS = [k for k in os.environ.get("KERNELS", "").split(",") if k]     # part 1: only these (default all)
FP8_ATTN = os.environ.get("FP8_ATTN", "1") == "1"


def segments(s: int) -> list[tuple[int, int, int]]:
    """H3-like mod_segments for s rows: text (tag 1), audio (modality row 2 of timestep 1: 5), video (row 0)."""
    t, a = (300, 414) if not DRY else (7, 11)
    return [(0, t, 1), (t, t + a, 5), (t + a, s, 0)]


def sync():
    if CUDA:
        torch.cuda.synchronize()


def bench(fn, warmup=25, rep=100) -> float:
    """Median ms of fn (CUDA events via triton.testing.do_bench); DRY: one host-timed call."""
    if not CUDA:
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def env_info():
    import triton

    RES["env"] = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name() if CUDA else "cpu", "rows": ROWS, "reps": REPS}
    try:
        import comfyui_version

        RES["env"]["comfyui"] = comfyui_version.__version__
    except Exception as e:  # noqa: BLE001
        RES["env"]["comfyui"] = repr(e)
    from h3_turbo.kernels.attention import cudnn_fp8

    RES["env"]["cudnn_frontend"] = getattr(cudnn_fp8.frontend(), "__version__", None)
    RES["env"]["cudnn_frontend_error"] = cudnn_fp8.frontend_error()
    RES["env"]["cudnn_backend"] = torch.backends.cudnn.version() if CUDA else None
    save()


def step(part: str, name: str, fn):
    """Run one step; its dict result goes under RES[part][name]; errors are recorded, never fatal."""
    if now() > DEADLINE:
        RES["errors"][f"{part}/{name}"] = f"skipped: deadline {DEADLINE} s reached at {now():.0f} s"
        save()
        return None
    t = time.perf_counter()
    try:
        out = fn()
        out = dict(out or {}, wall_s=round(time.perf_counter() - t, 2))
        RES[part][name] = out
        print(json.dumps({f"{part}/{name}": out}, default=str)[:1500], flush=True)
        return out
    except Exception:  # noqa: BLE001
        RES["errors"][f"{part}/{name}"] = traceback.format_exc()[-2500:]
        print(f"ERROR {part}/{name}:\n{RES['errors'][f'{part}/{name}']}", flush=True)
        return None
    finally:
        if CUDA:
            torch.cuda.empty_cache()
        save()


# --------------------------------------------------------------------------- part 1: kernels

def kernels_part():
    from h3_turbo.kernels import fused as fk
    from h3_turbo.kernels import triton_nvfp4 as tk

    g = torch.Generator(device=DEV).manual_seed(0)
    for s in ROWS:
        segs = segments(s)
        rows = fk.segment_rows(segs, s, DEV)
        sample = torch.linspace(0, s - 1, min(256, s), device=DEV).long()

        def mk(m, k, scale=1.0):
            return (torch.randn(m, k, device=DEV, generator=g) * scale).to(BF16)

        x = mk(s, HID)
        w = (1.0 + 0.2 * torch.randn(HID, device=DEV, generator=g)).to(BF16)
        ada = mk(6, 6 * HID, 0.3)       # [R, 6*hidden] as core's adaln_proj output; chunks are column slices
        sh, sc, gt = ada[:, :HID], ada[:, HID:2 * HID], ada[:, 2 * HID:3 * HID]
        o = mk(s, HID)

        def unfused_norm_mod(xx):
            h = torch.nn.functional.rms_norm(xx, (HID,), w, 1e-5)
            for a, b, r in segs:
                h[a:b].mul_(1.0 + sc[r].to(h.dtype)).add_(sh[r].to(h.dtype))
            return tk.quant_rows_fp8(h)

        def acc_fp8(y8, sy, h64):
            q64, s64 = fk.quantize_rows(h64)
            deq = y8[sample].float() * sy[sample]
            return {"rel_l2_vs_fp64": rel(deq, h64), "code_mismatch_frac": float((y8[sample].float() != q64.float()).float().mean()),
                    "scale_rel_max": float(((sy[sample] - s64) / s64).abs().max())}

        def k_norm_mod():
            bytes_ = s * HID * (2 + 1) + 4 * s
            t_un = bench(lambda: unfused_norm_mod(x))
            t_fu = bench(lambda: fk.norm_mod(x, w, 1e-5, sh, sc, rows))
            y8, sy = fk.norm_mod(x, w, 1e-5, sh, sc, rows)
            h64, _ = fk.norm_mod_ref(x[sample], w, 1e-5, sh, sc, rows[sample])
            u8, su = unfused_norm_mod(x)
            out = {"ms_unfused": t_un, "ms_fused": t_fu, "speedup": t_un / t_fu, "bytes_min": bytes_,
                   "gbps_fused": bytes_ / t_fu / 1e6, **acc_fp8(y8, sy, h64),
                   "unfused_rel_l2_vs_fp64": rel(u8[sample].float() * su[sample], h64)}
            nw0 = fk.NORM_WARPS
            for nw in ((4, 8, 16, 32) if CUDA else ()):   # launch-constant sweep (the default is fk.NORM_WARPS)
                fk.NORM_WARPS = nw
                try:
                    out[f"ms_fused_warps{nw}"] = bench(lambda: fk.norm_mod(x, w, 1e-5, sh, sc, rows))
                except Exception as e:  # noqa: BLE001
                    out[f"ms_fused_warps{nw}"] = f"{type(e).__name__}: {e}"[:200]
                finally:
                    fk.NORM_WARPS = nw0
            return out

        def k_res_norm_mod():
            xs = [x.clone() for _ in range(2)]

            def unfused():
                xx = xs[0]
                for a, b, r in segs:
                    xx[a:b].addcmul_(o[a:b], gt[r].to(xx.dtype))
                return unfused_norm_mod(xx)

            bytes_ = s * HID * (2 + 2 + 2 + 1) + 4 * s
            t_un = bench(unfused)
            t_fu = bench(lambda: fk.norm_mod(xs[1], w, 1e-5, sh, sc, rows, residual=(o, gt)))
            x0 = x.clone()
            x1 = x.clone()
            y8, sy = fk.norm_mod(x1, w, 1e-5, sh, sc, rows, residual=(o, gt))
            want = fk.gate_residual_ref(x0, o, gt, rows)
            h64, _ = fk.norm_mod_ref(want[sample], w, 1e-5, sh, sc, rows[sample])
            return {"ms_unfused": t_un, "ms_fused": t_fu, "speedup": t_un / t_fu, "bytes_min": bytes_,
                    "gbps_fused": bytes_ / t_fu / 1e6, "residual_bit_identical_to_addcmul": bool(torch.equal(x1, want)),
                    **acc_fp8(y8, sy, h64)}

        def k_swiglu():
            h = mk(s, 2 * FFN, 2.0)
            import comfy.ops

            act = comfy.ops.INPUT_ACT_EAGER["swiglu"]
            bytes_ = s * 2 * FFN * 2 + s * FFN + 4 * s
            t_un = bench(lambda: tk.quant_rows_fp8(act(h)))
            out = {"ms_unfused": t_un, "bytes_min": bytes_}
            ref64 = fk.swiglu_ref(h[sample])
            t = bench(lambda: fk.swiglu(h))
            y8, sy = fk.swiglu(h)
            out.update(ms_fused=t, speedup=t_un / t, gbps_fused=bytes_ / t / 1e6, **acc_fp8(y8, sy, ref64))
            return out

        def k_gate_res():
            xs = [x.clone() for _ in range(2)]

            def unfused():
                for a, b, r in segs:
                    xs[0][a:b].addcmul_(o[a:b], gt[r].to(BF16))
                return xs[0]

            bytes_ = s * HID * 2 * 3
            t_un = bench(unfused)
            t_fu = bench(lambda: fk.gate_residual_(xs[1], o, gt, rows))
            a0, a1 = x.clone(), x.clone()
            for a, b, r in segs:
                a0[a:b].addcmul_(o[a:b], gt[r].to(BF16))
            fk.gate_residual_(a1, o, gt, rows)
            return {"ms_unfused": t_un, "ms_fused": t_fu, "speedup": t_un / t_fu, "bytes_min": bytes_,
                    "gbps_fused": bytes_ / t_fu / 1e6, "gbps_unfused": bytes_ / t_un / 1e6,
                    "bit_identical_to_addcmul": bool(torch.equal(a0, a1))}

        def k_quant_out():
            a = mk(s, HEADS * HD)
            bytes_ = s * HEADS * HD * 3 + 4 * s
            t = bench(lambda: tk.quant_rows_fp8(a))
            return {"ms_quant_rows_fp8": t, "bytes_min": bytes_, "gbps": bytes_ / t / 1e6}

        def rope_problem():
            """A qkv GEMM output [s, 3 * 56 * 128], core's rotation table (96 of 128 dims) and q/k norm weights."""
            import comfy.ldm.minimax.model as mm_h3

            qkv0 = mk(s, 3 * HEADS * HD, 3.0)
            ang = torch.randn(s, 96, device=DEV, generator=g) * 20.0
            table = mm_h3.rope_rotation_table(torch.cat((ang[:, :48], ang[:, :48]), 1), BF16)
            qw = (1.0 + 0.2 * torch.randn(HD, device=DEV, generator=g)).to(BF16)
            kw = (1.0 + 0.2 * torch.randn(HD, device=DEV, generator=g)).to(BF16)
            return qkv0, table, qw, kw

        def k_qk_rope():
            import comfy.quant_ops

            inner = HEADS * HD
            qkv0, table, qw, kw = rope_problem()
            bufs = [qkv0.clone(), qkv0.clone()]

            def unfused(b=bufs[0]):     # core 0.33's Attention: kitchen RMSNorm+RoPE in place, then v.clone()
                q = b[:, :inner].view(1, s, HEADS, HD)
                k = b[:, inner:2 * inner].view(1, s, HEADS, HD)
                comfy.quant_ops.ck.rms_rope_split_half_(q, k, table, qw, kw, epsilon=1e-6, rot_dim=96)
                return b[:, 2 * inner:].view(s, HEADS, HD).clone()

            bytes_ = s * inner * 2 * (2 * 2 + 2)        # q, k read + written, v read + written
            out = {"ms_unfused": bench(unfused), "bytes_min": bytes_}
            before = (fk.ROPE_ROWS, fk.ROPE_WARPS)
            best = None
            for rows_, warps in ((8, 4), (16, 4), (32, 4), (16, 8), (32, 8), (8, 2)):
                fk.ROPE_ROWS, fk.ROPE_WARPS = rows_, warps
                t = bench(lambda: fk.qk_norm_rope(bufs[1], HEADS, HD, table, qw, kw, 1e-6))
                out[f"ms_fused_rows{rows_}_warps{warps}"] = t
                if best is None or t < best[0]:
                    best = (t, rows_, warps)
            fk.ROPE_ROWS, fk.ROPE_WARPS = before
            out.update(ms_fused=best[0], best_rows=best[1], best_warps=best[2], speedup=out["ms_unfused"] / best[0],
                       gbps_fused=bytes_ / best[0] / 1e6)
            a, b = qkv0.clone(), qkv0.clone()
            v0 = unfused(a)
            v1 = fk.qk_norm_rope(b, HEADS, HD, table, qw, kw, 1e-6)
            def ordered(t):     # bf16 bit patterns -> integers in the order of their values (ulp distances)
                i = t.view(torch.int16).int()
                return torch.where(i < 0, -32768 - i, i)

            d = (ordered(a) - ordered(b)).abs()
            ref = fk.qk_norm_rope_ref(qkv0[sample], HEADS, HD, table[:, sample], qw, kw, 1e-6)
            out.update(v_bit_identical=bool(torch.equal(v0, v1)), ulp_max_vs_kitchen=int(d.max()),
                       ulp_mismatch_frac_vs_kitchen=float((d > 0).double().mean()),
                       rel_l2_vs_kitchen=rel(b, a), rel_l2_vs_ref=rel(b[sample], ref),
                       kitchen_rel_l2_vs_ref=rel(a[sample], ref))
            return out

        def k_sage_chain():
            """qkv GEMM output -> out_proj's e4m3 input with int8_sage attention: unfused (qk_norm_rope,
            the backend's Q pre-kernel, K/V statistics and quantization, kernel, bf16 output, quant_rows) vs fused
            (qk_norm_rope_sage, K/V quantization from its sums, kernel with Q_ROW and e4m3 output)."""
            from h3_turbo.kernels.attention import int8_kernels as K
            from h3_turbo.kernels.attention.reference import accuracy, reference_attention

            inner = HEADS * HD
            qkv0, table, qw, kw = rope_problem()
            tuned = K.tuned_config(DEV, s)
            if DRY:
                tuned = dict(tuned, BLOCK_M=64, BLOCK_N=64)
            b0, b1 = qkv0.clone(), qkv0.clone()
            view = lambda t: t.view(s, HEADS, HD).transpose(0, 1).unsqueeze(0)      # noqa: E731

            def unfused_prep():
                v = fk.qk_norm_rope(b0, HEADS, HD, table, qw, kw, 1e-6)
                kv = K.quantize_kv(view(b0[:, inner:2 * inner]), v.transpose(0, 1).unsqueeze(0), tuned)
                q8 = K.quantize_q(view(b0[:, :inner]), HD ** -0.5 * K.LOG2E, tuned, lam=kv["lam"])
                return q8, kv

            def fused_prep():       # what the route runs before the kernel (the partials reduced by quantize_kv)
                p = fk.qk_norm_rope_sage(b1, HEADS, HD, table, qw, kw, 1e-6)
                c = dict(tuned, QPRE=True, Q_ROW=True)
                return K.quantize_kv(view(b1[:, inner:2 * inner]), view(b1[:, 2 * inner:]), c,
                                     parts=(p["ksum"], p["vamax"]))

            def unfused_chain():
                v = fk.qk_norm_rope(b0, HEADS, HD, table, qw, kw, 1e-6)
                o = K.sage_attention(view(b0[:, :inner]), view(b0[:, inner:2 * inner]), v.transpose(0, 1).unsqueeze(0),
                                     out_layout="blhd", config=tuned)
                return tk.quant_rows_fp8(o[0])

            def fused_chain():
                p = fk.qk_norm_rope_sage(b1, HEADS, HD, table, qw, kw, 1e-6)
                return K.sage_attention_prequantized(p["q8"], p["qs"], view(b1[:, inner:2 * inner]),
                                                     view(b1[:, 2 * inner:]), p["ksum"], p["vamax"], config=tuned,
                                                     out_fp8=True)

            out = {"config": {k: v for k, v in tuned.items()}}
            out["ms_prep_unfused"] = bench(unfused_prep)
            out["ms_prep_fused"] = bench(fused_prep)
            out["ms_chain_unfused"] = bench(unfused_chain)
            out["ms_chain_fused"] = bench(fused_chain)
            out["chain_speedup"] = out["ms_chain_unfused"] / out["ms_chain_fused"]
            before = (fk.ROPE_ROWS, fk.ROPE_WARPS)
            for rows_, warps in (((8, 4), (16, 4)) if CUDA else ((8, 4),)):
                fk.ROPE_ROWS, fk.ROPE_WARPS = rows_, warps
                try:
                    tag = f"rows{rows_}_warps{warps}"
                    out[f"ms_chain_fused_{tag}"] = bench(fused_chain)
                    out[f"ms_prep_fused_{tag}"] = bench(fused_prep)
                    out[f"ms_qk_norm_rope_sage_{tag}"] = bench(lambda: fk.qk_norm_rope_sage(b1, HEADS, HD, table, qw,
                                                                                            kw, 1e-6))
                    b2 = qkv0.clone()      # the launch alone (no statistics): q8 / qs written, k rotated
                    q8b = torch.empty(s, HEADS, HD, device=DEV, dtype=torch.int8)
                    qsb = torch.empty(s, HEADS, device=DEV)
                    out[f"ms_qk_launch_only_{tag}"] = bench(lambda: fk._qk_rope_launch(
                        b2, HEADS, HD, table, qw, kw, 1e-6, (q8b, qsb)))
                finally:
                    fk.ROPE_ROWS, fk.ROPE_WARPS = before
            kc, vc = b1[:, inner:2 * inner].view(s, HEADS, HD), b1[:, 2 * inner:].view(s, HEADS, HD)
            out["ms_kv_stats_pass"] = bench(lambda: K.kv_partial_stats(kc, vc))   # the statistics pass alone
            out["ms_qk_norm_rope_sage"] = bench(lambda: fk.qk_norm_rope_sage(b1, HEADS, HD, table, qw, kw, 1e-6))
            out["ms_qk_norm_rope"] = bench(lambda: fk.qk_norm_rope(b0, HEADS, HD, table, qw, kw, 1e-6))
            # the kernel alone, per-block vs per-row Q scales (the backend's pre-kernels in both)
            rot = qkv0.clone()
            vv = fk.qk_norm_rope(rot, HEADS, HD, table, qw, kw, 1e-6).transpose(0, 1).unsqueeze(0)
            qq, kk = view(rot[:, :inner]), view(rot[:, inner:2 * inner])
            out["ms_sage_tuned"] = bench(lambda: K.sage_attention(qq, kk, vv, out_layout="blhd", config=tuned))
            qrow = dict(tuned, QPRE=True, Q_ROW=True)
            out["ms_sage_tuned_q_row"] = bench(lambda: K.sage_attention(qq, kk, vv, out_layout="blhd", config=qrow))
            # accuracy on sampled query rows against float32 attention
            rows_s = torch.linspace(0, s - 1, min(512, s), device=DEV).long()
            ref = reference_attention(qq, kk, vv, rows=rows_s, dtype=torch.float32)      # [H, r, D]
            b0.copy_(qkv0)
            u8, su = unfused_chain()
            b1.copy_(qkv0)
            f8, sf = fused_chain()

            def as_heads(t):
                return t[rows_s].view(-1, HEADS, HD).transpose(0, 1).float()

            o_plain = K.sage_attention(qq, kk, vv, out_layout="blhd", config=tuned)[0]
            o_row = K.sage_attention(qq, kk, vv, out_layout="blhd", config=qrow)[0]
            out["acc_unfused_chain"] = accuracy(as_heads(u8.float() * su), ref)
            out["acc_fused_chain"] = accuracy(as_heads(f8.float() * sf), ref)
            out["acc_sage_tuned_bf16"] = accuracy(as_heads(o_plain), ref)
            out["acc_sage_q_row_bf16"] = accuracy(as_heads(o_row), ref)
            out["rel_fused_vs_unfused_chain"] = rel(f8.float() * sf, u8.float() * su)
            out["k_bit_identical"] = bool(torch.equal(b0[:, inner:2 * inner], b1[:, inner:2 * inner]))
            return out

        for name, fn in (("norm_mod", k_norm_mod), ("res_norm_mod", k_res_norm_mod), ("swiglu", k_swiglu),
                         ("gate_residual", k_gate_res), ("quant_attn_out", k_quant_out), ("qk_norm_rope", k_qk_rope),
                         ("sage_chain", k_sage_chain)):
            if KERNELS and name not in KERNELS:
                continue
            step("kernels", f"{name}@{s}", fn)
        del x, o


# --------------------------------------------------------------------------- part 2: one DiT block

def make_block():
    import comfy.ldm.minimax.model as mm_h3

    from h3_turbo.formats import nvfp4
    from h3_turbo.runtime.ops import make_operations

    ops = make_operations(DEV, compute_dtype=BF16)
    blk = mm_h3.DiTBlock(HID, HEADS, HD, FFN, TDIM, 1e-5, 1e-5, dtype=BF16, device=DEV, operations=ops)
    g = torch.Generator(device=DEV).manual_seed(1)
    sd = {}
    quant = {"attn.qkv_proj": (3 * HEADS * HD, HID), "attn.out_proj": (HID, HEADS * HD),
             "mlp.fc1": (2 * FFN, HID), "mlp.fc2": (HID, FFN)}
    meta = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    for name, (n, k) in quant.items():
        w = (torch.randn(n, k, device=DEV, generator=g) / math.sqrt(k)).to(BF16)
        q, bs, sc = nvfp4.quantize(w)
        sd.update({f"{name}.weight": q, f"{name}.weight_scale": bs, f"{name}.weight_scale_2": sc,
                   f"{name}.comfy_quant": meta})
    for name, n in (("norm1", HID), ("norm2", HID), ("attn.q_norm", HD), ("attn.k_norm", HD)):
        sd[f"{name}.weight"] = (1.0 + 0.1 * torch.randn(n, device=DEV, generator=g)).to(BF16)
    sd["adaln_proj.linear.weight"] = (torch.randn(6 * 3 * HID, TDIM, device=DEV, generator=g) * 0.02).to(BF16)
    sd["adaln_proj.linear.bias"] = (torch.randn(6 * 3 * HID, device=DEV, generator=g) * 0.1).to(BF16)
    missing, unexpected = blk.load_state_dict(sd, strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected keys {unexpected}")
    for name in quant:
        m = blk.get_submodule(name)
        if getattr(m, "quant_format", None) != "nvfp4":
            raise RuntimeError(f"{name} did not load as NVFP4 (missing: {missing})")
    return blk.eval().requires_grad_(False)


def set_path(blk, path):
    for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
        m = blk.get_submodule(name)
        m._h3_path = path
        m._h3_cache = None


class TurboStub:
    """A stand-in for one target of the Turbo branch (adapters/branch.py) with its fused interface: the layer's
    forward computes base + coef * Bc @ (A @ x) through ``h3turbo_lora_forward`` (the branch's fused route), and
    exposes ``h3turbo_lora_operands`` / ``h3turbo_count`` for the fused block."""

    def __init__(self, m, rank, blocks, g):
        self.m = m
        self.a = (torch.randn(rank * blocks, m.in_features, device=DEV, generator=g) / math.sqrt(m.in_features)).to(BF16)
        self.bc = (torch.randn(m.out_features, rank, device=DEV, generator=g) * 0.02).to(BF16).contiguous()
        self.amax = self.a.abs().amax(dim=1).float()
        self.coef, self.blocks = 1.0, blocks
        self.key = ("turbo_stub", id(m))
        self.count = 0

        def fwd(x):
            self.count += 1
            return m.h3turbo_lora_forward(x, self.a, self.bc, self.coef, self.blocks, self.amax, self.key)

        fwd.h3turbo_lora_operands = lambda x: (self.a, self.bc, self.coef, self.blocks, self.amax, self.key) \
            if m.h3turbo_fusable(x) else None
        fwd.h3turbo_count = lambda: setattr(self, "count", self.count + 1)
        m.forward = fwd

    def remove(self):
        del self.m.forward


def block_inputs(s):
    import comfy.ldm.minimax.model as mm_h3

    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(s, HID, device=DEV, generator=g).to(BF16)
    t_emb = torch.randn(2, TDIM, device=DEV, generator=g).to(BF16)
    pos = torch.stack([torch.arange(s) // 600, (torch.arange(s) // 30) % 20, torch.arange(s) % 30], -1).double()
    inv = 1.0 / (10000 ** (torch.arange(16, dtype=torch.float32) / 16))
    ns = type("R", (), {})()
    ns.rope = type("R", (), {})()
    ns.rope.inv_freq = inv
    angles = mm_h3.MiniMaxH3Model.rope_freqs(ns, pos, DEV)
    rope = mm_h3.rope_rotation_table(angles, BF16)
    return x, t_emb, segments(s), rope


#: kernel-name rules of benchmarks/bench_denoiser.py's profile (GEMM / attention; everything else counts as
#: non-GEMM non-attention); the attention backends' own q/k/v casts and amax reductions count as "other" here
ATTN_KEYS = ("flash", "fmha", "sdpa", "attn", "attention", "softmax", "_quant_kv", "_quant_q_kernel", "cudnn")
GEMM_KEYS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "gemv", "matmul", "splitk")


def kernel_category(name: str) -> str:
    n = name.lower()
    if n.startswith("memcpy dtod"):      # the benchmark's own x0.clone() per call (the fused block issues none)
        return "memcpy"
    if any(k in n for k in ATTN_KEYS):
        return "attention"
    if any(k in n for k in GEMM_KEYS):
        return "gemm"
    return "other"


def profile_categories(fn) -> dict:
    """Kernel time (ms) of one fn() call by category, from the torch profiler's device events (DRY: top-level CPU
    ops), plus the 25 largest kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    sync()
    with profile(activities=acts) as prof:
        fn()
        sync()
    cats = {"gemm": 0.0, "attention": 0.0, "other": 0.0, "memcpy": 0.0}
    per: dict = {}
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if (CUDA and dt == DeviceType.CUDA) or (not CUDA and dt == DeviceType.CPU and e.cpu_parent is None):
            t = (e.time_range.end - e.time_range.start) / 1e3
            c = kernel_category(e.name)
            cats[c] += t
            q = per.setdefault(e.name[:140], [0.0, 0, c])
            q[0] += t
            q[1] += 1
    cats = {k: round(v, 3) for k, v in cats.items()}
    cats["top"] = [{"name": k, "ms": round(v[0], 3), "calls": v[1], "category": v[2]}
                   for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])[:25]]
    return cats


def block_part():
    import comfy.ldm.minimax.model as mm_h3  # noqa: F401

    from h3_turbo.kernels import fused as fk
    from h3_turbo.kernels.attention import cudnn_fp8, exact, int8_sage
    from h3_turbo.runtime import fused_block as fb

    blk = make_block()
    RES["block"]["structure_problem"] = fb.structure_problem(blk)
    ex = exact.exact_override() if CUDA else exact.cpu_exact()
    to_exact = {"optimized_attention_override": ex}
    ops = fk.TRITON
    patch = fb.FusedBlockPatch(blk, 0, ops=ops, devices=(DEV.type,))
    stubs: list = []

    def turbo(on):
        while stubs:
            stubs.pop().remove()
        if on:
            g = torch.Generator(device=DEV).manual_seed(3)
            for name, r, b in (("attn.qkv_proj", 128, 3), ("attn.out_proj", 128, 1), ("mlp.fc1", 128, 1),
                               ("mlp.fc2", 128, 1)):
                stubs.append(TurboStub(blk.get_submodule(name), r if not DRY else 4, b, g))

    for s in ROWS:
        x0, t_emb, segs, rope = block_inputs(s)

        def core_run(to):
            x = x0.clone()
            with torch.inference_mode():
                return blk(x, t_emb, segs, rope, transformer_options=to)

        def fused_run(to):
            x = x0.clone()
            args = {"img": x, "t_emb": t_emb, "mod_segments": segs, "rope_freqs": rope, "transformer_options": to}
            with torch.inference_mode():
                return patch(args, {"original_block": lambda a: {"img": blk(a["img"], a["t_emb"], a["mod_segments"],
                                                                            a["rope_freqs"], transformer_options=a["transformer_options"])}})["img"]

        for tb in (False, True):
            def one(tb=tb):
                turbo(tb)
                set_path(blk, "exact")
                ref = core_run(to_exact)
                set_path(blk, "fp8")
                out = {}
                runs = [("unfused_fp8", lambda: core_run(to_exact)),
                        ("fused_fp8", lambda: fused_run(to_exact))]
                if CUDA:     # int8_sage: core's block; the fused block (its producer route)
                    i8 = int8_sage.int8_override()
                    to8 = {"optimized_attention_override": i8}
                    runs += [("unfused_fp8_int8_sage", lambda: core_run(to8)),
                             ("fused_fp8_int8_sage", lambda: fused_run(to8))]
                if FP8_ATTN and cudnn_fp8.frontend() is not None and CUDA:
                    c8 = cudnn_fp8.cudnn_fp8_override()
                    runs += [("unfused_fp8_cudnn_fp8", lambda: core_run({"optimized_attention_override": c8})),
                             ("fused_fp8_cudnn_fp8", lambda: fused_run({"optimized_attention_override": c8}))]
                t_ex = bench(lambda: core_run(to_exact), warmup=1, rep=REPS * 30) if CUDA else None
                out["exact"] = {"ms": t_ex}
                dref = ref.double() - x0.double()
                for name, fn in runs:
                    c0, r0 = patch.calls, dict(patch.routes)
                    y = fn()
                    r = {"rel_out_vs_exact": rel(y, ref), "rel_update_vs_exact": rel(y.double() - x0.double(), dref)}
                    if name.startswith("fused"):
                        r["fused_calls"] = patch.calls - c0
                        r["routes"] = {k: v - r0.get(k, 0) for k, v in patch.routes.items() if v - r0.get(k, 0)}
                    r["ms"] = bench(fn, warmup=1, rep=REPS * 30)
                    prof = profile_categories(fn)
                    r["profile_ms"] = prof
                    r["non_gemm_non_attention_ms"] = prof["other"]
                    out[name] = r
                    del y
                if stubs:
                    out["turbo_counts"] = [st.count for st in stubs]
                turbo(False)
                return out

            step("block", f"S{s}_turbo{int(tb)}", one)
        del x0, rope


# --------------------------------------------------------------------------- part 3: attention

def attention_part():
    from h3_turbo.kernels.attention import auto8, cudnn_fp8, exact
    from h3_turbo.kernels.attention.reference import accuracy, reference_attention

    if cudnn_fp8.frontend() is None:
        RES["attention"]["skipped"] = f"nvidia-cudnn-frontend not importable: {cudnn_fp8.frontend_error()}"
        save()
        return
    if not CUDA:
        RES["attention"]["skipped"] = "DRY/CPU: the cuDNN kernel is GPU-only"
        save()
        return
    c8 = cudnn_fp8.cudnn_fp8_override()

    def core_func(*a, **k):
        raise RuntimeError("core's attention function must not run here")

    for s in ROWS:
        def one(s=s):
            _, (q, k, v) = _common.h3_qkv(s, HEADS, HD, DEV, seed=s)
            rows = torch.linspace(0, s - 1, 512, device=DEV).long()
            ref = reference_attention(q, k, v, rows=rows, dtype=torch.float32)
            o16 = exact.sdpa_with("CUDNN_ATTENTION", q, k, v)
            out = {"cudnn_bf16": {"ms": bench(lambda: exact.sdpa_with("CUDNN_ATTENTION", q, k, v)),
                                  **accuracy(o16[0][:, rows], ref)}}
            o = c8(core_func, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)
            if c8.calls == 0:
                raise RuntimeError(f"cudnn_fp8 fell back: {c8.graphs}")
            out["cudnn_fp8"] = {"ms_override": bench(lambda: c8(core_func, q, k, v, HEADS, skip_reshape=True,
                                                                skip_output_reshape=True)),
                                "ms_fp8_out": bench(lambda: c8.attention_fp8(q, k, v)),
                                **accuracy(o[0][:, rows].float(), ref)}
            out["ratio_override_to_cudnn_bf16"] = out["cudnn_fp8"]["ms_override"] / out["cudnn_bf16"]["ms"]
            out["ratio_fp8_out_to_cudnn_bf16"] = out["cudnn_fp8"]["ms_fp8_out"] / out["cudnn_bf16"]["ms"]
            a8 = auto8.Auto8Attention()
            a8(core_func, q, k, v, HEADS, skip_reshape=True, skip_output_reshape=True)
            ch = next(iter(a8.choices.values()))
            out["auto8"] = {"choice": ch.backend, "cos_min": ch.cos_min, "seconds": ch.seconds, "rejected": ch.rejected}
            return out

        step("attention", f"S{s}", one)


def main():
    env_info()
    if "kernels" in PARTS:
        kernels_part()
    if "block" in PARTS:
        try:
            block_part()
        except Exception:  # noqa: BLE001
            RES["errors"]["block"] = traceback.format_exc()[-2500:]
            save()
    if "attention" in PARTS:
        attention_part()
    RES["elapsed_s"] = round(now(), 1)
    save()
    # the short table last (the device reply carries the tail)
    for k, v in RES["kernels"].items():
        print(f"{k:28s} unfused {v.get('ms_unfused', float('nan')):8.3f} ms  fused "
              f"{v.get('ms_fused', float('nan')):8.3f} ms")
    for k, v in RES["block"].items():
        if isinstance(v, dict):
            for n, r in v.items():
                if isinstance(r, dict) and "ms" in r:
                    print(f"block {k:16s} {n:24s} {r['ms'] if r['ms'] is not None else float('nan'):8.2f} ms  "
                          f"other {r.get('non_gemm_non_attention_ms', float('nan')):7.2f} ms  "
                          f"rel {r.get('rel_update_vs_exact', float('nan')):.4f}")
    for k, v in RES["attention"].items():
        if isinstance(v, dict) and "cudnn_fp8" in v:
            print(f"attn {k}: fp8/bf16 {v['ratio_override_to_cudnn_bf16']:.3f} cos {v['cudnn_fp8']['cos_min']:.5f} "
                  f"rel {v['cudnn_fp8']['rel_l2']:.4f}; auto8 -> {v['auto8']['choice']}")
    print(json.dumps({"ok": not RES["errors"], "errors": list(RES["errors"]), "elapsed_s": RES["elapsed_s"]}))


if __name__ == "__main__":
    main()
