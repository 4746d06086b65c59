"""The loop of one H3 Turbo Multi-GPU worker (started by :class:`~.pool.WorkerPool` through ``_boot.py``).

Boot: ComfyUI's arguments and model folders from the main process (before ``comfy.model_management`` is imported),
one ``torch.distributed`` group (NCCL on CUDA, gloo on the CPU; ``timeout`` = H3T_SP_TIMEOUT_S) and yunchang's Ulysses
group (``set_seq_parallel_pg(world, 1, ...)``), then "ready". Jobs:

- ``sample``: rebuild the MODEL (:func:`.recipe.rebuild` on the kept base), install the shard
  (:meth:`.engine.SequenceShard.install`), and run core's own ``outer_sample`` (model loading onto this worker's GPU,
  the sampler loop, the MODEL's OUTER_SAMPLE wrappers such as the Turbo coverage check) with the main process's
  guider state, noise, latent, sampler, sigmas and seed. Every rank computes the same full result; rank 0 sends it.
- ``call``: run ``job["fn"](ctx, **job["kwargs"])`` (a module-level function, e.g. the benchmark's) with the group.

Every exception is sent as ("error", job, rank, message) and the worker keeps serving (the main process stops the
pool on any error, so a half-failed collective never leaks into the next request).
"""
from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import threading
import time
import traceback


def _setup_comfy(state: dict) -> None:
    from comfy.cli_args import args

    vals = dict(state["args"])
    vals["cuda_device"] = None          # CUDA_VISIBLE_DEVICES already picks this worker's GPU
    vals["listen"] = vals.get("listen")
    vars(args).update(vals)
    import folder_paths

    for k, (paths, exts) in state["folders"].items():
        folder_paths.folder_names_and_paths[k] = (list(paths), set(exts))
    folder_paths.set_output_directory(state["output"])
    folder_paths.set_input_directory(state["input"])
    folder_paths.set_temp_directory(state["temp"])
    folder_paths.models_dir = state["models_dir"]


class Context:
    """What a ``call`` job gets: ``rank``, ``world``, ``group`` (yunchang's Ulysses group), ``device``, ``cancelled``
    (callable: the main process asked to stop), ``profile``."""

    def __init__(self, rank, world, group, device, cancelled, profile):
        self.rank, self.world, self.group, self.device = rank, world, group, device
        self.cancelled, self.profile = cancelled, profile


def watch_parent(parent_pid: int | None, period_s: float = 1.0) -> None:
    """Exit this process once the process that started it is gone (it is re-parented: ``os.getppid()`` changes).
    A server killed without running its exit handlers (SIGTERM, SIGKILL, a crash) must not leave workers behind,
    each holding a whole model on its GPU. A daemon thread; None/0 watches nothing."""
    if not parent_pid:
        return

    def loop():
        while True:
            time.sleep(period_s)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=loop, name="h3turbo-sp-parent-watch", daemon=True).start()


def main(cfg: dict) -> None:
    watch_parent(cfg.get("parent_pid"))
    rank, world = cfg["rank"], cfg["world"]
    results, requests, cancel = cfg["results"], cfg["requests"], cfg["cancel"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[h3turbo-sp rank {rank}] %(levelname)s %(message)s")
    try:
        _setup_comfy(cfg["comfy"])
        import torch
        import torch.distributed as dist

        import comfy.model_management as mm  # noqa: F401  (after the arguments)

        if cfg["device"] == "cuda":
            torch.cuda.set_device(0)
            backend, device = "nccl", torch.device("cuda", 0)
            name = f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '?')} {torch.cuda.get_device_name(0)}"
        else:
            backend, device, name = "gloo", torch.device("cpu"), f"cpu pid {os.getpid()}"
            # the workers share the host's cores: no oversubscription (OpenMP threads spinning against each other)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg["timeout_s"]), **kw)
        import yunchang
        from yunchang.globals import PROCESS_GROUP

        yunchang.set_seq_parallel_pg(world, 1, rank, world)
        group = PROCESS_GROUP.ULYSSES_PG
    except BaseException:  # noqa: BLE001 - reported to the main process
        results.put(("error", None, rank, traceback.format_exc(limit=8)))
        return
    if rank > 0:
        # the AdaLN table's on-disk cache (adaln=table): every rank computes the same table; only rank 0 writes the
        # shared folder, the others their own (two writers of one file would race on its ".part" file)
        from ..runtime import adaln_memo

        os.environ[adaln_memo.CACHE_ENV] = os.path.join(adaln_memo.cache_dir(), f"multigpu_rank{rank}")
    results.put(("ready", rank, name))
    bases: dict = {}
    while True:
        msg = requests.get()
        if msg[0] == "stop":
            break
        _, job_id, data = msg
        try:
            from . import recipe as recipe_mod

            job = recipe_mod.loads(data)
            if job["kind"] == "sample":
                out, stats = _sample(job, bases, group, rank, world, cancel, cfg, results, job_id)
            else:
                t0 = time.perf_counter()
                out = job["fn"](Context(rank, world, group, device, cancel.is_set, bool(job.get("profile"))), **job.get("kwargs", {}))
                stats = {"seconds": time.perf_counter() - t0}
            results.put(("done", job_id, rank, recipe_mod.dumps(out) if rank == 0 else None, stats))
        except BaseException as e:  # noqa: BLE001 - reported to the main process
            from .engine import Interrupted

            if isinstance(e, Interrupted):
                results.put(("interrupted", job_id, rank))
            else:
                tb = traceback.format_exc(limit=6)
                logging.getLogger("h3_turbo").error("job failed:\n%s", tb)
                results.put(("error", job_id, rank, f"{type(e).__name__}: {e}"))
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _base(recipe, bases: dict):
    key = recipe.base_key
    mp = bases.get(key)
    if mp is None:
        import comfy.model_management as mm

        if bases:
            bases.clear()
            mm.unload_all_models()
            gc.collect()
        f, args = recipe.base_init[0], recipe.base_init[1]
        t0 = time.perf_counter()
        mp = f(*args)
        if len(recipe.base_init) > 2:
            mp = mp[recipe.base_init[2]]
        logging.getLogger("h3_turbo").info("loaded the base model in %.1f s: %s", time.perf_counter() - t0, key[:200])
        bases[key] = mp
    return mp


def _sample(job, bases, group, rank, world, cancel, cfg, results, job_id):
    import torch

    import comfy.model_patcher
    import comfy.patcher_extension as pe
    import comfy.sampler_helpers
    import comfy.samplers

    from . import recipe as recipe_mod
    from .engine import SequenceShard

    rec = job["recipe"]
    t0 = time.perf_counter()
    mp = recipe_mod.rebuild(rec, _base(rec, bases))
    dm = mp.model.diffusion_model
    shard = SequenceShard(group, len(dm.blocks), dm.blocks[0].attn.heads, cancelled=cancel.is_set,
                          profile=bool(job.get("profile")))
    chained = shard.install(mp)
    cls = job["guider_cls"]
    g = cls.__new__(cls)
    g.__dict__.update(job["guider_state"])
    g.model_patcher = mp
    g.model_options = comfy.model_patcher.create_model_options_clone(mp.model_options)
    comfy.sampler_helpers.prepare_model_patcher(mp, g.conds, g.model_options)
    comfy.samplers.filter_registered_hooks_on_conds(g.conds, g.model_options)
    callback = None
    if rank == 0 and job["callback"]:
        def callback(step, x0, x, total):
            results.put(("progress", job_id, step, total, recipe_mod.dumps((x0, x))))
    ex = pe.WrapperExecutor.new_class_executor(
        g.outer_sample, g, pe.get_all_wrappers(pe.WrappersMP.OUTER_SAMPLE, g.model_options, is_model_options=True))
    if torch.cuda.is_available() and cfg["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        out = ex.execute(job["noise"], job["latent_image"], job["sampler"], job["sigmas"], job["denoise_mask"],
                         callback, True, job["seed"], latent_shapes=job["latent_shapes"])
    finally:
        comfy.samplers.cast_to_load_options(g.model_options, device=mp.offload_device)
        mp.restore_hook_patches()
    stats = shard.stats.as_dict()
    stats.update({"seconds": time.perf_counter() - t0, "chained_hooks": chained, "rank": rank})
    if cfg["device"] == "cuda":
        stats["peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return out.detach().to("cpu"), stats
