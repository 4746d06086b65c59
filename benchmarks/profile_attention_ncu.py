"""Nsight Compute's view of the fused route's attention kernels: the warp-specialized Gluon ``int8_sage`` kernel
(what the route runs on Hopper from 16 384 tokens on) and the Triton kernel in the tuned Hopper configuration, on the
same inputs: where they wait (warp stall reasons), how busy each pipe is (tensor cores, FMA, special-function unit),
issue slots, the clock they ran at. Both run at about 41 % of the card's 8-bit tensor rate (docs/attention.md), while
neither the tensor cores nor the special-function unit alone would bound them there; this is the measurement that
says what does.

The script runs itself under ``ncu`` (found on PATH or under /usr/local/cuda*/bin; ``--clock-control none``, so the
clock is the one the card chooses): the child builds the route's prequantized inputs (``h3_qkv``, Q per row, K/V
partial statistics) for L tokens x H heads x 128, launches each kernel twice (the first compiles and warms up) and
ncu profiles the second launch of each.

Writes ``$OUT/$TAG.json``: ``variants`` (names in launch order), ``metrics`` (per variant: metric -> [value, unit],
every metric the sections collect, from ncu's ``--csv --page raw``), ``ncu`` (the command, its return code, the end
of its stderr) and ``$OUT/$TAG.csv`` (ncu's own output).

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

VARIANTS = ("gluon", "triton")     # the route's Gluon configuration at L tokens; the tuned Triton configuration
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
    configs = configs_for(K, torch.device("cuda"))
    for _ in range(2):
        for name in VARIANTS:
            K.sage_attention_prequantized(q8, qs, k, v, ksum, vamax, config=configs[name], out_fp8=True)
            torch.cuda.synchronize()


def configs_for(K, device) -> dict:
    """{variant: launch configuration}: the fused route's own choice (``fused_block._gluon_config``, the
    warp-specialized form at these lengths) and the tuned configuration it starts from (the Triton kernel)."""
    from h3_turbo.runtime import fused_block

    base = K.tuned_config(device, L)
    return {"gluon": fused_block._gluon_config(base, device, L), "triton": base}


def parse(text: str) -> dict:
    """ncu's raw CSV (a header row of metric names, a row of units, one row per profiled launch; ncu's own log lines
    before it) -> {launch index: {metric: [value, unit]}}, launches numbered in order."""
    start = text.find('"ID"')
    rows = list(csv.reader(io.StringIO(text[start:] if start >= 0 else "")))
    if len(rows) < 3:
        return {}
    names, units = rows[0], rows[1]
    return {i: {n: [v, u] for n, u, v in zip(names, units, r)} for i, r in enumerate(rows[2:])}


def main() -> None:
    import torch

    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"L": L, "heads": H, "variants": list(VARIANTS), "metrics": {}, "ncu": {}}
    if DRY:
        from _common import import_package

        import_package()
        from h3_turbo.kernels.attention import int8_kernels as K

        res["configs"] = configs_for(K, torch.device("cpu"))
        res["dry"] = "configurations built (the CPU has no Gluon route: both are the base); ncu needs a GPU"
        tag = os.environ.get("TAG", "attention_ncu_dry")
    else:
        from _common import gpu_tag

        gpu = torch.cuda.get_device_name()
        tag = os.environ.get("TAG", f"attention_ncu_{gpu_tag()}")
        ncu = os.environ.get("NCU") or shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))),
                                                                   None)
        if ncu is None:
            res["ncu"] = {"error": "ncu not found (PATH, /usr/local/cuda*/bin, NCU)"}
        else:
            n = len(VARIANTS)
            cmd = [ncu, "-k", "regex:_attn_fwd", "--launch-skip", str(n), "--launch-count", str(n),
                   "--clock-control", "none", "--csv", "--page", "raw"]
            cmd += [a for s in SECTIONS for a in ("--section", s)] + [sys.executable, __file__]
            res["ncu"] = {"cmd": " ".join(cmd), "gpu": gpu}
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, _H3T_NCU_CHILD="1"),
                                   timeout=int(os.environ.get("NCU_TIMEOUT", 300)))
                (out_dir / f"{tag}.csv").write_text(p.stdout)
                res["ncu"].update(rc=p.returncode, stderr_tail=p.stderr[-3000:])
                parsed = parse(p.stdout)
                res["metrics"] = {VARIANTS[i] if i < n else str(i): m for i, m in parsed.items()}
            except subprocess.TimeoutExpired as e:
                res["ncu"].update(rc=None, error=f"timed out after {e.timeout} s")
    (out_dir / f"{tag}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("variants", "ncu")}, default=str)[:2000])


if __name__ == "__main__":
    if os.environ.get("_H3T_NCU_CHILD") == "1":
        child()
    else:
        main()
