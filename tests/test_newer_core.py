"""Issue 39: the ComfyUI cores users run (torch only, no ComfyUI import here, except one subprocess test).

- Multi-GPU pickling of classes and functions from modules that ComfyUI names by their file path, with a
  dot-directory in that path (``~/.local/ComfyUI``): pickle's by-name reference fails there; the pack's reference to
  the file loads in a fresh process (the worker's situation).
- Per-token modulation rows (newer cores: ``mod_segments`` rows may be an index tensor per token): the Multi-GPU
  shard cuts them with the rows, the fused block's row table takes them, anything else is refused by name.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
MODULE = """
class Guider:
    def __init__(self):
        self.conds = {"positive": [1, 2]}

    def name(self):
        return "guider"


def wrapper(x):
    return x + 1
"""


def _path_module(tmp_path):
    """A module loaded as ComfyUI loads comfy_extras/*.py: named by its file path (without .py), here under a
    dot-directory."""
    d = tmp_path / ".apps" / "ComfyUI" / "comfy_extras"
    d.mkdir(parents=True)
    (d / "nodes_x.py").write_text(MODULE)
    name = str(d / "nodes_x")
    spec = importlib.util.spec_from_file_location(name, name + ".py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return name, mod


def test_path_named_module_under_a_dot_directory_pickles_for_a_fresh_process(tmp_path):
    from h3_turbo.parallel import recipe

    name, mod = _path_module(tmp_path)
    try:
        g = mod.Guider()
        g.conds["positive"].append(3)
        with pytest.raises(pickle.PicklingError, match="import of module"):      # the failure this fixes
            pickle.dumps(mod.Guider)
        data = recipe.dumps({"cls": mod.Guider, "obj": g, "fn": mod.wrapper, "state": dict(vars(g))})
        (tmp_path / "job.pkl").write_bytes(data)
        code = textwrap.dedent(f"""
            import sys
            from h3_turbo.parallel import recipe
            job = recipe.loads(open({str(tmp_path / 'job.pkl')!r}, "rb").read())
            assert {name!r} in sys.modules
            assert type(job["obj"]) is job["cls"] and job["cls"].__module__ == {name!r}
            print(job["obj"].name(), job["obj"].conds["positive"], job["fn"](1), job["state"])
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "guider [1, 2, 3] 2 {'conds': {'positive': [1, 2, 3]}}"
        # in this process the reference resolves to the very objects
        back = recipe.loads(data)
        assert back["cls"] is mod.Guider and back["fn"] is mod.wrapper
    finally:
        sys.modules.pop(name, None)


def test_path_reference_is_only_for_path_named_modules():
    from h3_turbo.parallel import recipe

    assert recipe._path_reference(torch.nn.Linear) is None              # importable by name: pickle's own reference
    assert recipe._path_reference(recipe.dumps) is None
    assert recipe._path_global is not None and recipe.loads(recipe.dumps(recipe._path_global)) is recipe._path_global


# ------------------------------------------------------------------------------------------ per-token rows
def test_shard_cuts_per_token_rows_with_the_rows():
    from h3_turbo.errors import SequenceParallelError
    from h3_turbo.parallel.engine import local_segments

    rows = torch.tensor([3, 3, 6, 6, 9, 9, 3], dtype=torch.long)
    segs = [(0, 5, 1), (5, 12, rows), (12, 13, 2)]
    got = local_segments(segs, 0, 7)
    assert got[0] == (0, 5, 1) and got[1][:2] == (5, 7) and got[1][2].tolist() == [3, 3]
    got = local_segments(segs, 7, 14)
    assert got[0][:2] == (0, 5) and got[0][2].tolist() == [6, 6, 9, 9, 3] and got[1] == (5, 6, 2)
    assert local_segments([(0, 4, torch.tensor(5))], 0, 2) == [(0, 2, 5)]           # a 0-d tensor is an index
    for bad, what in ((torch.zeros(7), r"torch.float32 tensor of shape \(7,\)"),
                      (torch.zeros(7, dtype=torch.uint8), r"torch.uint8 tensor of shape \(7,\)"),
                      (torch.zeros(6, dtype=torch.long), r"torch.int64 tensor of shape \(6,\)"), ("x", "a str")):
        with pytest.raises(SequenceParallelError, match=rf"modulation row is (a )?{what}.*one entry per row of the "
                                                        r"segment \(7\) \(ComfyUI "):
            local_segments([(0, 5, 1), (5, 12, bad)], 0, 7)


def test_segment_rows_takes_per_token_rows_and_checks_them():
    from h3_turbo.kernels import fused as fk

    t = torch.tensor([4, 4, 7], dtype=torch.long)
    rows = fk.segment_rows([(0, 2, 1), (2, 5, t)], 5, "cpu", limit=9)
    assert rows.dtype == torch.int32 and rows.tolist() == [1, 1, 4, 4, 7]
    assert fk.segment_rows([(0, 2, 1), (2, 5, t)], 5, "cpu", limit=9) is rows        # cached by the tensor's identity
    t2 = t.clone()
    assert fk.segment_rows([(0, 2, 1), (2, 5, t2)], 5, "cpu", limit=9) is not rows
    t2[0] = 5                                                                          # an in-place change: rebuilt
    assert fk.segment_rows([(0, 2, 1), (2, 5, t2)], 5, "cpu", limit=9).tolist() == [1, 1, 5, 4, 7]
    with pytest.raises(ValueError, match=r"per-token rows 4\.\.7\): modulation rows must be in 0\.\.6"):
        fk.segment_rows([(0, 2, 1), (2, 5, t)], 5, "cpu", limit=7)
    with pytest.raises(ValueError, match=r"mod_segments\[1\].*float32 tensor"):
        fk.segment_rows([(0, 2, 1), (2, 5, t.float())], 5, "cpu")


@pytest.mark.comfyui
@pytest.mark.multigpu
@pytest.mark.skipif(os.environ.get("H3T_SECOND_CORE_RUN") == "1", reason="the second-core run already runs from a "
                    "dot-directory")
def test_multigpu_with_comfyui_under_a_dot_directory(tmp_path):
    """The user's report: ComfyUI in ``<somewhere>/.apps/ComfyUI`` (a copy of $COMFYUI_PATH; ComfyUI resolves
    symlinks, so a link would not reproduce it): core's graph sharded on 2 gloo workers equals one process
    (tests/test_multigpu.py's base-path test, in a subprocess that boots this copy)."""
    from h3_turbo.harness import find_comfyui

    dst = tmp_path / ".apps" / "ComfyUI"
    shutil.copytree(find_comfyui(), dst, ignore=shutil.ignore_patterns(".git", "__pycache__"), symlinks=True)
    env = dict(os.environ, COMFYUI_PATH=str(dst), H3T_SECOND_CORE_RUN="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_multigpu.py", "-k", "base_path"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and "1 passed" in proc.stdout, tail
