"""Where the Gluon ``int8_sage`` kernels' time goes: each kernel (the 4-warp ``gluon_m64`` and the warp-specialized
``gluon_ws``) timed with one part of its softmax replaced by a cheaper, WRONG stand-in, on the same inputs
(960x544x124: 19 584 tokens, 56 heads x 128). The outputs of the stand-ins are meaningless; only their time is kept.

Variants: ``base``; ``tree_max`` (the row max as a tree of independent maxima per thread, ``_row_max``, instead of
``gl.max``'s one dependent chain: the same bits); ``exp_fma2`` / ``exp_fma4`` (a half / a quarter of the exponentials on the FMA pipe, FlashAttention-4's
exp2 emulation: right outputs within the polynomial's 7.5e-5, their bytes compared with ``base``); ``no_cvt`` (P's f32 -> e4m3 conversion, two ``cvt.rn.satfinite.e4m3x2.f32`` per 4 values,
replaced by three byte permutes); ``no_exp`` (``exp2(arg)`` of the scores replaced by one multiply); ``no_exp_cvt``
(both); ``no_rescale`` (O's rescale by alpha dropped); ``no_max`` (the row max over the block dropped).
The time a stand-in saves bounds what making that part cheaper could buy.

Env: OUT (default benchmarks/results), TAG (default ablate_attention_gluon_h200), L (default 19584), ONLY (variants),
KERNELS (default m64,ws2), REP (timed calls, default 40; 1 under a profiler), DRY=1 (CPU: build the variant sources
only). Saves ``$OUT/$TAG.json`` after every variant.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cuda_median_ms, h3_qkv, import_package, q_row_codes  # noqa: E402

import_package()
from h3_turbo.kernels.attention import int8_kernels as K  # noqa: E402

DRY = bool(os.environ.get("DRY"))
OUT = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
TAG = os.environ.get("TAG", "ablate_attention_gluon_h200")
L = int(os.environ.get("L", 19584))
SRC = Path(K.__file__).with_name("int8_gluon.py").read_text()
CVT = ('"{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "\n'
       '            "mov.b32 $0, {lo, hi}; }"')
EXP = "return gl.exp2(arg), gl.exp2(m_i - m_new), m_new"
RESCALE = "acc = acc * gl.expand_dims(alpha_o, 1)"
MAX = "m_new = gl.maximum(m_i, gl.max(x, 1) * c + off)"
SOFTMAX_DEF = "    @gluon.jit\n    def _softmax_block("
# 2^x on the FMA pipe for a share of the scores (FlashAttention-4's exp2 emulation): x = j + f with j the nearest
# integer (the 1.5 * 2^23 rounding trick), f in [-0.5, 0.5], 2^f by a degree-3 polynomial (relative error 7.5e-5, fitted
# here), j added to the exponent bits; x clamped at -100 (2^-100 is 0 in e4m3, and the exponent cannot wrap)
EXP_FMA = '''    @gluon.jit
    def _exp2_fma(x):
        x = gl.maximum(x, -100.0)
        t = x + 12582912.0
        f = x - (t - 12582912.0)
        p = ((0.0551716573536396 * f + 0.2426111400127411) * f + 0.6932609677314758) * f + 0.9999280571937561
        return (p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)).to(gl.float32, bitcast=True)

    @gluon.jit
    def _exp2_half(arg):
        BM: gl.constexpr = arg.shape[0]
        BN: gl.constexpr = arg.shape[1]
        a, b = gl.split(gl.reshape(arg, [BM, BN // 2, 2]))
        return gl.reshape(gl.join(gl.exp2(a), _exp2_fma(b)), [BM, BN])

    @gluon.jit
    def _exp2_quarter(arg):
        BM: gl.constexpr = arg.shape[0]
        BN: gl.constexpr = arg.shape[1]
        a, b = gl.split(gl.reshape(arg, [BM, BN // 2, 2]))
        b = gl.permute(gl.reshape(b, [BM, BN // 16, 2, 4]), [0, 1, 3, 2])
        b0, b1 = gl.split(gl.reshape(b, [BM, BN // 4, 2]))
        b = gl.reshape(gl.join(gl.exp2(b0), _exp2_fma(b1)), [BM, BN // 16, 4, 2])
        b = gl.reshape(gl.permute(b, [0, 1, 3, 2]), [BM, BN // 2])
        b = gl.convert_layout(b, a.type.layout, assert_trivial=True)
        return gl.reshape(gl.join(gl.exp2(a), b), [BM, BN])

'''
STANDIN = {
    CVT: '"{ .reg .b32 t, u; prmt.b32 t, $1, $2, 0x7531; prmt.b32 u, $3, $4, 0x7531; prmt.b32 $0, t, u, 0x5410; }"',
    EXP: "return arg * 1.0001, gl.exp2(m_i - m_new), m_new",
    RESCALE: "acc = acc",
    MAX: "m_new = gl.maximum(m_i, off)",
}
ROW_MAX = '''    @gluon.jit
    def _row_max(x, row_layout: gl.constexpr):
        """max over axis 1 of ``x`` [BLOCK_M, BLOCK_N] in the scores' wgmma layout, as a tree: within each thread over
        the (e, i) pairs of its columns c = 16h + 8i + 2t + e (independent maxima), then over h, then across the
        quad (t). ``gl.max(x, 1)`` folds each thread's 32 values of a row in one dependent chain; the result is the
        same (max is exact in any order)."""
        BLOCK_M: gl.constexpr = x.shape[0]
        BLOCK_N: gl.constexpr = x.shape[1]
        y = gl.reshape(x, [BLOCK_M, BLOCK_N // 16, 2, 4, 2])
        y = gl.max(y, 4)
        y = gl.max(y, 2)
        y = gl.max(y, 1)
        y = gl.max(y, 1)
        return gl.convert_layout(y, row_layout, assert_trivial=True)

'''
# real alternatives (right outputs, other instructions): the row max as a tree (the same bits), and a half or
# a quarter of the exponentials on the FMA pipe
ALT = {
    "tree_max": {SOFTMAX_DEF: ROW_MAX + SOFTMAX_DEF,
                 MAX: "m_new = gl.maximum(m_i, _row_max(x, gl.SliceLayout(1, x.type.layout)) * c + off)"},
    "exp_fma2": {SOFTMAX_DEF: EXP_FMA + SOFTMAX_DEF, EXP: "return _exp2_half(arg), gl.exp2(m_i - m_new), m_new"},
    "exp_fma4": {SOFTMAX_DEF: EXP_FMA + SOFTMAX_DEF, EXP: "return _exp2_quarter(arg), gl.exp2(m_i - m_new), m_new"},
}
VARIANTS = {"base": [], "no_cvt": [CVT], "no_exp": [EXP], "no_exp_cvt": [EXP, CVT], "no_rescale": [RESCALE],
            "no_max": [MAX], "tree_max": ["tree_max"], "exp_fma2": ["exp_fma2"], "exp_fma4": ["exp_fma4"]}
ONLY = [x for x in os.environ.get("ONLY", "").split(",") if x]          # variants, e.g. base (for a profiler run)
KERNELS = [x for x in os.environ.get("KERNELS", "m64,ws2").split(",") if x]
REP = int(os.environ.get("REP", 40))
RES: dict = {"env": {}, "L": L, "variants": {}, "errors": []}


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{TAG}.json").write_text(json.dumps(RES, indent=1, default=str))


def variant_module(name, pieces, folder):
    src = SRC
    subs = [kv for p in pieces for kv in (ALT[p].items() if p in ALT else [(p, STANDIN[p])])]
    for p, new in subs:
        if p not in src:
            raise RuntimeError(f"variant {name}: the piece {p[:60]!r} is not in int8_gluon.py")
        src = src.replace(p, new, 1)
    path = Path(folder) / f"int8_gluon_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"int8_gluon_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    import triton

    RES["env"] = {"torch": torch.__version__, "triton": triton.__version__, "dry": DRY,
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not DRY else None}
    folder = tempfile.mkdtemp(prefix="ablate_gluon_")
    mods = {name: variant_module(name, pieces, folder) for name, pieces in VARIANTS.items()
            if not ONLY or name in ONLY}
    if DRY:
        RES["dry"] = f"built {len(mods)} variant modules"
        save()
        print(RES["dry"])
        return
    dev, H, D = "cuda", 56, 128
    _, (q, k, v) = h3_qkv(L, H, D, dev, seed=1)
    q8, qs = q_row_codes(q)
    kc, vc = k[0].transpose(0, 1), v[0].transpose(0, 1)
    ksum, vamax = K.kv_partial_stats(kc, vc)
    base = dict(K.tuned_config(dev, L), GLUON=True, BLOCK_M=64, num_warps=4, MAXNREG=None, Q_ROW=True, QPRE=True)
    cfgs = {"m64": K._cfg(base), "ws2": K._cfg(dict(base, BLOCK_M=128, num_stages=2))}
    cfgs = {k: c for k, c in cfgs.items() if k in KERNELS}
    kv = K.quantize_kv(k, v, K._cfg(base), parts=(ksum, vamax))
    ones = K._ones_e4m3(dev, 128)
    sm_log2 = D ** -0.5 * K.LOG2E
    t0 = time.time()
    base_out = {}
    for name, mod in mods.items():
        row = {}
        for kname, c in cfgs.items():
            try:
                def run():
                    out = torch.empty((1, L, H * D), device=dev, dtype=torch.float8_e4m3fn)
                    sx = torch.empty((L, 1), device=dev, dtype=torch.float32)
                    return mod.launch_prequantized(q8, qs, kv, out, (kv["hmax"], sx), ones, H, L, D, sm_log2, c)
                o = run()
                torch.cuda.synchronize()
                if name == "base":
                    base_out[kname] = o.view(torch.uint8).clone()
                elif kname in base_out:
                    bo = base_out[kname]
                    ob = o.view(torch.uint8)
                    row[f"{kname}_bytes_equal"] = (ob == bo).float().mean().item()
                    of, bf = o.float(), bo.view(torch.float8_e4m3fn).float()
                    row[f"{kname}_rel_l2_vs_base"] = ((of - bf).norm() / bf.norm()).item()
                row[f"ms_{kname}"] = cuda_median_ms(run, rep=REP)
            except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
                row[f"{kname}_error"] = f"{type(e).__name__}: {e}"[:1500]
                RES["errors"].append({"variant": name, "kernel": kname, "trace": traceback.format_exc()[-3000:]})
        RES["variants"][name] = row
        b = RES["variants"].get("base", {})
        for kname in cfgs:
            if f"ms_{kname}" in row and f"ms_{kname}" in b:
                row[f"ratio_{kname}"] = row[f"ms_{kname}"] / b[f"ms_{kname}"]
        RES["elapsed_s"] = time.time() - t0
        save()
        print(name, json.dumps(row), flush=True)
    print("errors:", len(RES["errors"]), flush=True)
    for e in RES["errors"]:
        print(e["trace"][-1500:], flush=True)


if __name__ == "__main__":
    main()
