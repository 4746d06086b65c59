"""runtime/prologue.py through the real ComfyUI (CPU): the packed layout's position ids and update masks are
handed to core's H3 forward already on the device, once per layout. Sampling and direct forwards are bit for bit
what core computes without the wrapper; a layout of another signature, a call with keyframes and no layout, and a
core layout without these tensors pass through unchanged (the last logged once)."""
from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.comfyui


@pytest.fixture()
def prologue():
    from h3_turbo.runtime import prologue as p

    saved = dict(p.SETTINGS)
    yield p
    p.SETTINGS.clear()
    p.SETTINGS.update(saved)
    p._OFF.clear()


def _prompt(seed_prefix):
    p = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": "h3_tiny_bf16.safetensors",
                                                              "compute": "reference"}}}
    m = ["1", 0]
    p["4"] = {"class_type": "H3TurboTestConditioning", "inputs": {"model": m, "seed": 0, "tokens": 8}}
    p["9"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 48, "length": 5}}
    p["5"] = {"class_type": "BasicGuider", "inputs": {"model": m, "conditioning": ["4", 0]}}
    p["6"] = {"class_type": "BasicScheduler", "inputs": {"model": m, "scheduler": "simple", "steps": 3, "denoise": 1.0}}
    p["7"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
    p["8"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}}
    p["10"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["8", 0], "guider": ["5", 0],
                                                                 "sampler": ["7", 0], "sigmas": ["6", 0],
                                                                 "latent_image": ["9", 0]}}
    p["11"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["10", 0]}}
    p["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"h3t/{seed_prefix}_v"}}
    p["13"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 1], "filename_prefix": f"h3t/{seed_prefix}_a"}}
    return p


def test_sampling_is_bit_identical_and_places_the_run_layout_once(comfy, prologue):
    """A 3-step SamplerCustomAdvanced run: extra_conds' layout is placed once and reused by the other two forwards;
    the latents equal those of the same run with the wrapper off."""
    comfy.executor.reset()
    s0 = dict(prologue.STATS)
    on = comfy.run_latents(_prompt("prologue_on"), ("12", "13"))
    placed = prologue.STATS["placed"] - s0["placed"]
    reused = prologue.STATS["reused"] - s0["reused"]
    assert placed == 1 and reused == 2, (placed, reused)
    prologue.SETTINGS["device_layout"] = False
    comfy.executor.reset()
    off = comfy.run_latents(_prompt("prologue_off"), ("12", "13"))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(on, off))
    assert float(on[0].std()) > 0.1


def _model(fixtures_dir):
    from h3_turbo.runtime.loading import load_h3_model

    return load_h3_model(fixtures_dir["bf16"], "reference")


def _to(mp):
    import comfy.patcher_extension as pe

    to = pe.copy_nested_dicts(mp.model_options.get("transformer_options", {}))
    to["wrappers"] = pe.copy_nested_dicts(mp.wrappers)
    return to


def _inputs(t=7, h=6, w=10):
    g = torch.Generator().manual_seed(0)
    return ([torch.randn(1, 24, t, h, w, generator=g), torch.randn(1, 32, 2, 5, generator=g)],
            torch.tensor([800.0]), torch.randn(1, 9, 48, generator=g))


def test_direct_forward_without_a_layout_builds_cores_once_and_matches(fixtures_dir, comfy, prologue):
    """No payload: core's PackedLayout for the call's signature (odd latent width 5: padded to 6, as core pads) is
    built once and reused; the output is core's (the wrapper off) bit for bit."""
    mp = _model(fixtures_dir)
    dm = mp.model.diffusion_model
    x, t, ctx = _inputs(w=9)
    s0 = dict(prologue.STATS)
    with torch.no_grad():
        a = dm(x, t, ctx, transformer_options=_to(mp))
        b = dm(x, t, ctx, transformer_options=_to(mp))
        prologue.SETTINGS["device_layout"] = False
        ref = dm(x, t, ctx, transformer_options=_to(mp))
    assert prologue.STATS["built"] - s0["built"] <= 1          # (a previous test may have built this signature)
    assert prologue.STATS["reused"] - s0["reused"] >= 1
    for u, v, r in zip(a, b, ref):
        assert torch.equal(u, r) and torch.equal(v, r)


def _capture(dm, wrapper):
    """A real WrapperExecutor over a function that records the payload core's _forward would get."""
    import comfy.patcher_extension as pe

    got = {}

    def original(x, timestep, context, transformer_options, minimax_payload=None, **kw):
        got["payload"] = minimax_payload
        return "out"

    ex = pe.WrapperExecutor.new_class_executor(original, dm, [wrapper])
    return ex, got


def test_other_signature_keyframes_and_foreign_layouts_pass_through(fixtures_dir, comfy, prologue, caplog):
    import comfy.ldm.minimax.model as core

    dm = _model(fixtures_dir).model.diffusion_model
    x, t, ctx = _inputs()
    ex, got = _capture(dm, prologue.wrapper)
    sig = prologue.signature(dm, x, ctx)
    assert sig == (9, 7, 6, 10, 5)
    other = core.PackedLayout(9, 7, 6, 12, 5)                       # not the call's: core builds its own
    payload = {"layout": other, "seed": 3}
    assert ex.execute(x, t, ctx, {}, minimax_payload=payload) == "out" and got["payload"] is payload
    kf = {"keyframes": [{"resolved_frame_index": 0}], "seed": 3}     # keyframes and no layout: core builds it
    ex.execute(x, t, ctx, {}, minimax_payload=kf)
    assert got["payload"] is kf
    mine = core.PackedLayout(*sig)
    ex.execute(x, t, ctx, {}, minimax_payload={"layout": mine, "seed": 3})
    placed = got["payload"]["layout"]
    assert placed is not mine and placed.position_ids.dtype == torch.float32 and got["payload"]["seed"] == 3
    assert torch.equal(placed.position_ids, mine.position_ids.to(torch.float32))
    assert placed.segments is mine.segments and mine.position_ids.dtype == torch.float64   # the original untouched

    class Foreign:                         # a core whose layout has no update masks
        signature = sig
        position_ids = mine.position_ids

    foreign = {"layout": Foreign()}
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        ex.execute(x, t, ctx, {}, minimax_payload=foreign)
        ex.execute(x, t, ctx, {}, minimax_payload={"layout": mine})
    assert got["payload"]["layout"] is mine                           # off for every later call too
    assert caplog.text.count("packed layout is not the one this pack places") == 1
