"""``adaln=table``: the first run of a new schedule computes every timestep group it will use in ONE pass over the
AdaLN weights (runtime/adaln_memo.py: groups predicted at sampling start), for the samplers of the example
workflows and their Turbo-off variants, through the real ComfyUI on the CPU (small 2+1-block fixture):

- H3 Turbo Sigmas + H3 Turbo Sampler with the 4-step and the 8-step Turbo LoRA, and with Turbo off (H3TurboLoRA none,
  steps 4 and 8: the sampler then takes its shifts from the MODEL);
- core's beta scheduler + ``res_multistep`` (the base workflow) and ``euler``, after MiniMaxH3SigmaShift 12/3 and 6/3.

Per case: a fresh load, the run's weight passes counted (``WEIGHT_READS``): exactly 1, and no "neither in this
schedule's cache nor among the groups predicted" warning; the second run of the same schedule reads the cache (0).
"""
from __future__ import annotations

import logging
import os

import pytest

from corpus import write_small_fixtures  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.comfyui

SUB = "zz_adaln_pred"
_N = [0]


@pytest.fixture(scope="module")
def small(comfy, tmp_path_factory):
    root = tmp_path_factory.mktemp("adaln_pred_models")
    out = write_small_fixtures(str(root), SUB, str(tmp_path_factory.mktemp("adaln_pred_src")))
    comfy.add_models_dir(root)
    cache = tmp_path_factory.mktemp("adaln_pred_cache")
    old = os.environ.get("H3_TURBO_ADALN_CACHE")
    os.environ["H3_TURBO_ADALN_CACHE"] = str(cache)
    yield out
    if old is None:
        os.environ.pop("H3_TURBO_ADALN_CACHE", None)
    else:
        os.environ["H3_TURBO_ADALN_CACHE"] = old


def _prompt(small, sampler: str, turbo: str | None, steps: int, shifts=(12.0, 3.0)) -> dict:
    _N[0] += 1
    p = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": small["unet"], "compute": "reference",
                                                              "adaln": "table"}}}
    m = ["1", 0]
    if sampler == "turbo":
        p["2"] = {"class_type": "H3TurboLoRA", "inputs": {"model": m, "turbo": small[f"lora_{turbo}"] if turbo
                                                          else "none", "strength": 1.0}}
        m = ["2", 0]
        p["6"] = {"class_type": "H3TurboSigmas", "inputs": {"model": m, "steps": steps}}
        p["7"] = {"class_type": "H3TurboSampler", "inputs": {"state_dtype": "fp32"}}
    else:
        p["2"] = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": m, "shift_video": shifts[0],
                                                                  "shift_audio": shifts[1]}}
        m = ["2", 0]
        p["6"] = {"class_type": "BasicScheduler", "inputs": {"model": m, "scheduler": "beta", "steps": steps,
                                                             "denoise": 1.0}}
        p["7"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": sampler}}
    p["4"] = {"class_type": "H3TurboTestConditioning", "inputs": {"model": m, "seed": 0, "tokens": 8}}
    p["5"] = {"class_type": "BasicGuider", "inputs": {"model": m, "conditioning": ["4", 0]}}
    p["8"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}}
    p["9"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}}
    p["10"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["8", 0], "guider": ["5", 0],
                                                                 "sampler": ["7", 0], "sigmas": ["6", 0],
                                                                 "latent_image": ["9", 0]}}
    p["11"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["10", 0]}}
    p["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"h3t/pred{_N[0]}_v"}}
    p["13"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 1], "filename_prefix": f"h3t/pred{_N[0]}_a"}}
    return p


CASES = [("turbo", "4step", 0, (12.0, 3.0)), ("turbo", "8step", 0, (12.0, 3.0)),
         ("turbo", None, 4, (12.0, 3.0)), ("turbo", None, 8, (12.0, 3.0)),
         ("res_multistep", None, 7, (12.0, 3.0)), ("euler", None, 5, (6.0, 3.0))]


@pytest.mark.parametrize("sampler,turbo,steps,shifts", CASES)
def test_first_run_of_a_schedule_is_one_weight_pass(comfy, small, sampler, turbo, steps, shifts, caplog):
    from h3_turbo import state
    from h3_turbo.runtime.adaln_memo import WEIGHT_READS

    state.LOGGED.clear()
    p = _prompt(small, sampler, turbo, steps, shifts)
    comfy.executor.reset()
    WEIGHT_READS.clear()
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        comfy.run_latents(p, ("12", "13"))
    first = WEIGHT_READS.counts
    assert "neither in this schedule's cache" not in caplog.text, caplog.text[-2000:]
    assert first["passes"] == 1 and first["written"] == 1, first
    comfy.executor.reset()
    WEIGHT_READS.clear()
    comfy.run_latents(_prompt(small, sampler, turbo, steps, shifts), ("12", "13"))
    assert WEIGHT_READS.counts["passes"] == 0 and WEIGHT_READS.counts["cached"] >= 1


def test_samplers_sharing_a_schedule_find_their_groups_in_its_cache(comfy, small, tmp_path, monkeypatch, caplog):
    """H3 Turbo Sampler with the 8-step contract and with Turbo off at 8 steps get the same sigmas (one cache file)
    but per-call audio shifts that differ in the last bits: the second sampler computes its own groups in one pass
    (not one pass per missing group), the file then holds both, and later runs of either read no weights."""
    from h3_turbo import state
    from h3_turbo.runtime.adaln_memo import WEIGHT_READS

    monkeypatch.setenv("H3_TURBO_ADALN_CACHE", str(tmp_path))
    passes = []
    for turbo, steps in (("8step", 0), (None, 8), ("8step", 0), (None, 8)):
        state.LOGGED.clear()
        comfy.executor.reset()
        WEIGHT_READS.clear()
        with caplog.at_level(logging.WARNING, logger="h3_turbo"):
            comfy.run_latents(_prompt(small, "turbo", turbo, steps), ("12", "13"))
        passes.append(WEIGHT_READS.counts["passes"])
    assert passes == [1, 1, 0, 0], passes
    assert "neither in this schedule's cache" not in caplog.text
    assert len(os.listdir(next(p for p in tmp_path.iterdir() if p.is_dir()))) == 1      # one file: one schedule
