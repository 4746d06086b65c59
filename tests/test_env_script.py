"""Issue 18, item 10: scripts/env.sh installs ComfyUI's pinned requirements whenever one of them is not met
(a reused venv must not keep comfy-kitchen 0.2.31 under a core that pins 0.2.36). Tested without running
env.sh's main body and without pip: scripts/requirements_met.py against this interpreter's real packages, and
env.sh's ``comfy_requirements`` shell function on a fake venv whose ``pip`` only records its arguments."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "scripts" / "requirements_met.py"
KITCHEN = metadata.version("comfy-kitchen")


def _check(tmp_path, text):
    p = tmp_path / "req.txt"
    p.write_text(text)
    return subprocess.run([sys.executable, str(CHECK), str(p)], capture_output=True, text=True, timeout=60)


def test_requirements_met_reports_each_unmet_pin(tmp_path):
    ok = _check(tmp_path, f"# comment\ncomfy-kitchen=={KITCHEN}\nnumpy>=1.0\n\n-r other.txt\n")
    assert (ok.returncode, ok.stdout) == (0, "")
    bad = _check(tmp_path, f"comfy-kitchen==0.0.1\nnumpy>=1.0\nh3t-no-such-package==1.0\n"
                           f"comfy-kitchen==0.0.2 ; python_version < '3'\n")
    assert bad.returncode == 1
    assert bad.stdout.splitlines() == [f"  comfy-kitchen: installed {KITCHEN}, wanted ==0.0.1",
                                       "  h3t-no-such-package: not installed (wanted ==1.0)"]


def _fake_env(tmp_path, requirements: str):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    (venv / "bin" / "python").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "pip").write_text(f'#!/usr/bin/env bash\necho "$@" >> "{log}"\ncat "${{@: -2:1}}" >> "{log}"\n')
    for f in ("python", "pip"):
        (venv / "bin" / f).chmod(0o755)
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "requirements.txt").write_text(requirements)
    res = subprocess.run(["bash", "-c", 'H3T_ENV_FUNCTIONS_ONLY=1 source "$1/scripts/env.sh"; '
                                        'comfy_requirements "$2" "$3" "$1"', "_", str(REPO), str(venv), str(comfy)],
                         capture_output=True, text=True, timeout=120)
    return res, (log.read_text() if log.exists() else "")


def test_env_sh_installs_when_a_pin_changed(tmp_path):
    res, pip = _fake_env(tmp_path, f"torch\ntorchvision\ncomfy-kitchen==0.2.36\nnumpy>=1.0\n")
    assert res.returncode == 0, res.stderr
    assert f"comfy-kitchen: installed {KITCHEN}, wanted ==0.2.36" in res.stdout
    assert "[h3-turbo] installing ComfyUI requirements from" in res.stdout
    first, *rest = pip.splitlines()
    assert first.startswith("install -q -r ") and first.endswith(" packaging")
    assert rest == ["comfy-kitchen==0.2.36", "numpy>=1.0"]        # torch lines left to the pinned stack


def test_env_sh_skips_pip_when_every_requirement_is_met(tmp_path):
    res, pip = _fake_env(tmp_path, f"torch\ncomfy-kitchen=={KITCHEN}\nnumpy>=1.0\n")
    assert res.returncode == 0, res.stderr
    assert (res.stdout, pip) == ("", "")


def test_quiet_pip_prints_pip_output_only_when_pip_fails(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "pip").write_text('#!/usr/bin/env bash\necho "WARNING: noise"\necho "$@" >&2\n'
                                      '[ "$1" = fail ] && exit 3\nexit 0\n')
    (venv / "bin" / "pip").chmod(0o755)

    def run(*args):
        return subprocess.run(["bash", "-c", 'H3T_ENV_FUNCTIONS_ONLY=1 source "$1/scripts/env.sh"; shift; quiet_pip "$@"',
                               "_", str(REPO), str(venv), *args], capture_output=True, text=True, timeout=60)

    ok = run("install", "-q", "x")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", "")
    bad = run("fail", "x")
    assert bad.returncode == 3 and bad.stdout == ""
    assert bad.stderr.splitlines() == ["WARNING: noise", "fail x", "[h3-turbo] pip fail x failed"]
