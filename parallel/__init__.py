"""Sequence parallelism for core's H3 across the GPUs of one host (``H3 Turbo Multi-GPU``).

The collectives come from an existing engine: yunchang (the Ulysses all-to-all of its USP attention,
``yunchang.comm.all_to_all``, and its process groups, ``yunchang.set_seq_parallel_pg``) over
``torch.distributed`` (NCCL on CUDA, gloo on the CPU). They are the pack's optional extra ``[multigpu]``;
:func:`engine.require_yunchang` says how to install it when it is missing.

Modules:

- :mod:`.engine`: the yunchang import, the Ulysses attention override (all-to-all around the pack's own
  attention backend) and the per-block sequence shard (shard at block 0, gather after the last block,
  through core's ``patches_replace["dit"][("double_block", i)]`` hook). Torch only.
- :mod:`.recipe`: what travels to the workers: the MODEL as core's ``cached_patcher_init`` + the patches,
  options and the pack's own replays (Turbo branch, attention backend); anything that cannot travel is
  refused by name.
- :mod:`.pool`: the worker processes (one per GPU, ``torch.multiprocessing`` spawn, kept between
  requests), the main process's OUTER_SAMPLE wrapper, errors, timeouts, interrupts.
- :mod:`.worker`: the worker's loop (boots ComfyUI, rebuilds the MODEL, runs core's sampling loop).

Design, exactness and what was measured: ``docs/multigpu.md``.
"""
