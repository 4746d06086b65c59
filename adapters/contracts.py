"""Turbo contracts: what each distilled adapter / DMD model requires of the sampler.

A contract travels with the MODEL in ``model_options["h3_turbo"]["contract"]`` (see :func:`attach`,
:func:`get`) so the sampler can enforce it at sampling time. Sources: docs/h3-facts.md#turbo-lora-files
(NFE, shifts, alpha/rank, SHA-256), #sigma-schedules, #turboh3-dmd-schedule.
"""
from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field

MODEL_OPTIONS_KEY = "h3_turbo"


class AdapterFileNames:
    """Mixin for adapter records that hold ``path`` (the adapter file) and ``contract``
    (:class:`TurboContract`, or None when the file's contract cannot be determined): ``file`` (the file's base
    name) and ``variant`` (the contract's, ``"unknown"`` without one)."""

    @property
    def file(self) -> str:
        return os.path.basename(self.path)

    @property
    def variant(self) -> str:
        return self.contract.variant if self.contract is not None else "unknown"


@dataclass(frozen=True)
class TurboContract:
    """Sampling contract of one Turbo artifact.

    variant: API alias ("4step", "8step", "turboh3-dmd").
    nfe: model evaluations per sample (ComfyUI "steps"); grid has nfe+1 sigmas.
    shift_video / shift_audio: the uniform-shifted-grid shifts per modality.
    alpha_over_rank: the expected effective LoRA scale (None for non-LoRA artifacts or not known).
    name: the artifact (file name or alias); sha256: content hash when known; source: where the
    contract came from ("known-artifact", "metadata", "fixture", "user"). An adapter whose contract cannot be
    determined carries none (None), never a placeholder.
    update: the sampler's update rule for ``update=auto`` ("euler": deterministic training-Euler; "renoise":
    x0 then fresh noise at the next sigma, docs/turboh3.md#update-rule).
    """

    variant: str
    nfe: int
    shift_video: float
    shift_audio: float
    alpha_over_rank: float | None = None
    name: str = ""
    sha256: str | None = None
    source: str = "known-artifact"
    extra: dict = field(default_factory=dict, compare=False)
    update: str = "euler"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KnownArtifact:
    """An official artifact: file name stem, SHA-256 if published, and its contract."""

    filename: str
    sha256: str | None
    contract: TurboContract


def _c(variant, nfe, sv, sa, aor, name, sha=None):
    return KnownArtifact(name + ".safetensors", sha, TurboContract(variant, nfe, sv, sa, aor, name, sha))


# docs/h3-facts.md#turbo-lora-files (alpha per file, shifts, NFE, SHA-256); tests/test_contracts.py quotes the
# public source of every row.
KNOWN_ARTIFACTS: tuple[KnownArtifact, ...] = (
    _c("4step", 4, 6.0, 3.0, 1.0, "minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16",
       "449d80f301ac571622c72e28b8fd72a4b3681b7a8df8a92f17c8f6ec43f56558"),
    _c("8step", 8, 12.0, 3.0, 1 / 16, "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16",
       "2339acdf19bfe123f46b971ea35d367a84adb85de43627e1eceafa5a5b2b111e"),
    _c("4step", 4, 6.0, 3.0, 1.0, "minimax_h3_fl2v_turbo_4step_v1.0_768p_comfyui_bf16"),
    # Names below are official (docs/h3-facts.md#turbo-lora-files); alpha/rank 1/16 is inferred from their
    # Diffusers twins declaring alpha 8: the loader checks the file's own alpha tensors.
    _c("8step", 8, 6.0, 3.0, 1 / 16, "minimax_h3_fl2v_turbo_8step_v1.0_768p_comfyui_bf16"),
    _c("4step", 4, 6.0, 3.0, 1 / 16, "minimax_h3_fl2v_turbo_4step_v1.2_768p_comfyui_bf16"),
    # the 544p 4-step v0.1 adapter is published only in the Diffusers layout, without alpha (8 applies)
    _c("4step", 4, 12.0, 3.0, 1 / 16, "minimax_h3_fl2v_turbo_4step_v0.1",
       "5ff4a12c8b4599fec716e1b15a45e504e0d1129111896bdcde5ac4a15e395b29"),
)

#: the official file each alias of the ``variant`` input stands for (README "Turbo contracts")
ALIASES = {"4step": "minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16",
           "8step": "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16"}
#: choices of H3TurboLoRA's ``variant`` input: the file's own contract, an alias's contract, or none
VARIANTS = ("auto", "4step", "8step", "none")

# TurboH3-FL2VA-I2VA DMD: 5 sigma points = 4 updates, shifts 12/3 (docs/h3-facts.md#turboh3-dmd-schedule).
# update rule: re-noise, inferred from TurboDiffusion's public few-step samplers (docs/turboh3.md#update-rule)
TURBOH3_DMD = TurboContract("turboh3-dmd", 4, 12.0, 3.0, None, "TurboH3-FL2VA-I2VA", None, "known-artifact",
                            update="renoise")


def by_sha256(sha: str) -> KnownArtifact | None:
    """The known artifact with this SHA-256 (lowercase hex), or None."""
    for a in KNOWN_ARTIFACTS:
        if a.sha256 and a.sha256 == sha.lower():
            return a
    return None


def by_filename(name: str) -> KnownArtifact | None:
    """The known artifact whose official file name equals ``name`` (base name, with extension)."""
    for a in KNOWN_ARTIFACTS:
        if a.filename == name:
            return a
    return None


def choose(file_contract: TurboContract | None, variant: str, name: str) -> TurboContract | None:
    """The contract a Turbo adapter named ``name`` carries for the ``variant`` input (:data:`VARIANTS`).

    ``auto``: the file's own contract (None when it cannot be determined); ``none``: no contract;
    ``4step`` / ``8step``: the file's own contract when it is that variant, else (no contract of its own) the
    alias's official NFE and shifts (:data:`ALIASES`) with source ``"user"`` and no alpha expectation. A file
    whose own contract is another variant raises TurboLoRAError naming both.
    """
    from ..errors import TurboLoRAError

    if variant not in VARIANTS:
        raise TurboLoRAError(f"Apply H3 Turbo LoRA: variant {variant!r} is not one of {', '.join(VARIANTS)}")
    if variant == "auto":
        return file_contract
    if variant == "none":
        return None
    if file_contract is not None:
        if file_contract.variant != variant:
            raise TurboLoRAError(
                f"Apply H3 Turbo LoRA: variant {variant!r} contradicts {name!r}, whose own contract is "
                f"{file_contract.variant} ({file_contract.nfe} model evaluations, shifts "
                f"{file_contract.shift_video:g}/{file_contract.shift_audio:g}, from {file_contract.source}). Pick "
                f"'auto' (or '{file_contract.variant}'), or 'none' to sample without a contract.")
        return file_contract
    official = by_filename(ALIASES[variant] + ".safetensors").contract
    return TurboContract(variant, official.nfe, official.shift_video, official.shift_audio, None, name, None,
                         "user", {"verified": False, "as": official.name})


def attach(model_patcher, contract: TurboContract | None, **info) -> None:
    """Store ``contract`` (and extra info such as the adapter key) on a ModelPatcher's model_options.

    Call on a clone only. ``None`` removes any contract (Turbo off).
    """
    opts = model_patcher.model_options
    entry = dict(opts.get(MODEL_OPTIONS_KEY) or {})
    if contract is None:
        entry.pop("contract", None)
    else:
        entry["contract"] = contract
    entry.update(info)
    opts[MODEL_OPTIONS_KEY] = entry


def get(model_options: dict) -> TurboContract | None:
    """The Turbo contract carried by ``model_options`` (a ModelPatcher's or a sampler's), or None."""
    entry = (model_options or {}).get(MODEL_OPTIONS_KEY) or {}
    return entry.get("contract")


def copy_entry(model_options: dict) -> dict:
    """A copy of the pack's model_options entry (for logging / the ready route)."""
    return copy.copy((model_options or {}).get(MODEL_OPTIONS_KEY) or {})
