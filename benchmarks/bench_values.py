"""Cost of the value check (``formats/values.py``) on a large file, on the CPU (no GPU needed).

    python benchmarks/bench_values.py DIR [--blocks 1] [--refiner 1] [--quantize]

Writes a full-width BF16 H3 with ``--blocks`` DiT blocks and ``--refiner`` refiner blocks (1 + 1: 2.2 GB)
into DIR (kept for reuse), then times ``inspect``'s scan of every tensor (read + check, and the check alone)
and, with ``--quantize``, ``quantize`` (the loader's streaming path: read, check, quantize, write) with the
time its value check took. Prints one JSON line. Results: docs/formats.md ("Value check").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def make(path: str, blocks: int, refiner: int) -> None:
    import torch

    from h3_turbo.tools.fixtures import TinyH3Config, _save_aligned, make_tiny_h3_state_dict

    cfg = dataclasses.replace(TinyH3Config(), hidden=5376, heads=56, head_dim=128, ffn=14336, text_dim=5120,
                              timestep_input_dim=256, time_embed_hidden=5376, time_embed_dim=2688, rope_len=16,
                              num_layers=blocks, refiner_layers=refiner)
    sd = make_tiny_h3_state_dict(cfg, projection=lambda w: {"weight": w.to(torch.bfloat16)})
    _save_aligned(sd, path, {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--refiner", type=int, default=1)
    ap.add_argument("--quantize", action="store_true")
    a = ap.parse_args()
    from h3_turbo.formats import convert, values
    from h3_turbo.formats.detect import detect
    from h3_turbo.formats.safetensors_io import read_header

    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, f"h3_fullwidth_{a.blocks}+{a.refiner}_bf16.safetensors")
    if not os.path.exists(path):
        make(path, a.blocks, a.refiner)
    det = detect(read_header(path))
    res = values.scan(path, det)                       # warm the page cache
    t0 = time.perf_counter()
    res = values.scan(path, det)
    scan_s = time.perf_counter() - t0
    checker = values.CheckedReader(None, path, values.block_scale_keys(det))
    import torch

    from h3_turbo.formats.safetensors_io import open_tensors

    check_s = 0.0
    with open_tensors(path) as f:
        for k in f.keys():
            t = f.get_tensor(k)
            t1 = time.perf_counter()
            values.problems(t, k in checker.block_scales)
            check_s += time.perf_counter() - t1
    out = {"file_bytes": os.path.getsize(path), "tensors": res.tensors, "tensor_bytes": res.bytes,
           "scan_read_and_check_s": round(scan_s, 2), "check_only_s": round(check_s, 2),
           "threads": torch.get_num_threads()}
    if a.quantize:
        q = os.path.join(a.dir, "out_nvfp4.safetensors")
        plan = convert.make_plan(det)
        t0 = time.perf_counter()
        seen = {}
        orig = values.CheckedReader.__init__

        def spy(self, *args, **kw):
            orig(self, *args, **kw)
            seen["reader"] = self

        values.CheckedReader.__init__ = spy
        try:
            convert.write_safetensors_stream(q, convert.iter_native(plan), convert.output_plan(plan),
                                             convert.native_metadata(plan))
        finally:
            values.CheckedReader.__init__ = orig
        out.update(quantize_s=round(time.perf_counter() - t0, 2),
                   quantize_value_check_s=round(seen["reader"].stats["seconds"], 2))
        os.remove(q)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
