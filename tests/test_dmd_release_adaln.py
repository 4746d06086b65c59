"""The TurboH3 release's ``adaln/`` in its inferred layout (issue 40 item 3; ``formats.dmd.read_release_rows``):
11 rows = the i2va plan's timesteps (step 0 {0, 0.999}, steps 1-3 {t_video, t_audio, 0.999}) keyed by
t = fp32(1 - sigma), per-block rows + final rows, detected from the shapes and read; a layout that fits none is
refused with what was found. Release roots found from a file or an index inside the release folder."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from h3_turbo.errors import CheckpointError
from h3_turbo.formats import dmd as fdmd
from h3_turbo.runtime import adaln as A

H, L, R = 4, 3, 11


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(R, 18 * H, generator=g).bfloat16() for _ in range(L)], torch.randn(R, 2 * H, generator=g).bfloat16()


def _write(d, sd, meta, sidecar=None):
    os.makedirs(d, exist_ok=True)
    save_file(sd, os.path.join(d, "adaln.safetensors"), metadata=meta)
    if sidecar is not None:
        with open(os.path.join(d, "adaln.json"), "w") as f:
            json.dump(sidecar, f)
    return str(d)


def test_i2va_plan_timesteps_are_the_11_rows():
    ts = fdmd.i2va_plan_timesteps()
    want = [0.0, 0.999, 1 - 0.972973, 0.1, 0.999, 1 - 0.923077, 0.25, 0.999, 0.2, 0.5, 0.999]
    assert len(ts) == 11 and ts == pytest.approx(want, abs=1e-6)
    assert [len(r) for r in fdmd._increasing_runs(ts)] == [2, 3, 3, 3]
    b = torch.linspace(1, 0, 5)
    assert ts[3] == float(1 - 3 * b[1] / (1 + 2 * b[1]))        # fp32 arithmetic, as diffusers' scheduler


def test_per_block_layout_with_the_schedule_in_a_sidecar(tmp_path):
    blocks, final = _rows()
    sd = {f"transformer_blocks.{i}.adaln_proj": b.reshape(3 * R, 6 * H) for i, b in enumerate(blocks)}
    sd["norm_out.linear_out"] = final
    d = _write(tmp_path / "adaln", sd, {"timestep_mlp_dtype": "float32"},
               {"schedule": {"task": "i2va", "steps": 5, "video_shift": 12, "audio_shift": 3}})
    t = A.read_table(d)
    assert (t.layout, t.hidden, len(t.blocks), t.rows) == ("turboh3_release_rows", H, L, R)
    assert [len(g) for g in t.groups] == [2, 3, 3, 3] and t.starts == [0, 2, 5, 8]
    assert all(torch.equal(a, b) for a, b in zip(t.blocks, blocks)) and torch.equal(t.final, final)
    assert t.meta["timesteps_from"].startswith("the i2va plan")
    # a forward at core's fp32 audio timestep finds its update's rows (within the tolerance), never interpolated
    core_step1 = torch.tensor([fdmd.i2va_plan_timesteps()[2], 0.10000014305114746, 0.999], dtype=torch.float32)
    assert t.rows_for(core_step1).tolist() == [2, 3, 4]
    t.check_fits(L, H, need_final=True)


def test_stacked_layout_with_a_timesteps_tensor(tmp_path):
    blocks, final = _rows(1)
    ts = fdmd.i2va_plan_timesteps()
    sd = {"adaln": torch.stack(blocks).reshape(L, R, 3, 6, H), "final_layer": final.reshape(R, 2, H),
          "timesteps": torch.tensor(ts, dtype=torch.float32)}
    t = A.read_table(_write(tmp_path / "adaln", sd, {}))
    assert all(torch.equal(a, b) for a, b in zip(t.blocks, blocks)) and t.meta["timesteps_from"] == "tensor timesteps"
    assert t.timesteps() == ts


def test_layouts_that_fit_none_are_refused_with_what_was_found(tmp_path):
    blocks, final = _rows(2)
    # a block tensor of the wrong width
    sd = {f"blocks.{i}.mod": b[:, : 17 * H].contiguous() for i, b in enumerate(blocks)}
    sd["norm_out"] = final
    d = _write(tmp_path / "a" / "adaln", sd, {"timesteps": json.dumps(fdmd.i2va_plan_timesteps())})
    with pytest.raises(CheckpointError, match=r"unknown AdaLN table layout: files \['adaln.safetensors'\].*"
                                              r"blocks.0.mod BF16 \[11, 68\].*not the inferred TurboH3 release "
                                              r"layout: tensor blocks.0.mod BF16 \[11, 68\] fits neither"):
        A.read_table(d)
    # the right shapes, but nothing says which timesteps the rows hold
    sd = {f"blocks.{i}.mod": b for i, b in enumerate(blocks)}
    sd["norm_out"] = final
    d = _write(tmp_path / "b" / "adaln", sd, {"steps": "8"})
    with pytest.raises(CheckpointError, match=r"no timesteps: .*no i2va schedule \(steps 8"):
        A.read_table(d)
    # two safetensors files
    _write(tmp_path / "b" / "adaln", {"x": torch.zeros(1)}, {})
    os.rename(os.path.join(d, "adaln.safetensors"), os.path.join(d, "other.safetensors"))
    _write(tmp_path / "b" / "adaln", {"x": torch.zeros(1)}, {})
    with pytest.raises(CheckpointError, match=r"one .safetensors in adaln/ \(2 found\)"):
        A.read_table(d)


def test_release_root_found_from_files_inside_it(tmp_path):
    root = tmp_path / "TurboH3-X"
    for p in ("transformer/a.safetensors.index.json", "w8a8/model_w8a8.safetensors", "adaln/adaln.safetensors",
              "model.safetensors"):
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_bytes(b"x")
    for p in ("transformer/a.safetensors.index.json", "w8a8/model_w8a8.safetensors", "model.safetensors"):
        rel = fdmd.find_release(str(root / p))
        assert (rel.root, rel.adaln, rel.manifest) == (str(root), str(root / "adaln"), None), p
        assert (rel.bf16 or rel.w8a8) == str(root / p)
    (root / "manifest.json").write_text("{}")
    assert fdmd.find_release(str(root / "w8a8/model_w8a8.safetensors")).manifest == str(root / "manifest.json")
    # negative controls: no adaln/ in the release, or a file outside any release
    lone = tmp_path / "elsewhere" / "w8a8" / "model_w8a8.safetensors"
    lone.parent.mkdir(parents=True)
    lone.write_bytes(b"x")
    assert fdmd.find_release(str(lone)).adaln is None
    os.rename(root / "adaln", root / "adaln_old")
    assert fdmd.find_release(str(root / "w8a8/model_w8a8.safetensors")).adaln is None
