"""H3 Turbo: a ComfyUI node pack for MiniMax H3 (NVFP4 loader, Turbo LoRA runtime branch,
shifted training-Euler AV sampler, hot API).

ComfyUI loads this folder from ``custom_nodes/`` and awaits :func:`comfy_entrypoint` (node API V3).
Importing this module is cheap and needs neither torch nor ComfyUI: every heavy import happens inside
the entrypoint. The same files are importable as ``h3_turbo`` after ``pip install -e .``.
"""

__version__ = "0.1.0"


async def comfy_entrypoint():
    """V3 entry point: returns the pack's ``ComfyExtension`` (needs a running ComfyUI)."""
    from .nodes import H3TurboExtension

    return H3TurboExtension()
