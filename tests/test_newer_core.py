"""Issue 39: the ComfyUI cores users run (torch only, no ComfyUI import here).

- Multi-GPU pickling of classes and functions from modules that ComfyUI names by their file path, with a
  dot-directory in that path (``~/.local/ComfyUI``): pickle's by-name reference fails there; the pack's reference to
  the file loads in a fresh process (the worker's situation).
- Per-token modulation rows (newer cores: ``mod_segments`` rows may be an index tensor per token): the Multi-GPU
  shard cuts them with the rows, the fused block's row table takes them, anything else is refused by name.
"""
from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

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
