"""Shared fixtures. Core tests need only torch; tests marked ``comfyui`` import the real ComfyUI
(``$COMFYUI_PATH``, else ``~/ComfyUI``) in-process on the CPU and skip loudly when it is absent."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

# Never touch a GPU in tests, and keep kernels testable on CPU (TRITON_INTERPRET=1 set per test).
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _comfyui_path() -> Path | None:
    from h3_turbo.harness import ComfyUINotFound, find_comfyui

    try:
        return find_comfyui()
    except ComfyUINotFound:
        return None


def chromium_path() -> str | None:
    """The Chromium the browser tests drive: ``$H3T_CHROMIUM``, else ``chromium`` / ``chromium-browser`` on PATH."""
    import shutil

    return os.environ.get("H3T_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _browser_missing() -> str | None:
    """Why the browser tests cannot run here (None when they can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (it is in the pack's [test] extra: pip install playwright)"
    if chromium_path() is None:
        return "no Chromium found (apt-get install chromium, or set H3T_CHROMIUM to a Chromium binary)"
    return None


def _skip_loudly(items, markers: tuple[str, ...], what: str, reason: str) -> None:
    skip = pytest.mark.skip(reason=reason)
    n = 0
    for item in items:
        if any(m in item.keywords for m in markers):
            item.add_marker(skip)
            n += 1
    if n:
        warnings.warn(f"{n} {what} skipped: {reason}")
        print(f"\n*** {n} {what} SKIPPED: {reason} ***\n", file=sys.stderr)


def pytest_collection_modifyitems(config, items):
    import importlib.util

    if importlib.util.find_spec("comfy_cli") is None:  # the registry checks need comfy-cli, not ComfyUI
        _skip_loudly(items, ("registry",), "registry tests",
                     "NO COMFY-CLI: comfy-cli is not installed (it is in the pack's [test] extra); "
                     "`comfy node validate` did NOT run")
    if importlib.util.find_spec("yunchang") is None:  # the [multigpu] extra
        _skip_loudly(items, ("multigpu",), "multi-GPU tests",
                     "NO YUNCHANG: yunchang (the pack's [multigpu] extra: pip install -e \".[multigpu]\"; scripts/env.sh "
                     "installs it) is not installed; the 2-process sequence-parallel tests did NOT run")
    if _comfyui_path() is None:
        _skip_loudly(items, ("comfyui", "server", "browser"), "integration tests",
                     "NO REAL COMFYUI: set COMFYUI_PATH (or put a checkout at ~/ComfyUI, see README 'Tests'); "
                     "the integration tests did NOT run")
        return
    missing = _browser_missing()
    if missing:
        _skip_loudly(items, ("browser",), "browser tests",
                     f"NO BROWSER: {missing}; the browser tests did NOT run (README 'Tests')")



@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> dict[str, str]:
    """The tiny H3 fixture tree (models/...) generated once per session; {name: path} plus 'root'."""
    from h3_turbo.tools.fixtures import make_fixtures

    root = tmp_path_factory.mktemp("models")
    try:
        import comfy_kitchen  # noqa: F401
        has_ck = True
    except ImportError:
        has_ck = False
    paths = make_fixtures(str(root), nvfp4=has_ck)
    paths["root"] = str(root)
    return paths


@pytest.fixture(scope="session")
def comfy(fixtures_dir, tmp_path_factory):
    """The real ComfyUI booted in-process on the CPU with this pack's nodes and the fixture models."""
    from h3_turbo.harness import boot

    runner = boot(cpu=True)
    runner.add_models_dir(fixtures_dir["root"])
    runner.set_output_dir(tmp_path_factory.mktemp("output"))
    yield runner
    # Release ComfyUI's models while its modules are alive (else ModelPatcher.__del__ runs at interpreter
    # teardown and prints "Exception ignored ... ON_DETACH").
    import gc

    import comfy.model_management as mm
    import torch

    from h3_turbo.adapters import residency

    runner.executor.reset()
    residency.clear()  # the resident adapters are ModelPatchers too
    with torch.inference_mode():
        mm.unload_all_models()
    gc.collect()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    shots = getattr(config, "_h3_browser_screenshots", None)  # set by tests/test_browser.py
    if shots is not None:
        terminalreporter.write_line(f"browser screenshots (each example workflow, the demo after its run, the node library): {shots}")


# ----------------------------------------------------------------------------------------- server
# One real ComfyUI server per test session, shared by tests/test_server.py and tests/test_reliability_server.py.
SERVER_STARTUP_TIMEOUT_S = 180
REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """{"url", "base", "log", "models", "output", "proc"} of a running ComfyUI with the pack and fixtures."""
    import requests

    from h3_turbo.harness import find_comfyui
    from h3_turbo.tools.fixtures import make_fixtures

    comfy = find_comfyui()
    base = tmp_path_factory.mktemp("comfy_base")
    (base / "custom_nodes").mkdir()
    os.symlink(REPO, base / "custom_nodes" / "h3_turbo", target_is_directory=True)
    for d in ("user", "input", "output", "temp"):
        (base / d).mkdir()
    models = make_fixtures(str(base / "models"))
    port = _free_port()
    log = base / "server.log"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(comfy / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--base-directory", str(base), "--disable-api-nodes", "--disable-auto-launch",
           "--database-url", "sqlite:///:memory:"]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, cwd=str(base), stdout=lf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ComfyUI exited with {proc.returncode} during startup:\n{_log_tail(log)}")
            try:
                if requests.get(url + "/h3turbo/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > t_end:
                pytest.fail(f"ComfyUI did not serve /h3turbo/ready within {SERVER_STARTUP_TIMEOUT_S} s:\n"
                            f"{_log_tail(log)}")
            time.sleep(0.5)
        yield {"url": url, "base": base, "log": log, "models": models, "output": base / "output", "proc": proc}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
