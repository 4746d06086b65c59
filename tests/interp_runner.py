"""Re-running a test file's ``test_interp_*`` tests in a fresh interpreter with TRITON_INTERPRET=1 (it must be set
before triton is first imported), for the attention kernel tests."""
from __future__ import annotations

import os
import re
import subprocess
import sys


def run_interp_tests(path: str, passed: int, timeout: int = 600, allow_skips: bool = False) -> None:
    """Run ``path``'s ``test_interp_*`` tests interpreted; assert the run succeeds with exactly ``passed`` passes (and,
    unless ``allow_skips``, nothing skipped)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_",
                           os.path.abspath(path)], env=env, capture_output=True, text=True, timeout=timeout)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) == passed, tail
    assert allow_skips or "skipped" not in proc.stdout.splitlines()[-1], tail
