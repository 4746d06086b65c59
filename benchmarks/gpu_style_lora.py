"""GPU check: a style LoRA loaded by core beside H3TurboLoRA on every compute path (docs/lora.md, "A style LoRA
beside Turbo").

A full-width, partial-depth H3 ($NB DiT blocks + 2 refiner blocks, random weights, ComfyUI-native NVFP4 projections,
as benchmarks/bench_e2e_gpu.py part 2 writes it), its rank-128 Turbo LoRA (4step) and two synthetic style LoRAs
(tools/style_lora.py: every update as large as the weight it patches (Frobenius norm); ``proj``: the block projections; ``adaln``: also
every AdaLN / time-embedder Linear). Per case the MODEL is built as a workflow builds it: loader
(``runtime.loading.load_h3_model``: compute, weights, adaln) -> core's style LoRA (``comfy.sd.load_lora_for_models``
= LoraLoaderModelOnly, or ``load_bypass_lora_for_models`` = LoraLoaderBypassModelOnly) -> ``H3TurboLoRA(4step)`` ->
[``H3TurboFusedBlocks(fp8)``] -> ``load_models_gpu``; then one DiT forward (core's attention, fixed inputs, 2040
video tokens at 480x272x61 + 67 audio tokens). Cases: reference, exact, fp8 resident, fp8 lean, fp8 + fused blocks,
fp8 and reference with adaln=table, each without a style LoRA and with the merged and the bypass one (reference with
adaln=table: bit-identity with resident expected); adaln=table with the ``adaln`` style LoRA (the refusal:
InputError before sampling).

Per case: relative L2 of the outputs (video, audio) against the reference case with the same style loader (and
without a style LoRA, the path's own error); the style effect = reference with vs without the style LoRA. ``pass``:
error < the path's per-layer ``error_bound`` (kernels/registry.py; the fused blocks: fp8's) and effect >= 10x the
error (the model-level effect of a LoRA is far below the per-layer bounds: 10x those cannot be asked of it). Also recorded: the LoRA routes, the
pack's log lines (a layer that runs core's path because of a weight patch says so), peak memory.

Env: COMFYUI_PATH (ComfyUI tree), OUT (result folder, default .), NB (DiT blocks, default 2), DRY=1 (CPU, tiny
widths: the whole logic, the kernel paths fall back to the reference computation there), CASES (comma list of case
names to run; default all). Writes $OUT/gpu_style_lora.json after every case.

Run (GPU): ``OUT=benchmarks/results COMFYUI_PATH=<ComfyUI> python3 benchmarks/gpu_style_lora.py``; CPU check:
``DRY=1 OUT=/tmp/dry COMFYUI_PATH=$HOME/ComfyUI python benchmarks/gpu_style_lora.py``.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

DRY = bool(os.environ.get("DRY"))
OUT = os.environ.get("OUT", ".")
sys.argv = ["main.py"] + os.environ.get("COMFY_ARGS", "").split()
RES: dict = {"dry": DRY, "errors": {}, "cases": {}, "log": []}
os.makedirs(OUT, exist_ok=True)

from _common import collect_logs, h3_config, import_package, lora_routes, rel_l2  # noqa: E402

collect_logs(RES["log"], 400)
import_package()

import torch  # noqa: E402

#: name -> (compute, weights, adaln, fused, style loader, style file); names are "<path>_<style>"
CASES: dict = {}
for _s in ("none", "merged", "bypass"):
    _st = None if _s == "none" else _s
    CASES.update({
        f"reference_{_s}": ("reference", "resident", "resident", False, _st, "proj"),
        f"exact_{_s}": ("exact", "resident", "resident", False, _st, "proj"),
        f"fp8_{_s}": ("fp8", "resident", "resident", False, _st, "proj"),
        f"fp8lean_{_s}": ("fp8", "lean", "resident", False, _st, "proj"),
        f"fp8fused_{_s}": ("fp8", "resident", "resident", True, _st, "proj"),
        f"fp8table_{_s}": ("fp8", "resident", "table", False, _st, "proj"),
        f"referencetable_{_s}": ("reference", "resident", "table", False, _st, "proj"),
    })
CASES.update({
    "refused_merged": ("reference", "resident", "table", False, "merged", "adaln"),
    "refused_bypass": ("reference", "resident", "table", False, "bypass", "adaln"),
})


def save():
    with open(os.path.join(OUT, "gpu_style_lora.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def sync():
    if torch.cuda.is_available() and not DRY:
        torch.cuda.synchronize()


def write_models(models: str, cfg, dev) -> dict:
    """The NVFP4 model, its Turbo LoRA and the two style LoRAs in a ComfyUI models tree; returns their paths."""
    from safetensors.torch import save_file

    from h3_turbo.formats import nvfp4
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.tools import style_lora
    from h3_turbo.tools.fixtures import make_tiny_h3_state_dict, make_turbo_lora

    marker = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)

    def native_nvfp4(w):
        q, bs, s = nvfp4.quantize(w.to(torch.bfloat16))
        return {"weight": q, "weight_scale": bs, "weight_scale_2": s.float().reshape(()), "comfy_quant": marker.clone()}

    for d in ("diffusion_models", "loras"):
        os.makedirs(os.path.join(models, d), exist_ok=True)
    path = os.path.join(models, "diffusion_models", "h3_style_nvfp4.safetensors")
    sd = {k: v.cpu() for k, v in make_tiny_h3_state_dict(cfg, seed=0, device=dev, projection=native_nvfp4).items()}
    save_file(sd, path)
    del sd
    lt, lm = make_turbo_lora(None, cfg, alpha_over_rank=1.0, seed=1, nfe=4, shifts=(6.0, 3.0))
    turbo = "h3_style_turbo_4step.safetensors"
    save_file(lt, os.path.join(models, "loras", turbo), metadata=lm)
    dm = load_h3_model(path, "reference", adaln="resident").model.diffusion_model
    out = {"unet": path, "turbo": turbo}
    for kind in ("proj", "adaln"):
        p = os.path.join(models, "loras", f"h3_style_{kind}.safetensors")
        save_file(style_lora.for_model(dm, adaln=kind == "adaln", rel=1.0), p)
        out[kind] = p
    return out


def build(files, compute, weights, adaln, fused, style, style_file):
    """The MODEL of one case, as the workflow builds it (not yet loaded)."""
    from comfy.sd import load_bypass_lora_for_models, load_lora_for_models
    from comfy.utils import load_torch_file

    from h3_turbo.nodes import fused as nfused
    from h3_turbo.nodes import lora as nlora
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.runtime.ops import install_compute

    if DRY:      # the loader refuses the kernel paths on a CPU: switched as the GPU loader switches them
        m = load_h3_model(files["unet"], "reference", adaln=adaln)
        if compute != "reference":
            install_compute(m, compute, weights=weights)
    else:
        m = load_h3_model(files["unet"], compute, adaln=adaln, weights=weights)
    if style is not None:
        lora = load_torch_file(files[style_file], safe_load=True)
        loader = load_lora_for_models if style == "merged" else load_bypass_lora_for_models
        m = loader(m, None, lora, 1.0, 0)[0]
    m = nlora.H3TurboLoRA.execute(m, files["turbo"], 1.0).args[0]
    if fused:
        m = nfused.H3TurboFusedBlocks.execute(m, "fp8").args[0]
    return m


def inputs(cfg, dev):
    w, h, frames, text = (96, 64, 22, 16) if DRY else (480, 272, 61, 64)
    lt = 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2
    at = round(frames / 24 * 40) if DRY else 67
    g = torch.Generator(device=dev).manual_seed(1)
    x = [torch.randn(1, 24, lt, h // 16, w // 16, device=dev, generator=g),
         torch.randn(1, 32, 2, at, device=dev, generator=g)]
    ctx = torch.randn(1, text, cfg.text_dim, device=dev, generator=g).to(torch.bfloat16)
    return x, ctx, torch.tensor([800.0], device=dev)


def forward(m, x, ctx, t):
    import comfy.model_management as mm
    import comfy.patcher_extension as pe

    mm.load_models_gpu([m] + m.get_nested_additional_models())
    to = pe.copy_nested_dicts(m.model_options.get("transformer_options", {}))
    to["wrappers"] = pe.copy_nested_dicts(m.wrappers)
    to["callbacks"] = pe.copy_nested_dicts(m.callbacks)
    dt = m.model.get_dtype_inference()     # what core's apply_model casts the inputs to
    with torch.inference_mode():
        o = m.model.diffusion_model([v.to(dt) for v in x], t, ctx.to(dt), transformer_options=to)
    sync()
    return [tt.float().cpu() for tt in (o if isinstance(o, (list, tuple)) else [o])]


def main():
    from h3_turbo.harness import boot
    from h3_turbo.kernels import registry
    from h3_turbo.runtime import adaln_lora

    dev = "cpu" if DRY else "cuda"
    nb = int(os.environ.get("NB", 2))
    cfg = h3_config(nb, DRY)
    runner = boot(cpu=DRY)
    import comfy.model_management as mm

    models = tempfile.mkdtemp(prefix="h3style_models_")
    t0 = time.perf_counter()
    files = write_models(models, cfg, dev)
    runner.add_models_dir(models)
    RES.update(nb=nb, write_s=time.perf_counter() - t0, torch=torch.__version__,
               device=torch.cuda.get_device_name() if torch.cuda.is_available() and not DRY else "cpu")
    x, ctx, t = inputs(cfg, dev)
    RES["shape"] = {"video": list(x[0].shape), "audio": list(x[1].shape), "ctx": list(ctx.shape)}
    save()
    only = [c for c in os.environ.get("CASES", "").split(",") if c]
    outs = {}
    for name, (compute, weights, adaln, fused, style, sfile) in CASES.items():
        if only and name not in only:
            continue
        rr = RES["cases"].setdefault(name, {"compute": compute, "weights": weights, "adaln": adaln, "fused": fused,
                                            "style": style, "style_file": sfile})
        log0 = len(RES["log"])
        try:
            if torch.cuda.is_available() and not DRY:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            m = build(files, compute, weights, adaln, fused, style, sfile)
            if adaln == "table":
                keys = adaln_lora.adaln_lora_keys(m)
                rr["adaln_lora_keys"] = len(keys)
                if keys:     # what sampling does first (the OUTER_SAMPLE wrapper): refuse
                    try:
                        adaln_lora.refuse(m, "adaln=table")
                        rr["refused"] = False
                    except Exception as e:  # noqa: BLE001
                        rr["refused"] = True
                        rr["refusal"] = f"{type(e).__name__}: {str(e)[:600]}"
                    rr["pass"] = rr["refused"]
                    continue
            r0 = lora_routes()
            outs[name] = forward(m, x, ctx, t)
            rr["s"] = time.perf_counter() - t0
            rr["lora_routes"] = {k: v - r0.get(k, 0) for k, v in lora_routes().items() if v - r0.get(k, 0)}
            rr["finite"] = all(bool(torch.isfinite(o).all()) for o in outs[name])
            if torch.cuda.is_available() and not DRY:
                rr["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            path_key, sty = name.rsplit("_", 1)
            bound = registry.get(compute).error_bound
            rr["bound"] = bound
            ref = f"reference_{sty}"
            if name != ref and ref in outs:
                rr["err_vs_reference"] = [rel_l2(a, b) for a, b in zip(outs[name], outs[ref])]
                rr["bit_identical_to_reference"] = all(torch.equal(a, b) for a, b in zip(outs[name], outs[ref]))
            own = outs.get(f"{path_key}_none")
            if sty != "none" and own is not None and "reference_none" in outs:
                rr["err_without_style"] = [rel_l2(a, b) for a, b in zip(own, outs["reference_none"])]
            if sty != "none" and ref in outs and "reference_none" in outs:
                rr["style_effect"] = [rel_l2(a, b) for a, b in zip(outs[ref], outs["reference_none"])]
                err = rr.get("err_vs_reference", [0.0])
                rr["pass"] = max(err) < bound and min(rr["style_effect"]) >= 10 * max(err)
        except Exception as e:  # noqa: BLE001
            rr["error"] = f"{type(e).__name__}: {str(e)[:800]}"
            rr["tb"] = traceback.format_exc()[-2000:]
        finally:
            rr["log"] = RES["log"][log0:][:40]
            try:
                mm.unload_all_models()
                mm.soft_empty_cache()
            except Exception:  # noqa: BLE001
                pass
            print(name, json.dumps({k: v for k, v in rr.items() if k not in ("tb", "log")})[:600], flush=True)
            save()
    RES["summary"] = {k: v.get("pass") for k, v in RES["cases"].items()}
    save()
    print(json.dumps(RES["summary"]))


if __name__ == "__main__":
    main()
