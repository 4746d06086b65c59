"""The hot API end to end: a REAL ComfyUI server (``main.py --cpu --listen 127.0.0.1``) with this pack in
``custom_nodes/`` and the tiny fixtures in ``models/``, driven over HTTP + websocket by
``h3_turbo.client`` (the CLI as a subprocess and its functions).

One server per test session (startup ~20-40 s on 2 cores); it is killed in the fixture teardown. The
scanner unit tests at the bottom need no server.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import _log_tail  # tests/ is on sys.path (as for tests/corpus)

REPO = Path(__file__).resolve().parent.parent
TINY_API = REPO / "example_workflows" / "api" / "h3turbo_tiny_demo.json"
RUN_TIMEOUT_S = 300


# The session-scoped ``server`` fixture (one real ComfyUI server shared by every server test) lives in
# tests/conftest.py.


def _cli(*args, timeout=RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3_turbo.client", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO.parent))


def _ready(server) -> dict:
    from h3_turbo.client import Client

    return Client(server["url"]).ready()


def _wait_scan(server, timeout=60.0) -> dict:
    t_end = time.monotonic() + timeout
    while True:
        r = _ready(server)
        if r["scan"]["state"] == "done":
            return r
        if time.monotonic() > t_end:
            pytest.fail(f"Turbo scan not done after {timeout} s: {r['scan']}")
        time.sleep(0.2)


def _pack_nodes(server) -> set[str]:
    return set(_ready(server)["nodes"])


def _need(server, *node_ids):
    missing = [n for n in node_ids if n not in _pack_nodes(server)]
    if missing:
        pytest.skip(f"node(s) {', '.join(missing)} not registered by the pack yet (nodes/lora.py, nodes/sampler.py, "
                    f"nodes/loader.py and NODE_MODULES)")


TINY_NODES = ("H3TurboNVFP4Loader", "H3TurboLoRA", "H3TurboSigmas", "H3TurboSampler", "H3TurboTestConditioning",
              "H3TurboSaveLatentPreview")


# ----------------------------------------------------------------------------------------- route
@pytest.mark.server
def test_ready_route_reports_pack_state(server):
    import requests

    from h3_turbo import __version__

    r = _wait_scan(server)
    for k in ("ready", "available_turbos", "resident_turbos", "current_turbo", "loaded_models", "device",
              "versions", "scan", "nodes"):
        assert k in r, k
    assert r["ready"] is True
    assert r["device"]["type"] == "cpu"
    assert r["versions"]["h3_turbo"] == __version__
    assert r["versions"]["comfyui"]
    assert {"H3TurboTestConditioning", "H3TurboSaveLatentPreview"} <= set(r["nodes"])
    # both fixture LoRAs recognized from their header metadata, hashed in the background
    by_file = {t["file"]: t for t in r["available_turbos"]}
    four = by_file["h3_tiny_turbo_4step_comfyui_bf16.safetensors"]
    eight = by_file["h3_tiny_turbo_8step_comfyui_bf16.safetensors"]
    assert (four["variant"], four["nfe"], four["shift_video"]) == ("4step", 4, 6.0)
    assert (eight["variant"], eight["nfe"], eight["shift_video"]) == ("8step", 8, 12.0)
    import hashlib

    for t, key in ((four, "lora_4step"), (eight, "lora_8step")):
        assert t["sha256"] == hashlib.sha256(Path(server["models"][key]).read_bytes()).hexdigest()
        assert t["verified"] is None  # no published hash for fixtures
    # the route is also mounted under /api, and the CLI prints the same JSON
    assert requests.get(server["url"] + "/api/h3turbo/ready", timeout=10).json()["nodes"] == r["nodes"]
    p = _cli("ready", "--server", server["url"], timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["versions"] == r["versions"]


@pytest.mark.server
def test_templates_listed_under_pack_name(server):
    import requests

    from h3_turbo.tools import workflows

    got = requests.get(server["url"] + "/api/workflow_templates", timeout=10).json()
    assert sorted(got["h3_turbo"]) == sorted(w.name for w in workflows.workflows())
    ui = requests.get(server["url"] + "/api/workflow_templates/h3_turbo/h3turbo_tiny_demo.json", timeout=10)
    assert ui.status_code == 200
    assert ui.json() == json.loads((REPO / "example_workflows" / "h3turbo_tiny_demo.json").read_text())


# ----------------------------------------------------------------------------------------- runs
@pytest.mark.server
def test_submit_tiny_workflow_downloads_outputs(server, tmp_path):
    _need(server, *TINY_NODES)
    out = tmp_path / "out"
    p = _cli("submit", str(TINY_API), "--server", server["url"], "--out", str(out), "--json", "--no-progress")
    assert p.returncode == 0, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}\nserver:\n{_log_tail(server['log'])}"
    res = json.loads(p.stdout)
    files = [Path(f) for f in res["files"]]
    names = sorted(f.name for f in files)
    assert any(n.startswith("tiny_video") and n.endswith(".latent") for n in names), names
    assert any(n.startswith("tiny_audio") and n.endswith(".latent") for n in names), names
    for f in files:
        assert f.is_file() and f.stat().st_size > 0
        assert f.read_bytes() == (server["output"] / f.relative_to(out)).read_bytes()
    from safetensors.torch import load_file

    v = load_file(str(next(f for f in files if f.name.startswith("tiny_video"))))["latent_tensor"]
    a = load_file(str(next(f for f in files if f.name.startswith("tiny_audio"))))["latent_tensor"]
    assert tuple(v.shape) == (1, 24, 7, 6, 8)  # 128x96, 22 frames -> 7 latent frames, /16 spatial
    assert tuple(a.shape) == (1, 32, 2, 37)  # 22 frames at 24 fps -> round(22/24*40)
    assert bool(v.isfinite().all()) and bool(a.isfinite().all())


@pytest.mark.server
def test_invalid_model_file_is_a_comfy_error_and_server_survives(server, tmp_path):
    from h3_turbo.client import Client, PromptRejected, load_workflow

    prompt = load_workflow(TINY_API)
    loader = next(i for i, n in prompt.items() if n["inputs"].get("unet_name"))
    p = _cli("submit", str(TINY_API), "--server", server["url"], "--out", str(tmp_path),
             "--set", f"{loader}.unet_name=no_such_model.safetensors", "--no-progress")
    assert p.returncode == 2, p.stderr
    assert "no_such_model.safetensors" in p.stderr
    assert f"node {loader}" in p.stderr and "unet_name" in p.stderr
    # the same through the functions: ComfyUI's own 400 body is kept
    prompt[loader]["inputs"]["unet_name"] = "no_such_model.safetensors"
    with pytest.raises(PromptRejected) as ei:
        Client(server["url"]).submit(prompt, progress=False, timeout=60)
    ne = ei.value.payload["node_errors"][loader]["errors"][0]
    assert ne["type"] == "value_not_in_list" and "no_such_model.safetensors" in ne["details"]
    assert server["proc"].poll() is None
    assert _ready(server)["ready"] is True


@pytest.mark.server
def test_bad_set_argument_is_a_client_error(server, tmp_path):
    p = _cli("submit", str(TINY_API), "--server", server["url"], "--set", "NoSuchNode.x=1", "--no-progress")
    assert p.returncode == 3 and "NoSuchNode" in p.stderr
    p = _cli("submit", str(REPO / "example_workflows" / "h3turbo_tiny_demo.json"), "--server", server["url"])
    assert p.returncode == 3 and "UI-format" in p.stderr


@pytest.mark.server
def test_wrong_steps_for_turbo_is_an_execution_error(server, tmp_path):
    _need(server, *TINY_NODES)
    p = _cli("submit", str(TINY_API), "--server", server["url"], "--out", str(tmp_path),
             "--set", "H3TurboSigmas.steps=5", "--no-progress")
    assert p.returncode == 1, f"{p.stdout}\n{p.stderr}"
    assert "H3TurboSigmas" in p.stderr and "steps=5" in p.stderr and "grid points" in p.stderr
    assert server["proc"].poll() is None
    assert _ready(server)["ready"] is True


@pytest.mark.server
def test_turbo_switch_per_request_keeps_base_loaded(server, tmp_path):
    """4step -> 8step -> none on one server: current_turbo follows each request, the loader is not re-run."""
    from h3_turbo.client import Client, apply_sets, load_workflow

    _need(server, *TINY_NODES)
    c = Client(server["url"])
    base = load_workflow(TINY_API)
    loader = next(i for i, n in base.items() if n["class_type"] == "H3TurboNVFP4Loader")
    runs = [("h3_tiny_turbo_4step_comfyui_bf16.safetensors", 0, "4step"),
            ("h3_tiny_turbo_8step_comfyui_bf16.safetensors", 0, "8step"),
            ("none", 1, "none")]
    loaded = None
    for i, (turbo, steps, expect) in enumerate(runs):
        prompt = apply_sets(base, [f"H3TurboLoRA.turbo={turbo}", f"H3TurboSigmas.steps={steps}",
                                   f"RandomNoise.noise_seed={100 + i}"])
        res = c.submit(prompt, out_dir=tmp_path / str(i), progress=False, timeout=RUN_TIMEOUT_S)
        assert res["files"], res
        r = _ready(server)
        cur = r["current_turbo"]
        assert cur == expect or (expect != "none" and cur in (turbo, os.path.basename(turbo))), (expect, cur)
        cached = [n for ev, d in res["events"] if ev == "execution_cached" for n in d.get("nodes", [])]
        if i > 0:
            assert loader in cached, f"run {i}: the base loader ran again (cached nodes {cached})"
        if r["loaded_models"]:
            if loaded is None:
                loaded = r["loaded_models"]
            assert r["loaded_models"] == loaded, "the base model was reloaded"
    # a resident adapter is `verified` exactly as the same file in available_turbos (README "Hot API")
    r = _wait_scan(server)
    avail = {t["file"]: t["verified"] for t in r["available_turbos"]}
    resident = {v["file"]: v["verified"] for v in r["resident_turbos"].values() if v["file"] in avail}
    assert set(resident) >= {os.path.basename(t) for t, _, e in runs if e != "none"}, r["resident_turbos"]
    assert resident == {f: avail[f] for f in resident} and set(resident.values()) == {None}


# ----------------------------------------------------------------------------------------- scanner units
def test_scanner_recognizes_by_name_metadata_and_hash(tmp_path, fixtures_dir):
    """Names: official file name -> its variant (and a wrong hash is reported); fixture metadata -> variant;
    an H3-LoRA-shaped file with an unknown name and hash is not listed; other files are ignored."""
    import shutil

    from h3_turbo import state
    from h3_turbo.adapters import contracts, scan

    official = tmp_path / contracts.KNOWN_ARTIFACTS[0].filename
    shutil.copy(fixtures_dir["lora_4step"], official)  # official name, fixture bytes: hash mismatch
    renamed = tmp_path / "my_renamed_lora.safetensors"
    from safetensors.torch import load_file, save_file

    save_file(load_file(fixtures_dir["lora_8step"]), str(renamed))  # no metadata: a hash-only candidate
    (tmp_path / "notes.txt").write_text("x")
    files = [(p.name, str(p)) for p in (official, renamed, tmp_path / "notes.txt", Path(fixtures_dir["lora_4step"]))]
    sc = scan.TurboScanner(lister=lambda: files)
    assert sc.start()
    assert sc.wait(60)
    st = sc.status()
    assert st["state"] == "done" and st["pending_hashes"] == 0 and st["files_seen"] == 4
    items = {i["file"]: i for i in sc.items()}
    assert set(items) == {official.name, Path(fixtures_dir["lora_4step"]).name}
    o = items[official.name]
    assert (o["variant"], o["source"], o["verified"]) == ("4step", "filename", False)
    assert o["expected_sha256"] == contracts.KNOWN_ARTIFACTS[0].sha256 and "differs from the published" in o["error"]
    f = items[Path(fixtures_dir["lora_4step"]).name]
    assert (f["variant"], f["source"], f["verified"], f["nfe"]) == ("4step", "fixture-metadata", None, 4)
    assert f["sha256"] == o["sha256"]  # same bytes
    assert [i["file"] for i in state.snapshot()["available_turbos"]] == sorted(items, key=lambda n: (items[n]["variant"], n))


def test_scanner_lists_a_renamed_official_file_by_hash(tmp_path, monkeypatch, fixtures_dir):
    """A file with an unknown name whose SHA-256 is published is listed with the official contract."""
    import hashlib

    from h3_turbo.adapters import contracts, scan
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed.safetensors"
    save_file(load_file(fixtures_dir["lora_8step"]), str(renamed))
    sha = hashlib.sha256(renamed.read_bytes()).hexdigest()
    art = contracts.KnownArtifact("x_8step.safetensors", sha, contracts.TurboContract("8step", 8, 12.0, 3.0, 1 / 16))
    monkeypatch.setattr(contracts, "KNOWN_ARTIFACTS", contracts.KNOWN_ARTIFACTS + (art,))
    sc = scan.TurboScanner(lister=lambda: [(renamed.name, str(renamed))])
    sc.start()
    assert sc.wait(60)
    (item,) = sc.items()
    assert (item["variant"], item["source"], item["verified"], item["sha256"]) == ("8step", "sha256", True, sha)
    assert item["official_name"] == "x_8step.safetensors"


def test_ready_payload_is_cheap_and_complete(monkeypatch):
    """The route body reads cached state only: no hashing inside (sha256_file is never called)."""
    from h3_turbo import server_routes, state
    from h3_turbo.adapters import turbo_lora

    def boom(*a, **k):
        raise AssertionError("hashing inside the request")

    monkeypatch.setattr(turbo_lora, "sha256_file", boom)
    state.set_current_turbo("8step")
    body = server_routes.ready_payload()
    assert body["current_turbo"] == "8step"
    for k in ("ready", "available_turbos", "resident_turbos", "loaded_models", "device", "versions", "scan"):
        assert k in body
    json.dumps(body, default=str)
    state.set_current_turbo("none")
    # the README's table of the answer lists exactly its keys
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    hot = readme[readme.index("## Hot API"):]
    hot = hot[:hot.index("\n## ", 1)]
    documented = re.findall(r"^\| `(\w+)` \|", hot, flags=re.M)
    assert sorted(documented) == sorted(body), (documented, sorted(body))


# ----------------------------------------------------------------------------------------- client units
def test_apply_sets_by_id_title_and_class_type():
    from h3_turbo.client import ClientError, apply_sets, load_workflow

    p = load_workflow(TINY_API)
    q = apply_sets(p, ["RandomNoise.noise_seed=7", "Save video latent.filename_prefix=a/b", "3.tokens=32",
                       'H3TurboLoRA.turbo="none"', "H3TurboLoRA.strength=0.5"])
    assert q["7"]["inputs"]["noise_seed"] == 7
    assert q["11"]["inputs"]["filename_prefix"] == "a/b"
    assert q["3"]["inputs"]["tokens"] == 32 and q["2"]["inputs"]["turbo"] == "none"
    assert q["2"]["inputs"]["strength"] == 0.5
    assert p["7"]["inputs"]["noise_seed"] == 42  # the original is untouched
    with pytest.raises(ClientError, match="2 nodes have class_type 'SaveLatent'"):
        apply_sets(p, ["SaveLatent.filename_prefix=x"])
    with pytest.raises(ClientError, match="has no input 'seeed'"):
        apply_sets(p, ["RandomNoise.seeed=1"])
    with pytest.raises(ClientError, match="expected NODE_OR_TITLE.INPUT=VALUE"):
        apply_sets(p, ["RandomNoise.noise_seed"])


def test_load_workflow_refuses_ui_format(tmp_path):
    from h3_turbo.client import ClientError, load_workflow

    with pytest.raises(ClientError, match="UI-format"):
        load_workflow(REPO / "example_workflows" / "h3turbo_tiny_demo.json")
    (tmp_path / "x.json").write_text("{\"a\": 1}")
    with pytest.raises(ClientError, match="not an API-format workflow"):
        load_workflow(tmp_path / "x.json")


def test_error_messages_keep_comfy_details():
    from h3_turbo.client import format_execution_error, format_rejection

    body = {"error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                      "details": "", "extra_info": {}},
            "node_errors": {"1": {"errors": [{"type": "value_not_in_list", "message": "Value not in list",
                                              "details": "unet_name: 'x.safetensors' not in [...]",
                                              "extra_info": {"input_name": "unet_name"}}],
                                  "dependent_outputs": ["11"], "class_type": "H3TurboNVFP4Loader"}}}
    assert format_rejection(body) == ("Prompt outputs failed validation\n  node 1 (H3TurboNVFP4Loader) input "
                                      "'unet_name': Value not in list: unet_name: 'x.safetensors' not in [...]")
    assert format_execution_error({"node_id": "5", "node_type": "H3TurboSigmas", "exception_type": "ValueError",
                                   "exception_message": "bad steps\n"}) == \
        "node 5 (H3TurboSigmas) failed: ValueError: bad steps"
