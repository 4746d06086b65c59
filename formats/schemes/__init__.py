"""Checkpoint formats, one module each; :mod:`h3_turbo.formats.registry` lists them in detection order.

A scheme is one object (see :class:`.base.Scheme`): ``name`` (the ``Detection.format`` string),
``claims(view)`` (evidence or None), ``detect_layers`` / ``validate`` (its findings), ``to_native``
(one layer into ComfyUI's native NVFP4 layout, streaming) and ``from_native`` (this format written from
a native state dict). Adding a format: ``docs/EXTENDING.md``.
"""
