"""Turbo sampling nodes: the shifted sigma grid (SIGMAS) and the training-Euler AV sampler (SAMPLER).

Both plug into core's ``SamplerCustomAdvanced``. Logic: :mod:`h3_turbo.samplers.schedules` and
:mod:`h3_turbo.samplers.training_euler`.
"""
from __future__ import annotations

import logging

from comfy_api.latest import io

from . import CATEGORY, checks
from ..adapters import contracts
from ..samplers import schedules, training_euler

log = logging.getLogger("h3_turbo")


def turbo_sigmas(model, steps: int):
    """SIGMAS for H3 Turbo Sigmas: fp32 [N+1], ``shift_v*b/(1+(shift_v-1)*b)``, b = linspace(1, 0, N+1),
    last exactly 0 (docs/h3-facts.md#sigma-schedules).

    With a Turbo contract on ``model.model_options`` (attached by the Turbo LoRA node): N = the contract's
    NFE (steps 0 or equal to it) and shift_v = the contract's video shift; any other steps is a ValueError
    naming the artifact and its NFE (steps == NFE+1 is called out as grid points vs model evaluations).
    Without a contract: steps must be > 0 and shift_v is the model's ``model_sampling.shift`` (core's
    ModelSamplingMiniMaxH3 / MiniMaxH3SigmaShift patch, else the checkpoint default 12).
    """
    import torch

    contract = contracts.get(getattr(model, "model_options", None) or {})
    steps = int(steps)
    if contract is not None:
        nfe = int(contract.nfe)
        who = f"Turbo '{contract.name or contract.variant}' ({contract.variant})"
        if steps not in (0, nfe):
            msg = (f"H3 Turbo Sigmas: {who} wants {nfe} model evaluations, got steps={steps}. "
                   f"Set steps to {nfe} or 0 (= the contract's).")
            if steps == nfe + 1:
                msg += (f" You gave grid points, not model evaluations: {nfe} evaluations use "
                        f"{nfe + 1} sigmas, and ComfyUI's steps count evaluations.")
            raise training_euler.TurboContractError(msg)
        return schedules.shifted_grid(nfe, contract.shift_video, dtype=torch.float32)
    if steps <= 0:
        entry = contracts.copy_entry(getattr(model, "model_options", None) or {})
        adapter = entry.get("adapter_file")
        if adapter and entry.get("no_contract") == "variant none":
            why = f"its Turbo adapter {adapter!r} was applied with variant none"
        elif adapter:
            why = (f"its Turbo adapter {adapter!r} carries none (not an official file: pick variant 4step or 8step on "
                   "Apply H3 Turbo LoRA to use an official contract)")
        else:
            why = ("no Turbo LoRA is active on it: none was applied, or Apply H3 Turbo LoRA switched it off with "
                   "turbo=none or strength 0")
        raise training_euler.TurboContractError(
            f"H3 Turbo Sigmas: steps=0 means 'the Turbo contract's NFE', but the MODEL carries no Turbo contract "
            f"({why}); or set steps > 0.")
    ms = model.get_model_object("model_sampling")
    shift = getattr(ms, "shift", None)
    if shift is None or getattr(ms, "audio_shift", None) is None:
        raise ValueError(f"H3 Turbo Sigmas: the MODEL's model_sampling ({type(ms).__name__}) is not "
                         f"ModelSamplingAV (no shift/audio_shift): connect a MiniMax H3 model.")
    log.info("H3 Turbo Sigmas: no Turbo contract; %d steps at the model's video shift %g.", steps, float(shift))
    return schedules.shifted_grid(steps, float(shift), dtype=torch.float32)


NO_CONTRACT_SIGMAS = ("Without a Turbo contract (no Turbo LoRA, variant none, or an adapter that is not an official "
                      "file) steps must be > 0 and the grid uses the model's video shift.")
NO_CONTRACT_SAMPLER = ("Without a Turbo contract it steps the SIGMAS it is given, the audio on the grid of the "
                       "model's shifts, and enforces nothing (CFG and denoiser caches are then allowed).")


class H3TurboSigmas(io.ComfyNode):
    """The uniform shifted video sigma grid of the Turbo contract (or of the model's shift)."""

    DISPLAY = "H3 Turbo Sigmas"
    NUMBERS = {"steps": checks.Number("int", 0, 0, 1000)}

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboSigmas",
            display_name=cls.DISPLAY,
            category=CATEGORY,
            description="The sigmas (noise levels) a Turbo LoRA was trained with, for SamplerCustomAdvanced: "
                        "the uniform grid shifted by the adapter's video shift. steps counts model evaluations, as "
                        "ComfyUI does (a 4-step adapter: steps 4, five sigmas); 0 takes the adapter's own count, and "
                        "with a Turbo adapter any other count is an error. " + NO_CONTRACT_SIGMAS,
            inputs=[
                io.Model.Input("model", tooltip="The MODEL from Apply H3 Turbo LoRA (carries the adapter's step "
                                                "count and shifts)."),
                cls.NUMBERS["steps"].input("steps", tooltip="Model evaluations; 0 = the Turbo adapter's own count "
                                                            "(4 for 4-step, 8 for 8-step)."),
            ],
            outputs=[io.Sigmas.Output()],
        )

    @classmethod
    def execute(cls, model, steps) -> io.NodeOutput:
        (steps,) = checks.check(cls, steps=steps)
        return io.NodeOutput(turbo_sigmas(model, steps))


class H3TurboSampler(io.ComfyNode):
    """SAMPLER: shifted training-Euler with independent video and audio states (one model call per step)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="H3TurboSampler",
            display_name="H3 Turbo Sampler",
            category=CATEGORY,
            description="The sampler the Turbo LoRAs were distilled with (LightX2V's training Euler), for "
                        "SamplerCustomAdvanced: deterministic Euler steps, one model call per step, with video on "
                        "the SIGMAS and audio on its own shifted grid, each kept as a separate state. It checks the "
                        "Turbo adapter's contract when sampling starts (step count, sigmas, shifts, no CFG, no "
                        "EasyCache/LazyCache) and stops with an error naming what is wrong. A latent noise_mask "
                        "(inpainting, video or audio extension) works as with core's samplers: masked-out tokens "
                        "keep the latent's values. " + NO_CONTRACT_SAMPLER,
            inputs=[
                io.Combo.Input("state_dtype", options=list(training_euler.STATE_DTYPES), default="fp32",
                               optional=True,
                               tooltip="dtype of the video/audio states between steps (fp32 = LightX2V)."),
                io.Combo.Input("update", options=list(training_euler.UPDATES), default="auto", optional=True,
                               tooltip="auto: the Turbo contract's rule (renoise for the TurboH3 DMD model, inferred "
                                       "from TurboDiffusion's public samplers, which re-noise; euler otherwise). renoise: "
                                       "x0, then fresh seeded noise at the next sigma. euler: deterministic training-Euler, "
                                       "the rule of diffusers' MiniMaxH3Scheduler and LightX2V; it reproduces diffusers' "
                                       "sampling (docs/parity.md)."),
            ],
            outputs=[io.Sampler.Output()],
        )

    @classmethod
    def execute(cls, state_dtype="fp32", update="auto") -> io.NodeOutput:
        import comfy.samplers

        return io.NodeOutput(comfy.samplers.KSAMPLER(training_euler.sample_h3_turbo,
                                                     extra_options={"state_dtype": state_dtype, "update": update}))


NODES = [H3TurboSigmas, H3TurboSampler]
