"""Nsight Compute's view of the warp-specialized Gluon ``int8_sage`` kernel in each of its schedules: where the
kernel waits (warp stall reasons), how busy each pipe is (tensor cores, FMA, special-function unit), issue slots,
achieved clock. The GPU-only complement of the static SASS counts in docs/attention.md.

The script runs itself under ``ncu`` (found on PATH or under /usr/local/cuda*/bin): the child builds the fused
route's prequantized inputs (``h3_qkv``, Q per row, K/V partial statistics) for L tokens x H heads x 128, launches
each variant twice (the first compiles and warms up) and ncu profiles the second launch of each. Variants: the
default schedule, ``EXP2_FMA=1`` and ``WS_OVERLAP`` (config keys of ``int8_kernels.DEFAULT_CONFIG``).

Writes ``$OUT/$TAG.json``: ``variants`` (names in launch order), ``metrics`` (per variant: section -> metric ->
[value, unit], from ncu's ``--csv --page details``), ``ncu`` (the command, its return code, the end of its stderr)
and ``$OUT/$TAG.csv`` (ncu's own output).

Env: OUT (default benchmarks/results), TAG (default attention_ncu_<gpu>), L (default 19584), H (default 8: one
launch takes a few ms, so ncu's replay passes stay short), NCU (the ncu binary), DRY=1 (CPU: only checks the
variants' configurations and writes the JSON without running anything).

Run (GPU with Nsight Compute): ``OUT=benchmarks/results python3 benchmarks/profile_attention_ncu.py``.
"""
from __future__ import annotations

import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = (("default", {}), ("exp2_fma1", {"EXP2_FMA": 1}), ("ws_overlap", {"WS_OVERLAP": True}))
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats", "InstructionStats",
            "Occupancy")
L = int(os.environ.get("L", 19584))
H = int(os.environ.get("H", 8))
DRY = bool(os.environ.get("DRY"))


def child() -> None:
    """Under ncu: each variant launched twice, in VARIANTS order."""
    import torch

    from _common import h3_qkv, import_package, q_row_codes

    import_package()
    from h3_turbo.kernels.attention import int8_kernels as K

    _, (q, k, v) = h3_qkv(L, H, 128, "cuda", seed=1)
    q8, qs = q_row_codes(q)
    ksum, vamax = K.kv_partial_stats(k[0].transpose(0, 1), v[0].transpose(0, 1))
    base = dict(K.tuned_config("cuda", L), GLUON=True, BLOCK_M=128, num_warps=4, MAXNREG=None, num_stages=2)
    for _ in range(2):
        for _, change in VARIANTS:
            K.sage_attention_prequantized(q8, qs, k, v, ksum, vamax, config=dict(base, **change), out_fp8=True)
            torch.cuda.synchronize()


def parse(text: str) -> dict:
    """ncu's details CSV -> {launch index: {section: {metric: [value, unit]}}}, launches numbered in order."""
    out: dict = {}
    ids: dict = {}
    start = text.find('"ID"')
    for row in csv.DictReader(io.StringIO(text[start:] if start >= 0 else "")):
        i = ids.setdefault(row.get("ID"), len(ids))
        sec = out.setdefault(i, {}).setdefault(row.get("Section Name", ""), {})
        sec[row.get("Metric Name", "")] = [row.get("Metric Value"), row.get("Metric Unit")]
    return out


def main() -> None:
    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"L": L, "heads": H, "variants": [n for n, _ in VARIANTS], "metrics": {}, "ncu": {}}
    if DRY:
        from _common import import_package

        import_package()
        from h3_turbo.kernels.attention import int8_kernels as K

        for _, change in VARIANTS:
            K._cfg(dict(K.DEFAULT_CONFIG, GLUON=True, BLOCK_M=128, TMA=True, QPRE=True, Q_ROW=True,
                        ROWSUM_MMA=True, num_stages=2, **change))
        res["dry"] = "configurations checked; ncu needs a GPU"
        tag = os.environ.get("TAG", "attention_ncu_dry")
    else:
        import torch

        gpu = torch.cuda.get_device_name()
        card = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
        tag = os.environ.get("TAG", f"attention_ncu_{card}")
        ncu = os.environ.get("NCU") or shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))),
                                                                   None)
        if ncu is None:
            res["ncu"] = {"error": "ncu not found (PATH, /usr/local/cuda*/bin, NCU)"}
        else:
            n = len(VARIANTS)
            cmd = [ncu, "-k", "regex:_attn_fwd_gluon_ws", "--launch-skip", str(n), "--launch-count", str(n), "--csv",
                   "--page", "details"] + [a for s in SECTIONS for a in ("--section", s)] + [sys.executable, __file__]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, _H3T_NCU_CHILD="1"),
                               timeout=int(os.environ.get("NCU_TIMEOUT", 300)))
            (out_dir / f"{tag}.csv").write_text(p.stdout)
            res["ncu"] = {"cmd": " ".join(cmd), "rc": p.returncode, "stderr_tail": p.stderr[-3000:], "gpu": gpu}
            parsed = parse(p.stdout)
            res["metrics"] = {VARIANTS[i][0] if i < n else str(i): m for i, m in parsed.items()}
    (out_dir / f"{tag}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("variants", "ncu")}, default=str)[:2000])


if __name__ == "__main__":
    if os.environ.get("_H3T_NCU_CHILD") == "1":
        child()
    else:
        main()
