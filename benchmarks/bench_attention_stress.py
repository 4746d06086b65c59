"""Every attention backend on every case of the stress corpus (kernels/attention/stress.py): accuracy and time.

Rows (``rows`` of the JSON, one per backend x case x length, saved after every row): ``backend``, ``case``, ``S``,
``rel_l2`` / ``cos_min`` (against float32 attention on 512 evenly spaced query rows x 8 evenly spaced heads:
relative L2 and the minimum per-head cosine), ``ms`` (CUDA events, median), ``x_cudnn`` (ms / cuDNN bf16 SDPA's ms
on the same case and length, in this run). Backends: ``cudnn_bf16`` (the exact backend's choice on Hopper),
``fa3_bf16`` (FlashAttention-3, the ``fa3-fwd`` wheel), ``fa3_fp8`` (its e4m3 path, per-(batch, head) descales) and
``fa3_fp8_rot_smooth`` (after a Hadamard rotation of q / k and K/V token-mean smoothing), ``int8_sage`` (the
override's kernel with its default configuration: q / k balanced per channel and rotated), ``int8_sage_rotate_only``
(rotated, not balanced), ``int8_sage_unrotated`` (neither: the configuration before issue 38, the negative control),
``int8_route`` (the fused block's kernel: ``sage_attention_prequantized`` with e4m3 output as the fused route runs
it, Gluon where it runs, on q / k balanced with the l that ``balance.from_k_amax`` gives for the case: what the route's
norm-weight balance gives when the outlier channels come from the q / k norm weights), ``int8_route_rotate_only`` (the
route when they do not: l = 1), ``int8_route_unrotated`` (neither), ``cudnn_fp8``
(where nvidia-cudnn-frontend imports). Each approximate row also has ``guard``: the per-layer guard's own measure of
that output (``guard.measure``: 256 sampled rows x every head against SDPA) and whether a layer with these inputs keeps
running 8-bit (``runs_8bit``) or runs exact. ``extra``: per length, the guard's check (256 sampled rows x every head:
SDPA on those rows + the measures), the rotation's cost in the K/V pre-kernel, the Q pre-kernel and the fused
producer (``qk_norm_rope_sage``), ROTATE on vs off.

Run (GPU, repo root; ~4 min on an H100):
    python3 benchmarks/bench_attention_stress.py          -> benchmarks/results/attention_stress_<gpu>.json
DRY=1 runs the whole logic on the CPU at tiny shapes (Triton interpreted) -> attention_stress_dry.json.
``OUT`` (default benchmarks/results) changes the folder; ``LENGTHS=19584`` / ``BACKENDS=int8_sage,cudnn_bf16`` run a
part (``cudnn_bf16`` is needed for ``x_cudnn``); ``APPEND=1`` keeps the rows already in the file (those of another
length or backend; a row of the same backend, case and length is replaced); ``TAG`` is appended to the file name. The FA3 wheel: if ``fa3_fwd_interface`` does not import
and ./.whl/fa3_fwd-*.whl exists, it is installed with ``pip install --no-deps`` first (this script only).
"""
import glob
import json
import os
import subprocess
import sys
import time

DRY = os.environ.get("DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from _common import REPO, collect_logs, cuda_median_ms, import_package, q_row_codes  # noqa: E402
from _common import gpu_tag as cuda_gpu_tag  # noqa: E402

import_package()
from h3_turbo.kernels.attention import balance, cudnn_fp8, exact, fa3, guard, int8_kernels as K, stress  # noqa: E402
from h3_turbo.kernels.attention.reference import accuracy, reference_attention  # noqa: E402

DEV = "cpu" if DRY else "cuda"
LENGTHS = tuple(int(x) for x in os.environ["LENGTHS"].split(",")) if os.environ.get("LENGTHS") else \
    ((256,) if DRY else (19584, 37632))
ONLY = set(os.environ["BACKENDS"].split(",")) if os.environ.get("BACKENDS") else None
HEADS, D = (2, 128) if DRY else (56, 128)
SAMPLE_ROWS, SAMPLE_HEADS = (64, 2) if DRY else (512, 8)
OUT = os.environ.get("OUT", os.path.join(REPO, "benchmarks", "results"))


def gpu_tag() -> str:
    return "dry" if DRY else cuda_gpu_tag()


def ensure_fa3(log):
    if DRY or fa3.available() is None:
        return
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "fa3_fwd-*.whl")))
    if wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", wheels[-1]], capture_output=True,
                           text=True)
        log.append(f"pip install --no-deps {os.path.basename(wheels[-1])}: rc {r.returncode} {r.stderr[-300:]}")
        import importlib

        importlib.invalidate_caches()          # the new module is found by this process's import system
        fa3._STATE.clear()
        log.append(f"fa3 after the install: {fa3.available() or 'importable'}")


def timer(fn):
    if DRY:
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    return cuda_median_ms(fn, warmup=3, rep=10)


def route_config(S, rotate):
    c = dict(K.tuned_config(DEV, S), ROTATE=rotate)
    if not DRY:
        try:
            from h3_turbo.runtime import fused_block

            c = fused_block._gluon_config(c, torch.device(DEV), S)
        except Exception as e:  # noqa: BLE001 - the Triton kernel then
            print("route: no Gluon config:", e)
    return c


def backends(S, result):
    """{name: fn(q, k, v) -> [1, H, S, D] output} for this process. The fused route's Q codes (made by its producer,
    timed in ``extra``) and K/V partial statistics are computed once per input (``_prep``), outside the timing."""
    out = {}
    if not DRY:
        out["cudnn_bf16"] = lambda q, k, v: exact.sdpa_with("CUDNN_ATTENTION", q, k, v)
        if fa3.available() is None:
            out["fa3_bf16"] = lambda q, k, v: fa3.attention(q, k, v)
            out["fa3_fp8"] = lambda q, k, v: fa3.attention_fp8(q, k, v)
            out["fa3_fp8_rot_smooth"] = lambda q, k, v: fa3.attention_fp8(q, k, v, rotate=True, smooth=True)
        else:
            result["fa3"] = fa3.available()
    else:
        out["cudnn_bf16"] = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    base = K.tuned_config(DEV, S)
    out["int8_sage"] = lambda q, k, v: K.sage_attention(q, k, v, config=base)
    rot_only = dict(base, BALANCE=False)
    out["int8_sage_rotate_only"] = lambda q, k, v: K.sage_attention(q, k, v, config=rot_only)
    mma = dict(base, ROT_MMA=True)
    out["int8_sage_rot_mma"] = lambda q, k, v: K.sage_attention(q, k, v, config=mma)
    old = dict(base, ROTATE=False, BALANCE=False, Q_ROW=False)
    out["int8_sage_unrotated"] = lambda q, k, v: K.sage_attention(q, k, v, config=old)
    for name, rot, bal in (("int8_route", True, True), ("int8_route_rotate_only", True, False),
                           ("int8_route_unrotated", False, False)):
        c = route_config(S, rot)

        def route(q, k, v, c=c, rot=rot, bal=bal):
            q8, qs, kb, ksum, vamax = _prep(q, k, v, rot, bal)
            o8, sx = K.sage_attention_prequantized(q8, qs, kb, v, ksum, vamax, config=c, out_fp8=True)
            return (o8.float() * sx).view(1, q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)

        out[name] = route
    if DRY or cudnn_fp8.frontend() is not None:
        ov = cudnn_fp8.CudnnFP8Attention(emulate=DRY)

        def cfp8(q, k, v):
            o8, d = ov.attention_fp8(q, k, v)
            return (o8.float() * d).view(1, q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)

        out["cudnn_fp8"] = cfp8
    return {n: f for n, f in out.items() if ONLY is None or n in ONLY}


_PREP: dict = {}


def _prep(q, k, v, rot, bal):
    """(q8, qs, k, ksum, vamax) of the fused route for these tensors (cached for the current case); ``bal``: q x l
    and k / l first (exact in bf16: l a power of two per (head, channel), ``balance.from_k_amax``)."""
    key = (q.data_ptr(), tuple(q.shape), rot, bal)
    if key not in _PREP:
        if bal:
            km = torch.mean(k, dim=2, dtype=torch.float32).reshape(-1, k.shape[-1])
            lam = balance.from_k_amax(balance.k_amax(k, km)).view(1, k.shape[1], 1, k.shape[-1])
            q, k = (q.float() * lam).to(q.dtype), (k.float() / lam).to(k.dtype)
        q8, qs = q_row_codes(q, rotate=rot)
        ksum, vamax = K.kv_partial_stats(k[0].transpose(0, 1), v[0].transpose(0, 1))
        _PREP[key] = (q8, qs, k, ksum, vamax)
    return _PREP[key]


def extra_timings(S, q, k, v):
    """The guard's check and the rotation's cost (ROTATE on / off; the K/V pre-kernel's with BALANCE on / off too)
    of each pre-kernel, ms (``_rot1``: rotation and balance on, the default; ``_rot0``: both off)."""
    e = {}
    g = guard.LayerGuard("bench")
    rows = g.sample(S, q.device)
    o = exact.sdpa_with("CUDNN_ATTENTION", q, k, v) if not DRY else torch.nn.functional.scaled_dot_product_attention(
        q, k, v)
    e["guard_check_ms"] = timer(lambda: guard.measure(o[:, :, rows], q[:, :, rows], k, v))
    for rot in (True, False):
        c = dict(K.tuned_config(DEV, S), ROTATE=rot, BALANCE=rot)
        e[f"quantize_kv_ms_rot{int(rot)}"] = timer(lambda c=c: K.quantize_kv(k, v, c))
        if c["QPRE"]:
            lam = K.quantize_kv(k, v, c)["lam"]
            e[f"quantize_q_ms_rot{int(rot)}"] = timer(lambda c=c, lam=lam: K.quantize_q(q, 1.0, c, lam=lam))
    e["quantize_kv_ms_rot1_bal0"] = timer(lambda: K.quantize_kv(k, v, dict(K.tuned_config(DEV, S), BALANCE=False)))
    # ROT_MMA: the rotation on the tensor cores (standalone K/V pre-kernel; the route's form from partial statistics)
    e["quantize_kv_ms_rot1_mma1"] = timer(lambda: K.quantize_kv(k, v, dict(K.tuned_config(DEV, S), ROT_MMA=True)))
    parts = K.kv_partial_stats(k[0].transpose(0, 1), v[0].transpose(0, 1))
    for rot, mma in ((False, False), (True, False), (True, True)):
        c = dict(route_config(S, rot), ROT_MMA=mma)
        e[f"route_quantize_kv_ms_rot{int(rot)}_mma{int(mma)}"] = timer(lambda c=c: K.quantize_kv(k, v, c, parts=parts))
    try:
        from h3_turbo.kernels import fused as fk

        gen = torch.Generator(device=DEV).manual_seed(0)
        qkv = torch.randn(S, 3 * HEADS * D, device=DEV, generator=gen).to(torch.bfloat16)
        r2 = D * 3 // 8
        ang = torch.randn(S, r2, device=DEV, generator=gen)
        c_, s_ = torch.cos(ang), torch.sin(ang)
        table = torch.stack([c_, -s_, s_, c_], dim=-1).reshape(1, S, 1, r2, 2, 2)
        w = torch.ones(D, device=DEV, dtype=torch.bfloat16)
        for rot in (True, False):
            e[f"qk_norm_rope_sage_ms_rot{int(rot)}"] = timer(
                lambda rot=rot: fk.qk_norm_rope_sage(qkv.clone(), HEADS, D, table, w, w, 1e-6, rotate=rot))
        # the fused route's form: rotation and the q / k balance in the launch (against _rot1: the balance's cost)
        e["qk_norm_rope_sage_ms_rot1_bal1"] = timer(
            lambda: fk.qk_norm_rope_sage(qkv.clone(), HEADS, D, table, w, w, 1e-6, rotate=True, balance=True))
        e["qk_norm_rope_sage_ms_rot1_bal1_mma1"] = timer(
            lambda: fk.qk_norm_rope_sage(qkv.clone(), HEADS, D, table, w, w, 1e-6, rotate=True, balance=True,
                                         rot_mma=True))
        e["qkv_clone_ms"] = timer(lambda: qkv.clone())
    except Exception as ex:  # noqa: BLE001
        e["qk_norm_rope_sage_error"] = f"{type(ex).__name__}: {ex}"
    return e


def fns_names() -> list:
    """The backend names this run may write (:func:`backends`' keys, for APPEND)."""
    names = ["cudnn_bf16", "fa3_bf16", "fa3_fp8", "fa3_fp8_rot_smooth", "int8_sage", "int8_sage_rotate_only",
             "int8_sage_rot_mma", "int8_sage_unrotated", "int8_route", "int8_route_rotate_only", "int8_route_unrotated", "cudnn_fp8"]
    return [n for n in names if ONLY is None or n in ONLY]


def main():
    logs = []
    collect_logs(logs)
    os.makedirs(OUT, exist_ok=True)
    ensure_fa3(logs)
    tag = gpu_tag()
    path = os.path.join(OUT, f"attention_stress_{tag}{os.environ.get('TAG', '')}.json")
    result = {"gpu": "cpu (DRY)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
              "heads": HEADS, "head_dim": D, "sample": [SAMPLE_ROWS, SAMPLE_HEADS], "rows": [], "extra": {},
              "log": logs}

    if os.environ.get("APPEND") == "1" and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        done = {(b, c, s) for b in fns_names() for c in stress.CASES for s in LENGTHS}
        result["rows"] = [r for r in old.get("rows", []) if (r["backend"], r["case"], r["S"]) not in done]
        result["extra"] = {k: v for k, v in old.get("extra", {}).items() if int(k) not in LENGTHS}
        result["log"].extend(old.get("log", [])[-50:])

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    t0 = time.time()
    for S in LENGTHS:
        fns = backends(S, result)
        rows = torch.linspace(0, S - 1, SAMPLE_ROWS, device=DEV).round().long()
        heads = torch.linspace(0, HEADS - 1, SAMPLE_HEADS, device=DEV).round().long()
        for case in stress.CASES:
            q, k, v = stress.bhld(*stress.make(case, S, HEADS, D, seed=0, device=DEV))
            ref = reference_attention(q, k, v, rows=rows, heads=heads)
            base_ms = None
            for name, fn in fns.items():
                row = {"backend": name, "case": case, "S": S}
                try:
                    o = fn(q, k, v)
                    acc = accuracy(o[0, heads][:, rows].float(), ref)
                    if name != "cudnn_bf16":    # what the per-layer guard decides for a layer with these inputs
                        gr = guard.sample_rows(S, device=q.device)
                        gc, gl = guard.measure(o[:, :, gr].to(q.dtype), q[:, :, gr], k, v)
                        row["guard"] = {"cos_min": gc, "rel_l2": gl,
                                        "runs_8bit": gc >= guard.COS_MIN and gl <= guard.REL_L2_MAX}
                    del o
                    row.update(rel_l2=acc["rel_l2"], cos_min=acc["cos_min"], ms=timer(lambda fn=fn: fn(q, k, v)))
                    if name == "cudnn_bf16":
                        base_ms = row["ms"]
                    row["x_cudnn"] = row["ms"] / base_ms if base_ms else None
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                result["rows"].append(row)
                save()
                print(json.dumps(row), f"t={time.time() - t0:.0f}s", flush=True)
            if case == "rand":
                result["extra"][str(S)] = extra_timings(S, q, k, v)
                save()
                print(S, result["extra"][str(S)], flush=True)
            _PREP.clear()
            del q, k, v, ref
            if not DRY:
                torch.cuda.empty_cache()
    result["seconds"] = time.time() - t0
    save()
    print("wrote", path)


if __name__ == "__main__":
    main()
