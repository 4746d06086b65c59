"""Installation through ComfyUI-Manager (``comfyui-manager`` 4.3 from PyPI, in the ``[test]`` extra): its own CLI
(``cm-cli install <git URL>``, run as ``python -m cm_cli``) clones the pack from a ``file://localhost/...`` URL of a
local clone of this repository into a fresh ComfyUI's ``custom_nodes`` (a copy of the ComfyUI checkout without
custom nodes, models or user data), installs the pack's ``requirements.txt`` with pip, and the server started on that
ComfyUI (``--enable-manager``, as core 0.33 starts the Manager) registers the pack's nodes and answers
``GET /h3turbo/ready``. No network: the clone is local, the Manager reads its bundled node list, and every
requirement is already installed. Skipped loudly when comfyui-manager is not installed.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 180


def _require_manager() -> None:
    if importlib.util.find_spec("cm_cli") is None or importlib.util.find_spec("comfyui_manager") is None:
        reason = ("NO COMFYUI-MANAGER: comfyui-manager is not installed (it is in the pack's [test] extra); the "
                  "ComfyUI-Manager installation test did NOT run")
        warnings.warn(reason)
        print(f"\n*** {reason} ***\n", file=sys.stderr)
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requirements() -> list[str]:
    lines = (REPO / "requirements.txt").read_text(encoding="utf-8").splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def test_comfyui_manager_installs_the_pack_from_a_git_url(tmp_path):
    import requests

    from h3_turbo.harness import find_comfyui

    _require_manager()
    if shutil.which("git") is None:
        pytest.fail("git is needed to clone the pack (ComfyUI-Manager installs packs with git)")
    comfy = tmp_path / "ComfyUI"                 # a fresh ComfyUI: the checkout's code, no custom nodes or data
    top = Path(find_comfyui())

    def skip(folder, names):
        drop = {"__pycache__", ".git"} | ({"custom_nodes", "models", "user", "output", "input", "temp"}
                                           if Path(folder) == top else set())
        return [n for n in names if n in drop]

    shutil.copytree(top, comfy, ignore=skip)
    (comfy / "custom_nodes").mkdir()
    src = tmp_path / "src" / "h3-turbo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(src)], check=True, timeout=120)
    url = f"file://localhost{src}"
    env = dict(os.environ, COMFYUI_PATH=str(comfy), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "cm_cli", "install", url], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Installation was successful." in out, out[-4000:]
    installed = comfy / "custom_nodes" / "h3-turbo"
    assert (installed / "__init__.py").is_file() and (installed / ".git").is_dir()
    for req in _requirements():               # the Manager ran pip for each line of requirements.txt
        assert f"'install', '{req}'" in out, (req, out[-3000:])

    port = _free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, str(comfy / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--disable-api-nodes", "--disable-auto-launch", "--database-url", "sqlite:///:memory:",
           "--enable-manager"]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, cwd=str(comfy), stdout=lf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t_end, body = time.monotonic() + STARTUP_TIMEOUT_S, None
        while True:
            assert proc.poll() is None, \
                f"ComfyUI exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
            try:
                resp = requests.get(base + "/h3turbo/ready", timeout=2)
                if resp.status_code == 200:
                    body = resp.json()
                    if body["ready"]:
                        break
            except requests.RequestException:
                pass
            assert time.monotonic() < t_end, f"no ready answer within {STARTUP_TIMEOUT_S} s:\n" \
                                             f"{log.read_text(errors='replace')[-4000:]}"
            time.sleep(0.5)
        assert {"H3TurboNVFP4Loader", "H3TurboLoRA", "H3TurboSigmas", "H3TurboSampler"} <= set(body["nodes"])
        info = requests.get(base + "/object_info/H3TurboNVFP4Loader", timeout=10).json()
        assert info["H3TurboNVFP4Loader"]["category"].startswith("H3 Turbo")
        text = log.read_text(errors="replace")
        assert str(installed) in text, text[-3000:]        # the pack came from the Manager's clone
        assert not [ln for ln in text.splitlines() if str(installed) in ln and "IMPORT FAILED" in ln], text[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
