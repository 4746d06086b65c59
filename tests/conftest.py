"""Shared fixtures. Core tests need only torch; tests marked ``comfyui`` import the real ComfyUI
(``$COMFYUI_PATH``, else ``~/ComfyUI``) in-process on the CPU and skip loudly when it is absent."""
from __future__ import annotations

import os
import sys
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


def pytest_collection_modifyitems(config, items):
    if _comfyui_path() is not None:
        return
    reason = ("NO REAL COMFYUI: set COMFYUI_PATH (or put a checkout at ~/ComfyUI, see README 'Tests'); "
              "the integration tests did NOT run")
    skip = pytest.mark.skip(reason=reason)
    n = 0
    for item in items:
        if "comfyui" in item.keywords or "server" in item.keywords:
            item.add_marker(skip)
            n += 1
    if n:
        warnings.warn(f"{n} integration tests skipped: {reason}")
        print(f"\n*** {n} integration tests SKIPPED: {reason} ***\n", file=sys.stderr)


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
    return runner
