"""Thin ``io.ComfyNode`` classes of the pack and the ``ComfyExtension`` that registers them.

Each module below exports ``NODES`` (a list of node classes). Logic lives outside ``nodes/``
(``formats/``, ``adapters/``, ``samplers/``, ``kernels/``) so it is testable without ComfyUI.
"""
from __future__ import annotations

import importlib
import logging

from comfy_api.latest import ComfyExtension, io

log = logging.getLogger("h3_turbo")

# Node modules, in the order their nodes appear in the UI.
NODE_MODULES = ("loader", "dmd", "conditioning", "sampler", "attention", "fused", "lora", "multigpu")

CATEGORY = "H3 Turbo"


def all_nodes() -> list[type[io.ComfyNode]]:
    """Every node class of the pack (imports each node module once)."""
    out: list[type[io.ComfyNode]] = []
    for name in NODE_MODULES:
        mod = importlib.import_module(f".{name}", __name__)
        out.extend(mod.NODES)
    return out


class H3TurboExtension(ComfyExtension):
    """Registers the pack's nodes and its HTTP route (``GET /h3turbo/ready``)."""

    async def on_load(self) -> None:
        from ..server_routes import register_routes

        register_routes(node_classes=all_nodes)

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return all_nodes()
