"""``python -m h3_turbo.client``: a server that does not answer is one line naming the URL, and
``ready --rescan`` waits for the re-scan the request asked for (``scan.requested`` / ``scans_completed`` of
``GET /h3turbo/ready``, adapters/scan.py; asked again when the server throttles it), so a LoRA file dropped into the
loras folder is listed by the answer."""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from h3_turbo.client import Client
from h3_turbo.client.__main__ import main


def _dead_url() -> str:
    with socket.socket() as s:          # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("argv", [["ready"], ["ready", "--rescan"],
                                  ["submit", "example_workflows/api/h3turbo_tiny_demo.json"]])
def test_no_server_is_one_line_naming_the_url(argv, capsys):
    url = _dead_url()
    here = Path(__file__).resolve().parent.parent
    argv = [os.path.join(here, a) if a.endswith(".json") else a for a in argv]
    assert main(argv + ["--server", url]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("error: ") and err.endswith(f"is ComfyUI running at {url}?"), err
    assert "Connection refused" in err and "HTTPConnectionPool" not in err


def test_scanner_counts_the_scan_a_request_waits_for():
    """A start() while a scan runs queues one more: ``requested`` is that later scan, reached only after it ran."""
    from h3_turbo.adapters.scan import TurboScanner

    gate, listed = threading.Event(), []

    def lister():
        listed.append(time.time())
        gate.wait(10)
        return []

    sc = TurboScanner(lister=lister)
    assert sc.status()["requested"] == 0 and sc.status()["scans_completed"] == 0
    assert sc.start() is True
    assert sc.status()["requested"] == 1
    assert sc.start() is False                        # running: one more is queued
    st = sc.status()
    assert st["requested"] == 2 and st["scans_started"] == 1 and st["scans_completed"] == 0
    gate.set()
    assert sc.wait(10)
    st = sc.status()
    assert st["scans_completed"] == 2 and st["scans_started"] == 2 and len(listed) == 2 and st["state"] == "done"


@pytest.mark.server
def test_ready_rescan_lists_a_new_lora_file_at_once(server):
    folder = Path(server["base"]) / "models" / "loras" / "zz_rescan"
    folder.mkdir(parents=True, exist_ok=True)
    c = Client(server["url"])
    try:
        for i in range(2):      # a new name each time, the second within the server's 5 s throttle of ?rescan=1
            shutil.copy(server["models"]["lora_4step"], folder / f"new_{i}.safetensors")
            body = c.ready(rescan=True, wait=60)
            files = {os.path.basename(t["path"]) for t in body["available_turbos"]
                     if t["path"].startswith(str(folder))}
            assert f"new_{i}.safetensors" in files, (i, sorted(files), body["scan"])
            assert body["scan"]["scans_completed"] >= body["scan"]["requested"] >= 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        c.ready(rescan=True, wait=60)     # leave the listing as the other server tests expect it
