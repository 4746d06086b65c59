"""The second core: the ComfyUI-backed integration tests again, against a newer ComfyUI than ``$COMFYUI_PATH``.

ComfyUI is imported in-process once per interpreter, so this test runs pytest in a subprocess with
``COMFYUI_PATH`` set to the second core: ``$COMFYUI_NEXT_PATH``, else ``~/ComfyUI-next`` when that folder exists
(the README's "Tests" section says how to set one up; without one the test is skipped and says so). The core is
copied under a dot-directory first (``<tmp>/.apps/ComfyUI``, without its ``.git``): ComfyUI names the modules it
loads by their file path, and the Multi-GPU workers must not depend on that path being importable by name.

The subprocess runs every ``comfyui``-marked test (never the browser or server tests: they start their own server
from ``$COMFYUI_PATH``). ``H3T_SECOND_CORE_TESTS=focused`` runs only those of :data:`FILES`, the ones that touch
what newer cores change (the H3 model's forward and modulation rows, masks, the sampler, Multi-GPU, the core node
definitions of the example workflows, the hook points); a space-separated list of test files runs those.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHILD_ENV = "H3T_SECOND_CORE_RUN"
FILES = ["tests/test_masks_comfy.py", "tests/test_multigpu.py", "tests/test_sampler_comfy.py",
         "tests/test_workflows.py", "tests/test_prologue.py", "tests/test_comfy_load.py",
         "tests/test_reliability2.py"]
TIMEOUT_S = 3600


def second_core() -> Path | None:
    """``$COMFYUI_NEXT_PATH`` (must be a ComfyUI with H3), else ``~/ComfyUI-next`` if it is one, else None."""
    from h3_turbo.harness import ComfyUINotFound, find_comfyui

    named = os.environ.get("COMFYUI_NEXT_PATH")
    if named:
        return find_comfyui(named)           # a named core that is not one is an error, not a skip
    home = Path.home() / "ComfyUI-next"
    if not home.is_dir():
        return None
    try:
        return find_comfyui(home)
    except ComfyUINotFound:
        return None


def _selection() -> list[str]:
    sel = os.environ.get("H3T_SECOND_CORE_TESTS", "").strip()
    if sel in ("", "all"):
        return ["tests"]
    return FILES if sel == "focused" else sel.split()


@pytest.mark.skipif(os.environ.get(CHILD_ENV) == "1", reason="this is the second-core run itself")
def test_comfyui_tests_pass_on_the_second_core(tmp_path_factory, capsys):
    core = second_core()
    if core is None:
        pytest.skip("NO SECOND CORE: set COMFYUI_NEXT_PATH (or put a newer checkout at ~/ComfyUI-next, README "
                    "'Tests') to run the ComfyUI tests against it too")
    from h3_turbo.harness import find_comfyui

    try:
        first = find_comfyui().resolve()
    except Exception:  # noqa: BLE001 - no first core: the second still runs
        first = None
    if first is not None and first == core.resolve():
        pytest.skip(f"the second core {core} is COMFYUI_PATH itself")
    dst = tmp_path_factory.mktemp("second_core") / ".apps" / "ComfyUI"
    shutil.copytree(core, dst, ignore=shutil.ignore_patterns(".git", "__pycache__"), symlinks=True)
    env = dict(os.environ, COMFYUI_PATH=str(dst), **{CHILD_ENV: "1"})
    env.pop("COMFYUI_NEXT_PATH", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-m", "comfyui and not browser and not server",
           *_selection()]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = (proc.stdout or "").strip().splitlines()
    summary = lines[-1] if lines else "(no output)"
    with capsys.disabled():
        print(f"\n[second core] {core} (run from {dst}): {summary} in {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, f"the ComfyUI tests fail on the second core {core}:\n" + \
        "\n".join(lines[-60:]) + "\n" + (proc.stderr or "")[-3000:]
    assert " passed" in summary and "error" not in summary, summary
