"""Issue 18, item 6: API workflows saved before a node gained an input keep validating.

``tests/saved_workflows/*.json`` are API prompts as saved by earlier versions of the pack (add one each time
a node gains an input: the prompt without it); each must pass ComfyUI's own ``validate_prompt`` with the
fixture models. ``required_inputs.json`` is the baseline of every node's REQUIRED inputs: a node may drop a
required input or add optional ones, never add a required one (that breaks every saved prompt with "Required
input is missing"). A run of such a prompt: ``test_reliability2.test_saved_workflow_without_new_inputs_runs``.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui

SAVED = Path(__file__).resolve().parent / "saved_workflows"
WORKFLOWS = sorted(p.name for p in SAVED.glob("*.json") if p.name != "required_inputs.json")


def _required(cls) -> dict[str, list[str]]:
    schema = cls.define_schema()
    return {schema.node_id: sorted(i.id for i in schema.inputs if not i.optional)}


def test_there_are_saved_workflows():
    assert "h3turbo_tiny_demo_before_state_dtype_and_variant.json" in WORKFLOWS


@pytest.mark.parametrize("name", WORKFLOWS)
def test_saved_workflow_still_validates(comfy, name):
    import execution

    prompt = json.loads((SAVED / name).read_text())
    ok, err, outputs, node_errors = asyncio.run(execution.validate_prompt("saved-" + name, prompt, None))
    assert ok, (err, node_errors)
    assert outputs and not node_errors


def test_no_node_gained_a_required_input(comfy):
    from h3_turbo.nodes import all_nodes

    baseline = json.loads((SAVED / "required_inputs.json").read_text())
    now = {}
    for cls in all_nodes():
        now.update(_required(cls))
    assert set(baseline) <= set(now), f"nodes removed: {sorted(set(baseline) - set(now))}"
    grown = {n: sorted(set(now[n]) - set(baseline[n])) for n in baseline if set(now[n]) - set(baseline[n])}
    assert not grown, f"new inputs must be optional (saved API workflows lack them): {grown}"
    new = sorted(set(now) - set(baseline))
    assert not new, f"add the new nodes' required inputs to {SAVED / 'required_inputs.json'}: {new}"
