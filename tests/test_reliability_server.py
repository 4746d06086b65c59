"""Issue 8, server half: no cross-talk between requests and no resident-memory growth, on ONE real ComfyUI
server (the session ``server`` fixture of tests/conftest.py, shared with tests/test_server.py).

The requests sample the 2+1-block variant of the tiny fixtures (``corpus.write_small_fixtures``: same widths
and latents as the 50+2-block fixture, ~0.15 s per step on 2 cores) at 64x64, length 5, 4 / 8 steps.

- ``test_back_to_back_requests_equal_solo_runs``: one solo run per kind (4step, 8step, none = reference and
  warm-up), then 20 alternating 4step / 8step / none requests plus two bad requests (a truncated model, an
  adapter with missing targets) are ALL queued before waiting. Every good output equals the solo run of the
  same request bit for bit; each bad one fails with its own message; ``/h3turbo/ready`` stays consistent
  while the queue runs (current_turbo always one of the three, at most the two adapters resident) and ends at
  the last request's adapter; the adapter load counter shows each adapter read from disk once; every request
  reuses the loaded base from ComfyUI's cache, also right after the failed ones.
- Memory: the server's RSS (psutil, the ComfyUI process) after good request 10 and after request 20 of that
  queue differ by less than :data:`RSS_TOLERANCE_MB` (the solo runs are the warm-up). Measured on 2 cores:
  see the report printed by the test (``-s``).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import av_prompt, build_adapter_corpus, write_small_fixtures  # noqa: E402

pytestmark = pytest.mark.server

RSS_TOLERANCE_MB = 50
N_GOOD = 20
WAIT_S = 300
SUB = "h3rel"


@pytest.fixture(scope="module")
def rel_server(server, tmp_path_factory):
    """The server plus the small fixtures and two bad files in its models folders."""
    from h3_turbo.tools.variants import damage

    models = str(server["base"] / "models")
    small = write_small_fixtures(models, SUB, str(tmp_path_factory.mktemp("rel_small_src")))
    bad_model = os.path.join(models, "diffusion_models", SUB, "h3rel_truncated.safetensors")
    damage(small["unet_path"], "truncated", bad_model)
    bad_lora = build_adapter_corpus({"lora_4step": small["lora_4step_path"]},
                                    str(tmp_path_factory.mktemp("rel_bad_lora")))["missing_targets"]
    dst = os.path.join(models, "loras", SUB, "h3rel_missing_targets.safetensors")
    with open(bad_lora, "rb") as f, open(dst, "wb") as g:
        g.write(f.read())
    return dict(server, small=small, bad_model=f"{SUB}/h3rel_truncated.safetensors", bad_model_path=bad_model,
                bad_lora=f"{SUB}/h3rel_missing_targets.safetensors", bad_lora_path=dst)


def _kinds(s) -> dict:
    """kind -> (turbo input, steps, seed)."""
    return {"4step": (s["small"]["lora_4step"], 0, 11), "8step": (s["small"]["lora_8step"], 0, 12),
            "none": ("none", 4, 13)}


def _prompt(s, kind, tag):
    turbo, steps, seed = _kinds(s)[kind]
    return av_prompt(unet=s["small"]["unet"], turbo=turbo, steps=steps, seed=seed, tag=tag)


def _latents(s, entry) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    res = []
    for nid in ("11", "12"):
        info = entry["outputs"][nid]["latents"][0]
        res.append(load_file(str(Path(s["output"]) / info["subfolder"] / info["filename"]))["latent_tensor"])
    return res[0], res[1]


def _rss_mb(proc) -> float:
    import psutil

    return psutil.Process(proc.pid).memory_info().rss / 2**20


def _status(entry) -> tuple[str, list]:
    st = entry.get("status") or {}
    return st.get("status_str"), st.get("messages") or []


def _mine(ready, s) -> dict:
    """resident_turbos entries of this test's two adapters."""
    files = {os.path.basename(s["small"]["lora_4step"]), os.path.basename(s["small"]["lora_8step"])}
    return {k: v for k, v in ready["resident_turbos"].items() if v.get("file") in files}


def test_back_to_back_requests_equal_solo_runs(rel_server):
    from h3_turbo.client import Client

    s = rel_server
    c = Client(s["url"])
    loads0 = c.ready()["adapter_loads"]
    assert set(loads0) >= {"loads", "hits", "evictions"}, loads0
    # solo runs (reference + warm-up), each waited for before the next
    solo = {}
    for kind in ("4step", "8step", "none"):
        pid = c.queue(_prompt(s, kind, f"solo_{kind}"), "h3rel")
        e = c.wait_history(pid, WAIT_S)
        assert _status(e)[0] == "success", _status(e)
        solo[kind] = _latents(s, e)
        assert torch.isfinite(solo[kind][0]).all()
    assert not torch.equal(solo["4step"][0], solo["8step"][0]) and not torch.equal(solo["4step"][0], solo["none"][0])
    rss_warm = _rss_mb(s["proc"])
    # 20 good requests alternating 4step / 8step / none, and two bad ones, ALL queued before waiting
    order = ["4step", "8step", "none"]
    plan = []
    for i in range(N_GOOD):
        plan.append(("good", order[i % 3], _prompt(s, order[i % 3], f"q{i:02d}")))
        if i == 4:
            p = _prompt(s, "4step", "bad_model")
            p["1"]["inputs"]["unet_name"] = s["bad_model"]
            plan.append(("bad_model", None, p))
        if i == 10:
            p = _prompt(s, "4step", "bad_lora")
            p["2"]["inputs"]["turbo"] = s["bad_lora"]
            plan.append(("bad_lora", None, p))
    ids = [c.queue(p, "h3rel") for _, _, p in plan]
    seen_current, max_mine, rss = set(), 0, {}
    good_done = 0
    entries = []
    for (what, kind, _), pid in zip(plan, ids):
        t_end = time.monotonic() + WAIT_S
        while True:
            e = c.history(pid)
            r = c.ready()
            seen_current.add(r["current_turbo"])
            max_mine = max(max_mine, len(_mine(r, s)))
            if e is not None and (e.get("status") or {}).get("completed") is not None:
                break
            assert time.monotonic() < t_end, f"request {pid} not done after {WAIT_S} s"
            time.sleep(0.1)
        entries.append(e)
        if what == "good":
            good_done += 1
            if good_done in (N_GOOD // 2, N_GOOD):
                rss[good_done] = _rss_mb(s["proc"])
    # every good output equals its solo run, bit for bit; the sampler really ran each time; the loaded base was
    # reused from ComfyUI's cache by every request, also right after the failed ones (nothing lost)
    for (what, kind, _), e in zip(plan, entries):
        st, msgs = _status(e)
        if what != "good":
            continue
        assert st == "success", (kind, st, msgs)
        v, a = _latents(s, e)
        assert torch.equal(v, solo[kind][0]) and torch.equal(a, solo[kind][1]), f"{kind} differs from its solo run"
        cached = [n for ev, d in msgs if ev == "execution_cached" for n in d.get("nodes", [])]
        assert "9" not in cached, f"the sampler output was served from the cache: {cached}"
        assert "1" in cached, f"the base model was loaded again: cached nodes {cached}"
    # the bad requests failed with their own message, in their own node
    for (what, _, _), e in zip(plan, entries):
        if what == "good":
            continue
        st, msgs = _status(e)
        err = next(d for ev, d in msgs if ev == "execution_error")
        assert st == "error"
        if what == "bad_model":
            assert err["node_type"] == "H3TurboNVFP4Loader"
            assert err["exception_message"].startswith(f"{s['bad_model_path']}: tensor ")
            assert "file is truncated" in err["exception_message"]
        else:
            assert err["node_type"] == "H3TurboLoRA"
            assert err["exception_message"].strip().startswith(
                "Turbo LoRA 'h3rel_missing_targets.safetensors' does not fit this model (12 targets expected, 8 in "
                "the file); missing targets: 4 [blocks.1.attn.out_proj, blocks.1.attn.qkv_proj, blocks.1.mlp.fc1, "
                "blocks.1.mlp.fc2].")
    # /h3turbo/ready stayed consistent and ends at the last request's adapter
    names = {s["small"]["lora_4step"], s["small"]["lora_8step"], "none"}
    assert seen_current <= names | {"none"}, seen_current
    final = c.ready()
    last_kind = order[(N_GOOD - 1) % 3]
    assert final["current_turbo"] == _kinds(s)[last_kind][0], (final["current_turbo"], last_kind)
    assert max_mine <= 2 and len(_mine(final, s)) == 2, (max_mine, final["resident_turbos"])
    assert {v["variant"] for v in _mine(final, s).values()} == {"4step", "8step"}
    # each adapter read from disk once over 3 solo + 21 queued uses (the missing-targets file once more)
    loads = final["adapter_loads"]
    assert loads["loads"] - loads0["loads"] == 3, (loads0, loads)
    uses = 2 + sum(1 for what, kind, _ in plan if what == "good" and kind != "none")  # solo + queued
    assert loads["hits"] - loads0["hits"] == uses - 2, (loads0, loads, uses)
    # memory: the last 10 requests do not grow the resident set
    growth = rss[N_GOOD] - rss[N_GOOD // 2]
    print(f"\nRSS MB: after warm-up {rss_warm:.1f}, after request {N_GOOD // 2} {rss[N_GOOD // 2]:.1f}, "
          f"after {N_GOOD} {rss[N_GOOD]:.1f} (growth over the last {N_GOOD // 2}: {growth:+.1f} MB); "
          f"adapter loads {loads}")
    assert growth < RSS_TOLERANCE_MB, f"RSS grew {growth:.1f} MB over the last {N_GOOD // 2} requests"
    assert s["proc"].poll() is None
