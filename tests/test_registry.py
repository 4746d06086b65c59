"""Registry packaging: comfy-cli's ``comfy node validate`` (the checks ``comfy node publish`` runs: the
pyproject parses, the version is set, no exec/eval/multi-statement lines) passes on this checkout, and
pyproject.toml carries what the Comfy registry and ComfyUI-Manager read. Skipped loudly without comfy-cli."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.mark.registry
def test_comfy_node_validate_passes(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), DO_NOT_TRACK="1", COMFY_NO_TELEMETRY="1")
    p = subprocess.run([sys.executable, "-m", "comfy_cli", "--skip-prompt", "node", "validate"], cwd=str(REPO),
                       capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "All validation checks passed successfully" in out, out
    assert "Warning" not in out and "Security warnings" not in out and "Error" not in out, out


def test_pyproject_has_what_the_registry_needs():
    from h3_turbo import __version__

    proj, comfy = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
    # the registry's node id: letters, digits, - _ . ; no leading digit; under 100 characters
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]{0,98}", proj["name"]) and "comfyui" not in proj["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", proj["version"]) and proj["version"] == __version__
    assert proj["description"] and proj["license"] == "MIT" and (REPO / "LICENSE").is_file()
    assert proj["urls"]["Repository"].startswith("https://github.com/")
    assert comfy["PublisherId"] and comfy["DisplayName"] == "H3 Turbo"
    icon = comfy["Icon"]
    assert icon.startswith("https://") and icon.endswith("/docs/icon.svg") and (REPO / "docs" / "icon.svg").is_file()
    assert re.fullmatch(r">=\d+\.\d+\.\d+", comfy["requires-comfyui"])
    # ComfyUI-Manager installs requirements.txt, pip the pyproject dependencies: the same runtime packages
    reqs = [ln.strip() for ln in (REPO / "requirements.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert set(reqs) <= set(proj["dependencies"]), (reqs, proj["dependencies"])
    test = {re.split(r"[<>=]", d)[0] for d in proj["optional-dependencies"]["test"]}
    assert {"pytest", "playwright", "comfy-cli"} <= test
