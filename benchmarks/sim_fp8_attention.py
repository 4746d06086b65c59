"""Issue 9, library check on the CPU: would an FP8 (e4m3) attention such as cuDNN's FP8 SDPA forward or
FlashAttention-3's FP8 path meet the 8-bit target's accuracy (per-head cosine >= 0.999 vs float32)?

Those kernels take Q, K, V in e4m3 with one scale per tensor (or per head) and round P to e4m3. This
script models that math in float64 on H3-like inputs (``_common.h3_qkv``: RMS-normalised q/k with a gain,
core's strided layout) and prints the smallest per-head cosine and the relative L2 against exact
attention, for per-tensor and per-head scales, with and without e4m3 P/V.

Run: ``python3 benchmarks/sim_fp8_attention.py [S]`` (default S = 4096, 4 heads). The recorded result and
what it decided: ``docs/attention.md`` ("FP8 Q K").
"""
import sys

import torch

import _common


def main(S=4096, H=4, D=128):
    _, (q, k, v) = _common.h3_qkv(S, H, D, "cpu")
    q, k, v = (t.double() for t in (q, k, v))
    sc = D ** -0.5
    ref = torch.softmax(q @ k.transpose(-1, -2) * sc, -1) @ v

    def f8(x, per):
        a = x.abs().amax() if per == "tensor" else x.abs().amax(dim=(-1, -2), keepdim=True)
        s = 448 / a
        return (x * s).float().to(torch.float8_e4m3fn).double() / s

    def metrics(o):
        cos = torch.nn.functional.cosine_similarity(o.flatten(2), ref.flatten(2), dim=-1).min().item()
        return cos, ((o - ref).norm() / ref.norm()).item()

    for per in ("tensor", "head"):
        qq, kk, vv = f8(q, per), f8(k, per), f8(v, per)
        s = qq @ kk.transpose(-1, -2) * sc
        print(per, "e4m3 Q/K only: cos %.5f rel %.4f" % metrics(torch.softmax(s, -1) @ v))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        e8 = (e * 448).float().to(torch.float8_e4m3fn).double() / 448
        print(per, "e4m3 Q/K/V/P:  cos %.5f rel %.4f" % metrics((e8 @ vv) / e.sum(-1, keepdim=True)))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
