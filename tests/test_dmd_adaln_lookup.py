"""AdaLN table lookup by the nearest stored timestep within ``runtime.adaln.TOLERANCE`` (issue 40 item 2): a table
keyed by another implementation's fp32 timesteps (diffusers / LightX2V: fp32(1 - sigma)) serves core's forwards,
whose audio timestep core recomputes from the video sigma in fp32 (16 ulp away at t = 0.1, 4 ulp at 0.25). Never
interpolated: a timestep farther than the tolerance is refused naming the nearest key and the distance."""
from __future__ import annotations

import logging

import pytest
import torch

from h3_turbo import state
from h3_turbo.errors import CheckpointError
from h3_turbo.runtime import adaln as A


def _bits(vals):
    return tuple(torch.tensor(vals, dtype=torch.float32).view(torch.int32).tolist())


def _f(bits):
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


# fp32(1 - sigma) of the DMD schedule's step 1 (video sigma 0.972973, audio 0.9) and step 3 (0.8 / 0.5), as a table
# written by diffusers' arithmetic holds them, with the condition rows at 0.999
T_A1 = float(torch.tensor(1.0) - torch.tensor(0.9, dtype=torch.float32))        # 0.100000024 (0x3dccccd0)
T_A3 = 0.5
CORE_A1 = _f(0x3DCCCCE0)                                                        # core's 0.10000014305114746


def _table():
    groups = [(0.0,), (0.027027, T_A1), (0.027027, T_A1, 0.999), (0.2, T_A3, 0.999)]
    keys = [_bits(g) for g in groups]
    starts, s = [], 0
    for g in keys:
        starts.append(s)
        s += len(g)
    rows = torch.arange(s, dtype=torch.float32)[:, None].repeat(1, 18)         # row r holds r everywhere
    return A.AdaLNTable("/x/adaln", "test", 1, keys, starts, [rows, rows + 100], rows[:, :2].clone())


def test_exact_keys_are_one_group():
    t = _table()
    A.LOOKUPS.clear()
    g = torch.tensor([0.027027, T_A1, 0.999], dtype=torch.float32)
    assert t.rows_for(g).tolist() == [3, 4, 5]
    assert A.LOOKUPS.counts == {"group": 1, "nearest": 0, "composed": 0}


def test_core_audio_timestep_matches_the_nearest_key(caplog):
    t = _table()
    A.LOOKUPS.clear()
    state.LOGGED.clear()
    core = torch.cat([torch.tensor([0.027027]), CORE_A1, torch.tensor([0.999])]).float()
    assert float(core[1]) == 0.10000014305114746 and abs(float(core[1]) - T_A1) == pytest.approx(1.19e-7, rel=0.01)
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        assert t.rows_for(core).tolist() == [3, 4, 5]                      # the stored group, not an interpolation
        assert t.rows_for(core[:2]).tolist() == [1, 2]
    assert A.LOOKUPS.counts == {"group": 0, "nearest": 2, "composed": 0}
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "0.10000014305114746 -> 0.10000002384185791 (|dt| 1.19e-07)" in msg


def test_composed_group_with_a_near_key():
    t = _table()
    A.LOOKUPS.clear()
    mixed = torch.cat([CORE_A1, torch.tensor([0.2])]).float()               # never stored as one batch
    assert t.rows_for(mixed).tolist() == [2, 6]
    assert A.LOOKUPS.counts == {"group": 0, "nearest": 0, "composed": 1}


@pytest.mark.parametrize("dt", [A.TOLERANCE * 1.5, 1e-4])
def test_beyond_the_tolerance_names_the_nearest_key_and_distance(dt):
    t = _table()
    bad = torch.tensor([0.027027, T_A1 + dt, 0.999], dtype=torch.float32)
    with pytest.raises(CheckpointError) as e:
        t.rows_for(bad)
    msg = str(e.value)
    assert f"/x/adaln: timestep {float(bad[1])!r} (fp32 bits" in msg and "of this forward is not in the AdaLN table" in msg
    assert "the nearest stored timestep is 0.10000002384185791 (fp32 bits 0x3dccccd0)" in msg
    assert f"|dt| = {float(bad[1]) - T_A1:.3g} > the tolerance 2e-06" in msg and "never interpolated" in msg


def test_tolerance_covers_16_ulp_and_separates_schedule_timesteps():
    """16 ulp anywhere in [0, 1) is inside the tolerance; the distinct timesteps of every built-in schedule (and
    the condition level 0.999) are farther apart than twice the tolerance, so a nearest match is never ambiguous."""
    ulp_top = float(torch.tensor(0.75).nextafter(torch.tensor(1.0)) - 0.75)   # 2^-24: the largest ulp below 1
    assert 16 * ulp_top < A.TOLERANCE
    from h3_turbo.samplers.schedules import shifted_grid

    for s in A.SCHEDULES.values():
        ts = sorted({float(1 - x) for x in shifted_grid(s.nfe, s.shift_video, torch.float32).tolist()[:-1]}
                    | {float(1 - x) for x in shifted_grid(s.nfe, s.shift_audio, torch.float32).tolist()[:-1]}
                    | {0.999})
        assert min(b - a for a, b in zip(ts, ts[1:])) > 2 * A.TOLERANCE, s.name
