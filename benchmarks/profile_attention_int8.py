"""Issue 9: where the time of one ``int8_sage`` call goes, on one GPU (H200), at S = 19 584 (H3 960x544x124).

Prints: do_bench (median) of the whole call and of cuDNN SDPA; host time per call; the call with its
pre-passes cached (the attention kernel alone); each pre-pass; a CUDA-graph replay of the whole call; and
a ``torch.profiler`` table of the GPU kernels of 5 calls (at S = 19 584 and 37 632).

Also the target of Nsight Compute (``ncu``) runs, with ``ONE=1`` (3 calls of the tuned kernel, nothing
else)::

    ONE=1 ncu --clock-control none --section SpeedOfLight --section SchedulerStats --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --section Occupancy --section MemoryWorkloadAnalysis \\
        -k regex:_attn_fwd -s 2 -c 1 python3 benchmarks/profile_attention_int8.py
    ONE=1 ncu --clock-control none --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,\\
        regex:sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active" -k regex:_attn_fwd -s 2 -c 1 \\
        python3 benchmarks/profile_attention_int8.py

Run from the repo root (device tool ``run``, no carry): ``python3 benchmarks/profile_attention_int8.py``.
"""
import os
import time

import torch
import triton

import _common  # benchmarks/_common.py

_common.import_package()
from h3_turbo.kernels.attention import exact as A  # noqa: E402
from h3_turbo.kernels.attention import int8_kernels as Q  # noqa: E402


def db(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median")


def main():
    S = int(os.environ.get("S", 19584))
    _, (q, k, v) = _common.h3_qkv(S, 56, 128, "cuda", S)
    out = torch.empty(1, S, 56 * 128, device="cuda", dtype=torch.bfloat16)
    f = lambda: Q.sage_attention(q, k, v, out_layout="blhd", out=out)  # noqa: E731
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    if os.environ.get("ONE"):
        print("config", Q.tuned_config(q.device, S))
        return
    print("config", Q.tuned_config(q.device, S))
    print("whole call ms", db(f), " cudnn ms", db(lambda: A.sdpa_with("CUDNN_ATTENTION", q, k, v)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print("host ms per call", (t1 - t0) * 100, " wall ms per call", (time.perf_counter() - t0) * 100)
    c = Q.tuned_config(q.device, S)
    kv, qq = Q.quantize_kv(k, v, c), Q.quantize_q(q, 128 ** -0.5 * Q.LOG2E, c)
    real = Q.quantize_kv, Q.quantize_q
    Q.quantize_kv, Q.quantize_q = (lambda *a, **kw: kv), (lambda *a, **kw: qq)
    try:
        print("kernel only (pre-passes cached) ms", db(f))
    finally:
        Q.quantize_kv, Q.quantize_q = real
    print("quantize_kv ms", db(lambda: Q.quantize_kv(k, v, c)), " of which kv_stats ms",
          db(lambda: Q.kv_stats(k, v, c["V_MEAN"], c["PV_FP8"])), " quantize_q ms",
          db(lambda: Q.quantize_q(q, 0.1, c)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    print("CUDA graph replay ms", db(g.replay))
    from torch.profiler import ProfilerActivity, profile
    for S2 in (S, 37632):
        _, (q2, k2, v2) = _common.h3_qkv(S2, 56, 128, "cuda", S2)
        for _ in range(2):
            Q.sage_attention(q2, k2, v2, out_layout="blhd")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                Q.sage_attention(q2, k2, v2, out_layout="blhd")
            torch.cuda.synchronize()
        print(S2, prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
