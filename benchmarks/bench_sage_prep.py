"""The fused route's ``int8_sage`` pre-passes on one GPU, launch settings swept (issue 21): what runs between the qkv
GEMM and the attention kernel in a fused DiT block.

1. ``rope``: ``qk_norm_rope_sage``'s launch as the route runs it (``SETTINGS["sage_stats"]`` "pass": q -> INT8 per
   (row, head) + scales, k normed and rotated in place, no statistics) for each (``rope_rows``, ``rope_warps``,
   ``rope_prefetch``);
   its outputs (q8, qs, k) compared bit for bit with the first variant's (another tile layout may round the
   row's sum of squares differently).
2. ``stats``: ``kv_partial_stats`` (k column sums, max |v| over R row ranges) for each (parts, block_l, warps), and
   ``quantize_kv`` from those partials in the fused route's configuration (the Gluon kernel's layout on Hopper:
   ``gluon_layout``): reduced by every key-block program, per parts and warps, and reduced once per head by a small
   launch (``ms_quantize_kv_once``, the route's default); all outputs compared bit for bit:
   ``quantize_kv_warps_same_bits``.

S rows (default 19 077 = the 960x544x124 joint tokens), 56 x 128 heads, core's rope table layout (48 rotated
pairs). CUDA-event medians (``_common.cuda_median_ms``, 100 calls after 10); GB/s from the bytes each pass must
move. Env: OUT (default benchmarks/results), TAG (default sage_prep_h200), ROWS, PARTS (default "rope,stats"), DRY=1 (CPU under
TRITON_INTERPRET=1, tiny shapes: checks the script; timings meaningless). Saves ``$OUT/$TAG.json`` after every step.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

DRY = bool(os.environ.get("DRY"))
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"       # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_median_ms, import_package  # noqa: E402

import_package()
from h3_turbo.kernels import fused as fk  # noqa: E402
from h3_turbo.kernels.attention import int8_kernels as K  # noqa: E402
from h3_turbo.runtime.fused_block import _gluon_config  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not DRY else "cpu"
OUT = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
TAG = os.environ.get("TAG", "sage_prep_h200")
S = int(os.environ.get("ROWS", 45 if DRY else 19077))
HEADS, HD, R2 = (3, 128, 48) if DRY else (56, 128, 48)
RES: dict = {"env": {"rows": S, "heads": HEADS, "head_dim": HD, "rot_pairs": R2}, "rope": {}, "stats": {},
             "errors": []}
T0 = time.perf_counter()
ROPE = ((8, 4, False), (4, 2, False), (8, 4, True), (4, 2, True), (16, 4, True), (8, 8, True), (4, 4, True),
        (2, 2, True))
PARTS = os.environ.get("PARTS", "rope,stats").split(",")
STATS = ((16, 32, 4), (16, 64, 4), (16, 16, 4), (32, 32, 4), (64, 32, 4), (32, 64, 8), (8, 64, 8), (16, 64, 8))
QKV_WARPS = (4, 8)


def bench(fn):
    if DRY:
        fn()
        return 0.0
    return cuda_median_ms(fn, warmup=10, rep=100)


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    RES["elapsed_s"] = round(time.perf_counter() - T0, 1)
    (OUT / f"{TAG}.json").write_text(json.dumps(RES, indent=1, default=str))


def problem():
    g = torch.Generator(device=DEV).manual_seed(0)
    qkv = (torch.randn(S, 3 * HEADS * HD, device=DEV, generator=g) * 3.0).to(torch.bfloat16)
    ang = torch.randn(S, R2, device=DEV, generator=g) * 4.0
    c, sn = torch.cos(ang), torch.sin(ang)
    table = torch.stack([c, -sn, sn, c], dim=-1).reshape(1, S, 1, R2, 2, 2).to(torch.bfloat16)
    qw = (1 + 0.2 * torch.randn(HD, device=DEV, generator=g)).to(torch.bfloat16)
    kw = (1 + 0.2 * torch.randn(HD, device=DEV, generator=g)).to(torch.bfloat16)
    return qkv, table, qw, kw


def rope_part(qkv0, table, qw, kw):
    inner = HEADS * HD
    gb = S * inner * (2 + 2 + 2 + 1) / 1e9 + S * HEADS * 4 / 1e9   # q, k read; k written; q8 written; qs
    RES["rope"]["gb_min"] = gb
    first = None
    before = dict(fk.SETTINGS)
    for rows, warps, prefetch in ROPE:
        tag = f"rows{rows}_warps{warps}" + ("_prefetch" if prefetch else "")
        try:
            fk.SETTINGS.update(rope_rows=rows, rope_warps=warps, rope_prefetch=prefetch)
            b = qkv0.clone()
            q8 = torch.empty(S, HEADS, HD, device=DEV, dtype=torch.int8)
            qs = torch.empty(S, HEADS, device=DEV)

            def launch():
                fk._qk_rope_launch(b, HEADS, HD, table, qw, kw, 1e-6, b, (q8, qs, b, b), False)

            launch()                        # k rotated once: the outputs to compare
            got = (q8.clone(), qs.clone(), b[:, inner:2 * inner].clone())
            b.copy_(qkv0)
            ms = bench(launch)              # k keeps being re-normed in place: the same work per call
            r = {"ms": ms, "gbps": gb / ms * 1e3 if ms else None}
            if first is None:
                first = got
            else:
                r["q8_equal"] = bool(torch.equal(got[0], first[0]))
                r["qs_equal"] = bool(torch.equal(got[1], first[1]))
                r["k_equal"] = bool(torch.equal(got[2], first[2]))
            RES["rope"][tag] = r
        except Exception as e:      # noqa: BLE001 - one variant failing must not lose the others
            RES["errors"].append(f"rope {tag}: {type(e).__name__}: {e}")
            traceback.print_exc()
        finally:
            fk.SETTINGS.update(before)
        save()


def stats_part(qkv0):
    inner = HEADS * HD
    kc = qkv0[:, inner:2 * inner].view(S, HEADS, HD)
    vc = qkv0[:, 2 * inner:].view(S, HEADS, HD)
    view = lambda t: t.transpose(0, 1).unsqueeze(0)      # noqa: E731  [1, H, S, D]
    # the fused route's Gluon choice for S tokens on the tuned configuration (on Hopper the warp-specialized kernel
    # and its V layout, keys permuted per 32: what run 2 measured; elsewhere, as under DRY, the Triton kernel's)
    cfg = _gluon_config(K.tuned_config(DEV, S), DEV, S)
    RES["stats"]["gluon_layout"] = bool(cfg["GLUON"])
    RES["stats"]["gb_min_stats"] = 2 * S * inner * 2 / 1e9
    RES["stats"]["gb_min_quantize_kv"] = 2 * S * inner * 3 / 1e9
    first = None
    for parts, block_l, warps in STATS:
        tag = f"parts{parts}_block{block_l}_warps{warps}"
        try:
            ms = bench(lambda: K.kv_partial_stats(kc, vc, parts=parts, block_l=block_l, num_warps=warps))
            ks, va = K.kv_partial_stats(kc, vc, parts=parts, block_l=block_l, num_warps=warps)
            tot = (ks.double().sum(0), va.amax(0))
            r = {"ms": ms, "gbps": RES["stats"]["gb_min_stats"] / ms * 1e3 if ms else None, "partials": ks.shape[0]}
            if first is None:
                first = tot
            else:
                r["ksum_max_rel"] = float(((tot[0] - first[0]).abs() / first[0].abs().clamp_min(1e-30)).max())
                r["vamax_equal"] = bool(torch.equal(tot[1], first[1]))
            outs = {}
            for qw_ in QKV_WARPS:
                run = lambda: K.quantize_kv(view(kc), view(vc), cfg, parts=(ks, va), num_warps=qw_,  # noqa: E731
                                            reduce_once=False)
                r[f"ms_quantize_kv_warps{qw_}"] = bench(run)
                outs[qw_] = run()
            # the partials reduced once per head by a small launch (the route's default) instead of per program
            once = lambda: K.quantize_kv(view(kc), view(vc), cfg, parts=(ks, va))       # noqa: E731
            r["ms_quantize_kv_once"] = bench(once)
            outs["once"] = once()
            # the launch's warps and the reduce-once launch change no bit (every reduction is a max or in a fixed order)
            bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t      # noqa: E731  (e4m3: no equal)
            r["quantize_kv_warps_same_bits"] = all(torch.equal(bits(o[n]), bits(outs[QKV_WARPS[0]][n]))
                                                   for o in outs.values()
                                                   for n in ("k8", "ks", "vq", "km", "vinv", "vs", "hmax"))
            RES["stats"][tag] = r
        except Exception as e:      # noqa: BLE001
            RES["errors"].append(f"stats {tag}: {type(e).__name__}: {e}")
            traceback.print_exc()
        save()


def main():
    RES["env"].update(torch=torch.__version__, device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                      dry=DRY)
    qkv0, table, qw, kw = problem()
    if "rope" in PARTS:
        rope_part(qkv0, table, qw, kw)
    if "stats" in PARTS:
        stats_part(qkv0)
    save()
    print(json.dumps({k: RES[k] for k in ("rope", "stats", "errors")}, indent=1, default=str)[-6000:])
    print("errors:", len(RES["errors"]))


if __name__ == "__main__":
    main()
