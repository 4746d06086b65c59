"""The pack loads in a real ComfyUI from ``custom_nodes/``: ``main.py --cpu --quick-test-for-ci`` (loads all
nodes, then exits before serving) registers our node ids with no import failure."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.comfyui
def test_quick_test_for_ci_loads_the_pack(tmp_path):
    from h3_turbo.harness import find_comfyui

    comfy = find_comfyui()
    (tmp_path / "custom_nodes").mkdir()
    os.symlink(REPO, tmp_path / "custom_nodes" / "h3_turbo", target_is_directory=True)
    for d in ("user", "input", "output", "temp", "models"):
        (tmp_path / d).mkdir()
    # Print the registered ids from inside ComfyUI: quick-test exits before serving, so /object_info is
    # unavailable; a sitecustomize-free way is a tiny custom node that logs nodes.NODE_CLASS_MAPPINGS at exit.
    probe = tmp_path / "custom_nodes" / "zz_probe.py"
    probe.write_text(
        "import atexit, nodes\n"
        "atexit.register(lambda: print('H3T_IDS ' + ' '.join(sorted(k for k in nodes.NODE_CLASS_MAPPINGS "
        "if k.startswith('H3Turbo'))), flush=True))\n"
        "NODE_CLASS_MAPPINGS = {}\n")
    cmd = [sys.executable, str(comfy / "main.py"), "--cpu", "--quick-test-for-ci", "--base-directory", str(tmp_path),
           "--disable-api-nodes", "--database-url", "sqlite:///:memory:"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    bad = [ln for ln in log.splitlines()
           if ("IMPORT FAILED" in ln or "Cannot import" in ln) and "h3_turbo" in ln]
    assert not bad, "\n".join(bad) + "\n" + log[-4000:]
    assert "(IMPORT FAILED)" not in "".join(ln for ln in log.splitlines() if "h3_turbo" in ln)
    ids_line = [ln for ln in log.splitlines() if ln.startswith("H3T_IDS ")]
    assert ids_line, log[-4000:]
    ids = set(ids_line[-1].split()[1:])
    from h3_turbo.tools.workflows import pack_node_types

    PACK_NODE_TYPES = pack_node_types()

    assert {"H3TurboTestConditioning", "H3TurboSaveLatentPreview"} <= ids
    # every pack node the example workflows use and the pack declares in NODE_MODULES is registered
    import ast

    src = (REPO / "nodes" / "__init__.py").read_text()
    mods = ast.literal_eval(src.split("NODE_MODULES = ", 1)[1].split("\n", 1)[0])
    declared = set()
    for m in mods:
        text = (REPO / "nodes" / f"{m}.py").read_text()
        declared |= {t for t in PACK_NODE_TYPES if f'node_id="{t}"' in text}
    assert declared <= ids, f"declared but not registered: {sorted(declared - ids)}"
