"""H3 Turbo Multi-GPU (issue 22): the full-size H3 on 1 GPU (the plain path) and on N GPUs (H3 Turbo Multi-GPU,
Ulysses on yunchang over NCCL), forward and whole Turbo 4-step runs, through the pack's nodes.

What runs, per shape (default 960x544x124, 1344x768x124, 1344x768x362):

1. The random full-depth NVFP4 H3 and its Turbo 4-step LoRA (official shapes) are drawn on GPU 0 and written once by
   ``bench_denoiser.make_files`` (reused when present; ``CKPT_DIR``).
2. The MODEL as a user builds it: ``runtime.loading.load_h3_model`` (the loader node's code, ``COMPUTE``, default
   exact), H3 Turbo LoRA (the 4-step branch), H3 Turbo Attention (exact), plus a timing DIFFUSION_MODEL wrapper
   (:func:`timing_wrapper`, a module function, so it travels into the workers with the MODEL). Conditioning:
   H3TurboTestConditioning (seed 0, ``TEXT`` tokens); sampler: H3 Turbo Sigmas (steps 0) + H3 Turbo Sampler in core's
   SamplerCustomAdvanced, noise seed 42.
3. 1 GPU: two runs in the main process (the first warms up: attention choice, kernel preparation); N GPUs
   (``NS``, default every visible count > 1 that divides 56 up to the visible count, e.g. "2" on 2 GPUs, "2,4" on 4):
   ``H3 Turbo Multi-GPU(gpus=N)``, a first run (worker start + model load, reported apart), a timed run, and a run
   with ``profile`` on (collectives synchronized and timed: the all-to-all and gather seconds per forward).
4. Reported per (shape, GPUs): ``forward_s`` (median of the timed run's 4 forwards), ``turbo4_s`` (the timed run),
   ``speedup_forward`` / ``speedup_turbo4`` (1 GPU / N GPUs), ``peak_gb`` per GPU, ``all_to_all_s`` and ``gather_s``
   per forward (profiled run), ``rel_l2_vs_1gpu`` of the final latent, ``first_run_s``.

Every worker's environment has NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1
(``parallel.pool.WORKER_ENV``; set here too before anything starts).

Output: ``$OUT/multi_gpu_<KIND>.json`` and ``.md`` (OUT default benchmarks/results, with DRY /tmp/h3t_bench_multi_gpu_dry; KIND default ``h200x<visible>``,
``dry_cpu`` with DRY). Env: DRY=1 (CPU: tiny widths, 3 blocks, 2 gloo worker processes: checks the script), SHAPES,
NS, NB (DiT blocks, default 50; DRY 3), TEXT (default 300; DRY 16), COMPUTE, CKPT_DIR, DEADLINE (s after start after
which no new shape starts), KIND, MERGE=a.json,b.json (merge runs of single shapes into one file, see :func:`merge`).

GPU (a machine with N H200s): ``python3 benchmarks/bench_multi_gpu.py``; CPU check: ``DRY=1 python3 benchmarks/bench_multi_gpu.py``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v
DRY = bool(os.environ.get("DRY"))
if DRY:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_denoiser as bd  # noqa: E402  (its helpers: full_cfg, make_files, pick_disk, rel_l2, mark, RES)
import torch  # noqa: E402

from _common import import_package  # noqa: E402

import_package()
CUDA = torch.cuda.is_available() and not DRY
OUT = os.environ.get("OUT", "/tmp/h3t_bench_multi_gpu_dry" if DRY else os.path.join(HERE, "results"))
SEED = 42
TEXT = int(os.environ.get("TEXT", 16 if DRY else 300))
DEADLINE = float(os.environ.get("DEADLINE", 1e9))
T0 = time.perf_counter()

#: per-forward seconds measured by :func:`timing_wrapper` in this process (main, or a worker)
TIMES: list = []


def sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timing_wrapper(executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper: seconds of each model call (device-synchronized) into :data:`TIMES`."""
    sync()
    t0 = time.perf_counter()
    out = executor(*args, **kwargs)
    sync()
    TIMES.append(time.perf_counter() - t0)
    return out


def worker_times(ctx, last: int):
    """``call`` job: every rank's last ``last`` forward times (rank order)."""
    import torch.distributed as dist

    every = [None] * ctx.world
    dist.all_gather_object(every, TIMES[-last:], group=ctx.group)
    return every


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def build_model(path, lname, compute):
    """The MODEL as the nodes build it: loader (compute), Turbo 4-step branch, attention exact, timing wrapper."""
    import comfy.patcher_extension as pe
    import nodes

    from h3_turbo.kernels.attention import registry as attn
    from h3_turbo.runtime.loading import load_h3_model

    m = load_h3_model(path, compute)
    m = nodes.NODE_CLASS_MAPPINGS["H3TurboLoRA"].execute(m, lname, 1.0).args[0]
    m = attn.apply(m, "exact")
    m = m.clone()
    # by its module name (not __main__), so that the workers can import it
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "h3turbo_bench_timing", _me().timing_wrapper)
    return m


def _me():
    import importlib

    return importlib.import_module("bench_multi_gpu")


def turbo_run(model, w, h, length):
    """One Turbo 4-step run through core's SamplerCustomAdvanced; (wall s, (video, audio) CPU fp32)."""
    import nodes
    from comfy_extras.nodes_custom_sampler import Guider_Basic, Noise_RandomNoise, SamplerCustomAdvanced
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    latent = EmptyMiniMaxH3LatentAV.execute(w, h, length).args[0]
    cond = nodes.NODE_CLASS_MAPPINGS["H3TurboTestConditioning"].execute(model, 0, TEXT).args[0]
    sigmas = nodes.NODE_CLASS_MAPPINGS["H3TurboSigmas"].execute(model, 0).args[0]
    sampler = nodes.NODE_CLASS_MAPPINGS["H3TurboSampler"].execute("fp32", "auto").args[0]
    guider = Guider_Basic(model)
    guider.set_conds(cond)
    sync()
    t0 = time.perf_counter()
    out = SamplerCustomAdvanced.execute(Noise_RandomNoise(SEED), guider, sampler, sigmas, latent)
    sync()
    wall = time.perf_counter() - t0
    v, a = out.args[0]["samples"].unbind()
    return wall, (v.float().cpu(), a.float().cpu())


def rows_of(w, h, length, text):
    t = ((length - 5) // 17) * 5 + 2
    return {"video": t * (h // 32) * (w // 32), "audio": 2 * round(length / 24 * 40), "text": text}


def default_ns(visible: int) -> list[int]:
    from h3_turbo.parallel.engine import ulysses_degrees

    if DRY:
        return [2]
    return [n for n in ulysses_degrees(56, visible)]


def table(res) -> str:
    lines = [f"# H3 Turbo Multi-GPU ({res['kind']})", "",
             f"{res['device']}; NB={res['blocks']}, TEXT={TEXT}, compute={res['compute']}, yunchang "
             f"{res.get('yunchang')}. DRY={DRY}.", "",
             "| shape | rows | GPUs | forward s | Turbo 4-step s | speed-up fwd | speed-up 4-step | peak GB/GPU | "
             "all-to-all s/fwd | gather s/fwd | rel L2 vs 1 GPU | first run s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for sk, rows in res["shapes"].items():
        for n, r in rows.items():
            if "error" in r:
                lines.append(f"| {sk} | | {n} | error: {r['error'][:80]} |||||||||")
                continue
            f = lambda k, d=3: "" if r.get(k) is None else (f"{r[k]:.{d}f}" if isinstance(r[k], float) else str(r[k]))  # noqa: E731
            lines.append(f"| {sk} | {r.get('rows')} | {n} | {f('forward_s')} | {f('turbo4_s')} | {f('speedup_forward', 2)} "
                         f"| {f('speedup_turbo4', 2)} | {f('peak_gb', 1)} | {f('all_to_all_s')} | {f('gather_s')} "
                         f"| {f('rel_l2_vs_1gpu', 6) if r.get('rel_l2_vs_1gpu') else f('rel_l2_vs_1gpu')} | {f('first_run_s', 1)} |")
    return "\n".join(lines) + "\n"


def merge(paths: list[str]) -> None:
    """MERGE=a.json,b.json: one result file (and table) from runs of single shapes (a device call is limited to 10
    minutes, and the 1344x768x362 row alone takes several), written as ``$OUT/multi_gpu_<KIND>.json`` (default: the
    first file's kind)."""
    res = None
    for p in paths:
        r = json.load(open(p))
        if res is None:
            res = r
        else:
            res["shapes"].update(r["shapes"])
            res["errors"].update(r.get("errors", {}))
    res["merged_from"] = [os.path.basename(p) for p in paths]
    res["kind"] = os.environ.get("KIND") or res["kind"]
    os.makedirs(OUT, exist_ok=True)
    out_json = os.path.join(OUT, f"multi_gpu_{res['kind']}.json")
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)
    with open(out_json[:-5] + ".md", "w") as f:
        f.write(table(res))
    print(table(res))


def main():
    if os.environ.get("MERGE"):
        return merge(os.environ["MERGE"].split(","))
    import yunchang

    from h3_turbo.harness import boot
    from h3_turbo.parallel import apply as sp
    from h3_turbo.parallel import pool

    times = _me().TIMES                  # the list timing_wrapper fills in this process
    visible = torch.cuda.device_count() if CUDA else 1
    kind = os.environ.get("KIND") or ("dry_cpu" if DRY else f"h200x{visible}")
    os.makedirs(OUT, exist_ok=True)
    ns = [int(x) for x in os.environ.get("NS", "").split(",") if x] or default_ns(visible)
    shapes = [s for s in os.environ.get("SHAPES", "96x64x22,128x96x22" if DRY else
                                        "960x544x124,1344x768x124,1344x768x362").split(",") if s]
    nb = int(os.environ.get("NB", 3 if DRY else 50))
    compute = os.environ.get("COMPUTE", "reference" if DRY else "exact")
    res = {"kind": kind, "dry": DRY, "blocks": nb, "compute": compute, "ns": ns, "shapes": {}, "errors": {},
           "yunchang": yunchang.__version__, "env": {k: os.environ.get(k) for k in pool.WORKER_ENV},
           "device": (f"{visible}x {torch.cuda.get_device_name(0)}" if CUDA else "CPU (gloo workers)")}
    out_json = os.path.join(OUT, f"multi_gpu_{kind}.json")

    def save():
        with open(out_json, "w") as f:
            json.dump(res, f, indent=1)
        with open(out_json[:-5] + ".md", "w") as f:
            f.write(table(res))

    runner = boot(cpu=not CUDA)
    root = os.environ.get("CKPT_DIR") or os.path.join(OUT if DRY else bd.pick_disk(), "h3bench_models")
    for sub in ("diffusion_models", "loras"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    runner.add_models_dir(root)
    cfg = bd.full_cfg(nb)
    path, lname, sd = bd.make_files(cfg, root, "cuda" if CUDA else "cpu")
    del sd
    if CUDA:
        torch.cuda.empty_cache()
    import comfy.model_management as mm

    model1 = build_model(path, lname, compute)
    for sk in shapes:
        if time.perf_counter() - T0 > DEADLINE:
            res["errors"][sk] = "skipped: DEADLINE"
            continue
        w, h, length = (int(x) for x in sk.split("x"))
        rows = rows_of(w, h, length, TEXT)
        rows["total"] = sum(rows.values())
        out = res["shapes"][sk] = {}
        try:
            times.clear()
            turbo_run(model1, w, h, length)                                     # warm-up
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            wall1, lat1 = turbo_run(model1, w, h, length)
            one = {"rows": rows["total"], "forward_s": median(times[-4:]), "turbo4_s": wall1,
                   "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if CUDA else None}
            out["1"] = one
        except Exception:  # noqa: BLE001
            out["1"] = {"error": traceback.format_exc()[-1500:]}
            save()
            continue
        save()
        bd.mark(f"{sk}: 1 GPU forward {one['forward_s']:.3f} s, 4-step {wall1:.2f} s")
        mm.unload_all_models()                                                  # GPU 0 is worker 0's now
        if CUDA:
            torch.cuda.empty_cache()
        for n in ns:
            try:
                m = sp.apply(model1, n)
                t0 = time.perf_counter()
                turbo_run(m, w, h, length)                                      # workers start, load, warm up
                first = time.perf_counter() - t0
                wall, lat = turbo_run(m, w, h, length)
                ranks = pool.LAST_RUN["ranks"]
                wtimes = pool.get_pool(n, "cuda" if CUDA else "cpu").run(
                    {"kind": "call", "fn": _me().worker_times, "kwargs": {"last": 4}})[0]
                mprof = sp.apply(model1, n, profile=True)
                turbo_run(mprof, w, h, length)
                prof = pool.LAST_RUN["ranks"]
                r = {"rows": rows["total"], "forward_s": median(wtimes[0]), "forward_s_per_rank": [median(t) for t in wtimes],
                     "turbo4_s": wall, "first_run_s": first,
                     "peak_gb": max((x.get("peak_bytes") or 0) for x in ranks) / 1e9 if CUDA else None,
                     "peak_gb_per_rank": [(x.get("peak_bytes") or 0) / 1e9 for x in ranks] if CUDA else None,
                     "all_to_all_s": max(x["all_to_all_s"] / max(x["forwards"], 1) for x in prof),
                     "gather_s": max(x["gather_s"] / max(x["forwards"], 1) for x in prof),
                     "rel_l2_vs_1gpu": bd.rel_l2(lat, lat1), "bit_identical": all(torch.equal(a, b) for a, b in zip(lat, lat1))}
                r["speedup_forward"] = one["forward_s"] / r["forward_s"] if r["forward_s"] else None
                r["speedup_turbo4"] = one["turbo4_s"] / r["turbo4_s"]
                out[str(n)] = r
                bd.mark(f"{sk}: {n} GPUs forward {r['forward_s']:.3f} s ({r['speedup_forward']:.2f}x), 4-step "
                        f"{wall:.2f} s ({r['speedup_turbo4']:.2f}x), rel L2 {r['rel_l2_vs_1gpu']:.2e}")
            except Exception:  # noqa: BLE001
                out[str(n)] = {"error": traceback.format_exc()[-1500:]}
                pool.shutdown()
            save()
        pool.shutdown()
    save()
    print(table(res))
    print(json.dumps({"ok": not res["errors"] and all("error" not in r for rows in res["shapes"].values()
                                                       for r in rows.values()), "json": out_json,
                      "elapsed_s": round(time.perf_counter() - T0, 1)}))


if __name__ == "__main__":
    main()
