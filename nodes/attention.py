"""H3 Turbo Attention: pick the attention backend of one MODEL (a clone) through core's per-model
attention override. Logic: ``kernels/attention.py``."""
from __future__ import annotations

import logging

from comfy_api.latest import io

from . import CATEGORY
from ..kernels import attention as attn

log = logging.getLogger("h3_turbo")


def apply_backend(model, backend: str):
    """Return a clone of ComfyUI MODEL ``model`` whose attention runs ``backend`` (see
    ``kernels.attention.BACKENDS``). Only the clone's ``model_options["transformer_options"]
    ["optimized_attention_override"]`` changes; ``model`` and other clones are untouched.

    ``exact``/``auto``: :func:`kernels.attention.exact_override` (fastest exact SDPA backend measured
    on this device; core's own path on CPU). ``sdpa_core``: core's registered ``"pytorch"`` attention
    (core's SDPA priority, FA2 first on CUDA), set with ``ModelPatcher.set_model_optimized_attention``.
    Raises ValueError for an unknown backend name.
    """
    name = attn.resolve_backend(backend)
    m = model.clone()
    to = m.model_options.setdefault("transformer_options", {})
    if "optimized_attention_override" in to:
        log.info("H3TurboAttention: replacing the attention override already set on this MODEL (%s)",
                 getattr(to["optimized_attention_override"], "__name__", type(to["optimized_attention_override"]).__name__))
    if name == attn.SDPA_CORE:
        import comfy.ldm.modules.attention as core_attention

        m.set_model_optimized_attention(core_attention.get_attention_function("pytorch"))
    elif name == attn.INT8_SAGE:
        from ..kernels import attention_int8

        log.info("H3TurboAttention: 8-bit attention (int8_sage: INT8 Q.K, FP8 P.V) on this MODEL: approximate, "
                 "~4% relative per attention call; inputs it does not take run exact attention")
        to["optimized_attention_override"] = attention_int8.int8_override()
    else:
        to["optimized_attention_override"] = attn.exact_override()
    return m


class H3TurboAttention(io.ComfyNode):
    """Sets the attention backend of one model (clone) through core's per-model override.

    ``auto`` = ``exact``: exact SDPA with the backend measured fastest on this GPU at first use (cuDNN on
    Hopper, 1.7x faster than core's FA2-first choice at H3 shapes); on CPU core's own path.
    ``sdpa_core``: core's PyTorch attention, for comparison. ``int8_sage`` (opt-in, approximate): the pack's
    Triton INT8 Q.K / FP8 P.V kernel (kernels/attention_int8.py), 1.3x faster than ``exact`` on the H200 at
    H3 sizes (attention alone; a whole 960x544x124 forward 1.10x) with per-head cosine >= 0.9990 against
    float32 attention; CPU, masks, other dtypes or head sizes
    and GPUs without FP8 run ``exact`` (logged once).
    """

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboAttention",
            display_name="H3 Turbo Attention",
            category=CATEGORY,
            description="Attention backend for this model only. auto = exact: exact SDPA with the backend "
                        "measured fastest on this GPU at first use (cuDNN on Hopper); core's path on CPU. "
                        "sdpa_core: core's PyTorch attention (FA2 first), for comparison. int8_sage: 8-bit "
                        "attention (INT8 Q.K, FP8 P.V; approximate, ~4% relative error per call, cosine >= 0.999; "
                        "about 1.3x faster than exact on an H200); needs a GPU with FP8 (sm_89+), else exact.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("backend", options=list(attn.BACKENDS), default=attn.AUTO),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, backend) -> io.NodeOutput:
        return io.NodeOutput(apply_backend(model, backend))


NODES = [H3TurboAttention]
