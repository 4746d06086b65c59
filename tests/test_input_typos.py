"""A misspelt input name in an API workflow is refused before it runs (ComfyUI ignores undeclared inputs, so a typo
in an optional input such as ``weigths`` would run silently with the default): ``client.misspelt_inputs``, used by
the demo's harness (the registered nodes' ``INPUT_TYPES``) and by ``client submit`` (the server's ``/object_info``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3_turbo.client import Client, PromptRejected, misspelt_inputs, object_info_inputs

REPO = Path(__file__).resolve().parent.parent
TINY_API = REPO / "example_workflows" / "api" / "h3turbo_tiny_demo.json"
KNOWN = {"H3TurboNVFP4Loader": {"unet_name", "compute", "adaln", "weights"}, "SaveVideo": {"video", "format", "filename_prefix"}}


def _typo(prompt: dict, cls: str, old: str, new: str) -> dict:
    p = json.loads(json.dumps(prompt))
    node = next(n for n in p.values() if n["class_type"] == cls)
    node["inputs"][new] = node["inputs"].pop(old)
    return p


def test_misspelt_inputs_names_node_input_and_suggestion():
    p = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": "m", "weigths": "lean"}}}
    assert misspelt_inputs(p, KNOWN) == ["node 1 (H3TurboNVFP4Loader): unknown input 'weigths' (did you mean 'weights'?)"]
    p["1"]["inputs"]["weights"] = "lean"     # the declared one is set: the extra name is not taken for its typo
    assert misspelt_inputs(p, KNOWN) == []


def test_misspelt_inputs_passes_declared_dynamic_and_unknown_classes():
    p = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": "m", "compute": "auto"}},
         "2": {"class_type": "SaveVideo", "inputs": {"video": ["1", 0], "format": "mp4", "format.codec": "h264",
                                                      "filename_prefix": "x"}},
         "3": {"class_type": "SomeOtherPack", "inputs": {"anything": 1}}}
    assert misspelt_inputs(p, KNOWN) == []


def test_object_info_inputs_reads_every_section():
    info = {"A": {"input": {"required": {"x": []}, "optional": {"y": []}, "hidden": {"z": "PROMPT"}}}, "B": {}}
    assert object_info_inputs(info) == {"A": {"x", "y", "z"}, "B": set()}


@pytest.mark.comfyui
def test_harness_refuses_a_misspelt_optional_input_and_the_example_workflows_pass(comfy):
    from h3_turbo.harness import PromptFailed, declared_inputs

    known = declared_inputs()
    assert {"unet_name", "compute", "adaln", "weights"} <= known["H3TurboNVFP4Loader"]
    for f in sorted((REPO / "example_workflows" / "api").glob("*.json")):
        assert misspelt_inputs(json.loads(f.read_text()), known) == [], f.name
    bad = _typo(json.loads(TINY_API.read_text()), "H3TurboNVFP4Loader", "compute", "comptue")
    with pytest.raises(PromptFailed, match=r"unknown input 'comptue' \(did you mean 'compute'\?\)"):
        comfy.run(bad)


@pytest.mark.server
def test_client_submit_refuses_a_misspelt_input_before_queueing(server):
    bad = _typo(json.loads(TINY_API.read_text()), "H3TurboNVFP4Loader", "compute", "comptue")
    with pytest.raises(PromptRejected, match=r"unknown input 'comptue' \(did you mean 'compute'\?\)"):
        Client(server["url"]).submit(bad, timeout=60)
