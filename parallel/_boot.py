"""Entry file of an H3 Turbo Multi-GPU worker process, run by ``runpy.run_path`` in a spawned child.

It is a file, not a module function, because the pack's module name depends on how ComfyUI loaded it (its folder
name under ``custom_nodes/``, or ``h3_turbo``): this file imports the pack under the main process's name (from its
folder when that name is not importable) and hands over to ``<pack>.parallel.worker.main``.
"""
import importlib
import importlib.util
import os
import sys

cfg = globals()["H3T_SP_CONFIG"]
os.environ.update(cfg["env"])
name, pack_dir = cfg["pack_name"], cfg["pack_dir"]
if name not in sys.modules:
    try:
        importlib.import_module(name)
    except ImportError:
        spec = importlib.util.spec_from_file_location(name, os.path.join(pack_dir, "__init__.py"),
                                                      submodule_search_locations=[pack_dir])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
importlib.import_module(name + ".parallel.worker").main(cfg)
