"""The model runtime: how the pack's NVFP4 operations sit inside core ComfyUI's H3.

- :mod:`.layer`: the fused-LoRA layer interface the Turbo branch uses (no ComfyUI import);
- :mod:`.ops`: core's ``mixed_precision_ops`` with the fp32 island kept and the kernel forward
  (:func:`.ops.make_operations`, :func:`.ops.install_compute`);
- :mod:`.loading`: validate, convert and build an H3 MODEL from a file (:func:`.loading.load_h3_model`);
- :mod:`.core_compat`: the hook points whose shape differs in newer cores, read with ``getattr``.

``nodes/`` only translates between ComfyUI's node API and these functions.
"""
