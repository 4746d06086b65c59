"""The worker processes of H3 Turbo Multi-GPU and the main process's side of a sampling run (needs ComfyUI).

Contract:

- :class:`WorkerPool`: ``world`` processes started with ``torch.multiprocessing`` (spawn), one per GPU (CUDA: worker r
  sees only the r-th visible GPU; CPU: gloo processes, for tests), kept between requests. Every worker boots ComfyUI
  with the main process's arguments and model folders, joins one ``torch.distributed`` group (NCCL / gloo) and yunchang's
  Ulysses group, and keeps the base models it loaded. NVLink multicast stays off in every worker
  (:data:`WORKER_ENV`).
- :func:`outer_sample_wrapper`: the MODEL's OUTER_SAMPLE wrapper (the outermost one, so nothing of the sampling runs in
  the main process): it sends the recipe (:mod:`.recipe`), the guider's conds, noise, latent, sampler, sigmas and seed
  to every worker, forwards rank 0's progress to ComfyUI's callback (previews, progress bar) and returns rank 0's
  result.
- Failures: a worker's exception, a worker that exits, or no message for ``H3T_SP_TIMEOUT_S`` seconds (default 1800)
  -> :class:`~h3_turbo.errors.SequenceParallelError` with the worker's message; the pool is shut down and the next
  request starts clean workers. ComfyUI's interrupt -> every worker stops at the start of its next forward (all ranks
  agree through an all-reduce), or is killed after ``H3T_SP_INTERRUPT_GRACE_S`` (default 60) seconds.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import queue as queue_mod
import runpy
import socket
import sys
import threading
import time
import types
import uuid
from pathlib import Path

from ..errors import SequenceParallelError
from ..logs import log
from . import recipe as recipe_mod

#: set in every worker's environment (and the main process's): NVLink SHARP / multicast off
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BOOT = str(Path(__file__).resolve().parent / "_boot.py")
BOOT_TIMEOUT_S = float(os.environ.get("H3T_SP_BOOT_TIMEOUT_S", "600"))


def timeout_s() -> float:
    return float(os.environ.get("H3T_SP_TIMEOUT_S", "1800"))


def interrupt_grace_s() -> float:
    return float(os.environ.get("H3T_SP_INTERRUPT_GRACE_S", "60"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_module_hidden():
    """multiprocessing's spawn re-runs the parent's ``__main__`` file in each child (ComfyUI's main.py would parse
    arguments and start a server there). The workers need nothing from it: hide it while the children start."""
    real = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if real is not None:
            sys.modules["__main__"] = real


def _pack_module() -> tuple[str, str]:
    """(the pack's module name in this process, its folder): the workers import the pack under the same name."""
    name = __name__.rsplit(".parallel.", 1)[0]
    return name, str(Path(__file__).resolve().parent.parent)


def _comfy_state() -> dict:
    import folder_paths
    from comfy.cli_args import args

    return {"args": dict(vars(args)),
            "folders": {k: (list(v[0]), set(v[1])) for k, v in folder_paths.folder_names_and_paths.items()},
            "output": folder_paths.get_output_directory(), "input": folder_paths.get_input_directory(),
            "temp": folder_paths.get_temp_directory(), "models_dir": folder_paths.models_dir}


def visible_devices(device_type: str) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry of each GPU this process sees (``["0", "1", ...]`` when the variable is unset)."""
    if device_type != "cuda":
        return []
    import torch

    n = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in env.split(",") if s.strip()] if env else [str(i) for i in range(n)]
    return ids[:n]


class WorkerPool:
    """``world`` workers on ``device_type`` ("cuda" or "cpu"). Start with :meth:`start`; :meth:`run` one job at a
    time; :meth:`close` stops them (also at interpreter exit)."""

    def __init__(self, world: int, device_type: str):
        self.world, self.device_type = int(world), device_type
        self.procs: list = []
        self.devices: list[str] = []
        self._lock = threading.Lock()
        self.started_at = None
        self.jobs = 0

    # ---- life cycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        import torch.multiprocessing as tmp

        os.environ.update(WORKER_ENV)
        ctx = tmp.get_context("spawn")
        self.ctx = ctx
        self.results = ctx.Queue()
        self.requests = [ctx.Queue() for _ in range(self.world)]
        self.cancel = ctx.Event()
        name, pack_dir = _pack_module()
        ids = visible_devices(self.device_type)
        if self.device_type == "cuda" and len(ids) < self.world:
            raise SequenceParallelError(f"H3 Turbo Multi-GPU: {self.world} GPUs requested, {len(ids)} visible")
        port = _free_port()
        state = _comfy_state()
        for rank in range(self.world):
            env = dict(WORKER_ENV)
            if self.device_type == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ids[rank]
            cfg = {"rank": rank, "world": self.world, "port": port, "device": self.device_type, "env": env,
                   "pack_name": name, "pack_dir": pack_dir, "comfy": state, "timeout_s": timeout_s(),
                   "requests": self.requests[rank], "results": self.results,
                   "cancel": self.cancel, "parent_pid": os.getpid()}
            p = ctx.Process(target=runpy.run_path, args=(BOOT,),
                            kwargs={"init_globals": {"H3T_SP_CONFIG": cfg}, "run_name": "__h3t_sp_worker__"},
                            daemon=True, name=f"h3turbo-sp-{rank}")
            with _main_module_hidden():
                p.start()
            self.procs.append(p)
        t0 = time.monotonic()
        ready: dict[int, str] = {}
        while len(ready) < self.world:
            msg = self._get(lambda: t0 + BOOT_TIMEOUT_S, "to start")
            if msg[0] == "ready":
                ready[msg[1]] = msg[2]
            elif msg[0] == "error":
                self.close()
                raise SequenceParallelError(f"H3 Turbo Multi-GPU: worker {msg[2]} failed to start: {msg[3]}")
        self.devices = [ready[r] for r in range(self.world)]
        self.started_at = time.time()
        log.info("H3 Turbo Multi-GPU: %d workers ready in %.1f s (%s; yunchang Ulysses over %s)", self.world,
                 time.monotonic() - t0, ", ".join(self.devices), "NCCL" if self.device_type == "cuda" else "gloo")

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        """Stop every worker (a polite stop, then terminate, then kill)."""
        procs, self.procs = self.procs, []
        for q in getattr(self, "requests", []):
            with contextlib.suppress(Exception):
                q.put(("stop",))
        deadline = time.monotonic() + 5
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    def _dead(self) -> str | None:
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                return f"worker {r} exited with code {p.exitcode}"
        return None

    def _get(self, deadline, what: str):
        """The next worker message; SequenceParallelError on a dead worker or when ``deadline()`` (a monotonic time,
        re-read while waiting) has passed."""
        while True:
            try:
                return self.results.get(timeout=0.1)
            except queue_mod.Empty:
                pass
            dead = self._dead()
            if dead:
                with contextlib.suppress(queue_mod.Empty):
                    return self.results.get(timeout=0.5)   # its last words, if it sent any
                self.close()
                raise SequenceParallelError(f"H3 Turbo Multi-GPU: {dead} (see its log above); the next request "
                                            "starts new workers")
            self._poll_interrupt()
            if time.monotonic() > deadline():
                self.close()
                raise _Silent(f"H3 Turbo Multi-GPU: no message from the workers for {timeout_s():.0f} s (waiting for "
                              f"them {what}; H3T_SP_TIMEOUT_S); they were stopped and the next request starts new "
                              "workers")

    def _poll_interrupt(self) -> None:
        hook = getattr(self, "interrupted", None)
        if hook is not None and hook() and not self.cancel.is_set():
            log.info("H3 Turbo Multi-GPU: interrupt: stopping the %d workers at their next forward", self.world)
            self.cancel.set()
            self._cancel_at = time.monotonic()

    # ---- jobs ----------------------------------------------------------------------------------------------------
    def run(self, job: dict, progress=None, interrupted=None):
        """Send ``job`` to every worker and wait. ``progress(step, total, payload)`` gets rank 0's progress messages,
        ``interrupted()`` is polled (True: stop the workers). Returns rank 0's result and the stats of every rank."""
        with self._lock:
            job_id = uuid.uuid4().hex
            # one pickle per worker: each shared-memory handle in it can be opened once
            datas = [recipe_mod.dumps(job) for _ in self.requests]
            self.cancel.clear()
            self._cancel_at = None
            self.interrupted = interrupted
            for q, data in zip(self.requests, datas):
                q.put(("job", job_id, data))
            self.jobs += 1
            done: dict[int, dict] = {}
            stopped: set[int] = set()
            result = None
            pending = None                      # an exception of the progress callback, raised once the workers stopped
            t_last = [time.monotonic()]

            def deadline():
                if self._cancel_at is not None:
                    return self._cancel_at + interrupt_grace_s()
                return t_last[0] + timeout_s()

            while len(done) + len(stopped) < self.world:
                try:
                    msg = self._get(deadline, "to finish the job")
                except _Silent as e:
                    if self._cancel_at is not None:
                        log.warning("H3 Turbo Multi-GPU: the workers did not stop within %.0f s of the interrupt; "
                                    "they were killed", interrupt_grace_s())
                        if pending is not None:
                            raise pending from None
                        raise Interrupted() from None
                    raise SequenceParallelError(str(e)) from None
                if msg[1] != job_id:
                    continue
                t_last[0] = time.monotonic()
                kind = msg[0]
                if kind == "progress" and progress is not None and pending is None:
                    try:
                        progress(msg[2], msg[3], msg[4])
                    except BaseException as e:  # noqa: BLE001 - e.g. ComfyUI's interrupt raised by its progress hook
                        pending = e
                        if not self.cancel.is_set():
                            log.info("H3 Turbo Multi-GPU: %s in the progress callback: stopping the %d workers at "
                                     "their next forward", type(e).__name__, self.world)
                            self.cancel.set()
                            self._cancel_at = time.monotonic()
                elif kind == "done":
                    done[msg[2]] = msg[4]
                    if msg[2] == 0:
                        result = msg[3]
                elif kind == "interrupted":
                    stopped.add(msg[2])
                elif kind == "error":
                    self.close()
                    raise SequenceParallelError(f"H3 Turbo Multi-GPU: worker {msg[2]} ({self.devices[msg[2]]}) "
                                                f"failed: {msg[3]}")
            self.interrupted = None
            if pending is not None:
                raise pending
            if stopped:
                raise Interrupted()
            return (recipe_mod.loads(result) if result is not None else None), [done[r] for r in sorted(done)]


class _Silent(SequenceParallelError):
    """No worker message before the deadline."""


class Interrupted(Exception):
    """The run was stopped by ComfyUI's interrupt (the caller raises ComfyUI's own exception)."""


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool(world: int, device_type: str) -> WorkerPool:
    """The running pool of ``world`` workers on ``device_type`` (started now if there is none, or another size)."""
    global _POOL
    with _POOL_LOCK:
        p = _POOL
        if p is not None and (p.world, p.device_type) == (world, device_type) and p.alive():
            return p
        if p is not None:
            log.info("H3 Turbo Multi-GPU: stopping the %d-worker pool (%s)", p.world,
                     "a worker is gone" if not p.alive() else f"{world} workers requested")
            p.close()
            _POOL = None
        p = WorkerPool(world, device_type)
        try:
            p.start()
        except BaseException:
            p.close()
            raise
        _POOL = p
        return p


def shutdown() -> None:
    """Stop the pool (if any)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


atexit.register(shutdown)


def _run_pool_job(world: int, device_type: str, job: dict, progress=None):
    import comfy.model_management as mm

    pool = get_pool(world, device_type)
    try:
        return pool.run(job, progress=progress, interrupted=mm.processing_interrupted)
    except Interrupted:
        if not pool.alive():
            shutdown()
        mm.throw_exception_if_processing_interrupted()
        raise SequenceParallelError("H3 Turbo Multi-GPU: the workers stopped on an interrupt") from None
    except SequenceParallelError:
        with _POOL_LOCK:
            global _POOL
            if _POOL is pool and not pool.alive():
                _POOL = None
        raise


#: the stats (one dict per rank) of the most recent sampling run in this process
LAST_RUN: dict = {}


def outer_sample_wrapper(executor, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None,
                         disable_pbar=False, seed=None, latent_shapes=None):
    """OUTER_SAMPLE wrapper of a Multi-GPU MODEL: the whole ``outer_sample`` (model loading, sampler loop) runs in the
    workers; see the module docstring."""
    guider = executor.class_obj
    if executor.idx != 0:
        names = [getattr(w, "__qualname__", type(w).__name__) for w in executor.wrappers[:executor.idx]]
        raise SequenceParallelError(f"H3 Turbo Multi-GPU: other OUTER_SAMPLE wrappers run before it ({names}); they "
                                    "would run in the main process. Put H3 Turbo Multi-GPU after the nodes that add them")
    mp = guider.model_patcher
    spec = mp.model_options.get(recipe_mod.SP_OPTIONS_KEY) or {}
    world, device_type = int(spec["world"]), spec["device"]
    rec = recipe_mod.build(mp)
    if rec.turbo is not None:           # what GET /h3turbo/ready reports (the Turbo wrapper itself runs in the workers)
        from .. import state as pack_state

        pack_state.set_current_turbo(rec.turbo["alias"])
    state = {k: v for k, v in vars(guider).items() if k not in ("model_patcher", "model_options")}
    why = recipe_mod._picklable(state)
    if why is not None:
        raise SequenceParallelError(f"H3 Turbo Multi-GPU: the guider {type(guider).__name__} (its conds) cannot be "
                                    f"sent to the workers ({why})")
    job = {"kind": "sample", "recipe": rec, "guider_cls": type(guider), "guider_state": state, "noise": noise,
           "latent_image": latent_image, "sampler": sampler, "sigmas": sigmas, "denoise_mask": denoise_mask,
           "seed": seed, "latent_shapes": latent_shapes, "callback": callback is not None,
           "profile": bool(spec.get("profile"))}

    def progress(step, total, payload):
        x0, x = recipe_mod.loads(payload)
        callback(step, x0, x, total)

    t0 = time.perf_counter()
    out, stats = _run_pool_job(world, device_type, job, progress=progress if callback is not None else None)
    LAST_RUN.clear()
    LAST_RUN.update({"world": world, "device": device_type, "seconds": time.perf_counter() - t0, "ranks": stats})
    return out
