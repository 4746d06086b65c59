"""The 33 B H3 under a VRAM cap: weights and AdaLN modes of the pack's loader, Turbo 4-step, on one GPU (issue 17).

One process (each step saves ``$OUT/$TAG.json``, so a killed run still returns what ran):

1. The full-depth, full-width random H3 of ``bench_denoiser.py`` (50 DiT + 2 refiner blocks, hidden 5376,
   ComfyUI-native NVFP4, unpruned: 26 GB of bf16 AdaLN kept) and its Turbo 4-step LoRA (qkv rank 384, the
   others 128), drawn on the GPU and written once per call (``bench_denoiser.make_files``).
2. Per configuration (``compute`` x ``weights`` x ``adaln``): loaded by ``runtime.loading.load_h3_model`` (the
   loader node's code), core's ``MiniMaxH3SigmaShift`` at the contract's 6/3, the Turbo branch by ``H3TurboLoRA``,
   attention ``ATTN`` (default exact = cuDNN), sampled by core's ``SamplerCustomAdvanced`` + ``H3TurboSampler``
   (fp32) on the contract's 4 sigmas at 960x544x124: a first run (compiles, the AdaLN table's one pass over
   the weights), then a timed run uncapped, then one timed run under each cap of ``CAPS`` (GB) set with
   ``torch.cuda.set_per_process_memory_fraction`` (a cap the model's resident bytes exceed is not tried).
3. Figures per (configuration, cap): ``resident_gb`` (allocated with the model loaded, before the adapter),
   ``adapter_gb``, ``peak_gb`` (max allocated during the run), ``turbo4_s``, ``ratio_to_resident`` (to the
   uncapped run of the same compute with weights=resident, adaln=resident), ``ok`` (ran, finite), and
   ``bit_identical_to_resident`` (final latents ``torch.equal`` to that run's).

Env: OUT, TAG (default memory_h200), DRY=1 (CPU, tiny widths, reference compute: checks the script), NB (DiT
blocks, default 50), CONFIGS (comma list of compute/weights/adaln, default below), CAPS (default 48,24),
ATTN (default exact), DEADLINE (s after which no new configuration starts), CKPT_DIR, SHAPE (default
960x544x124). COMFY_ARGS default ``--highvram`` (ComfyUI loads the whole model; the cap is torch's).

Run (GPU): ``OUT=benchmarks/results python3 benchmarks/bench_memory.py``; CPU check:
``DRY=1 OUT=/tmp/dry COMFYUI_PATH=$HOME/ComfyUI python benchmarks/bench_memory.py``.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TAG", "memory_h200")
os.environ.setdefault("SHAPES", os.environ.get("SHAPE", "96x64x22" if os.environ.get("DRY") else "960x544x124"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_denoiser as bd  # noqa: E402  (sets sys.argv for ComfyUI, logging, the timeline)

import torch  # noqa: E402

DRY, CUDA, OUT, TAG = bd.DRY, bd.CUDA, bd.OUT, bd.TAG
DEADLINE = bd.DEADLINE
CONFIGS = [c for c in os.environ.get("CONFIGS", ",".join([
    "fp8/resident/resident", "fp8/lean/table", "fp8/resident/table", "exact/resident/resident",
    "exact/lean/table"])).split(",") if c]
CAPS = [float(c) for c in os.environ.get("CAPS", "48,24").split(",") if c]
ATTN = os.environ.get("ATTN", "exact")
RES: dict = {"dry": DRY, "errors": {}, "rows": [], "loads": {}, "timeline": bd.RES["timeline"], "log": bd.RES["log"]}
LAT: dict = {}


def save():
    RES["elapsed_s"] = round(bd.now(), 1)
    RES["checkpoint"] = bd.RES.get("checkpoint")
    RES["summary"] = summary()
    with open(os.path.join(OUT, f"{TAG}.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def summary() -> dict:
    """Ratios to the resident run of the same compute, and the issue's targets (recorded, not asserted)."""
    base = {r["compute"]: r for r in RES["rows"] if r["weights"] == "resident" and r["adaln"] == "resident"
            and r["cap_gb"] is None and r.get("turbo4_s")}
    for r in RES["rows"]:
        b = base.get(r["compute"])
        if b and r.get("turbo4_s"):
            r["ratio_to_resident"] = round(r["turbo4_s"] / b["turbo4_s"], 4)
    out = {}
    for r in RES["rows"]:
        if r["compute"] == "fp8" and r["weights"] == "lean" and r["adaln"] == "table":
            key = f"fp8_lean_table_cap{r['cap_gb']}"
            out[key] = {k: r.get(k) for k in ("resident_gb", "peak_gb", "turbo4_s", "ratio_to_resident", "ok")}
            if r["cap_gb"] == 24:
                out["target_fp8_lean_table_24gb_met"] = bool(
                    r.get("ok") and (r.get("resident_gb") or 99) <= 13 and (r.get("peak_gb") or 99) <= 22
                    and (r.get("ratio_to_resident") or 9) <= 1.05)
        if r["compute"] == "exact" and r["weights"] == "lean" and r["cap_gb"] is None:
            out["exact_lean_ratio_to_resident"] = r.get("ratio_to_resident")
    return out


def run(m, sampler, sigmas, inp):
    """One 4-step run; (wall s, latents or None, error)."""
    try:
        wall, steps, lat = bd.sample4(m, sampler, sigmas, inp)
        return wall, steps, lat, None
    except Exception as e:  # noqa: BLE001
        return None, None, None, f"{type(e).__name__}: {str(e)[:600]}"


def config(spec, path, lname, inp, dev):
    import comfy.model_management as mm
    from comfy_extras.nodes_minimax_h3 import MiniMaxH3SigmaShift

    from h3_turbo.nodes import attention as nattn
    from h3_turbo.nodes import lora as nlora
    from h3_turbo.nodes.sampler import H3TurboSampler
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.samplers import schedules

    compute, weights, adaln = spec.split("/")
    ld = RES["loads"].setdefault(spec, {})
    if bd.now() + 60 > DEADLINE:
        ld["skipped"] = f"deadline {DEADLINE} s"
        bd.mark(f"skip {spec}: deadline")
        return
    bd.drop_all()
    if CUDA:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.reset_peak_memory_stats()
    base0 = torch.cuda.memory_allocated() if CUDA else 0
    bd.mark(f"{spec}: loading")
    t0 = time.perf_counter()
    mp = load_h3_model(path, "reference" if DRY else compute, adaln=adaln, weights=weights)
    ld["load_s"] = round(time.perf_counter() - t0, 2)
    ld["model_size_gb"] = bd.gb(mp.model_size())
    info = mp.model_options.get("h3_turbo", {}) if isinstance(mp.model_options.get("h3_turbo"), dict) else {}
    ld["resolved"] = {k: info.get(k) for k in ("compute", "weights", "adaln") if k in info}
    shifted = MiniMaxH3SigmaShift.execute(mp, 6.0, 3.0).args[0]
    mm.load_models_gpu([shifted])
    bd.sync()
    resident = (torch.cuda.memory_allocated() - base0) if CUDA else 0
    sampler = H3TurboSampler.execute("fp32").args[0]
    sigmas = schedules.shifted_grid(4, 6.0, dtype=torch.float32)
    tm = nlora.H3TurboLoRA.execute(shifted, lname, 1.0).args[0]
    m = nattn.H3TurboAttention.execute(tm, ATTN).args[0]
    mm.load_models_gpu([m] + m.get_nested_additional_models())
    bd.sync()
    adapter = ((torch.cuda.memory_allocated() - base0) if CUDA else 0) - resident
    t0 = time.perf_counter()
    wall, steps, lat, err = run(m, sampler, sigmas, inp)          # first: compiles, the AdaLN table's pass
    ld["first_turbo4_s"] = round(time.perf_counter() - t0, 3)
    ld["first_error"] = err
    bd.mark(f"{spec}: resident {bd.gb(resident)} GB, adapter {bd.gb(adapter)} GB, first run {ld['first_turbo4_s']} s"
            f"{' ' + err if err else ''}")
    save()
    for cap in [None] + [c for c in CAPS]:
        row = {"compute": compute, "weights": weights, "adaln": adaln, "cap_gb": cap,
               "resident_gb": bd.gb(resident), "adapter_gb": bd.gb(adapter), "attention": ATTN}
        if CUDA:
            total = torch.cuda.get_device_properties(0).total_memory
            if cap is not None and cap * 1e9 <= resident + adapter:
                row.update(ok=False, error=f"not tried: resident {bd.gb(resident + adapter)} GB exceeds the cap")
                RES["rows"].append(row)
                continue
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap * 1e9 / total))
            torch.cuda.reset_peak_memory_stats()
        wall, steps, lat, err = run(m, sampler, sigmas, inp)
        row["turbo4_s"] = round(wall, 4) if wall else None
        row["turbo4_forward_s"] = [round(s, 4) for s in steps] if steps else None
        row["peak_gb"] = bd.gb(torch.cuda.max_memory_allocated() - base0) if CUDA else None
        row["ok"] = err is None and lat is not None and all(bool(torch.isfinite(t).all()) for t in lat)
        if err:
            row["error"] = err
        if lat is not None:
            key = compute
            if weights == "resident" and adaln == "resident" and cap is None:
                LAT[key] = lat
            if key in LAT:
                row["bit_identical_to_resident"] = all(torch.equal(a, b) for a, b in zip(lat, LAT[key]))
                row["rel_l2_to_resident"] = bd.rel_l2(lat, LAT[key])
        RES["rows"].append(row)
        bd.mark(f"  cap {cap}: {row.get('turbo4_s')} s, peak {row.get('peak_gb')} GB, ok {row['ok']}"
                f"{' ' + err[:200] if err else ''}")
        save()
        if CUDA:
            torch.cuda.set_per_process_memory_fraction(1.0)
    del m, tm, shifted, mp
    gc.collect()
    bd.drop_all()


def main():
    from _common import import_package

    import_package()
    from h3_turbo.harness import boot

    runner = boot(cpu=DRY)
    root = os.environ.get("CKPT_DIR") or os.path.join(OUT if DRY else bd.pick_disk(), "h3bench_models")
    for sub in ("diffusion_models", "loras"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    runner.add_models_dir(root)
    runner.set_output_dir(os.path.join(root, "out"))
    os.environ.setdefault("H3_TURBO_ADALN_CACHE", os.path.join(root, "adaln_cache"))
    import comfy.utils

    comfy.utils.PROGRESS_BAR_ENABLED = False
    RES["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if CUDA else "cpu",
                  "configs": CONFIGS, "caps_gb": CAPS, "attention": ATTN, "comfy_args": sys.argv[1:]}
    dev = "cuda" if CUDA else "cpu"
    cfg = bd.full_cfg(int(os.environ.get("NB", 3 if DRY else 50)))
    with torch.inference_mode():
        path, lname, sd = bd.make_files(cfg, root, dev)
        del sd
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        w, h, n = (int(v) for v in os.environ["SHAPES"].split(",")[0].split("x"))
        inp = bd.Inputs(w, h, n, cfg.text_dim, dev)
        RES["input"] = inp.shapes
        save()
        for spec in CONFIGS:
            try:
                config(spec, path, lname, inp, dev)
            except Exception:  # noqa: BLE001
                RES["errors"][spec] = traceback.format_exc()[-3000:]
                bd.mark(f"{spec} failed: {RES['errors'][spec][-300:]}")
                bd.drop_all()
            save()
    save()
    print("compute | weights | adaln | cap_gb | resident_gb | adapter_gb | peak_gb | turbo4_s | ratio | ok | bitid")
    for r in RES["rows"]:
        print(*[r.get(k) for k in ("compute", "weights", "adaln", "cap_gb", "resident_gb", "adapter_gb", "peak_gb",
                                    "turbo4_s", "ratio_to_resident", "ok", "bit_identical_to_resident")], sep=" | ")
    print(json.dumps(RES["summary"], indent=1))
    print(json.dumps({"ok": True, "errors": list(RES["errors"]), "elapsed_s": round(bd.now(), 1)}))


if __name__ == "__main__":
    main()
