"""What of a MODEL travels to the workers, and how a worker rebuilds it (needs ComfyUI).

A worker cannot receive the main process's ModelPatcher itself (its operations classes, Turbo branch and wrappers are
closures). It rebuilds the same MODEL:

1. the base from core's own re-creation hook ``ModelPatcher.cached_patcher_init`` (set by core's loaders and by the
   pack's loaders: file path + loader options), loaded once per worker and kept between requests;
2. the pack's own parts replayed by name: the Turbo LoRA branch (adapter file, strength, alias, contract:
   ``adapters.residency.install``) and the attention backend (``kernels.attention.apply``);
3. every other part carried by value when it pickles: weight patches (core LoRA), object patches (e.g. core's
   ModelSamplingMiniMaxH3; instances of a local class with no methods of its own are rebuilt from its bases),
   model_options entries, wrappers and callbacks.

A part that does not pickle must exist under the same name in the rebuilt base or replay; otherwise the worker refuses
the request naming it (:class:`~h3_turbo.errors.SequenceParallelError`), never drops it silently. Tensors travel
through shared memory (torch.multiprocessing's reductions); CUDA tensors are copied to the CPU first. Classes and
functions of modules ComfyUI imported under their file path (core's ``comfy_extras`` nodes such as ``Guider_Basic``,
custom node packs) travel as a reference to that file, which the worker loads under the same name: pickle's by-name
reference breaks when the path has a dot-directory (``~/.local/ComfyUI``).
"""
from __future__ import annotations

import io
import os
import pickle
import sys
import threading
import types
import uuid
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions on ForkingPickler)

from ..errors import SequenceParallelError

SP_OPTIONS_KEY = "h3_turbo_sp"          # model_options entry of the Multi-GPU node (not carried)
WRAPPER_KEY = "h3turbo_multigpu"        # its OUTER_SAMPLE wrapper (not carried)
_SKIP_OPTIONS = {("transformer_options", "sample_sigmas"), (SP_OPTIONS_KEY,)}


def _new_local(bases: tuple, name: str):
    cls = _LOCAL_CLASSES.get((bases, name))
    if cls is None:
        cls = _LOCAL_CLASSES[(bases, name)] = type(name, bases, {"__module__": __name__})
    return cls.__new__(cls)


_LOCAL_CLASSES: dict = {}
_PLAIN_CLASS_KEYS = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__firstlineno__",
                     "__static_attributes__", "__annotations__"}


class _Pickler(ForkingPickler):
    """torch.multiprocessing's pickler (tensors through shared memory) + CUDA tensors sent as CPU copies + instances of
    a local class that adds nothing to its (importable) bases, e.g. ``class ModelSamplingAdvanced(ModelSamplingAV,
    CONST): pass`` inside a node, rebuilt as the same combination of bases + classes and functions of modules that
    ComfyUI named by their file path, referenced by that file (:func:`_path_reference`), never by pickle's import of
    the module name."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            return (_cpu_tensor, (obj.detach().cpu(),))
        if isinstance(obj, (type, types.FunctionType)) and obj is not _path_global:
            ref = _path_reference(obj)
            return NotImplemented if ref is None else (_path_global, ref)
        cls = type(obj)
        if "<locals>" in getattr(cls, "__qualname__", "") and not isinstance(obj, type) \
                and set(vars(cls)) <= _PLAIN_CLASS_KEYS \
                and all("<locals>" not in b.__qualname__ for b in cls.__bases__) and hasattr(obj, "__dict__"):
            return (_new_local, (cls.__bases__, cls.__name__), obj.__dict__)
        return NotImplemented


def _cpu_tensor(t):
    return t


def _path_reference(obj) -> tuple[str, str, str | None] | None:
    """(module name, qualified name, module file) of a class or function whose module ComfyUI imported under its file
    path (``comfy_extras`` nodes, custom node packs: ``spec_from_file_location(<path>, ...)``), else None. Pickle's own
    by-name reference fails for such names when the path has a dot (``~/.local/ComfyUI``: ``import`` splits the name at
    the dot); this reference names the file instead (:func:`_path_global`)."""
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<locals>" in qual or \
            ("/" not in mod and "\\" not in mod):
        return None
    m = sys.modules.get(mod)
    if m is None:
        return None
    try:
        found = _attr_path(m, qual)
    except AttributeError:
        return None
    return (mod, qual, getattr(m, "__file__", None)) if found is obj else None


def _attr_path(root, qualname: str):
    for part in qualname.split("."):
        root = getattr(root, part)
    return root


def _path_global(module: str, qualname: str, file: str | None):
    """The object :func:`_path_reference` names: from ``sys.modules[module]`` when this process has the module, else
    after loading ``file`` under the same module name (as ComfyUI does; a package submodule through its package)."""
    m = sys.modules.get(module)
    if m is None:
        base = module.replace("\\", "/").rsplit("/", 1)[-1]
        if "." in base:                        # a submodule of a path-named package (e.g. a custom node pack's)
            import importlib

            m = importlib.import_module(module)
        elif file is not None and os.path.isfile(file):
            m = _load_file_module(module, file)
        else:
            raise ImportError(f"H3 Turbo Multi-GPU: the worker cannot find {qualname} of module {module!r} "
                              f"(its file {file!r} does not exist here)")
    return _attr_path(m, qualname)


def _load_file_module(module: str, file: str):
    import importlib.util

    pkg = os.path.basename(file) == "__init__.py"
    spec = importlib.util.spec_from_file_location(module, file, submodule_search_locations=[os.path.dirname(file)]
                                                  if pkg else None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(module, None)
        raise
    return mod


def dumps(obj) -> bytes:
    """Pickle ``obj`` for a worker (see :class:`_Pickler`). CPU tensors go to shared memory by file name
    (torch's "file_system" strategy, for this pickle only): the default "file_descriptor" strategy keeps one open
    descriptor per tensor until the worker has read it, and a LoRA's hundreds of tensors times the workers would
    exceed the usual limit of open files."""
    import torch.multiprocessing as tmp

    buf = io.BytesIO()
    with _SHARING_LOCK:
        old = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        finally:
            tmp.set_sharing_strategy(old)
    return buf.getvalue()


_SHARING_LOCK = threading.Lock()


class _Unpickler(pickle.Unpickler):
    """Finds classes of modules that ComfyUI imported under their file path (``comfy_extras`` nodes, custom node packs:
    ``spec_from_file_location(<path>, ...)``) by importing that file under the same name, as ComfyUI does."""

    def find_class(self, module, name):
        if module not in sys.modules and os.path.isabs(module):
            _import_path_module(module)
        return super().find_class(module, name)


def _import_path_module(module: str) -> None:
    if os.path.isfile(module + ".py"):
        _load_file_module(module, module + ".py")
    elif os.path.isfile(os.path.join(module, "__init__.py")):
        _load_file_module(module, os.path.join(module, "__init__.py"))


def loads(data: bytes):
    """Unpickle what :func:`dumps` made (see :class:`_Unpickler`)."""
    return _Unpickler(io.BytesIO(data)).load()


def _picklable(obj) -> str | None:
    try:
        dumps(obj)
    except Exception as e:  # noqa: BLE001 - the reason is reported
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


@dataclass
class ModelRecipe:
    """The picklable description of a MODEL (see the module docstring). ``uncarried``: [(where, name, why)] of the
    parts that did not pickle (each must be present in the rebuilt base or replay)."""

    base_init: tuple
    patches: dict
    object_patches: dict
    options: dict                 # path tuple -> value (model_options leaves)
    wrappers: dict                # (wrapper type, key) -> list
    callbacks: dict               # (callback type, key) -> list
    turbo: dict | None
    attention: str | None
    injections: list = field(default_factory=list)
    additional_models: list = field(default_factory=list)
    uncarried: list = field(default_factory=list)

    @property
    def base_key(self) -> str:
        f, args = self.base_init[0], self.base_init[1:]
        return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', f)}{args!r}"


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        path = prefix + (k,)
        if isinstance(v, dict) and v and path[:2] != ("transformer_options", "optimized_attention_override"):
            yield from _leaves(v, path)
        else:
            yield path, v


def build(model_patcher) -> ModelRecipe:
    """The recipe of ``model_patcher`` (main process). Raises SequenceParallelError when the MODEL has no
    ``cached_patcher_init`` or carries hook patches (not supported)."""
    from ..adapters import contracts, residency
    from ..kernels.attention import registry as attn

    mp = model_patcher
    init = getattr(mp, "cached_patcher_init", None)
    if not init:
        raise SequenceParallelError(
            "H3 Turbo Multi-GPU: this MODEL cannot be rebuilt in the worker processes: it has no cached_patcher_init "
            "(core's re-creation hook). Load the model with core's Load Diffusion Model or the pack's H3 loaders")
    if getattr(mp, "hook_patches", None):
        raise SequenceParallelError("H3 Turbo Multi-GPU: hook patches (conditioning-scheduled LoRA hooks) are not "
                                    "supported across workers; remove the hook nodes")
    uncarried: list = []
    entry = contracts.copy_entry(mp.model_options)
    turbo = None
    if entry.get("adapter"):
        res = residency.find(entry.get("adapter_sha256"))
        if res is None:
            raise SequenceParallelError(f"H3 Turbo Multi-GPU: the Turbo adapter {entry['adapter']!r} is not resident "
                                        "any more (evicted); run the Apply H3 Turbo LoRA node again")
        turbo = {"path": res.path, "sha256": res.key, "strength": float(entry.get("strength", 1.0)),
                 "alias": entry["adapter"], "contract": entry.get("contract")}
    to = mp.model_options.get("transformer_options", {})
    override = to.get("optimized_attention_override")
    attention = getattr(override, "backend", None) if override is not None else None
    if attention is not None and attention not in attn.names():
        attention = None
    options: dict = {}
    for path, v in _leaves(mp.model_options):
        if path in _SKIP_OPTIONS or path[:1] == (SP_OPTIONS_KEY,):
            continue
        if path == ("transformer_options", "optimized_attention_override") and attention is not None:
            continue
        if path[:2] == ("transformer_options", "wrappers") and len(path) >= 4 and path[3] == WRAPPER_KEY:
            continue
        why = _picklable(v)
        if why is None:
            options[path] = v
        else:
            uncarried.append(("model_options", path, why))

    def pack(d, where):
        out = {}
        for t, keys in d.items():
            for k, fns in keys.items():
                if k == WRAPPER_KEY or not fns:
                    continue
                why = _picklable(fns)
                if why is None:
                    out[(t, k)] = list(fns)
                else:
                    uncarried.append((where, (t, k), why))
        return out

    wrappers = pack(mp.wrappers, "wrappers")
    callbacks = pack(mp.callbacks, "callbacks")
    objs = {}
    for name, obj in mp.object_patches.items():
        why = _picklable(obj)
        if why is None:
            objs[name] = obj
        else:
            uncarried.append(("object_patches", name, why))
    why = _picklable(mp.patches)
    if why is not None:
        raise SequenceParallelError(f"H3 Turbo Multi-GPU: the MODEL's weight patches cannot be sent to the workers "
                                    f"({why})")
    return ModelRecipe(tuple(init), dict(mp.patches), objs, options, wrappers, callbacks, turbo, attention,
                       injections=list(mp.injections), additional_models=list(mp.additional_models),
                       uncarried=uncarried)


def _set_path(d: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        nxt = d.get(k)
        d[k] = nxt = dict(nxt) if isinstance(nxt, dict) else {}
        d = nxt
    d[path[-1]] = value


def _has_path(d: dict, path: tuple) -> bool:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return False
        d = d[k]
    return True


def rebuild(recipe: ModelRecipe, base):
    """A clone of ``base`` (the worker's ModelPatcher from ``recipe.base_init``) with everything the recipe carries
    and replays. Raises SequenceParallelError naming each part that neither travelled nor exists in base/replay."""
    from ..adapters import residency, turbo_lora
    from ..kernels.attention import registry as attn

    mp = base.clone()
    if recipe.turbo is not None:
        t = recipe.turbo
        dm = mp.model.diffusion_model
        res = residency.get(t["path"], turbo_lora.model_target_dims(dm), head_dim=turbo_lora.model_head_dim(dm))
        if res.key != t["sha256"]:
            raise SequenceParallelError(f"H3 Turbo Multi-GPU: the Turbo adapter file {t['path']} changed on disk "
                                        f"(SHA-256 {res.key[:12]}..., the MODEL has {t['sha256'][:12]}...)")
        residency.install(mp, res, t["strength"], t["alias"], contract=t["contract"])
    for path, v in recipe.options.items():
        _set_path(mp.model_options, path, v)
    for (t, k), fns in recipe.wrappers.items():
        mp.wrappers.setdefault(t, {})[k] = list(fns)
    for (t, k), fns in recipe.callbacks.items():
        mp.callbacks.setdefault(t, {})[k] = list(fns)
    for name, obj in recipe.object_patches.items():
        mp.add_object_patch(name, obj)
    if recipe.patches:
        merged = {k: list(v) for k, v in mp.patches.items()}
        for k, v in recipe.patches.items():
            merged[k] = list(v)
        mp.patches = merged
        mp.patches_uuid = uuid.uuid4()
    if recipe.attention is not None:
        mp = attn.apply(mp, recipe.attention)
    missing = []
    for where, name, why in recipe.uncarried:
        if where == "model_options":
            ok = _has_path(mp.model_options, name)
        elif where == "wrappers":
            ok = bool(mp.wrappers.get(name[0], {}).get(name[1]))
        elif where == "callbacks":
            ok = bool(mp.callbacks.get(name[0], {}).get(name[1]))
        else:
            ok = name in mp.object_patches
        if not ok:
            missing.append(f"{where} {name!r} ({why})")
    missing += [f"injections {k!r}" for k in recipe.injections if k not in mp.injections]
    missing += [f"additional_models {k!r}" for k in recipe.additional_models if k not in mp.additional_models]
    if missing:
        raise SequenceParallelError(
            "H3 Turbo Multi-GPU: these parts of the MODEL cannot be carried into the worker processes (they do not "
            "pickle and are neither made by the model's loader nor by the pack's Turbo LoRA / attention nodes): "
            + "; ".join(missing) + ". Remove the node that adds them, or run without H3 Turbo Multi-GPU")
    return mp
