"""Run ComfyUI in-process (no web server): find it, boot it on a device, register this pack, and
execute API-format prompts through ComfyUI's own ``validate_prompt`` + ``PromptExecutor``.

Used by the main job (``python -m h3_turbo.demo``) and by the integration tests. Nothing here copies
ComfyUI code; it drives the real modules from the checkout found by :func:`find_comfyui`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import uuid
from pathlib import Path

log = logging.getLogger("h3_turbo")

DEFAULT_COMFYUI = Path.home() / "ComfyUI"


class ComfyUINotFound(RuntimeError):
    """No ComfyUI checkout with MiniMax H3 support could be found."""


#: this pack's folder (a ComfyUI it sits in, ``<ComfyUI>/custom_nodes/<pack>``, is one of the guesses)
PACK_DIR = Path(__file__).resolve().parent


def _is_h3_comfyui(p: Path) -> bool:
    return (p / "comfy" / "ldm" / "minimax" / "model.py").is_file() and (p / "execution.py").is_file()


def find_comfyui(explicit: str | os.PathLike | None = None) -> Path:
    """Locate a ComfyUI checkout with H3 support (``comfy/ldm/minimax/model.py``).

    ``explicit`` (a path the user named) is used if it is one, else refused. Without it: ``$COMFYUI_PATH`` (a
    wrong one is logged as a warning), the ComfyUI this pack sits in (``<ComfyUI>/custom_nodes/<pack>``), then
    ``~/ComfyUI``. Raises :class:`ComfyUINotFound` naming the explicit path, or every place tried.
    """
    here = PACK_DIR
    if explicit is not None:     # a path the user named is used or refused, never replaced by a guess
        p = Path(explicit)
        if _is_h3_comfyui(p):
            return p.resolve()
        raise ComfyUINotFound(
            f"{p}: not a ComfyUI checkout with MiniMax H3 support (expected {p / 'execution.py'} and "
            f"{p / 'comfy/ldm/minimax/model.py'}). Pass a ComfyUI checkout of 2026-08 or newer.")
    cands: list[tuple[str, Path]] = []
    if os.environ.get("COMFYUI_PATH"):
        cands.append(("$COMFYUI_PATH", Path(os.environ["COMFYUI_PATH"])))
    if here.parent.name == "custom_nodes":
        cands.append(("parent of custom_nodes/", here.parent.parent))
    cands.append(("default", DEFAULT_COMFYUI))
    for i, (src, p) in enumerate(cands):
        if _is_h3_comfyui(p):
            if i and cands[0][0] == "$COMFYUI_PATH":
                log.warning("$COMFYUI_PATH=%s is not a ComfyUI with H3 support; using %s (%s) instead",
                            cands[0][1], p, src)
            return p.resolve()
    tried = ", ".join(f"{src}: {p}" for src, p in cands)
    raise ComfyUINotFound(
        "No ComfyUI with MiniMax H3 support found (looked for comfy/ldm/minimax/model.py in "
        f"{tried}). Set COMFYUI_PATH to a ComfyUI checkout of 2026-08 or newer.")


class _ServerStub:
    """The few ``PromptServer`` members that ``PromptExecutor`` uses, recording every event."""

    def __init__(self) -> None:
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.events: list[tuple[str, object]] = []

    def send_sync(self, event, data, sid=None):
        self.events.append((event, data, time.perf_counter()))

    def queue_updated(self):
        pass


class ComfyRunner:
    """A booted in-process ComfyUI. Create with :func:`boot`; one per process."""

    def __init__(self, path: Path):
        self.path = path
        import execution  # noqa: F401  (ComfyUI's)

        self.server = _ServerStub()
        self.executor = execution.PromptExecutor(
            self.server, cache_type=execution.CacheType.CLASSIC,
            cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})

    def add_models_dir(self, root: str | os.PathLike) -> None:
        """Register ``root/<folder>`` for every ComfyUI model folder name found under ``root``."""
        import folder_paths

        for sub in sorted(Path(root).iterdir()):
            if sub.is_dir():
                folder_paths.add_model_folder_path(sub.name, str(sub), is_default=True)

    def set_output_dir(self, out: str | os.PathLike) -> None:
        import folder_paths

        os.makedirs(out, exist_ok=True)
        folder_paths.set_output_directory(str(out))

    def run(self, prompt: dict, outputs: list[str] | None = None) -> dict:
        """Validate and execute an API-format prompt. Returns ``history_result["outputs"]``.

        Raises :class:`PromptFailed` with ComfyUI's own validation or execution error text.
        """
        import execution

        from .client import misspelt_inputs

        typos = misspelt_inputs(prompt, declared_inputs())
        if typos:
            raise PromptFailed("ComfyUI would ignore these inputs: " + "; ".join(typos), None, None)
        prompt_id = str(uuid.uuid4())
        self.server.events.clear()
        ok, err, good_outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, prompt, outputs))
        if not ok:
            from .client import format_rejection

            raise PromptFailed("ComfyUI rejected the workflow: " + format_rejection({"error": err, "node_errors": node_errors}),
                               err, node_errors)
        self.executor.execute(prompt, prompt_id, {"client_id": "h3turbo-harness"}, good_outputs)
        if not self.executor.success:
            errs = [d for ev, d in self.executor.status_messages if ev == "execution_error"]
            msg = errs[0]["exception_message"] if errs else "execution failed"
            raise PromptFailed(msg, errs[0] if errs else None, None)
        return self.executor.history_result.get("outputs", {})

    def run_latents(self, prompt: dict, save_nodes: tuple[str, ...], remove: bool = True) -> list:
        """Run ``prompt`` and return the tensors that its ``SaveLatent`` nodes ``save_nodes`` wrote
        (``latent_tensor`` of each file, in that order); the files are deleted unless ``remove=False``."""
        import folder_paths
        from safetensors.torch import load_file

        outputs = self.run(prompt)
        tensors = []
        for nid in save_nodes:
            info = outputs[nid]["latents"][0]
            path = os.path.join(folder_paths.get_output_directory(), info["subfolder"], info["filename"])
            tensors.append(load_file(path)["latent_tensor"])
            if remove:
                os.remove(path)
        return tensors

    def node_times(self) -> list[tuple[str, float]]:
        """(node id, seconds) per node executed in the last :meth:`run`, from ComfyUI's own
        ``executing`` events (a cached node takes ~0 s)."""
        marks = [(d.get("node") if ev == "executing" else None, t) for ev, d, t in self.server.events
                 if ev in ("executing", "execution_success") and isinstance(d, dict)]
        return [(n, t1 - t0) for (n, t0), (_, t1) in zip(marks, marks[1:]) if n is not None]


def declared_inputs() -> dict[str, set[str]]:
    """{class_type: declared input names (required, optional, hidden)} of every node ComfyUI has registered."""
    import nodes

    from .client import input_names

    out = {}
    for name, cls in nodes.NODE_CLASS_MAPPINGS.items():
        try:
            types = cls.INPUT_TYPES()
        except Exception:   # a node whose inputs cannot be listed without its runtime: not checked
            continue
        out[name] = input_names(types)
    return out


class PromptFailed(RuntimeError):
    """A prompt failed validation or execution. ``str()``: ComfyUI's exception message for an execution error
    (``error`` is its ``execution_error`` data), a readable list of ComfyUI's validation errors for a rejected
    prompt (``error``, ``node_errors`` are ComfyUI's)."""

    def __init__(self, message: str, error=None, node_errors=None):
        super().__init__(message)
        self.error = error
        self.node_errors = node_errors


_RUNNER: ComfyRunner | None = None


def comfyui_first_on_path(path: str | os.PathLike) -> None:
    """Put the ComfyUI checkout ``path`` first on ``sys.path`` (moving it there if it is already on it), so that
    core's top-level modules (``nodes``, ``comfy``, ``folder_paths``) win over same-named folders, e.g. this pack's
    own ``nodes/`` when a test runner or PYTHONPATH put the pack's folder on the path."""
    p = str(path)
    while p in sys.path:
        sys.path.remove(p)
    sys.path.insert(0, p)


def boot(comfyui: str | os.PathLike | None = None, *, cpu: bool = True) -> ComfyRunner:
    """Import the real ComfyUI from :func:`find_comfyui`, load its built-in nodes, register this pack's
    nodes and route, and return the process-wide :class:`ComfyRunner`.

    ``cpu=True`` forces ComfyUI's ``--cpu`` (tests, the CPU demo). Idempotent.
    """
    global _RUNNER
    if _RUNNER is not None:
        return _RUNNER
    path = find_comfyui(comfyui)
    comfyui_first_on_path(path)
    from comfy.cli_args import args

    if cpu:
        args.cpu = True
    args.disable_all_custom_nodes = True
    import nodes

    where = os.path.dirname(os.path.abspath(getattr(nodes, "__file__", "") or ""))
    if os.path.realpath(where) != os.path.realpath(str(path)):
        raise ComfyUINotFound(f"'import nodes' found {where!r}, not ComfyUI's nodes.py in {path}: another folder "
                              "named 'nodes' comes first on sys.path (e.g. this pack's own nodes/ when the pack's "
                              "folder is on PYTHONPATH); remove it from PYTHONPATH")
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    from .nodes import all_nodes

    for cls in all_nodes():
        schema = cls.GET_SCHEMA() if hasattr(cls, "GET_SCHEMA") else None
        node_id = schema.node_id if schema is not None else cls.__name__
        nodes.NODE_CLASS_MAPPINGS[node_id] = cls
        if schema is not None and schema.display_name:
            nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id] = schema.display_name
    _RUNNER = ComfyRunner(path)
    return _RUNNER
