"""Issue 5 (core, no ComfyUI): the Turbo sigma grids of H3_FACTS §5/§6, the per-call audio shift, the
training-Euler loop against an independent float64 reference, and the sampling-time contract checks."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from h3_turbo.adapters import contracts
from h3_turbo.samplers import schedules
from h3_turbo.samplers import training_euler as te

# H3_FACTS §5 and §6 (6 decimals as printed there).
TABLES = {
    "4nfe_6_3": (4, 6.0, 3.0, [1, .947368, .857143, .666667, 0], [1, .9, .75, .5, 0]),
    "8nfe_12_3": (8, 12.0, 3.0, [1, .988235, .972973, .952381, .923077, .878049, .8, .631579, 0],
                  [1, .954545, .9, .833333, .75, .642857, .5, .3, 0]),
    "dmd_12_3": (4, 12.0, 3.0, [1, .972973, .923077, .8, 0], [1, .9, .75, .5, 0]),
    "8nfe_6_3": (8, 6.0, 3.0, [1, .976744, .947368, .909091, .857143, .782609, .666667, .461538, 0],
                 [1, .954545, .9, .833333, .75, .642857, .5, .3, 0]),
}


def _exact(nfe: int, shift: float) -> list[Fraction]:
    s = Fraction(shift)
    out = []
    for i in range(nfe + 1):
        b = Fraction(nfe - i, nfe)
        out.append(s * b / (1 + (s - 1) * b))
    return out


@pytest.mark.parametrize("name", list(TABLES))
def test_turbo_tables_match_facts(name):
    nfe, sv, sa, video, audio = TABLES[name]
    gv, ga = schedules.turbo_grids(nfe, sv, sa)
    assert gv.dtype == torch.float64 and gv.shape == (nfe + 1,)
    assert np.max(np.abs(gv.numpy() - np.array(video))) <= 1e-6
    assert np.max(np.abs(ga.numpy() - np.array(audio))) <= 1e-6
    assert gv[0].item() == 1.0 and gv[-1].item() == 0.0 and ga[-1].item() == 0.0
    # and to float64 rounding against exact rational arithmetic
    assert np.max(np.abs(gv.numpy() - np.array([float(f) for f in _exact(nfe, sv)]))) < 1e-15
    assert np.max(np.abs(ga.numpy() - np.array([float(f) for f in _exact(nfe, sa)]))) < 1e-15


def test_contract_artifacts_give_the_fact_tables():
    """Every known artifact's grid is one of the printed tables (docs/h3-facts.md#sigma-schedules)."""
    key = {(4, 6.0, 3.0): "4nfe_6_3", (8, 12.0, 3.0): "8nfe_12_3", (4, 12.0, 3.0): "dmd_12_3",
           (8, 6.0, 3.0): "8nfe_6_3"}
    alias = {v: contracts.by_filename(f + ".safetensors").contract for v, f in contracts.ALIASES.items()}
    assert [(alias[v].nfe, alias[v].shift_video) for v in ("4step", "8step")] == [(4, 6.0), (8, 12.0)]
    for c in [a.contract for a in contracts.KNOWN_ARTIFACTS] + [contracts.TURBOH3_DMD]:
        nfe, sv, sa, video, _ = TABLES[key[(c.nfe, c.shift_video, c.shift_audio)]]
        assert (c.nfe, c.shift_video, c.shift_audio) == (nfe, sv, sa)
        te.check_sigmas(c, torch.tensor(video, dtype=torch.float32))  # the printed table passes (1e-6)


def test_shifted_grid_fp32_and_errors():
    g = schedules.shifted_grid(4, 6.0, dtype=torch.float32)
    assert g.dtype == torch.float32 and g[-1].item() == 0.0 and g[0].item() == 1.0
    with pytest.raises(ValueError, match="model evaluations"):
        schedules.shifted_grid(0, 6.0)
    with pytest.raises(ValueError, match="shift"):
        schedules.shifted_grid(4, 0.0)


@pytest.mark.parametrize("name", list(TABLES))
def test_audio_grid_from_video_equals_own_grid(name):
    nfe, sv, sa, _, _ = TABLES[name]
    gv, ga = schedules.turbo_grids(nfe, sv, sa)
    got = schedules.audio_grid_from_video(gv, sv, sa)
    assert got[0] == 1.0 and got[-1] == 0.0
    assert max(abs(a - b) for a, b in zip(got, ga.tolist())) < 1e-14


@pytest.mark.parametrize("name", list(TABLES))
def test_audio_shift_for_round_trips_core_closed_form(name):
    nfe, sv, sa, _, _ = TABLES[name]
    gv, ga = schedules.turbo_grids(nfe, sv, sa)
    for s_v, s_a in zip(gv.tolist()[1:-1], ga.tolist()[1:-1]):
        shift_call = schedules.audio_shift_for(s_v, s_a, sv)
        # uniform grids: the per-call shift IS the contract's audio shift
        assert abs(shift_call - sa) < 1e-12
        assert abs(float(schedules.audio_sigma_from_video(s_v, sv, shift_call)) - s_a) < 1e-14
    # an audio sigma off the closed form still round-trips (the per-call shift then differs)
    sh = schedules.audio_shift_for(0.8, 0.3, 12.0)
    assert abs(float(schedules.audio_sigma_from_video(0.8, 12.0, sh)) - 0.3) < 1e-14
    with pytest.raises(ValueError):
        schedules.audio_shift_for(1.0, 1.0, 6.0)


def test_audio_shift_for_call_is_the_samplers_and_the_tables_rule():
    """The per-call rule the sampler and the AdaLN table's timestep groups share: the contract's shift at the first
    call (sigma 1 / 1, where any shift maps 1 to 1), audio_shift_for elsewhere."""
    from h3_turbo.runtime import adaln
    from h3_turbo.samplers import training_euler

    assert schedules.audio_shift_for_call(1.0, 1.0, 6.0, 3.0) == 3.0
    assert schedules.audio_shift_for_call(0.8, 0.3, 12.0, 3.0) == schedules.audio_shift_for(0.8, 0.3, 12.0)
    assert training_euler._audio_shift_for_call is schedules.audio_shift_for_call
    names = adaln.timestep_groups.__code__.co_names         # runtime imports samplers.schedules, not the sampler
    assert any(n.endswith("samplers.schedules") for n in names) and not any("training_euler" in n for n in names)


# ---------------------------------------------------------------------------------------------- loop

def _field(x: np.ndarray, sigma: float, phase: float) -> np.ndarray:
    """A synthetic, nonlinear velocity field (ComfyUI sign) in float64."""
    return np.sin(3.0 * x + phase) * (0.5 + sigma) + 0.25 * x * sigma ** 2 - 0.1


def test_euler_loop_matches_independent_float64_reference():
    nfe, sv, sa = 4, 6.0, 3.0
    gv = [float(f) for f in _exact(nfe, sv)]
    ga = [float(f) for f in _exact(nfe, sa)]
    rng = np.random.default_rng(0)
    xv0 = rng.standard_normal((1, 24, 3, 4, 4))
    xa0 = rng.standard_normal((1, 32, 2, 9))
    calls = []

    def velocity(i, xv, xa):
        calls.append((i, xv.clone(), xa.clone()))
        v = torch.from_numpy(_field(xv.numpy(), gv[i], 0.3))
        a = torch.from_numpy(_field(xa.numpy(), ga[i], -1.1))
        return v, a

    out_v, out_a = te.euler_av_loop(velocity, torch.from_numpy(xv0), torch.from_numpy(xa0), gv, ga)
    assert out_v.dtype == torch.float64 and len(calls) == nfe
    assert [c[0] for c in calls] == list(range(nfe))

    # independent reference: LightX2V's "reference_blend" form x0 = x - sigma*v, r = s'/s, x' = r x + (1-r) x0
    def ref(x, grid, phase):
        for i in range(len(grid) - 1):
            v = _field(x, grid[i], phase)
            x0 = x - grid[i] * v
            r = grid[i + 1] / grid[i]
            x = r * x + (1.0 - r) * x0
        return x

    rv, ra = ref(xv0.copy(), gv, 0.3), ref(xa0.copy(), ga, -1.1)
    assert np.max(np.abs(out_v.numpy() - rv)) < 1e-12
    assert np.max(np.abs(out_a.numpy() - ra)) < 1e-12
    # the audio really ran on its own grid: using the video grid for it gives a different answer
    assert np.max(np.abs(ref(xa0.copy(), gv, -1.1) - ra)) > 1e-3


def test_euler_loop_exact_for_a_single_data_point():
    # perfect velocity for one data point x0: v = noise - x0; Euler lands exactly on x0 from pure noise
    rng = np.random.default_rng(1)
    n_v, d_v = rng.standard_normal(50), rng.standard_normal(50)
    n_a, d_a = rng.standard_normal(20), rng.standard_normal(20)
    gv, ga = schedules.turbo_grids(8, 12.0, 3.0)
    vel = lambda i, xv, xa: (torch.from_numpy(n_v - d_v), torch.from_numpy(n_a - d_a))  # noqa: E731
    ov, oa = te.euler_av_loop(vel, torch.from_numpy(n_v.copy()), torch.from_numpy(n_a.copy()), gv.tolist(), ga.tolist())
    assert np.max(np.abs(ov.numpy() - d_v)) < 1e-12 and np.max(np.abs(oa.numpy() - d_a)) < 1e-12


def test_euler_update_sign():
    x = torch.zeros(3, dtype=torch.float64)
    v = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    assert torch.equal(te.euler_update(x, 0.75, 0.5, v), 0.25 * v)


def test_carry_factor():
    assert te.carry_factor(0.8, 0.5, 4.0) == 0.8 / 0.5
    assert te.carry_factor(0.0, 0.0, 4.0) == 4.0
    assert te.carry_factor(1.0, 1.0, 2.0) == 1.0
    assert te.carry_factor(0.8, 0.5, 1.0) == 1.0


# ---------------------------------------------------------------------------------------------- checks

C4 = contracts.KNOWN_ARTIFACTS[0].contract  # 4-step v1.1, 6/3


def test_check_sigmas_messages():
    good = schedules.shifted_grid(4, 6.0, dtype=torch.float32)
    te.check_sigmas(C4, good)
    with pytest.raises(te.TurboContractError, match=r"wants 4 model evaluations.*6 points = 5 model evaluations"
                       r".*grid points, not model evaluations"):
        te.check_sigmas(C4, schedules.shifted_grid(5, 6.0))
    with pytest.raises(te.TurboContractError, match=r"minimax_h3_fl2v_turbo_4step_v1.1.*wants 4 model evaluations"):
        te.check_sigmas(C4, schedules.shifted_grid(3, 6.0))
    with pytest.raises(te.TurboContractError) as e:
        te.check_sigmas(C4, schedules.shifted_grid(3, 6.0))
    assert "grid points" not in str(e.value)
    with pytest.raises(te.TurboContractError, match=r"not the video grid.*0\.972973"):
        te.check_sigmas(C4, schedules.shifted_grid(4, 12.0))  # the 12/3 grid with a 6/3 LoRA
    bad = good.clone()
    bad[2] += 2e-6
    with pytest.raises(te.TurboContractError, match="max difference"):
        te.check_sigmas(C4, bad)
    bad[2] -= 1.5e-6  # within 1e-6 (fp32 rounding of the printed table is fine)
    te.check_sigmas(C4, bad)


class _Guider:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_check_cfg():
    te.check_cfg(_Guider(cfg=1.0), C4)
    te.check_cfg(_Guider(cfg=1.0, cfg1=1.0, cfg2=1.0), C4)
    with pytest.raises(te.TurboContractError, match=r"guidance-distilled.*cfg=3\.5"):
        te.check_cfg(_Guider(cfg=3.5), C4)
    with pytest.raises(te.TurboContractError, match=r"cfg2=2"):
        te.check_cfg(_Guider(cfg=1.0, cfg1=1.0, cfg2=2.0), C4)


class EasyCacheHolder:  # same class names as core's holders (comfy_extras/nodes_easycache.py)
    pass


class LazyCacheHolder:
    pass


def _opts(holder=None, wrappers=None):
    to = {}
    if holder is not None:
        to["easycache"] = holder
    if wrappers is not None:
        to["wrappers"] = wrappers
    return {"transformer_options": to}


def test_cache_detection_names_the_node():
    f = lambda *a: None  # noqa: E731
    assert te.find_caches(_opts()) == []
    assert te.find_caches(_opts(EasyCacheHolder(), {"diffusion_model": {"easycache": [f]}})) == ["EasyCache"]
    assert te.find_caches(_opts(LazyCacheHolder(), {"predict_noise": {"lazycache": [f]}})) == ["LazyCache"]
    with pytest.raises(te.TurboContractError, match=r"denoiser cache EasyCache.*Remove the EasyCache node"):
        te.check_caches(_opts(EasyCacheHolder(), {"diffusion_model": {"easycache": [f]}}), C4)
    with pytest.raises(te.TurboContractError, match=r"LazyCache"):
        te.check_caches(_opts(LazyCacheHolder()), C4)
    # a foreign wrapper; ours (h3_turbo*) and other wrapper types are fine
    opts = _opts(None, {"diffusion_model": {"teacache_pack": [f], "h3_turbo_branch": [f], "h3turbo_lora": [f]},
                        "outer_sample": {"x": [f]}})
    assert te.foreign_wrappers(opts) == ["diffusion_model:teacache_pack"]
    with pytest.raises(te.TurboContractError, match=r"diffusion_model:teacache_pack"):
        te.check_caches(opts, C4)
    te.check_caches(_opts(None, {"apply_model": {"h3_turbo_x": [f]}}), C4)


class _MS:
    def __init__(self, shift, audio_shift):
        self.shift, self.audio_shift = shift, audio_shift


def test_check_shift_patch():
    te.check_shift_patch(C4, _MS(6.0, 3.0), True, {"minimax_h3_sigma_shift_video": 6.0,
                                                   "minimax_h3_sigma_shift_audio": 3.0})
    te.check_shift_patch(C4, _MS(12.0, 3.0), False, {})  # unpatched checkpoint default: the sampler overrides
    with pytest.raises(te.TurboContractError, match=r"model_sampling patch.*shift_video 12 \(contract 6\)"):
        te.check_shift_patch(C4, _MS(12.0, 3.0), True, {})
    with pytest.raises(te.TurboContractError, match=r"transformer_options.*shift_audio 2 \(contract 3\)"):
        te.check_shift_patch(C4, _MS(12.0, 3.0), False, {"minimax_h3_sigma_shift_audio": 2.0})
