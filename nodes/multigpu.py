"""H3 Turbo Multi-GPU: sample an H3 MODEL with its sequence split across the GPUs of this host (Ulysses on yunchang).
Logic: ``parallel/`` (``parallel/apply.py``)."""
from __future__ import annotations

from comfy_api.latest import io

from . import CATEGORY, checks
from ..parallel import apply as sp


class H3TurboSequenceParallel(io.ComfyNode):
    """MODEL -> a clone whose sampling runs on ``gpus`` worker processes, one per GPU, each holding the whole model and
    1/gpus of the sequence (Ulysses attention over yunchang; the pack's compute path, Turbo branch, AdaLN table and the
    sampler unchanged inside each worker). ``gpus`` 0 = every visible GPU. One GPU: the MODEL itself (plain path).
    Needs the pack's ``[multigpu]`` extra (yunchang); without it the node says how to install it."""

    DISPLAY = "H3 Turbo Multi-GPU"
    NUMBERS = {"gpus": checks.Number("int", 0, 0, 64)}

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboSequenceParallel",
            display_name=cls.DISPLAY,
            category=CATEGORY,
            description="Sample with the sequence split across the GPUs of this host (Ulysses sequence parallelism on "
                        "yunchang, one worker process per GPU, kept between runs). The GPU count must divide the "
                        "model's attention heads (H3: 56 -> 2, 4, 7 or 8). Needs the pack's [multigpu] extra.",
            inputs=[
                io.Model.Input("model"),
                cls.NUMBERS["gpus"].input("gpus", optional=True,
                                          tooltip="Worker GPUs; 0 = all visible (the largest count that divides the "
                                                  "heads). 1 = the plain single-GPU path."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, gpus=0) -> io.NodeOutput:
        (gpus,) = checks.check(cls, gpus=gpus)
        return io.NodeOutput(sp.apply(model, gpus))


NODES = [H3TurboSequenceParallel]
