"""Issue 17 item 2 through the real ComfyUI (CPU): ``H3TurboNVFP4Loader`` with ``adaln=table`` keeps the AdaLN
weights off the model (CPU memory), computes their output once per timestep group with core's own modules, and
caches the rows on disk per (model, schedule) in the pack's table format (runtime/adaln_memo.py).

- table-driven AdaLN samples bit-identically to resident AdaLN with core's euler/simple (SamplerCustomAdvanced),
  core's ``KSampler`` (euler/simple) and the pack's H3 Turbo Sigmas + H3 Turbo Sampler;
- a second run of the same schedule in a fresh load reads the cached table: no weight reads (counted);
- the cache file is the pack's format and, used as a fixed table, refuses a timestep it does not hold;
- ``auto`` is ``resident`` on the CPU; the model reported to ComfyUI no longer counts the AdaLN weights.
"""
from __future__ import annotations

import os

import pytest
import torch

from h3_turbo.harness import PromptFailed

from corpus import PatchTable  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.comfyui

UNET = "h3_tiny_bf16.safetensors"
_N = [0]


@pytest.fixture(scope="module")
def cache(comfy, tmp_path_factory):
    import nodes

    d = tmp_path_factory.mktemp("adaln_cache")
    old = os.environ.get("H3_TURBO_ADALN_CACHE")
    os.environ["H3_TURBO_ADALN_CACHE"] = str(d)
    nodes.NODE_CLASS_MAPPINGS["H3TurboTestFixedTable"] = PatchTable
    yield str(d)
    nodes.NODE_CLASS_MAPPINGS.pop("H3TurboTestFixedTable", None)
    if old is None:
        os.environ.pop("H3_TURBO_ADALN_CACHE", None)
    else:
        os.environ["H3_TURBO_ADALN_CACHE"] = old


def _loader(adaln):
    inputs = {"unet_name": UNET, "compute": "reference"}
    if adaln is not None:
        inputs["adaln"] = adaln
    return {"class_type": "H3TurboNVFP4Loader", "inputs": inputs}


def _prompt(adaln, kind, steps=3, table=None):
    _N[0] += 1
    p = {"1": _loader(adaln)}
    m = ["1", 0]
    if table:
        p["1f"] = {"class_type": "H3TurboTestFixedTable", "inputs": {"model": m, "table": table}}
        m = ["1f", 0]
    p["2"] = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": m, "shift_video": 6.0, "shift_audio": 3.0}}
    m = ["2", 0]
    p["4"] = {"class_type": "H3TurboTestConditioning", "inputs": {"model": m, "seed": 0, "tokens": 8}}
    p["9"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}}
    if kind == "ksampler":
        p["10"] = {"class_type": "KSampler", "inputs": {"model": m, "seed": 42, "steps": steps, "cfg": 1.0,
                                                        "sampler_name": "euler", "scheduler": "simple",
                                                        "positive": ["4", 0], "negative": ["4", 0],
                                                        "latent_image": ["9", 0], "denoise": 1.0}}
    else:
        p["5"] = {"class_type": "BasicGuider", "inputs": {"model": m, "conditioning": ["4", 0]}}
        if kind == "turbo":
            p["6"] = {"class_type": "H3TurboSigmas", "inputs": {"model": m, "steps": steps}}
            p["7"] = {"class_type": "H3TurboSampler", "inputs": {"state_dtype": "fp32"}}
        else:
            p["6"] = {"class_type": "BasicScheduler", "inputs": {"model": m, "scheduler": "simple", "steps": steps,
                                                                 "denoise": 1.0}}
            p["7"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
        p["8"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}}
        p["10"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["8", 0], "guider": ["5", 0],
                                                                     "sampler": ["7", 0], "sigmas": ["6", 0],
                                                                     "latent_image": ["9", 0]}}
    p["11"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["10", 0]}}
    p["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"h3t/mem{_N[0]}_v"}}
    p["13"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 1], "filename_prefix": f"h3t/mem{_N[0]}_a"}}
    return p


def _sample(comfy, adaln, kind, steps=3, table=None, fresh=True):
    if fresh:
        comfy.executor.reset()      # a fresh load (ComfyUI caches identical nodes): a new, empty memo
    v, a = comfy.run_latents(_prompt(adaln, kind, steps, table), ("12", "13"))
    assert torch.isfinite(v).all() and torch.isfinite(a).all() and float(v.std()) > 0.1
    return v, a


def _eq(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _files(d):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".safetensors"))


@pytest.mark.parametrize("kind,steps", [("euler", 3), ("ksampler", 5), ("turbo", 3)])
def test_table_equals_resident_bit_for_bit_and_second_run_reads_the_cache(comfy, cache, kind, steps):
    """(distinct schedules per case: the cache is per schedule, so KSampler at 3 steps would read euler's)"""
    from h3_turbo.runtime.adaln_memo import WEIGHT_READS

    ref = _sample(comfy, "resident", kind, steps)
    before = set(_files(cache))
    WEIGHT_READS.clear()
    got = _sample(comfy, "table", kind, steps)
    first = WEIGHT_READS.counts
    assert _eq(got[0], ref[0]) and _eq(got[1], ref[1])
    assert first["groups"] >= steps and first["written"] == 1 and first["cached"] == 0   # >= one group a step
    assert first["passes"] == 1       # every group predicted at sampling start: one pass over the weights
    new = sorted(set(_files(cache)) - before)
    assert len(new) == 1
    WEIGHT_READS.clear()
    again = _sample(comfy, "table", kind, steps)                         # fresh load, same schedule
    second = WEIGHT_READS.counts
    assert second["passes"] == second["groups"] == second["written"] == 0 and second["cached"] >= steps
    assert _eq(again[0], ref[0]) and _eq(again[1], ref[1])
    assert sorted(set(_files(cache)) - before) == new


def test_memo_reuses_groups_within_one_load(comfy, cache):
    """The same loaded model, a different seed: the groups computed by the first run are reused in memory."""
    from h3_turbo.runtime.adaln_memo import WEIGHT_READS

    _sample(comfy, "table", "euler", steps=2)
    WEIGHT_READS.clear()
    p = _prompt("table", "euler", 2)
    p["8"]["inputs"]["noise_seed"] = 7
    comfy.run_latents(p, ("12", "13"))
    assert WEIGHT_READS.counts == {"passes": 0, "groups": 0, "cached": 0, "written": 0}


def test_cache_file_is_the_pack_format_and_a_fixed_table_refuses_other_timesteps(comfy, cache):
    from h3_turbo.runtime import adaln as A

    ref = _sample(comfy, "resident", "euler", steps=4)
    before = set(_files(cache))
    _sample(comfy, "table", "euler", steps=4)
    (path,) = sorted(set(_files(cache)) - before)
    t = A.read_table(path)
    assert t.layout == "h3_turbo" and len(t.groups) >= 4 and t.final is not None
    assert t.meta["model_hash"] and t.meta["dtype"] == "torch.float32" and t.meta["device"] == "cpu"
    # the cache as a fixed table on a resident model: the same schedule is served bit-identically ...
    fixed = _sample(comfy, "resident", "euler", steps=4, table=path)
    assert _eq(fixed[0], ref[0]) and _eq(fixed[1], ref[1])
    # ... another schedule is refused with the timestep named, never interpolated
    with pytest.raises(PromptFailed, match=r"timestep .* is not in the AdaLN table .*never interpolated"):
        _sample(comfy, "resident", "euler", steps=3, table=path)


def test_auto_is_resident_on_cpu_and_table_takes_the_weights_off_the_model(comfy, fixtures_dir, cache):
    from h3_turbo.runtime import adaln_memo, loading

    path = fixtures_dir["bf16"]
    res = loading.load_h3_model(path, "reference", adaln="resident")
    auto = loading.load_h3_model(path, "reference")
    tab = loading.load_h3_model(path, "reference", adaln="table")
    dm = res.model.diffusion_model
    n = adaln_memo.adaln_bytes(dm)
    assert n > 0 and adaln_memo.memo_of(auto) is None and adaln_memo.memo_of(res) is None
    assert adaln_memo.memo_of(tab) is not None
    assert int(auto.model_size()) == int(res.model_size())
    assert int(tab.model_size()) == int(res.model_size()) - n
    # only the 0-element key slots of runtime/adaln_lora.py (a LoRA's AdaLN keys reach the refusal) remain
    assert not any(t.numel() for k, t in tab.model.state_dict().items() if "adaln_proj" in k or "time_embedder" in k)
    assert loading.resolve_adaln("auto", dm, torch.device("cpu"), 1 << 40)[0] == "resident"
    with pytest.raises(ValueError, match="adaln='lean': expected one of auto, resident, table"):
        loading.load_h3_model(path, "reference", adaln="lean")


def test_adaln_input_is_optional(comfy, cache):
    """A saved workflow without the new input loads as before (resident on the CPU)."""
    ref = _sample(comfy, "resident", "euler", steps=2)
    old = _sample(comfy, None, "euler", steps=2)
    assert _eq(old[0], ref[0]) and _eq(old[1], ref[1])


def test_cached_rows_equal_core_resident_modules_per_group(comfy, fixtures_dir, cache):
    """Every group of a written cache: its rows = core's own time_embedder + adaln_proj on the resident model,
    one batch per group as core's forward (torch.equal), and the rows differ between groups."""
    from h3_turbo.runtime import adaln as A
    from h3_turbo.runtime import loading

    before = set(_files(cache))
    _sample(comfy, "table", "euler", steps=6)
    (path,) = sorted(set(_files(cache)) - before)
    t = A.read_table(path)
    dm = loading.load_h3_model(fixtures_dir["bf16"], "reference", adaln="resident").model.diffusion_model
    with torch.no_grad():
        for g, s in zip(t.groups, t.starts):
            tv = torch.tensor(g, dtype=torch.int32).view(torch.float32)
            temb = dm.time_embedder(tv).to(torch.float32)
            for i, blk in enumerate(dm.blocks):
                assert torch.equal(torch.cat(blk.adaln_proj(temb), -1).reshape(len(g), -1), t.blocks[i][s:s + len(g)])
            assert torch.equal(torch.cat(dm.final_layer.adaln_proj(temb), -1).reshape(len(g), -1), t.final[s:s + len(g)])
    assert not torch.equal(t.blocks[0][t.starts[0]], t.blocks[0][t.starts[1]])


def test_with_weights_on_runs_the_module_on_copies_and_leaves_it_untouched(comfy):
    """The GPU pass of the AdaLN table runs each module with its weights copied to the device (no move and no copy
    back): forced here on the CPU, the copies give the module's own numbers bit for bit and the module keeps its own
    tensors (same storage, same values); tensors already on the device return the module itself."""
    from h3_turbo.runtime import adaln_memo

    lin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    lin.register_buffer("marker", torch.ones(3))
    x = torch.randn(5, 8)
    assert adaln_memo.with_weights_on(lin, "cpu") is lin
    before = {n: (t.clone(), t.data_ptr()) for n, t in lin.state_dict().items()}
    seen = []
    h = lin[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr()))
    f = adaln_memo.with_weights_on(lin, "cpu", force_copy=True)
    assert torch.equal(f(x), lin(x))
    h.remove()
    assert seen[0] != before["0.weight"][1] and seen[1] == before["0.weight"][1]   # the call ran on the copy
    assert all(torch.equal(t, before[n][0]) and t.data_ptr() == before[n][1] for n, t in lin.state_dict().items())


def test_device_copies_of_the_rows_are_freed_when_comfyui_unloads_the_model(comfy, cache):
    """adaln=table's per-device copy of the rows (runtime/adaln_memo.py ``_Staged``) is made by the forwards and
    freed by ComfyUI's real unload (ON_DETACH with unpatch_all), not by a clone hand-over."""
    import comfy.model_management as mm

    from h3_turbo.runtime import adaln_memo

    _sample(comfy, "table", "euler", steps=2)
    memos = [adaln_memo.memo_of(lm.model) for lm in mm.current_loaded_models]
    memos = [m for m in memos if m is not None]
    assert memos and all(m._staged for m in memos), "no loaded adaln=table model with device copies"
    mm.unload_all_models()
    assert all(not m._staged for m in memos)
