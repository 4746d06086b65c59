"""``H3TurboLoRA``: apply an official H3 Turbo LoRA as a runtime branch (never merged into the base)."""
from __future__ import annotations

import logging
import os

from comfy_api.latest import io

from . import CATEGORY, checks
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
    metadata declares that contract). ``variant`` (optional, default ``auto``): the contract the MODEL carries,
    see ``contracts.choose`` (an adapter whose contract cannot be determined carries none unless one is picked).
    Errors (wrong base, missing/extra keys, alpha mismatch, a variant that contradicts the file, a strength
    that is not a finite number in range) name the file or the input.
    """

    DISPLAY = "Apply H3 Turbo LoRA"
    NUMBERS = {"strength": checks.Number("float", 1.0, -2.0, 2.0, 0.05)}

    @classmethod
    def define_schema(cls):
        options, _, _ = turbo_options()
        return io.Schema(
            node_id="H3TurboLoRA",
            display_name=cls.DISPLAY,
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
                cls.NUMBERS["strength"].input("strength", tooltip="Branch strength. The Turbo contracts assume 1.0."),
                io.Combo.Input("variant", options=list(contracts.VARIANTS), default="auto", optional=True,
                               tooltip="The Turbo contract (steps, shifts) the model carries: auto = the file's "
                                       "own (none for a file that is not an official one); 4step / 8step = that "
                                       "official contract for a file without one; none = no contract."),
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
    def execute(cls, model, turbo, strength, variant="auto") -> io.NodeOutput:
        (strength,) = checks.check(cls, strength=strength)
        if turbo == NONE or strength == 0.0:
            if not contracts.copy_entry(model.model_options).get("adapter"):
                return io.NodeOutput(model)  # nothing to switch off: the input MODEL itself
            clone = model.clone()
            removed = residency.uninstall(clone)
            log.info("Apply H3 Turbo LoRA: turbo=%s strength=%g switches off the Turbo adapter %r applied "
                     "upstream", turbo, strength, removed)
            return io.NodeOutput(clone)
        from ..runtime.dmd import is_dmd

        if is_dmd(model):
            raise turbo_lora.TurboLoRAError(
                f"Apply H3 Turbo LoRA: the MODEL is the TurboH3 DMD model (Load TurboH3 DMD Model), a four-update "
                f"distilled model that takes no Turbo LoRA: the {turbo!r} adapter is for the base FL2VA model. Remove "
                f"this node (or set turbo=none) and sample the DMD model with H3 Turbo Sigmas + H3 Turbo Sampler.")
        _, aliases, files = turbo_options()
        name = aliases.get(turbo, turbo)
        if name not in files:
            raise turbo_lora.TurboLoRAError(f"Apply H3 Turbo LoRA: {turbo!r} is not in the loras folder "
                                            f"(known aliases: {sorted(aliases) or 'none'})")
        dm = model.model.diffusion_model
        dims = turbo_lora.model_target_dims(dm)
        # validated against this model before touching it
        resident = residency.get(files[name], dims, head_dim=turbo_lora.model_head_dim(dm))
        alias = turbo if turbo in aliases else name
        contract = contracts.choose(resident.contract, variant, resident.file)
        if contract is None:
            why = ("variant none" if variant == "none" else
                   "it is not an official file and carries no contract metadata")
            log.info("Apply H3 Turbo LoRA: %s carries no Turbo contract (%s): the sampler enforces no steps or "
                     "shifts", resident.file, why)
        elif contract.source == "user":
            log.info("Apply H3 Turbo LoRA: %s sampled under the %s contract of %s (picked by variant): %d steps, "
                     "shifts %g/%g", resident.file, variant, contract.extra["as"], contract.nfe,
                     contract.shift_video, contract.shift_audio)
        if strength != 1.0 and contract is not None:
            log.info("Apply H3 Turbo LoRA: strength %g (the %s contract assumes 1.0)", strength, contract.variant)
        clone = model.clone()
        residency.install(clone, resident, strength, alias, contract=contract)
        if contract is None:   # for the sigma node's message
            contracts.attach(clone, None, no_contract="variant none" if variant == "none" else "not official")
        return io.NodeOutput(clone)


NODES = [H3TurboLoRA]
