"""``adaln=table``'s first-run pass over the AdaLN weights at H3's real sizes: today's per-module synchronous copy
(``plain``) against the streamed pass (``streamed``: pinned staging ring, side stream, upload overlapped with compute;
``runtime/adaln_memo.py`` ``streamed_rows``). docs/memory.md, "The streamed pass".

The weights: core's own ``TimeEmbedder`` (256 -> 5376 -> 2688, fp32) and ``AdalnProj`` of 50 DiT blocks
(2688 -> 6 x 3 x 5376) and of the final layer (2688 -> 2 x 5376), built with the pack's operations as the loader
builds them (``runtime.ops.make_operations``; bf16 projections, the compute dtype of an NVFP4 H3 on the GPU), in
pageable CPU memory (26.1 GB = 24.3 GiB), held by an ``adaln_memo.Memo`` as ``adaln=table`` holds them. Each tensor
has its own random values: drawn on the GPU and copied into a fresh CPU tensor (a few seconds for all of them; no
CPU random generator over 13 G elements).

Steps, in this order (the JSON is rewritten after each; a warm-up first runs the time embedder, one block and the
final layer through the plain pass):
1. ``turbo4``: the groups H3 Turbo Sampler predicts for the Turbo 4-step contract (``adaln.timestep_groups`` of
   ``4step``, conditioned and not, on the device): streamed (``turbo4_streamed_cold``: the process's first pinned
   allocation included, as in a real first run), then plain.
2. ``probe``: bandwidths behind the passes: pageable -> pinned host copy (torch's threaded ``copy_``), pinned ->
   device, pageable -> device (what ``plain`` does per module), and one block's weight page-locked in place for its
   copy (``cudaHostRegister``, async copy, unregister: an alternative to the staging copy, measured only);
   medians of 5 staging-sized / one-block copies.
3. ``turbo4`` streamed twice more (``warm1``, ``warm2``: the pinned staging cached by torch).
4. ``off8``: the groups the sampling wrapper predicts for core's samplers on an 8-step 12/3 grid without Turbo
   (``adaln_memo.predict_groups``): plain, then streamed.
5. ``sweep``: the streamed pass on the turbo4 groups with other staging sizes / buffer counts, while the deadline
   allows.
Every streamed pass's rows are checked ``torch.equal`` against the plain pass's (``equal``); a pass reports seconds
(the rows back in CPU memory), GB/s (AdaLN bytes / seconds), the peak device memory, and whether it meets the
issue's target (``<= 1.6 s`` for the whole pass).

Env: COMFYUI_PATH (ComfyUI tree: core's modules and its ``time_shift_sigma`` for the predictions), OUT (result
folder, default benchmarks/results), DRY=1 (CPU, tiny widths and staging: the whole logic in seconds; the CPU form
of the streamed pass has no pinning or streams), DEADLINE (s from start, default 140: the sweep stops starting
passes before it), BLOCKS (DiT blocks, default 50). Writes $OUT/adaln_pass_<gpu>.json (<gpu>: h100, h200, ... from
the device name; ``dry`` for DRY).

Run (GPU, after the ComfyUI setup of benchmarks/README.md "How to rerun"; the build and 14 passes, the sweep bounded
by DEADLINE):
``OUT=benchmarks/results timeout 200 python3 benchmarks/bench_adaln_pass.py`` (exit 1 when a streamed pass's rows
differ from the plain pass's or a streamed pass fell back); CPU check:
``DRY=1 OUT=/tmp/dry COMFYUI_PATH=$HOME/ComfyUI python benchmarks/bench_adaln_pass.py``.
"""
import json
import os
import re
import sys
import time
from types import SimpleNamespace

T0 = time.perf_counter()
DRY = bool(os.environ.get("DRY"))
OUT = os.environ.get("OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
DEADLINE = float(os.environ.get("DEADLINE", "140"))
os.makedirs(OUT, exist_ok=True)
RES: dict = {"dry": DRY, "errors": {}, "log": [], "env": {}, "weights": {}, "probe": {}, "passes": {}}
NAME = ["adaln_pass_dry.json"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import _common  # noqa: E402  (benchmarks/_common.py)

_common.collect_logs(RES["log"], 400)
_common.import_package()
if os.environ.get("COMFYUI_PATH"):
    from h3_turbo.harness import comfyui_first_on_path  # noqa: E402

    comfyui_first_on_path(os.environ["COMFYUI_PATH"])
from comfy.cli_args import args as _comfy_args  # noqa: E402  (before comfy.model_management is imported)

_comfy_args.cpu = DRY

from h3_turbo.runtime import adaln as A  # noqa: E402
from h3_turbo.runtime import adaln_memo as M  # noqa: E402

CUDA = torch.cuda.is_available() and not DRY
DEV = torch.device("cuda" if CUDA else "cpu")
BLOCKS = int(os.environ.get("BLOCKS", "50"))
# hidden, time embedder (freq, hidden, out): H3's (formats/detect.py H3Sizes, core's MiniMaxH3Model defaults)
HID, FREQ, THID, TDIM = (64, 32, 64, 32) if DRY else (5376, 256, 5376, 2688)
STAGING = (4096, 3) if DRY else (M.STAGING_BYTES, M.STAGING_BUFFERS)
SWEEP = [(1536, 2), (65536, 4)] if DRY else [(128 << 20, 3), (32 << 20, 3), (256 << 20, 2), (64 << 20, 2),
                                              (64 << 20, 4)]
TARGET_S = 1.6


def now() -> float:
    return time.perf_counter() - T0


def save():
    RES["elapsed_s"] = round(now(), 2)
    with open(os.path.join(OUT, NAME[0]), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def build():
    """(memo, AdaLN bytes, compute dtype): core's modules with the loader's operations, random weights in CPU
    memory, one fresh CPU tensor per weight."""
    from comfy.ldm.minimax.model import AdalnProj, TimeEmbedder

    from h3_turbo.runtime.ops import make_operations

    ops = make_operations(DEV)
    dtype = torch.bfloat16 if CUDA else torch.float32
    gen = torch.Generator(device=DEV).manual_seed(0)

    def load(mod, shapes: dict, wdtype):
        """The ops' Linear makes its weight at load time (core's loader: load_state_dict): a fresh CPU tensor
        per key, random values drawn on the device."""
        sd = {}
        for k, shape in shapes.items():
            w = torch.empty(shape, dtype=wdtype)
            w.copy_(torch.randn(shape, device=DEV, generator=gen, dtype=wdtype).mul_(0.02))
            sd[k] = w
        mod.load_state_dict(sd)
        return mod

    def proj(expand, modalities):
        out = expand * modalities * HID
        return load(AdalnProj(TDIM, HID, expand, modalities, dtype=dtype, operations=ops),
                    {"linear.weight": (out, TDIM), "linear.bias": (out,)}, dtype)

    with torch.no_grad():
        te = load(TimeEmbedder(FREQ, THID, TDIM, dtype=torch.float32, operations=ops),
                  {"proj_in.weight": (THID, FREQ), "proj_in.bias": (THID,), "proj_out.weight": (TDIM, THID),
                   "proj_out.bias": (TDIM,)}, torch.float32)
        blocks = [proj(6, 3) for _ in range(BLOCKS)]
        final = proj(2, 1)
    memo = M.Memo(te, blocks, final, "bench")
    n = sum(t.numel() * t.element_size() for m in M._order(memo._mods.modules) for t in M._tensors_of(m).values())
    assert all(t.device.type == "cpu" for m in M._order(memo._mods.modules) for t in M._tensors_of(m).values())
    return memo, n, dtype


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for (ba, fa), (bb, fb) in zip(a, b) for x, y in list(zip(ba, bb)) + [(fa, fb)])


def timed(memo, groups, dtype, mode, staging=None):
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    sync()
    t = time.perf_counter()
    rows = memo.compute(groups, dtype, mode=mode, staging=staging)
    sync()
    dt = time.perf_counter() - t
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if CUDA else None
    return rows, dt, peak


def record(key, nbytes, dt, peak, rows_ref=None, rows=None, staging=None, memo=None):
    r = {"s": round(dt, 4), "GB_per_s": round(nbytes / 1e9 / dt, 2), "peak_device_GB": None if peak is None
         else round(peak, 3), "meets_target": dt <= TARGET_S}
    if staging is not None:
        r["staging"] = {"bytes": staging[0], "buffers": staging[1]}
        r["streamed"] = bool(memo.stream_ok)    # False: it failed and ran plain (see the log)
    if rows is not None and rows_ref is not None:
        r["equal"] = same(rows, rows_ref)
    RES["passes"][key] = r
    print(f"[{now():6.1f}s] {key}: {dt:.3f} s, {r['GB_per_s']} GB/s" + (f", equal={r.get('equal')}"
                                                                          if "equal" in r else ""), flush=True)
    save()


def probe(memo):
    """Bandwidths of the pieces (median of 5): host pageable -> pinned copy, pinned -> device, pageable -> device."""
    w = memo._mods.modules["blocks"][0].linear.weight.detach()
    src = w.reshape(-1).view(torch.uint8)
    n = min(src.numel(), STAGING[0])
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=CUDA)

    def med(fn, nbytes):
        ts = []
        for _ in range(5):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return round(nbytes / 1e9 / sorted(ts)[2], 2)

    RES["probe"]["host_to_pinned_GB_per_s"] = med(lambda: buf.copy_(src[:n]), n)
    RES["probe"]["host_copy_bytes"] = n
    RES["probe"]["torch_threads"] = torch.get_num_threads()
    if CUDA:
        dst = torch.empty(n, dtype=torch.uint8, device=DEV)
        RES["probe"]["pinned_to_device_GB_per_s"] = med(lambda: dst.copy_(buf, non_blocking=True), n)
        RES["probe"]["pageable_to_device_GB_per_s"] = med(lambda: w.to(DEV, copy=True), w.numel() * w.element_size())
        del dst
        # an alternative to the staging copy: page-lock one block's weight in place for its upload (register,
        # async copy, unregister); measured here only
        try:
            rt = torch.cuda.cudart()
            nb = w.numel() * w.element_size()
            dst = torch.empty(nb, dtype=torch.uint8, device=DEV)

            def registered():
                assert int(rt.cudaHostRegister(w.data_ptr(), nb, 0)) == 0, "cudaHostRegister failed"
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                assert int(rt.cudaHostUnregister(w.data_ptr())) == 0, "cudaHostUnregister failed"

            RES["probe"]["register_copy_unregister_GB_per_s"] = med(registered, nb)
            del dst
        except Exception as e:  # noqa: BLE001
            RES["errors"]["probe_register"] = f"{type(e).__name__}: {e}"
    save()


def main():
    if CUDA:
        gpu = torch.cuda.get_device_name()
        m = re.search(r"(H100|H200|A100|L40S|B200|RTX \d+|[A-Z]\d+)", gpu)
        NAME[0] = f"adaln_pass_{(m.group(1) if m else 'gpu').lower().replace(' ', '')}.json"
        RES["env"]["gpu"] = gpu
    RES["env"].update(torch=torch.__version__, cpu_count=os.cpu_count(), blocks=BLOCKS, hidden=HID,
                      staging_default={"bytes": STAGING[0], "buffers": STAGING[1]}, target_pass_s=TARGET_S)
    save()
    t = time.perf_counter()
    memo, nbytes, dtype = build()
    mods = memo._mods.modules
    RES["weights"] = {"bytes": nbytes, "GiB": round(nbytes / 2**30, 2), "dtype": str(dtype),
                      "build_s": round(time.perf_counter() - t, 2),
                      "shapes": {k: {n: [list(v.shape), str(v.dtype)] for n, v in M._tensors_of(m).items()}
                                 for k, m in (("time_embedder", mods["te"]), ("block", mods["blocks"][0]),
                                              ("final", mods["final"]))}}
    print(f"[{now():6.1f}s] built {nbytes / 2**30:.2f} GiB of AdaLN weights", flush=True)
    save()

    from h3_turbo.samplers.schedules import shifted_grid

    groups = {"turbo4": A.timestep_groups(A.SCHEDULES["4step"], device=DEV),
              "off8": M.predict_groups(shifted_grid(8, 12.0, torch.float32), {},
                                       SimpleNamespace(sigma_shift_video=12.0, sigma_shift_audio=3.0), DEV)}
    RES["groups"] = {k: {"groups": len(g), "rows": sum(map(len, g))} for k, g in groups.items()}
    tens = {k: [torch.tensor(x, dtype=torch.float32, device=DEV) for x in g] for k, g in groups.items()}

    # warm-up: cuBLAS handles and these GEMM shapes, on the time embedder, one block and the final layer
    M.plain_rows({"te": mods["te"], "blocks": mods["blocks"][:1], "final": mods["final"]}, tens["turbo4"][:1], dtype)

    cold, dt, peak = timed(memo, tens["turbo4"], dtype, "streamed", STAGING)   # before any pinned allocation
    ref, dtp, peakp = timed(memo, tens["turbo4"], dtype, "plain")
    record("turbo4_plain", nbytes, dtp, peakp)
    record("turbo4_streamed_cold", nbytes, dt, peak, ref, cold, STAGING, memo)
    del cold
    probe(memo)
    for i in (1, 2):
        rows, dt, peak = timed(memo, tens["turbo4"], dtype, "streamed", STAGING)
        record(f"turbo4_streamed_warm{i}", nbytes, dt, peak, ref, rows, STAGING, memo)
        del rows

    ref8, dtp, peakp = timed(memo, tens["off8"], dtype, "plain")
    record("off8_plain", nbytes, dtp, peakp)
    rows, dt, peak = timed(memo, tens["off8"], dtype, "streamed", STAGING)
    record("off8_streamed", nbytes, dt, peak, ref8, rows, STAGING, memo)
    del rows, ref8

    last = dt
    for st in SWEEP:
        if now() + 1.5 * last + 2 > DEADLINE:
            RES["errors"]["sweep"] = f"stopped before {st} at {now():.0f} s (DEADLINE {DEADLINE:.0f} s)"
            save()
            break
        rows, last, peak = timed(memo, tens["turbo4"], dtype, "streamed", st)
        size = f"{st[0] >> 20}MiB" if st[0] >= 1 << 20 else f"{st[0]}B"
        record(f"turbo4_streamed_{size}x{st[1]}", nbytes, last, peak, ref, rows, st, memo)
        del rows
    streamed = {k: v for k, v in RES["passes"].items() if "staging" in v}
    RES["summary"] = {
        "all_equal": all(v.get("equal") for v in streamed.values()),
        "all_streamed": all(v.get("streamed") for v in streamed.values()),
        "turbo4_plain_s": RES["passes"]["turbo4_plain"]["s"],
        "turbo4_streamed_best_s": min(v["s"] for k, v in streamed.items() if k.startswith("turbo4")),
        "turbo4_streamed_default_warm_s": RES["passes"]["turbo4_streamed_warm2"]["s"],
        "off8_plain_s": RES["passes"]["off8_plain"]["s"], "off8_streamed_s": RES["passes"]["off8_streamed"]["s"]}
    save()
    print(json.dumps(RES["summary"]), flush=True)
    if not (RES["summary"]["all_equal"] and RES["summary"]["all_streamed"]):
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except Exception:  # kept in the JSON, then raised
        import traceback

        RES["errors"]["main"] = traceback.format_exc()[-3000:]
        save()
        raise
