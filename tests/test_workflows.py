"""Example workflows: the committed files equal the generator's output, each UI file converts to the same
graph as its API twin, the node specs match the live ComfyUI definitions (comfyui), and the API files
pass ComfyUI's own ``validate_prompt`` (comfyui; real-model workflows may only lack their model files)."""
from __future__ import annotations

import copy
import glob
import json
import os
from pathlib import Path

import pytest

from h3_turbo.adapters import contracts
from h3_turbo.tools import workflows as W

REPO = Path(__file__).resolve().parent.parent
EX = REPO / "example_workflows"
NAMES = [w.name for w in W.workflows()]


def _load(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8"))


def test_committed_files_equal_generator_output():
    files = W.rendered(EX)
    stale = [str(p) for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
    assert not stale, f"out of date, run `python -m h3_turbo.tools.workflows`: {stale}"
    on_disk = {Path(p) for p in glob.glob(str(EX / "*.json")) + glob.glob(str(EX / "api" / "*.json"))}
    assert on_disk == set(files), f"files not made by the generator: {sorted(map(str, on_disk - set(files)))}"
    assert W.main(["--check"]) == 0


def test_check_mode_detects_a_stale_file(tmp_path):
    assert W.main(["--out", str(tmp_path)]) == 0
    assert W.main(["--check", "--out", str(tmp_path)]) == 0
    p = tmp_path / "api" / "h3turbo_tiny_demo.json"
    p.write_text(p.read_text().replace('"tokens": 16', '"tokens": 17'))
    assert W.main(["--check", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("name", NAMES)
def test_ui_file_converts_to_its_api_twin(name):
    ui, api = _load(EX / f"{name}.json"), _load(EX / "api" / f"{name}.json")
    assert W.ui_to_api(ui) == api


@pytest.mark.parametrize("name", NAMES)
def test_ui_file_is_a_consistent_litegraph_graph(name):
    ui = _load(EX / f"{name}.json")
    assert ui["version"] == 0.4
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert len(nodes) == len(ui["nodes"]) and ui["last_node_id"] == max(nodes)
    assert ui["last_link_id"] == len(ui["links"]) == len({lk[0] for lk in ui["links"]})
    for lid, src, sslot, dst, dslot, typ in ui["links"]:
        out = nodes[src]["outputs"][sslot]
        inp = nodes[dst]["inputs"][dslot]
        assert lid in out["links"] and inp["link"] == lid
        assert out["type"] == inp["type"] == typ, (lid, out, inp)
    for n in ui["nodes"]:
        for k, o in enumerate(n["outputs"]):
            for lid in o["links"] or []:
                assert [lk for lk in ui["links"] if lk[0] == lid][0][1:3] == [n["id"], k]
        ins, outs, _ = W.SPECS[n["type"]]
        nwidgets = sum(1 + ("+ctrl" in k) + ("+upload" in k) for _, _, k in ins if k.startswith("widget"))
        assert len(n.get("widgets_values", [])) == nwidgets, n["type"]
        assert ("widgets_values" in n) == (nwidgets > 0), n["type"]  # as the frontend saves a node
        assert [(o["name"], o["type"]) for o in n["outputs"]] == list(outs)
        assert sorted(n["order"] for n in ui["nodes"]) == list(range(len(ui["nodes"])))
    # order is a topological order of the links
    for _, src, _, dst, _, _ in ui["links"]:
        assert nodes[src]["order"] < nodes[dst]["order"]
    notes = [n for n in ui["nodes"] if n["type"] == "MarkdownNote"]
    assert len(notes) == 1 and "## Files" in notes[0]["widgets_values"][0]


TITLE_H = W.TITLE_H


def _rect(n):
    x, y = n["pos"]
    w, h = n["size"]
    return (x, y - TITLE_H, x + w, y + h)


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("name", NAMES)
def test_ui_layout_has_no_overlaps(name):
    """Nodes do not overlap, groups do not overlap, and a group holds exactly its member nodes (the frontend
    moves every node inside a group's rectangle with it)."""
    ui = _load(EX / f"{name}.json")
    rects = {n["id"]: _rect(n) for n in ui["nodes"]}
    ids = sorted(rects)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            assert not _overlap(rects[a], rects[b]), (name, a, b, rects[a], rects[b])
    groups = [(g["title"], (g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2],
                            g["bounding"][1] + g["bounding"][3])) for g in ui["groups"]]
    for i, (ta, ga) in enumerate(groups):
        for tb, gb in groups[i + 1:]:
            assert not _overlap(ga, gb), (name, ta, tb)
    wf = next(w for w in W.workflows() if w.name == name)
    for title, members in wf.groups:
        g = dict(groups)[title]
        for nid, r in rects.items():
            inside = g[0] <= r[0] and g[1] <= r[1] and r[2] <= g[2] and r[3] <= g[3]
            assert _overlap(g, r) == inside == (nid in members), (name, title, nid)


def test_ui_to_api_refuses_misaligned_widgets():
    ui = W.to_ui(W.workflows()[-1])
    bad = copy.deepcopy(ui)
    n = next(n for n in bad["nodes"] if n["type"] == "RandomNoise")
    n["widgets_values"] = n["widgets_values"][:1]  # the control_after_generate value is missing
    with pytest.raises(ValueError, match="RandomNoise"):
        W.ui_to_api(bad)
    bad = copy.deepcopy(ui)
    bad["nodes"][0]["type"] = "NoSuchNode"
    with pytest.raises(ValueError, match="NoSuchNode"):
        W.ui_to_api(bad)


def test_generator_refuses_unknown_inputs():
    wf = W.Workflow("x", "x", [W.Node(1, "RandomNoise", {"noise_seed": 1, "seed": 2})])
    with pytest.raises(ValueError, match="no input 'seed'"):
        W.to_api(wf)
    wf = W.Workflow("x", "x", [W.Node(1, "BasicGuider", {"model": (2, 0)})])
    with pytest.raises(ValueError, match="missing node 2|lacks required input"):
        W.to_api(wf)


def _api(name):
    return _load(EX / "api" / f"{name}.json")


def _by_type(api, t):
    return [n for n in api.values() if n["class_type"] == t]


@pytest.mark.parametrize("variant,nfe", [("4step", 4), ("8step", 8)])
def test_turbo_workflows_use_contract_steps_and_official_files(variant, nfe):
    name = f"h3turbo_fl2va_turbo_{variant}_nvfp4"
    api = _api(name)
    official = next(a.filename for a in contracts.KNOWN_ARTIFACTS if a.sha256 and a.contract.variant == variant)
    assert official == (W.TURBO_4STEP if nfe == 4 else W.TURBO_8STEP)
    (lora,) = _by_type(api, "H3TurboLoRA")
    # the official file by name (the frontend offers its download when it is missing; the alias would not)
    assert lora["inputs"]["turbo"] == official and lora["inputs"]["strength"] == 1.0
    (sig,) = _by_type(api, "H3TurboSigmas")
    assert sig["inputs"]["steps"] == 0  # = the contract's NFE
    assert _by_type(api, "H3TurboSampler")[0]["inputs"]["state_dtype"] == "fp32"
    assert not _by_type(api, "BasicScheduler") and not _by_type(api, "KSamplerSelect")
    assert _by_type(api, "CLIPLoader")[0]["inputs"]["type"] == "minimax"
    assert sorted(n["inputs"]["vae_name"] for n in _by_type(api, "VAELoader")) == [W.AUDIO_VAE, W.VIDEO_VAE]
    note = next(n for n in _load(EX / f"{name}.json")["nodes"] if n["type"] == "MarkdownNote")["widgets_values"][0]
    for f in (official, W.NVFP4_MODEL, W.TEXT_ENCODER, W.VIDEO_VAE, W.AUDIO_VAE):
        assert f in note
    assert f"{nfe} model calls" in note


@pytest.mark.parametrize("name", NAMES)
def test_models_lists_name_every_downloadable_file(name):
    """Each file with a public download is declared where the frontend looks (the node's ``properties.models``,
    the frontend's schema: name, url, directory) and in the graph-level ``models``; no other entries."""
    ui = _load(EX / f"{name}.json")
    used = []
    for n in ui["nodes"]:
        files = [v for v in n.get("widgets_values", []) if isinstance(v, str) and v.endswith(".safetensors")]
        want = [{"name": f, "url": W.MODEL_SOURCES[f][1], "directory": W.MODEL_SOURCES[f][0]}
                for f in files if f in W.MODEL_SOURCES]
        assert n["properties"].get("models", []) == want, (n["id"], n["type"])
        used += [f for f in files if f not in used]
    declared = [m["name"] for m in ui.get("models", [])]
    assert declared == [f for f in used if f in W.MODEL_SOURCES]
    assert set(used) - set(declared) <= {W.NVFP4_MODEL, W.TINY_MODEL, W.TINY_TURBO_4STEP}  # no public download
    for m in ui.get("models", []):
        assert m["url"].startswith("https://huggingface.co/") and m["url"].endswith("/" + m["name"])
    if name.startswith("h3turbo_fl2va_turbo_"):
        assert {m["directory"] for m in ui["models"]} == {"loras", "text_encoders", "vae"}


def test_model_sources_are_the_public_repositories():
    """Core's H3 files from Comfy-Org/MiniMax-H3 (the repository of core's own H3 templates), the Turbo LoRAs from
    lightx2v/Minimax-h3-Turbo; each in the folder its loader reads."""
    folders = {W.TEXT_ENCODER: "text_encoders", W.VIDEO_VAE: "vae", W.AUDIO_VAE: "vae", W.TURBO_4STEP: "loras",
               W.TURBO_8STEP: "loras"}
    assert {f: d for f, (d, _) in W.MODEL_SOURCES.items()} == folders
    for f, (d, url) in W.MODEL_SOURCES.items():
        repo = "lightx2v/Minimax-h3-Turbo" if d == "loras" else "Comfy-Org/MiniMax-H3"
        sub = "" if d == "loras" else d + "/"
        assert url == f"https://huggingface.co/{repo}/resolve/main/{sub}{f}"


def test_base_workflow_is_res_multistep_beta_20():
    api = _api("h3turbo_base_beta_res_20step")
    assert not _by_type(api, "H3TurboLoRA") and not _by_type(api, "H3TurboSigmas")
    (s,) = _by_type(api, "BasicScheduler")
    assert (s["inputs"]["scheduler"], s["inputs"]["steps"], s["inputs"]["denoise"]) == ("beta", 20, 1.0)
    assert _by_type(api, "KSamplerSelect")[0]["inputs"]["sampler_name"] == "res_multistep"
    (sh,) = _by_type(api, "MiniMaxH3SigmaShift")
    assert (sh["inputs"]["shift_video"], sh["inputs"]["shift_audio"]) == (12.0, 3.0)


def test_tiny_workflow_uses_fixture_files():
    from h3_turbo.tools.fixtures import FIXTURE_FILES

    api = _api("h3turbo_tiny_demo")
    names = {f for _, f in FIXTURE_FILES.values()}
    used = {v for n in api.values() for k, v in n["inputs"].items() if k in ("unet_name", "turbo")}
    assert used <= names | {"none", "4step", "8step"} and used & names


def test_comfyui_template_glob_finds_the_ui_files(tmp_path):
    """ComfyUI's /workflow_templates globs custom_nodes/*/example_workflows/*.json (app/custom_node_manager.py)."""
    (tmp_path / "custom_nodes").mkdir()
    os.symlink(REPO, tmp_path / "custom_nodes" / "h3_turbo")
    found = glob.glob(os.path.join(str(tmp_path / "custom_nodes"), "*/example_workflows/*.json"))
    assert sorted(Path(f).stem for f in found) == sorted(NAMES)


# ----------------------------------------------------------------------------------------- live ComfyUI
def _node_info(cls) -> dict:
    """What GET /object_info gives for one class (V3: GET_NODE_INFO_V1; V1: INPUT_TYPES/RETURN_*)."""
    if hasattr(cls, "GET_NODE_INFO_V1"):
        return cls.GET_NODE_INFO_V1()
    it = cls.INPUT_TYPES()
    return {"input": it, "input_order": {k: list(v) for k, v in it.items()}, "output": cls.RETURN_TYPES,
            "output_name": getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES)}


@pytest.mark.comfyui
@pytest.mark.parametrize("node_type", [t for t in W.CORE_SPECS if t not in W.NOTE_TYPES])
def test_spec_matches_live_definition(comfy, node_type):
    import nodes

    cls = nodes.NODE_CLASS_MAPPINGS.get(node_type)
    if cls is None:
        pytest.fail(f"core node {node_type} is missing from this ComfyUI")
    info = _node_info(cls)
    ins, outs = W.spec_from_node_info(info)
    if (ins, outs) == tuple(W.SPECS[node_type][:2]):
        return
    # a newer core's definition: only the changes the files survive (added optional widgets with their defaults, a
    # combo made a dynamic combo holding the files' value), named; anything else fails naming the input
    drift = W.core_drift(node_type, info)
    assert drift
    print(f"\n[core drift] {node_type}: " + "; ".join(drift))


FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "image", "turbo"}


@pytest.mark.comfyui
@pytest.mark.parametrize("name", NAMES)
def test_api_workflow_passes_comfy_validation(comfy, name):
    """ComfyUI's validate_prompt accepts the graph; for the real-model workflows the only errors allowed are
    model/image files absent from the fixture folders (value_not_in_list on file inputs)."""
    import asyncio

    import execution
    import nodes

    api = _api(name)
    missing = sorted({n["class_type"] for n in api.values()} - set(nodes.NODE_CLASS_MAPPINGS))
    if missing:
        pytest.skip(f"node(s) not registered yet: {missing}")
    ok, err, _outs, node_errors = asyncio.run(execution.validate_prompt("t", api, None))
    bad = [(nid, e["type"], (e.get("extra_info") or {}).get("input_name"))
           for nid, ne in node_errors.items() for e in ne["errors"]
           if not (e["type"] == "value_not_in_list" and (e.get("extra_info") or {}).get("input_name") in FILE_INPUTS)]
    assert not bad, (err, node_errors)
    if name == "h3turbo_tiny_demo":
        assert ok, (err, node_errors)


def _info_from_spec(node_type, change=None):
    """A GET /object_info entry for a core node of the files, built from its CORE_SPECS entry (``change(defs)``
    edits the required/optional input definitions)."""
    ins, outs, _ = W.CORE_SPECS[node_type]
    defs = {"required": {}, "optional": {}}
    for name, t, kind in ins:
        sec = "optional" if kind.rstrip("+ctrlupload").endswith("?") else "required"
        defs[sec][name] = [t if t != "COMBO" else ["auto", "mp4"], {}]
    if change:
        change(defs)
    return {"input": defs, "input_order": {k: list(v) for k, v in defs.items()},
            "output": [t for _, t in outs], "output_name": [n for n, _ in outs]}


def test_core_drift_tolerates_only_what_the_files_survive():
    """tools/workflows.core_drift: a newer core's SaveVideo (format a dynamic combo holding 'auto', codec optional)
    is named, not refused; a removed input, a required addition, or a dynamic combo without the files' value is a
    ValueError naming it (negative controls)."""
    assert W.core_drift("SaveVideo", _info_from_spec("SaveVideo")) == []

    def newer(d):
        d["required"]["format"] = ["COMFY_DYNAMICCOMBO_V3", {"options": [
            {"key": "auto", "inputs": {"required": {"codec": ["COMFY_DYNAMICCOMBO_V3", {"options": [
                {"key": "auto", "inputs": {}}]}]}}}, {"key": "webm", "inputs": {}}]}]
        d["optional"]["codec"] = d["required"].pop("codec")
    drift = W.core_drift("SaveVideo", _info_from_spec("SaveVideo", newer))
    assert drift == ["format: COMBO -> dynamic combo with options ['auto', 'webm']", "codec: widget -> widget?"]
    assert W.live_defaults(_info_from_spec("SaveVideo", newer))["format.codec"] == "auto"

    def added(d):
        d["optional"]["quality"] = ["INT", {"default": 7}]
    assert W.core_drift("SaveVideo", _info_from_spec("SaveVideo", added)) == ["quality: added (INT, default 7)"]

    def required(d):
        d["required"]["quality"] = ["INT", {"default": 7}]

    def removed(d):
        d["required"].pop("filename_prefix")

    def no_auto(d):
        newer(d)
        d["required"]["format"][1]["options"].pop(0)
    for change, match in ((required, "adds the required input 'quality'"), (removed, "inputs .* are"),
                          (no_auto, r"offers \['webm'\].*the files use \['auto'\]")):
        with pytest.raises(ValueError, match=match):
            W.core_drift("SaveVideo", _info_from_spec("SaveVideo", change))
