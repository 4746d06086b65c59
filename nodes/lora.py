"""``H3TurboLoRA``: apply an official H3 Turbo LoRA as a runtime branch (never merged into the base)."""
from __future__ import annotations

import logging
import os

from comfy_api.latest import io

from . import CATEGORY
from ..adapters import contracts, residency, turbo_lora

log = logging.getLogger("h3_turbo")

NONE = "none"


def _lora_files() -> dict[str, str]:
    import folder_paths

    out = {}
    for name in folder_paths.get_filename_list("loras"):
        p = folder_paths.get_full_path("loras", name)
        if p:
            out[name] = p
    return out


def turbo_options() -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(combo options, {alias: file name}, {file name: full path}) for the ``loras`` folder.

    Options: ``none``, then the aliases (``4step``/``8step``...) of recognized adapters, then every file.
    (``/h3turbo/ready``'s ``available_turbos`` is published by ``adapters/scan.py``'s background scanner.)
    """
    files = _lora_files()
    aliases = turbo_lora.alias_table(files)
    return [NONE] + sorted(aliases) + sorted(files, key=turbo_lora._natural), aliases, files


class H3TurboLoRA(io.ComfyNode):
    """Apply an H3 Turbo LoRA as a runtime branch: ``y = base(x) + strength*(alpha/rank)*B(A(x))``.

    The base weights (BF16, NVFP4, INT8) are never merged or changed; the output MODEL is a clone that
    carries the branch (injected while loaded), a per-call coverage check, the adapter as an
    additional model (ComfyUI memory management) and the Turbo contract (steps, shifts) for the sampler.
    ``turbo = none`` or ``strength = 0`` passes the input MODEL through unchanged (no contract).
    Alias ``4step``/``8step``: the official file present in the loras folder (else a fixture whose
    metadata declares that contract). Errors (wrong base, missing/extra keys, alpha mismatch) name the file.
    """

    @classmethod
    def define_schema(cls):
        options, _, _ = turbo_options()
        return io.Schema(
            node_id="H3TurboLoRA",
            display_name="Apply H3 Turbo LoRA",
            category=CATEGORY,
            description="Applies an official MiniMax H3 Turbo LoRA (4-step or 8-step, models/loras) as a separate "
                        "bf16 branch beside each projection: the base weights (BF16 or NVFP4) are never merged or "
                        "changed. The file is checked (keys, sizes, alpha) before use, and the adapter's sampling "
                        "contract (step count, shifts) travels with the MODEL to H3 Turbo Sigmas and H3 Turbo "
                        "Sampler. 'none' or strength 0 switches Turbo off.",
            inputs=[
                io.Model.Input("model", tooltip="An H3 MODEL (from Load H3 NVFP4 Diffusion Model, or any H3 "
                                                "loader)."),
                io.Combo.Input("turbo", options=options, default=NONE,
                               tooltip="none (Turbo off), 4step / 8step (the official file of that name in "
                                       "models/loras), or a file there (checked before use)."),
                io.Float.Input("strength", default=1.0, min=-2.0, max=2.0, step=0.05,
                               tooltip="Branch strength. The Turbo contracts assume 1.0."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, turbo=NONE, strength=1.0, **kwargs):
        """Re-execute when the chosen file changes on disk (same name, new content), like IS_CHANGED."""
        if turbo == NONE:
            return NONE
        _, aliases, files = turbo_options()
        name = aliases.get(turbo, turbo)
        try:
            st = os.stat(files[name])
        except (KeyError, OSError):
            return ("missing", turbo)
        return (name, st.st_size, st.st_mtime_ns)

    @classmethod
    def execute(cls, model, turbo, strength) -> io.NodeOutput:
        if turbo == NONE or float(strength) == 0.0:
            if not contracts.copy_entry(model.model_options).get("adapter"):
                return io.NodeOutput(model)  # nothing to switch off: the input MODEL itself
            clone = model.clone()
            removed = residency.uninstall(clone)
            log.info("Apply H3 Turbo LoRA: turbo=%s strength=%g switches off the Turbo adapter %r applied "
                     "upstream", turbo, strength, removed)
            return io.NodeOutput(clone)
        _, aliases, files = turbo_options()
        name = aliases.get(turbo, turbo)
        if name not in files:
            raise turbo_lora.TurboLoRAError(f"Apply H3 Turbo LoRA: {turbo!r} is not in the loras folder "
                                            f"(known aliases: {sorted(aliases) or 'none'})")
        dims = turbo_lora.model_target_dims(model.model.diffusion_model)
        resident = residency.get(files[name], dims)  # validated against this model before touching it
        alias = turbo if turbo in aliases else name
        if float(strength) != 1.0:
            log.info("Apply H3 Turbo LoRA: strength %g (the %s contract assumes 1.0)", strength, resident.variant)
        clone = model.clone()
        residency.install(clone, resident, float(strength), alias)
        return io.NodeOutput(clone)


NODES = [H3TurboLoRA]
