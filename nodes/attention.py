"""H3 Turbo Attention: pick the attention backend of one MODEL (a clone) through core's per-model
attention override. The backends, the combo and the apply: ``kernels/attention/`` (its registry)."""
from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY
from ..kernels import attention as registry

#: a clone of MODEL running a backend (``registry.apply``); ValueError for an unknown backend name
apply_backend = registry.apply


class H3TurboAttention(io.ComfyNode):
    """Sets the attention backend of one model (clone) through core's per-model override.

    ``backend``: one of ``registry.choices()`` (``auto`` = ``exact``); each backend's behaviour and
    fallback: ``kernels/attention/<name>.py``. Output: the cloned MODEL; the input MODEL is untouched.
    """

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboAttention",
            display_name="H3 Turbo Attention",
            category=CATEGORY,
            description=registry.description(),
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("backend", options=registry.choices(), default=registry.AUTO,
                               tooltip=f"auto = {registry.DEFAULT} (exact). Approximate backends run only when "
                                       "picked by name: " + ", ".join(b.name for b in registry.backends()
                                                                      if b.approximate) + "."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, backend) -> io.NodeOutput:
        return io.NodeOutput(registry.apply(model, backend))


NODES = [H3TurboAttention]
