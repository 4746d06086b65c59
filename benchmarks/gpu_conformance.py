"""GPU conformance sweep: every compute path at every H3 projection shape and every row count users produce, with
and without the Turbo LoRA, against a float64 reference; every attention backend at small lengths; and (MODE=demo)
the demo through real ComfyUI per compute path, attention backend and prompt length.

Sweep rows (``MODE=sweep``, the default): for each registered compute path (plus ``fp8_lean``: fp8 with
``weights=lean``) x shape (H3's qkv 21504x5376, out_proj 5376x7168, fc1 28672x5376, fc2 5376x14336 and the tiny
model's four) x M in ``MS`` x LoRA off / on (rank 128, qkv as 3 blocks; the tiny model's rank 4):
``{path, shape, M, lora, ok, rel, bound, error, refused, route, ms}``. ``ok``: the whole output finite, relative L2
against the float64 product (exact NVFP4 weight or the int8 weight dequantized, plus the LoRA in float64) within the
path's ``error_bound``, and no kernel fell back (``paths.base.KERNEL_FAILURES``). ``refused``: the path said why it
does not run (``supports`` False, or a ValueError / H3TurboError naming the reason). Anything else is an error row.
Rows past 512 compare a sample of 256 rows (first 64, last 64, 128 spread). Attention rows (``ATTN=1``): each
backend's override on H3's layout (56 x 128 heads, core's strided q/k/v) at S in ``ATTN_S`` against its eager
reference within its stated ``tolerance`` (non-approximate backends also in bf16, bound 1e-2 / cos 0.9999: bf16
rounding); a backend that hands the call to core's attention is a refusal (the reason from its log line). Fused
block rows (``FUSED=1``): ``kernels/fused.py``'s norm_mod (fp8 / bf16 out), swiglu, gate_residual_, quant_rows and
qk_norm_rope at H3's widths against their eager references; the exact GEMM forced to each autotuner config
(``exact_fused_cfg``) on qkv at 1 / 63 / 200 rows.

Demo rows (``MODE=demo``; ``MODE=all`` runs both): ``python -m h3_turbo.demo --gpu`` in a subprocess on the tiny
demo workflow (``DEMO=tiny``, the default) per compute (auto, reference, exact, fp8) with attention auto, per
attention backend with compute exact, and per prompt length (1, 50, 256, 300 text tokens) with exact and fp8;
``DEMO=realwidth`` (or ``tiny,realwidth``): the real-width random model (hidden 5376, 1 DiT + 2 refiner blocks,
written to a temporary folder by ``tools.fixtures.make_fixtures``) at those lengths with exact and fp8.

Writes ``$OUT/gpu_conformance_<gpu>.json`` (``<gpu>``: h100, h200, ...; ``dry_cpu`` for DRY) after every row that is
not ok and at least every 2 s otherwise, at the end, and on SIGTERM (``timeout``).
Exit status: 0 every row ok or refused; 1 some row neither; 3 none bad but ``DEADLINE`` (s) cut the run short.

Run on the GPU machine from the repo root (after ``.dev/prep.sh``, which sets COMFYUI_PATH for the demo rows):
``python3 benchmarks/gpu_conformance.py``; CPU check of the whole logic at tiny shapes (kernel paths run by the
Triton interpreter): ``DRY=1 OUT=/tmp/conf python benchmarks/gpu_conformance.py``.
Env: OUT (default benchmarks/results), TAG (file name suffix), MODE (sweep | demo | all), PATHS, SHAPES, MS
(comma lists), LORA (0, 1 or both), FUSED (0: no fused-kernel rows), ATTN (0: no attention rows), ATTN_S,
QUICK_TUNE (0: Triton's own autotuning timings), PARALLEL (0: one process; default 1 on the GPU: one process per
group of paths, their rows merged), DEADLINE (s, default 330),
DEMO_TIMEOUT (s per demo run, default 240), DEMO (tiny and/or realwidth).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

DRY = os.environ.get("DRY") == "1"
if DRY:  # the kernel paths' Triton code runs on the CPU under the interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _common  # noqa: E402  (benchmarks/_common.py)

_common.import_package()

import torch  # noqa: E402

from h3_turbo.errors import H3TurboError  # noqa: E402
from h3_turbo.formats import nvfp4 as fmt  # noqa: E402
from h3_turbo.kernels import dispatch as dsp  # noqa: E402
from h3_turbo.kernels import int8_block as ib  # noqa: E402
from h3_turbo.kernels import nvfp4_ref as ref  # noqa: E402
from h3_turbo.kernels import registry  # noqa: E402
from h3_turbo.kernels.paths import base  # noqa: E402

T0 = time.perf_counter()
OUT = os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results")
MODE = os.environ.get("MODE", "sweep")
DEADLINE = float(os.environ.get("DEADLINE", "1800" if DRY else "330"))
dev = torch.device("cpu" if DRY else "cuda")


def _list(name, default, conv=str):
    v = os.environ.get(name)
    return [conv(s) for s in v.split(",") if s] if v else list(default)


# (N, K, qkv blocks, LoRA rank): H3's four projections (hidden 5376, 56 x 128 heads, ffn 14336) and the tiny model's
# (tools/fixtures.TinyH3Config: hidden 64, 2 x 32 heads, ffn 128, LoRA rank 4)
H3_SHAPES = {"qkv": (21504, 5376, 3, 128), "out_proj": (5376, 7168, 1, 128), "fc1": (28672, 5376, 1, 128),
             "fc2": (5376, 14336, 1, 128)}
TINY_SHAPES = {"tiny_qkv": (192, 64, 3, 4), "tiny_out": (64, 64, 1, 4), "tiny_fc1": (256, 64, 1, 4),
               "tiny_fc2": (64, 128, 1, 4)}
ALL_MS = (1, 2, 7, 15, 16, 17, 31, 32, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, 512, 1000, 4096,
          19584)
if DRY:
    SHAPES = {"tiny_qkv": TINY_SHAPES["tiny_qkv"], "small_qkv": (384, 128, 3, 8)}
    MS_DEFAULT = (1, 17, 64, 300)
    ATTN_S_DEFAULT = (7, 130)
    ATTN_HEADS = ((2, 64),)
else:
    SHAPES = {**H3_SHAPES, **TINY_SHAPES}
    MS_DEFAULT = ALL_MS
    ATTN_S_DEFAULT = (1, 7, 16, 64, 100, 200, 256, 257, 300, 1000, 4096)
    ATTN_HEADS = ((56, 128), (2, 32))
SHAPE_NAMES = _list("SHAPES", SHAPES)
MS = _list("MS", MS_DEFAULT, int)
LORA = {"0": (False,), "1": (True,)}.get(os.environ.get("LORA", "both"), (False, True))
PATH_NAMES = _list("PATHS", ["exact", "fp8", "fp8_lean", "int8"] + [n for n in registry.PATHS
                                                                    if n not in ("exact", "fp8", "int8")])
#: the fused exact GEMM at every autotuner config (forced), on this shape at these row counts
CFG_SHAPE, CFG_MS = ("small_qkv", (1, 40)) if DRY else ("qkv", (1, 63, 200))
#: autotune with 5 + 10 ms of timing per config instead of Triton's 25 + 100 (which config wins does not matter
#: here: CFG rows check every config)
QUICK_TUNE = os.environ.get("QUICK_TUNE", "1") == "1"
ATTN = os.environ.get("ATTN", "1") == "1"
ATTN_S = _list("ATTN_S", ATTN_S_DEFAULT, int)
SAMPLE_ABOVE = 512
#: the sweep in one process per group of paths (see parallel_sweep); default on the GPU
PARALLEL = os.environ.get("PARALLEL", "0" if DRY else "1") == "1"


def gpu_slug() -> str:
    if DRY:
        return "dry_cpu"
    name = torch.cuda.get_device_name()
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.upper())
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name.lower())).lower()


import triton  # noqa: E402  (after TRITON_INTERPRET is settled)

RES = {"gpu": "cpu (DRY)" if DRY else torch.cuda.get_device_name(), "dry": DRY, "torch": torch.__version__,
       "triton": triton.__version__, "mode": MODE, "ms": MS, "shapes": {n: SHAPES[n] for n in SHAPE_NAMES},
       "paths": PATH_NAMES, "rows": [], "demo": [], "log": [], "summary": {}}
FNAME = os.path.join(OUT, f"gpu_conformance_{gpu_slug()}{'_' + os.environ['TAG'] if os.environ.get('TAG') else ''}.json")
os.makedirs(OUT, exist_ok=True)
_common.collect_logs(RES["log"], 400)


_LAST_SAVE = [0.0]


def save(force: bool = True):
    """Write the JSON (rows as they are so far); ``force=False``: only if the last write is over 2 s old (the file
    grows with the rows: a write per row would cost O(rows^2))."""
    if not force and time.perf_counter() - _LAST_SAVE[0] < 2.0:
        return
    _LAST_SAVE[0] = time.perf_counter()
    rows = RES["rows"] + RES["demo"]
    RES["summary"] = {"rows": len(rows), "ok": sum(1 for r in rows if r.get("ok")),
                      "refused": sum(1 for r in rows if r.get("refused")),
                      "bad": sum(1 for r in rows if not r.get("ok") and not r.get("refused") and not r.get("skipped")),
                      "skipped": sum(1 for r in rows if r.get("skipped")),
                      "elapsed_s": round(time.perf_counter() - T0, 1)}
    with open(FNAME + ".tmp", "w") as f:
        json.dump(RES, f, default=str)
    os.replace(FNAME + ".tmp", FNAME)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def over_deadline() -> bool:
    return time.perf_counter() - T0 > DEADLINE


def add(row: dict, table: str = "rows"):
    RES[table].append(row)
    save(force=not row.get("ok"))
    flag = "ok" if row.get("ok") else "REFUSED" if row.get("refused") else "skipped" if row.get("skipped") else "BAD"
    detail = row.get("error") or row.get("refused") or row.get("skipped") or ""
    print(f"{flag:8s} {row.get('path')} {row.get('shape')} M={row.get('M')} lora={row.get('lora')} "
          f"rel={row.get('rel')} {detail}"[:400], flush=True)


def classify(e: BaseException) -> dict:
    """A named refusal (ValueError / H3TurboError: the pack says why it does not run this) or an error."""
    line = base.first_line(e)
    if isinstance(e, (ValueError, H3TurboError)) and not isinstance(e, torch.OutOfMemoryError):
        return {"ok": False, "refused": line}
    return {"ok": False, "error": line}


# --------------------------------------------------------------------------------------------- linear sweep

def _dry_force(path) -> None:
    """DRY: a kernel path takes CPU bf16 inputs (its Triton code runs under the interpreter)."""
    if DRY and path.kernel:
        path.takes = lambda x2d: x2d.dtype in (torch.bfloat16, torch.float16)


def sample_rows(m: int) -> torch.Tensor:
    if m <= SAMPLE_ABOVE:
        return torch.arange(m, device=dev)
    mid = torch.linspace(64, m - 65, 128, device=dev).round().long()
    return torch.unique(torch.cat([torch.arange(64, device=dev), mid, torch.arange(m - 64, m, device=dev)]))


def lora_ref(xs64, w64, a, b, scale, blocks):
    """float64 x W^T + scale * per-block (x A_i^T) B_i^T (the Turbo branch; A [blocks*r, K], B [N, r])."""
    out = xs64 @ w64.t()
    if a is not None:
        r, nb = a.shape[0] // blocks, w64.shape[0] // blocks
        h = xs64 @ a.double().t()
        for i in range(blocks):
            out[:, i * nb:(i + 1) * nb] += scale * (h[:, i * r:(i + 1) * r] @ b[i * nb:(i + 1) * nb].double().t())
    return out


def linear_sweep(names):
    ms_max = max(MS)
    for pname in names:
        name, lean = ("fp8", True) if pname == "fp8_lean" else (pname, False)
        try:
            path = registry.get(name)
        except H3TurboError as e:
            add({"path": pname, "shape": None, "M": None, "lora": None, **classify(e)})
            continue
        ok, why = path.supports(dev)
        if not ok and not (DRY and path.kernel and path.weight_format == "nvfp4") and not (DRY and name == "int8"):
            add({"path": pname, "shape": None, "M": None, "lora": None, "ok": False, "refused": f"supports: {why}"})
            continue
        _dry_force(path)
        for sname in SHAPE_NAMES:
            n, k, blocks, rank = SHAPES[sname]
            g = torch.Generator(device=dev).manual_seed(n * 7 + k)
            w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            try:
                if path.weight_format == "nvfp4" or name == "reference":
                    q, bs, gs = fmt.quantize(w)
                    packed = dsp.PackedNVFP4(q, bs, gs, n, k)
                    w64 = ref.dequant_fp64(q, bs, gs, n, k)
                    prepared = dsp.prepare(packed, name, lean=lean)
                else:   # the int8 path's own weight format (the DMD loader's W8A8 blocks)
                    iw = ib.quantize_weight(w)
                    w64 = ib.dequantize(iw, torch.float32).double()
                    prepared = path.prepare(iw)
            except Exception as e:  # noqa: BLE001
                add({"path": pname, "shape": sname, "M": None, "lora": None, **classify(e)})
                continue
            del w
            x_all = torch.randn(ms_max, k, device=dev, generator=g).to(torch.bfloat16)
            a = (torch.randn(blocks * rank, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            b = (torch.randn(n, rank, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            scale = 1.0
            for lora in LORA:
                for m in MS:
                    row = {"path": pname, "shape": sname, "N": n, "K": k, "M": m, "lora": lora}
                    if over_deadline():
                        add({**row, "ok": False, "skipped": f"DEADLINE {DEADLINE:.0f} s reached"})
                        continue
                    x = x_all[:m]
                    fails0 = dict(base.KERNEL_FAILURES.data)
                    routes0 = dict(dsp.LORA_ROUTES)
                    try:
                        t = time.perf_counter()
                        if lora:
                            y = dsp.linear_with_lora(x, prepared, name, a, b, scale, blocks,
                                                     fold_key=("conformance", sname))
                        else:
                            y = dsp.linear(x, prepared, name)
                        sync()
                        row["ms"] = round((time.perf_counter() - t) * 1e3, 2)
                        idx = sample_rows(m)
                        want = lora_ref(x[idx].double(), w64, a if lora else None, b, scale, blocks)
                        rel = ((y[idx].double() - want).norm() / want.norm()).item()
                        finite = bool(torch.isfinite(y).all())
                        new = {repr(kk): v for kk, v in base.KERNEL_FAILURES.data.items() if kk not in fails0}
                        row.update(rel=rel, bound=path.error_bound, finite=finite,
                                   ok=finite and rel <= path.error_bound and not new)
                        if lora:
                            row["route"] = {kk: v - routes0.get(kk, 0) for kk, v in dsp.LORA_ROUTES.items()
                                            if v != routes0.get(kk, 0)}
                        if new:
                            row["error"] = f"a kernel fell back: {new}"
                        elif not finite:
                            row["error"] = "non-finite output"
                        elif not row["ok"]:
                            row["error"] = f"rel {rel:.4g} > bound {path.error_bound}"
                        del y, want
                    except Exception as e:  # noqa: BLE001
                        row.update(classify(e))
                    add(row)
            del x_all, w64, prepared, a, b
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def quick_tune() -> None:
    """Shorter autotuning benchmarks for the pack's autotuned kernels (see QUICK_TUNE)."""
    from triton.runtime.autotuner import Autotuner

    from h3_turbo.kernels import int8_triton, triton_nvfp4

    for tuner in (triton_nvfp4._gemm_tuned, int8_triton._tuned):
        if isinstance(tuner, Autotuner) and hasattr(tuner, "_do_bench"):
            tuner.__dict__.pop("do_bench", None)
            tuner._do_bench = lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=10, quantiles=quantiles)
    RES["quick_tune"] = True


def exact_config_sweep():
    """The exact path's fused GEMM forced to each autotuner config (``triton_nvfp4._gemm_configs``), with and without
    the LoRA epilogue: what autotuning may pick on another GPU, checked here whichever it picks."""
    from h3_turbo.kernels import triton_nvfp4 as tk

    n, k, blocks, rank = SHAPES[CFG_SHAPE]
    g = torch.Generator(device=dev).manual_seed(5)
    q, bs, gs = fmt.quantize((torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16))
    w64 = ref.dequant_fp64(q, bs, gs, n, k)
    gs1 = gs.float().reshape(1)
    x_all = torch.randn(max(CFG_MS), k, device=dev, generator=g).to(torch.bfloat16)
    a = (torch.randn(blocks * rank, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, rank, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    bound = registry.get("exact").error_bound
    for c in tk._gemm_configs():
        cfg = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        tag = f"BM{cfg['BM']}-BN{cfg['BN']}-{'swap' if cfg['SWAP'] else 'xwT'}-w{c.num_warps}s{c.num_stages}"
        for lora in LORA:
            for m in CFG_MS:
                row = {"path": "exact_fused_cfg", "shape": f"{CFG_SHAPE}:{tag}", "N": n, "K": k, "M": m, "lora": lora}
                if over_deadline():
                    add({**row, "ok": False, "skipped": f"DEADLINE {DEADLINE:.0f} s reached"})
                    continue
                x = x_all[:m]
                tk.SETTINGS.forced_config = cfg
                try:
                    lo = (torch.nn.functional.linear(x, a), b, 1.0, n // blocks) if lora else None
                    y = tk.gemm_exact(x, q, bs, gs1, n, k, lora=lo)
                    sync()
                    want = lora_ref(x.double(), w64, a if lora else None, b, 1.0, blocks)
                    rel = ((y.double() - want).norm() / want.norm()).item()
                    finite = bool(torch.isfinite(y).all())
                    row.update(rel=rel, bound=bound, finite=finite, ok=finite and rel <= bound)
                    if not row["ok"]:
                        row["error"] = "non-finite output" if not finite else f"rel {rel:.4g} > bound {bound}"
                except Exception as e:  # noqa: BLE001
                    row.update(classify(e))
                finally:
                    tk.SETTINGS.forced_config = None
                add(row)


# ------------------------------------------------------------------------------------- fused block kernels

def _fp8_rel(y8, sy, h64) -> float:
    """Relative L2 of the e4m3 codes times their row scales against the float64 value they encode."""
    d = y8.double() * sy.double()
    return ((d - h64).norm() / h64.norm()).item()


def fused_sweep():
    """The fused DiT block's kernels that are callable on their own (kernels/fused.py), at H3's widths and the row
    counts in MS, against their eager float64 references. Bounds: an e4m3 output 0.035 (its rounding, as the CPU
    tests), a bf16 output 1e-2, the gated residual bit for bit (core's addcmul_), the row quantization's scales
    equal and its codes within one e4m3 step of the reference's on < 0.5% of the values (rounding ties); the fused
    route's producer (rotated INT8 q, balanced k) within 1e-2 on k and its q codes within one step on < 1%."""
    from h3_turbo.kernels import fused as fk

    hidden, ffn, heads, d, r2 = (96, 80, 2, 64, 16) if DRY else (5376, 14336, 56, 128, 48)
    g = torch.Generator(device=dev).manual_seed(3)
    w = (1.0 + 0.3 * torch.randn(hidden, device=dev, generator=g)).to(torch.bfloat16)
    ada = (torch.randn(6, 6 * hidden, device=dev, generator=g) * 0.4).to(torch.bfloat16)
    sh, sc, gate = ada[:, :hidden], ada[:, hidden:2 * hidden], ada[:, 2 * hidden:3 * hidden]
    qw = (1 + 0.2 * torch.randn(d, device=dev, generator=g)).to(torch.bfloat16)
    kw = (1 + 0.2 * torch.randn(d, device=dev, generator=g)).to(torch.bfloat16)
    for m in MS:
        segs = [(0, m, 1)] if m < 2 else [(0, m // 3, 1), (m // 3, m, 0)]
        rows = fk.segment_rows(segs, m, dev)
        x = (torch.randn(m, hidden, device=dev, generator=g) * 2.0).to(torch.bfloat16)
        other = torch.randn(m, hidden, device=dev, generator=g).to(torch.bfloat16)
        h = (torch.randn(m, 2 * ffn, device=dev, generator=g) * 3.0).to(torch.bfloat16)
        ang = torch.randn(m, r2, device=dev, generator=g) * 4.0
        table = torch.stack([ang.cos(), -ang.sin(), ang.sin(), ang.cos()], -1).reshape(1, m, 1, r2, 2, 2)
        qkv = (torch.randn(m, 3 * heads * d, device=dev, generator=g) * 3.0).to(torch.bfloat16)

        def norm_fp8():
            y8, sy = fk.norm_mod(x, w, 1e-5, sh, sc, rows)
            return _fp8_rel(y8, sy, fk.norm_mod_ref(x, w, 1e-5, sh, sc, rows)[0]), 0.035

        def norm_bf16():
            y = fk.norm_mod(x, w, 1e-5, sh, sc, rows, out="bf16")
            h64 = fk.norm_mod_ref(x, w, 1e-5, sh, sc, rows)[0]
            return ((y.double() - h64).norm() / h64.norm()).item(), 1e-2

        def swiglu_fp8():
            y8, sy = fk.swiglu(h)
            return _fp8_rel(y8, sy, fk.swiglu_ref(h)), 0.035

        def gate_res():
            want = fk.gate_residual_ref(x, other, gate, rows)
            got = fk.gate_residual_(x.clone(), other, gate, rows)
            return (0.0 if torch.equal(got.view(torch.int16), want.view(torch.int16)) else float("inf")), 0.0

        def quant_rows():   # bound: the scales equal, codes within one e4m3 step where x * 448/amax is at a tie
            y8, sy = fk.quant_rows(h)
            q, s_ = fk.quantize_rows(h)
            steps = (y8.view(torch.uint8).int() - q.view(torch.uint8).int()).abs()
            same = torch.equal(sy, s_) and int(steps.max()) <= 1
            return (float((steps > 0).float().mean()) if same else float("inf")), 5e-3

        def rope():
            want = fk.qk_norm_rope_ref(qkv, heads, d, table, qw, kw, 1e-6)
            got = qkv.clone()
            fk.qk_norm_rope(got, heads, d, table, qw, kw, 1e-6)
            return ((got.double() - want.double()).norm() / want.double().norm()).item(), 1e-2

        def rope_sage(rot_mma=False):    # the fused route's producer: rotated q codes, k balanced by l (an outlier channel)
            qwo, kwo = qw.clone(), kw.clone()
            qwo[d - 3], kwo[d - 3] = qwo[d - 3] * 0.05, kwo[d - 3] * 24
            want = fk.qk_norm_rope_sage_ref(qkv, heads, d, table, qwo, kwo, 1e-6, balance=True)
            got = qkv.clone()
            prep = fk.qk_norm_rope_sage(got, heads, d, table, qwo, kwo, 1e-6, balance=True, rot_mma=rot_mma)
            inner = heads * d
            k64, kw64 = got[:, inner:2 * inner].double(), want["new"][:, inner:2 * inner].double()
            rel_k = ((k64 - kw64).norm() / kw64.norm()).item()
            steps = (prep["q8"].int() - want["q8"].int()).abs()
            if int(steps.max()) > 1:
                return float("inf"), 1e-2
            return max(rel_k, float((steps > 0).float().mean())), 1e-2

        for kname, shape, fn in (("norm_mod:fp8", hidden, norm_fp8), ("norm_mod:bf16", hidden, norm_bf16),
                                 ("swiglu:fp8", 2 * ffn, swiglu_fp8), ("gate_residual_", hidden, gate_res),
                                 ("quant_rows", 2 * ffn, quant_rows), ("qk_norm_rope", f"{heads}x{d}:r{2 * r2}", rope),
                                 ("qk_norm_rope_sage:balance", f"{heads}x{d}:r{2 * r2}", rope_sage),
                                 ("qk_norm_rope_sage:balance:rot_mma", f"{heads}x{d}:r{2 * r2}",
                                  lambda: rope_sage(rot_mma=True))):
            row = {"path": f"fused:{kname}", "shape": str(shape), "M": m, "lora": False}
            if over_deadline():
                add({**row, "ok": False, "skipped": f"DEADLINE {DEADLINE:.0f} s reached"})
                continue
            try:
                rel, bound = fn()
                sync()
                row.update(rel=rel, bound=bound, ok=rel <= bound)
                if not row["ok"]:
                    row["error"] = f"rel {rel:.4g} > bound {bound}" if bound else "not bit-identical to its reference"
            except Exception as e:  # noqa: BLE001
                row.update(classify(e))
            add(row)


# ------------------------------------------------------------------------------------------ attention sweep

def _comfy_importable() -> str | None:
    """None when core's attention module imports (ComfyUI from COMFYUI_PATH / ~/ComfyUI; on the CPU with --cpu)."""
    try:
        from h3_turbo import harness

        harness.comfyui_first_on_path(harness.find_comfyui())
        from comfy.cli_args import args

        args.cpu = args.cpu or DRY
        import comfy.ldm.modules.attention  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001
        return f"ComfyUI not importable: {base.first_line(e)}"


def attention_sweep():
    from h3_turbo.kernels.attention import registry as areg
    from h3_turbo.kernels.attention.base import Tolerance

    for b in areg.backends():
        pname = f"attention:{b.name}"
        ok, why = b.available()
        if ok and not DRY:   # DRY: its cpu_override runs its own path on the CPU
            ok, why = b.supports(dev)
        if ok and b.needs_comfy:
            why = _comfy_importable()
            ok = why is None
        if not ok:
            add({"path": pname, "shape": None, "M": None, "lora": False, "ok": False, "refused": why})
            continue
        dtypes = [(b.tolerance.dtype, b.tolerance)]
        if not b.approximate and b.tolerance.dtype != torch.bfloat16:
            dtypes.append((torch.bfloat16, Tolerance(1e-2, 0.9999, torch.bfloat16)))
        for heads, d in ATTN_HEADS:
            for s in ATTN_S:
                for dt, tol in dtypes:
                    row = {"path": pname, "shape": f"S{s}xH{heads}xD{d}:{str(dt).replace('torch.', '')}", "M": s,
                           "lora": False}
                    if over_deadline():
                        add({**row, "ok": False, "skipped": f"DEADLINE {DEADLINE:.0f} s reached"})
                        continue
                    _, (q, k, v) = _common.h3_qkv(s, heads, d, dev, seed=s)
                    if dt != torch.bfloat16:
                        q, k, v = q.to(dt), k.to(dt), v.to(dt)
                    handed = []

                    def core_attention(q_, k_, v_, heads_, mask=None, skip_reshape=False, skip_output_reshape=False,
                                       **kw):
                        handed.append(1)
                        o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_)
                        return o if skip_output_reshape else o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)

                    nlog = len(RES["log"])
                    try:
                        ov = b.cpu_override() if DRY else b.override()
                        out = ov(core_attention, q, k, v, heads, skip_reshape=True, skip_output_reshape=True,
                                 _inside_attn_wrapper=True)
                        sync()
                        if handed:
                            said = [ln for ln in RES["log"][nlog:]] or ["(no log line)"]
                            row.update(ok=False, refused=f"handed to core's attention: {said[-1][:300]}")
                        else:
                            acc = dict(b.check(out, q, k, v))
                            acc["ok"] = tol.holds(acc) and bool(torch.isfinite(out).all())
                            row.update(rel=acc["rel_l2"], cos_min=acc["cos_min"], bound=tol.rel_l2, ok=acc["ok"])
                            if not acc["ok"]:
                                row["error"] = f"rel {acc['rel_l2']:.4g} / cos {acc['cos_min']:.6f} outside {tol}"
                    except Exception as e:  # noqa: BLE001
                        row.update(classify(e))
                    add(row)


# ------------------------------------------------------------------------------------------------ demo runs

def _workflow(compute: str, backend: str, tokens: int) -> dict:
    """The tiny demo workflow with the loader's ``compute``, an H3TurboAttention(``backend``) after the LoRA node and
    the test conditioning's ``tokens`` (the text rows the token refiner's projections see)."""
    with open(os.path.join(REPO, "example_workflows", "api", "h3turbo_tiny_demo.json")) as f:
        wf = json.load(f)
    loader = next(i for i, nd in wf.items() if nd["class_type"] == "H3TurboNVFP4Loader")
    lora = next(i for i, nd in wf.items() if nd["class_type"] == "H3TurboLoRA")
    cond = next(i for i, nd in wf.items() if nd["class_type"] == "H3TurboTestConditioning")
    wf[loader]["inputs"]["compute"] = compute
    wf[cond]["inputs"]["tokens"] = tokens
    att = str(max(int(i) for i in wf) + 1)
    for nd in wf.values():
        for key, val in nd["inputs"].items():
            if val == [lora, 0]:
                nd["inputs"][key] = [att, 0]
    wf[att] = {"class_type": "H3TurboAttention", "inputs": {"model": [lora, 0], "backend": backend}}
    return wf


def demo_runs():
    from h3_turbo.kernels.attention import registry as areg

    sets = _list("DEMO", ["tiny"])
    runs = []
    if "tiny" in sets:
        runs += [(c, "auto", 16, False) for c in ("auto", "reference", "exact", "fp8")]
        runs += [("exact", b, 16, False) for b in areg.names()]
        runs += [(c, "auto", t, False) for c in ("exact", "fp8") for t in (1, 50, 256, 300)]
        if DRY:   # the CPU check of this logic: one run per kind (a kernel path is refused by name on the CPU)
            runs = [("auto", "auto", 16, False), ("exact", "auto", 300, False), ("auto", areg.names()[-1], 1, False)]
    if "realwidth" in sets:
        runs += [(c, "auto", t, True) for c in ("exact", "fp8") for t in (1, 50, 256, 300)]
        if DRY:
            runs = runs[:-8] + [("auto", "auto", 50, True)]
    tmp = tempfile.mkdtemp(prefix="h3conf_")
    os.symlink(REPO, os.path.join(tmp, "h3_turbo"))      # `python -m h3_turbo.demo` from this checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]))
    if not DRY:
        env.pop("TRITON_INTERPRET", None)
    models = None
    for compute, backend, tokens, real in runs:
        row = {"path": f"demo:{compute}", "shape": f"{'realwidth' if real else 'tiny'}:attention={backend}",
               "M": tokens, "lora": True}
        if over_deadline() and MODE != "demo":
            add({**row, "ok": False, "skipped": f"DEADLINE {DEADLINE:.0f} s reached"}, "demo")
            continue
        cmd = [sys.executable, "-m", "h3_turbo.demo", "--out", os.path.join(tmp, "out"),
               "--workflow", os.path.join(tmp, "wf.json")] + ([] if DRY else ["--gpu"])
        if real:
            if models is None:
                models = os.path.join(tmp, "models_realwidth")
                from h3_turbo.tools.fixtures import make_fixtures
                t = time.perf_counter()
                make_fixtures(models, cfg=_common.h3_config(1, dry=DRY))
                RES["realwidth_fixtures_s"] = round(time.perf_counter() - t, 1)
            cmd += ["--models", models]
        with open(os.path.join(tmp, "wf.json"), "w") as f:
            json.dump(_workflow(compute, backend, tokens), f)
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                               timeout=float(os.environ.get("DEMO_TIMEOUT", "240")))
            tail = (p.stdout + p.stderr)[-1500:]
            row.update(rc=p.returncode, ok=p.returncode == 0, s=round(time.perf_counter() - t, 1))
            text = p.stdout + p.stderr
            warn = [ln for ln in text.splitlines() if "failed to build or launch" in ln]
            named = re.search(r"NoCapablePathError: (.*)", text)
            if warn:
                row.update(ok=False, error=f"a kernel fell back: {warn[0][:300]}")
            elif p.returncode and named:
                row["refused"] = named.group(1)[:300]
            elif p.returncode:
                row["error"] = tail
        except subprocess.TimeoutExpired:
            row.update(ok=False, error=f"timeout after {os.environ.get('DEMO_TIMEOUT', '240')} s")
        add(row, "demo")


def parallel_sweep() -> None:
    """The sweep as one process per group of paths on the same GPU (``PARALLEL=1``): Triton compiles a process's
    kernels one after another on one CPU core, and the compiles, not the GPU, are most of a cold run. Each child
    writes its JSON into a temporary folder; their rows are merged here in group order."""
    rest = [n for n in PATH_NAMES if n not in ("exact", "fp8", "fp8_lean", "int8")]
    groups = [(["exact"], {}), (["fp8"], {}), (["fp8_lean"], {}), (["int8"], {}),
              (rest, {"FUSED": os.environ.get("FUSED", "1"), "ATTN": "1" if ATTN else "0"})]
    groups = [(g, e) for g, e in groups if [n for n in g if n in PATH_NAMES] or e]
    tmp = tempfile.mkdtemp(prefix="h3conf_par_")
    procs = []
    for i, (names, extra) in enumerate(groups):
        env = dict(os.environ, PARALLEL="0", MODE="sweep", OUT=tmp, TAG=f"part{i}",
                   PATHS=",".join(n for n in names if n in PATH_NAMES) or "none", FUSED="0", ATTN="0",
                   DEADLINE=str(max(1.0, DEADLINE - (time.perf_counter() - T0))))
        env.update(extra)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env))
    _PAR.update(groups=groups, procs=procs, tmp=tmp)
    for p in procs:
        p.wait()
    merge_parts()


_PAR: dict = {}


def merge_parts() -> None:
    """Move the children's rows and log lines into RES (once), in group order; a child that wrote nothing or
    crashed adds an error row."""
    if not _PAR or _PAR.get("merged"):
        return
    _PAR["merged"] = True
    groups, procs, tmp = _PAR["groups"], _PAR["procs"], _PAR["tmp"]
    RES["parallel"] = {"groups": [g for g, _ in groups], "rc": [p.returncode for p in procs]}
    for i in range(len(groups)):
        f = [n for n in os.listdir(tmp) if n.endswith(f"_part{i}.json")]
        if not f:
            add({"path": f"group {groups[i][0]}", "shape": None, "M": None, "lora": None, "ok": False,
                 "error": f"its process wrote no results (exit {procs[i].returncode})"})
            continue
        with open(os.path.join(tmp, f[0])) as fh:
            part = json.load(fh)
        RES["rows"] += part["rows"]
        RES["log"] += part["log"]
        RES.setdefault("quick_tune", part.get("quick_tune"))
        if procs[i].returncode not in (0, 1, 3):
            add({"path": f"group {groups[i][0]}", "shape": None, "M": None, "lora": None, "ok": False,
                 "error": f"its process ended with exit {procs[i].returncode} after {len(part['rows'])} rows"
                          + (f" ({part['stopped']})" if part.get("stopped") else "")})


def main() -> int:
    print(json.dumps({k: RES[k] for k in ("gpu", "torch", "triton", "mode")}), "->", FNAME, flush=True)
    import signal

    def on_term(signum, frame):   # `timeout` stops the run: keep what it (and its children) measured
        RES["stopped"] = f"signal {signum} after {time.perf_counter() - T0:.0f} s"
        for p in _PAR.get("procs", []):
            if p.poll() is None:
                p.terminate()
        for p in _PAR.get("procs", []):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        merge_parts()
        save()
        sys.exit(124)
    signal.signal(signal.SIGTERM, on_term)
    if MODE in ("sweep", "all") and PARALLEL:
        parallel_sweep()
    elif MODE in ("sweep", "all"):
        if QUICK_TUNE and not DRY:
            quick_tune()
        # exact first (issue 42's path), then the short kernel checks, then the other paths' long autotuning
        if "exact" in PATH_NAMES:
            linear_sweep(["exact"])
            exact_config_sweep()
        if os.environ.get("FUSED", "1") == "1":
            fused_sweep()
        if ATTN:
            attention_sweep()
        linear_sweep([n for n in PATH_NAMES if n not in ("exact", "none")])
    if MODE in ("demo", "all"):
        demo_runs()
    save()
    s = RES["summary"]
    print(json.dumps(s), flush=True)
    return 1 if s["bad"] else 3 if s["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())
