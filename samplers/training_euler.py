"""Shifted training-Euler AV sampler: independent video and audio states, one model call per step.

Mathematics (docs/h3-facts.md#training-euler-update; LightX2V ``h3_step_update="training_euler"``):
per stream, in float32, deterministic, no re-noise::

    x_next = x + (sigma_i - sigma_next) * v_dataward,    v_dataward = x0 - noise = -(ComfyUI velocity)

The video runs on the SIGMAS the sampler is given; the audio runs on its own grid (the Turbo contract's
audio shift, or the model_sampling audio shift without a contract). The network is evaluated once per
step at (sigma_v, sigma_a) exactly: core's DiT derives the audio sigma from the video sigma with the
per-call shifts in ``transformer_options`` (docs/h3-facts.md#audio-sigma-in-core), so the sampler sets
``minimax_h3_sigma_shift_audio = audio_shift_for(sigma_v, sigma_a, shift_v)`` on a per-call copy of the
model options, and hands the model the audio in core's carried form ``y = x_a * sigma_v / sigma_a`` so
core's ``forward`` un-carries it back to ``x_a`` (docs/h3-facts.md#audio-sigma-in-core). The velocity of each
stream is read by a per-call ``WrappersMP.DIFFUSION_MODEL`` wrapper that captures ``_forward``'s output
``[-video_out, -audio_out]`` (the streams' own velocities, before core's carried conversion).

Without a Turbo contract the sampler also accepts CFG > 1 and denoiser caches: when the network did not
run exactly once in a step, it reads the (combined) velocities from core's denoised by inverting the
carried conversion (:func:`velocities_from_denoised`). With a contract these are errors.

Entry and exit (docs/h3-facts.md#audio-sigma-in-core): the packed input is carried (audio x k on the way in, where
``k = BaseModel.audio_scale()``); the result handed back is carried too: ``y = x_a * sigma_v/sigma_a``,
and at sigma = 0 ``y = k * x_a`` (``process_latent_out`` divides the audio by k).

:func:`euler_av_loop` is the pure loop (no ComfyUI); :func:`sample_h3_turbo` is the
``comfy.samplers.KSAMPLER`` function; the ``check_*`` functions enforce the Turbo contracts at sampling
time and raise :class:`TurboContractError` (a ValueError) with a message that names the culprit.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from ..adapters import contracts
from .. import state
from ..errors import TurboContractError
from ..logs import log_once
from .schedules import audio_grid_from_video, shifted_grid
from .schedules import audio_shift_for_call as _audio_shift_for_call

log = logging.getLogger("h3_turbo")

SAMPLER_NAME = "H3 Turbo Sampler"
CAPTURE_KEY = "h3_turbo_velocity_capture"
# wrapper keys of this pack (e.g. the Turbo LoRA branch's "h3turbo_lora"): not foreign
OUR_WRAPPER_PREFIXES = ("h3_turbo", "h3turbo")
GRID_TOL = 1e-6
STATE_DTYPES = ("fp32", "model")
#: ``update`` input: ``auto`` = the Turbo contract's rule (renoise for the TurboH3 DMD model, else euler)
UPDATES = ("auto", "renoise", "euler")



# --------------------------------------------------------------------------------------------------
# The pure loop
# --------------------------------------------------------------------------------------------------

def euler_update(x: torch.Tensor, sigma: float, sigma_next: float, v_dataward: torch.Tensor) -> torch.Tensor:
    """One training-Euler step ``x + (sigma - sigma_next) * v_dataward`` (same dtype as ``x``).

    v_dataward: the data-ward velocity x0 - noise (ComfyUI models return noise - x0: pass its negative).
    Source: LightX2V ``run_back_simulation`` (docs/h3-facts.md#training-euler-update).
    """
    return x + (float(sigma) - float(sigma_next)) * v_dataward.to(x.dtype)


def euler_av_loop(velocity: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  x_v: torch.Tensor, x_a: torch.Tensor, sigmas_v, sigmas_a,
                  on_step: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the two-stream training-Euler loop.

    velocity(i, x_v, x_a) -> (v_v, v_a): the model's velocities at step i in ComfyUI's sign
    (noise - x0), each shaped like its state. It is called exactly ``len(sigmas_v) - 1`` times.
    x_v, x_a: the states at sigmas_v[0] / sigmas_a[0] (their dtype is the state dtype; the result has
    the same dtype). sigmas_v, sigmas_a: sequences of equal length N+1 (floats).
    on_step(i, x_v, x_a, v_v, v_a): optional, called after each evaluation, before the update.
    Returns (x_v, x_a) at sigmas_v[-1] / sigmas_a[-1].
    """
    sv = [float(s) for s in sigmas_v]
    sa = [float(s) for s in sigmas_a]
    if len(sv) != len(sa):
        raise ValueError(f"euler_av_loop: video grid has {len(sv)} points, audio grid {len(sa)}")
    for i in range(len(sv) - 1):
        v_v, v_a = velocity(i, x_v, x_a)
        if on_step is not None:
            on_step(i, x_v, x_a, v_v, v_a)
        x_v = euler_update(x_v, sv[i], sv[i + 1], -v_v)
        x_a = euler_update(x_a, sa[i], sa[i + 1], -v_a)
    return x_v, x_a


def renoise_update(x: torch.Tensor, sigma: float, sigma_next: float, v: torch.Tensor, noise) -> torch.Tensor:
    """One re-noise step: ``x0 = x - sigma * v`` (v in ComfyUI's sign, noise - x0), then
    ``x_next = (1 - sigma_next) * x0 + sigma_next * noise`` (``noise``: fresh N(0, 1) like x, or None when
    sigma_next == 0, where the step returns x0). TurboDiffusion's few-step samplers (docs/turboh3.md#update-rule)."""
    x0 = x - float(sigma) * v.to(x.dtype)
    if float(sigma_next) == 0.0:
        return x0
    return (1.0 - float(sigma_next)) * x0 + float(sigma_next) * noise.to(x.dtype)


def renoise_av_loop(velocity, x_v: torch.Tensor, x_a: torch.Tensor, sigmas_v, sigmas_a, generator: torch.Generator,
                    on_step=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-stream re-noise loop (same contract as :func:`euler_av_loop`): each stream predicts its x0 on its own
    grid and is re-noised to its next sigma with fresh noise drawn from ``generator`` (a CPU generator: video then
    audio, fp32, each step except the last), so a seed reproduces the run on any device."""
    sv = [float(s) for s in sigmas_v]
    sa = [float(s) for s in sigmas_a]
    if len(sv) != len(sa):
        raise ValueError(f"renoise_av_loop: video grid has {len(sv)} points, audio grid {len(sa)}")
    for i in range(len(sv) - 1):
        v_v, v_a = velocity(i, x_v, x_a)
        if on_step is not None:
            on_step(i, x_v, x_a, v_v, v_a)
        n_v = n_a = None
        if sv[i + 1] != 0.0 or sa[i + 1] != 0.0:
            n_v = torch.randn(x_v.shape, generator=generator, dtype=torch.float32).to(x_v.device)
            n_a = torch.randn(x_a.shape, generator=generator, dtype=torch.float32).to(x_a.device)
        x_v = renoise_update(x_v, sv[i], sv[i + 1], v_v, n_v)
        x_a = renoise_update(x_a, sa[i], sa[i + 1], v_a, n_a)
    return x_v, x_a


def resolve_update(update: str, contract: contracts.TurboContract | None) -> str:
    """``renoise`` / ``euler`` for the sampler's ``update`` input: ``auto`` = the contract's rule (``euler`` without
    a contract). ValueError for an unknown value."""
    if update not in UPDATES:
        raise ValueError(f"{SAMPLER_NAME}: update must be one of {UPDATES}, got {update!r}")
    if update != "auto":
        return update
    return getattr(contract, "update", "euler") if contract is not None else "euler"


def carry_factor(sigma_v: float, sigma_a: float, audio_scale: float) -> float:
    """The factor c with ``y = c * x_a``: core's carried audio at (sigma_v, sigma_a) (docs/h3-facts.md#audio-sigma-in-core).

    sigma_v / sigma_a for sigma > 0; ``audio_scale`` (k) at sigma_v = sigma_a = 0; 1 when k == 1 (core
    does not carry then).
    """
    if audio_scale == 1.0:
        return 1.0
    if sigma_a == 0.0:
        if sigma_v != 0.0:
            raise ValueError(f"carry_factor: audio sigma 0 with video sigma {sigma_v}")
        return float(audio_scale)
    return float(sigma_v) / float(sigma_a)


# --------------------------------------------------------------------------------------------------
# Contract checks (sampling time)
# --------------------------------------------------------------------------------------------------

def _who(contract: contracts.TurboContract) -> str:
    return f"Turbo '{contract.name or contract.variant}' ({contract.variant}, shifts {contract.shift_video:g}/{contract.shift_audio:g})"


def check_sigmas(contract: contracts.TurboContract, sigmas) -> None:
    """The SIGMAS must be the contract's video grid: ``len - 1 == nfe`` and every value within 1e-6 of
    ``shifted_grid(nfe, shift_video)``. Raises :class:`TurboContractError`."""
    sig = [float(s) for s in (sigmas.tolist() if isinstance(sigmas, torch.Tensor) else sigmas)]
    n = len(sig) - 1
    nfe = int(contract.nfe)
    if n != nfe:
        msg = (f"{SAMPLER_NAME}: {_who(contract)} wants {nfe} model evaluations (a {nfe + 1}-point sigma grid), "
               f"but the SIGMAS have {len(sig)} points = {n} model evaluations.")
        if n == nfe + 1:
            msg += (f" You gave grid points, not model evaluations: ComfyUI's steps count model calls, "
                    f"set steps to {nfe} (not {nfe + 1}).")
        else:
            msg += f" Set steps to {nfe} (or 0 on H3 Turbo Sigmas to use the contract's)."
        raise TurboContractError(msg)
    ref = shifted_grid(nfe, contract.shift_video).tolist()
    err = max(abs(a - b) for a, b in zip(sig, ref))
    if err > GRID_TOL:
        got = ", ".join(f"{s:.6f}" for s in sig)
        want = ", ".join(f"{s:.6f}" for s in ref)
        raise TurboContractError(
            f"{SAMPLER_NAME}: the SIGMAS are not the video grid of {_who(contract)}: got [{got}], "
            f"expected [{want}] (max difference {err:.3g} > {GRID_TOL:g}). Use H3 Turbo Sigmas "
            f"(steps 0), or the 'simple' scheduler with ModelSamplingMiniMaxH3 set to "
            f"{contract.shift_video:g}/{contract.shift_audio:g}.")


def check_cfg(guider, contract: contracts.TurboContract) -> None:
    """Turbo models are guidance-distilled: a guider with cfg (or cfg1/cfg2) other than 1 is an error."""
    for attr in ("cfg", "cfg1", "cfg2"):
        val = getattr(guider, attr, None)
        if isinstance(val, (int, float)) and not math.isclose(float(val), 1.0, rel_tol=0.0, abs_tol=1e-9):
            raise TurboContractError(
                f"{SAMPLER_NAME}: {_who(contract)} is guidance-distilled and runs without CFG, but the guider "
                f"{type(guider).__name__} has {attr}={val:g}. Use BasicGuider (or CFGGuider with cfg 1.0).")


_CACHE_NODES = {"easycache": "EasyCache", "lazycache": "LazyCache"}
_WRAPPER_TYPES_CHECKED = ("diffusion_model", "apply_model", "predict_noise")


def find_caches(model_options: dict) -> list[str]:
    """Names of denoiser caches found in ``model_options`` (core's EasyCache / LazyCache: holder at
    ``transformer_options["easycache"]``, wrappers keyed ``easycache`` / ``lazycache``, docs/h3-facts.md#denoiser-caches-in-core)."""
    to = (model_options or {}).get("transformer_options") or {}
    found: list[str] = []
    holder = to.get("easycache")
    if holder is not None:
        cls = type(holder).__name__
        found.append("LazyCache" if cls.startswith("LazyCache") else "EasyCache" if cls.startswith("EasyCache")
                     else f"a denoiser cache ({cls} at transformer_options['easycache'])")
    for wtype, keyed in (to.get("wrappers") or {}).items():
        for key in (keyed or {}):
            name = _CACHE_NODES.get(str(key).lower())
            if name and name not in found:
                found.append(name)
    return found


def foreign_wrappers(model_options: dict) -> list[str]:
    """``"<type>:<key>"`` of every DIFFUSION_MODEL / APPLY_MODEL / PREDICT_NOISE wrapper not of this pack
    (key not starting with ``h3_turbo`` / ``h3turbo``). Unkeyed wrappers show as ``<type>:None``."""
    to = (model_options or {}).get("transformer_options") or {}
    out = []
    for wtype, keyed in (to.get("wrappers") or {}).items():
        if wtype not in _WRAPPER_TYPES_CHECKED:
            continue
        for key, fns in (keyed or {}).items():
            if fns and not str(key).startswith(OUR_WRAPPER_PREFIXES):
                out.append(f"{wtype}:{key}")
    return out


def fun_controlnet_wrappers(model_options: dict) -> list:
    """The DIFFUSION_MODEL wrappers in ``model_options`` that are core's Fun ControlNet's
    (``runtime.core_compat.is_fun_controlnet_wrapper``; docs/h3-facts.md#newer-core)."""
    from ..runtime.core_compat import is_fun_controlnet_wrapper

    to = (model_options or {}).get("transformer_options") or {}
    keyed = (to.get("wrappers") or {}).get("diffusion_model") or {}
    return [fn for fns in keyed.values() for fn in (fns or []) if is_fun_controlnet_wrapper(fn)]


def check_caches(model_options: dict, contract: contracts.TurboContract) -> None:
    """With a Turbo contract, denoiser caches (core's EasyCache / LazyCache, named in the error) and any
    foreign DIFFUSION_MODEL / APPLY_MODEL / PREDICT_NOISE wrapper are refused: each of the few Turbo steps
    must be a real model evaluation. Core's Fun ControlNet (an unkeyed wrapper) is refused with its own message.
    (Without a contract the sampler accepts them: see sample_h3_turbo.)"""
    caches = find_caches(model_options)
    if caches:
        what = " and ".join(caches)
        raise TurboContractError(
            f"{SAMPLER_NAME}: the MODEL carries the denoiser cache {what}, which skips or reuses model "
            f"evaluations; {_who(contract)} takes only {contract.nfe} steps and each must be a real model "
            f"evaluation. Remove the {what} node from the MODEL path.")
    fun = fun_controlnet_wrappers(model_options)
    if fun:
        raise TurboContractError(
            f"{SAMPLER_NAME}: {_who(contract)} refuses the Fun ControlNet (core's MiniMaxH3FunControlNetApply: an "
            f"unkeyed DIFFUSION_MODEL wrapper of MiniMaxH3FunControlPatch that adds control residuals to the DiT "
            f"blocks). The Turbo adapter was distilled without control injection, so its contract ({contract.nfe} "
            f"steps at shifts {contract.shift_video:g}/{contract.shift_audio:g}) is not known to hold with it. "
            f"Pick variant 'none' on Apply H3 Turbo LoRA to sample without the contract, or remove the ControlNet.")
    foreign = foreign_wrappers(model_options)
    if foreign:
        raise TurboContractError(
            f"{SAMPLER_NAME}: {_who(contract)} refuses foreign model wrappers that may skip or alter "
            f"model evaluations (a denoiser cache?): {', '.join(foreign)} (wrapper type:key). Remove the "
            f"node that added them from the MODEL path.")


def check_shift_patch(contract: contracts.TurboContract, model_sampling, patched: bool,
                      transformer_options: dict) -> None:
    """A ModelSamplingMiniMaxH3 (MiniMaxH3SigmaShift) / ModelSamplingAV patch must agree with the contract.

    patched: whether ``model_sampling`` is an object patch on the ModelPatcher (an unpatched model keeps
    the checkpoint's default shifts, which the sampler overrides per call: allowed, logged once).
    Also checks ``transformer_options["minimax_h3_sigma_shift_video"/"_audio"]`` when present.
    """
    found = []
    if patched:
        sv = getattr(model_sampling, "shift", None)
        sa = getattr(model_sampling, "audio_shift", None)
        found.append(("model_sampling patch (ModelSamplingMiniMaxH3 / ModelSamplingAV)", sv, sa))
    tv = transformer_options.get("minimax_h3_sigma_shift_video")
    ta = transformer_options.get("minimax_h3_sigma_shift_audio")
    if tv is not None or ta is not None:
        found.append(("transformer_options minimax_h3_sigma_shift_video/_audio", tv, ta))
    for where, sv, sa in found:
        bad = []
        if sv is not None and abs(float(sv) - contract.shift_video) > 1e-6:
            bad.append(f"shift_video {float(sv):g} (contract {contract.shift_video:g})")
        if sa is not None and abs(float(sa) - contract.shift_audio) > 1e-6:
            bad.append(f"shift_audio {float(sa):g} (contract {contract.shift_audio:g})")
        if bad:
            raise TurboContractError(
                f"{SAMPLER_NAME}: the MODEL's {where} disagrees with {_who(contract)}: {', '.join(bad)}. "
                f"Set ModelSamplingMiniMaxH3 to {contract.shift_video:g}/{contract.shift_audio:g} or remove it.")
    if not patched:
        log_once(("sampler", "unpatched-shift"), "%s: model_sampling is not patched; the sampler sets the shifts per call "
                  "from the Turbo contract (%g/%g).", SAMPLER_NAME, contract.shift_video, contract.shift_audio)


# --------------------------------------------------------------------------------------------------
# The KSAMPLER function
# --------------------------------------------------------------------------------------------------

def _model_parts(model):
    """(guider, base_model, model_patcher) from the KSamplerX0Inpaint the KSAMPLER passes in."""
    guider = getattr(model, "inner_model", None)
    base = getattr(guider, "inner_model", None)
    patcher = getattr(guider, "model_patcher", None)
    if guider is None or base is None:
        raise TypeError(f"{SAMPLER_NAME}: expected ComfyUI's KSamplerX0Inpaint(guider) as the model, got "
                        f"{type(model).__name__}; use the SAMPLER with SamplerCustomAdvanced.")
    return guider, base, patcher


def _call_options(model_options: dict, shift_v: float, shift_a: float, capture) -> dict:
    """A per-call copy of ``model_options`` with the per-call shifts and the capture wrapper (the shared
    dicts are not mutated)."""
    import comfy.patcher_extension as pe

    mo = dict(model_options)
    to = dict(mo.get("transformer_options") or {})
    to["minimax_h3_sigma_shift_video"] = float(shift_v)
    to["minimax_h3_sigma_shift_audio"] = float(shift_a)
    wr = dict(to.get("wrappers") or {})
    dm = dict(wr.get(pe.WrappersMP.DIFFUSION_MODEL) or {})
    dm[CAPTURE_KEY] = [capture]
    wr[pe.WrappersMP.DIFFUSION_MODEL] = dm
    to["wrappers"] = wr
    mo["transformer_options"] = to
    return mo


class _Capture:
    """DIFFUSION_MODEL wrapper that records ``_forward``'s inputs and output ``[video_v, audio_v]``."""

    def __init__(self):
        self.calls = 0
        self.out = None
        self.x_in = None

    def __call__(self, executor, x, *args, **kwargs):
        out = executor(x, *args, **kwargs)
        self.calls += 1
        self.x_in = list(x)
        self.out = list(out)
        return out


def velocities_from_denoised(pack: torch.Tensor, denoised: torch.Tensor, shapes, sigma_v: float, sigma_a: float,
                             audio_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-stream velocities (ComfyUI sign, fp32) from a packed carried model input and core's packed
    denoised, by inverting ``BaseModel.calculate_denoised`` (``den = y - sigma_v*out``) and core's carried
    audio conversion ``out_y = (1-k)*x_a + (1+(k-1)*sigma_a)*v_a`` with ``x_a = y*sigma_a/sigma_v``
    (docs/h3-facts.md#audio-sigma-in-core). Valid for any affine combination of forwards (CFG). sigma_v > 0 required.
    """
    import comfy.utils

    xv, y = (t.float() for t in comfy.utils.unpack_latents(pack, shapes))
    dv, dy = (t.float() for t in comfy.utils.unpack_latents(denoised, shapes))
    v_v = (xv - dv) / sigma_v
    out_y = (y - dy) / sigma_v
    k = float(audio_scale)
    if k == 1.0:
        return v_v, out_y
    x_a = y * (sigma_a / sigma_v)
    return v_v, (out_y - (1.0 - k) * x_a) / (1.0 + (k - 1.0) * sigma_a)


@torch.no_grad()
def sample_h3_turbo(model, x, sigmas, extra_args=None, callback=None, disable=None, state_dtype="fp32",
                    update="auto"):
    """KSAMPLER function of H3 Turbo Sampler (training-Euler AV). Signature as k-diffusion samplers.

    model: ComfyUI's KSamplerX0Inpaint around a CFGGuider of an H3 model. x: the carried packed latent
    [1, 1, N_video + N_audio] at sigmas[0] (already noise-scaled). sigmas: 1-D video sigmas (N+1).
    extra_args: {"model_options", "seed", "denoise_mask"}. state_dtype: "fp32" or "model". update: "auto" (the
    contract's rule), "euler" (deterministic) or "renoise" (fresh noise from a CPU generator seeded with
    ``extra_args["seed"]``). Returns the carried pack at sigmas[-1].

    Errors (:class:`TurboContractError` / ValueError): not an H3 AV latent; the Turbo
    contract in ``model_options["h3_turbo"]`` violated (steps, grid, CFG, denoiser cache / foreign model
    wrapper, shift patch); with a contract, the network not run exactly once in a step.

    A denoise mask (``extra_args["denoise_mask"]``, a latent ``noise_mask`` on video and/or audio) is handled as core's
    samplers handle it: core's ``KSamplerX0Inpaint`` puts the kept tokens (mask 0) into the model input at each
    step and its denoised output holds the latent image there; the velocities are read from that denoised
    (:func:`velocities_from_denoised`), so kept tokens step towards the latent image and end on it. The model sees
    the mask as core passes it (newer cores: per-token modulation rows).

    Without a contract, CFG > 1 and denoiser caches are allowed: when ``_forward`` did not run exactly once
    in a step, the velocities are read from core's denoised instead (:func:`velocities_from_denoised`,
    logged once).
    """
    import comfy.utils
    from tqdm.auto import tqdm

    extra_args = dict(extra_args or {})
    model_options = extra_args.get("model_options") or {}
    entry = model_options.get(contracts.MODEL_OPTIONS_KEY) or {}
    state.set_current_turbo(entry.get("adapter") or "none")
    contract = contracts.get(model_options)

    guider, base, patcher = _model_parts(model)
    shapes = getattr(base, "latent_shapes", None)
    if shapes is None or len(shapes) != 2:
        raise ValueError(f"{SAMPLER_NAME}: needs an H3 audio+video latent (2 streams), got latent_shapes="
                         f"{shapes}. Use EmptyMiniMaxH3LatentAV / an H3 AV latent.")
    masked = extra_args.get("denoise_mask") is not None
    if masked:
        log_once(("sampler", "denoise-mask"), "%s: a denoise mask (latent noise_mask): core's KSamplerX0Inpaint blends "
                 "the kept tokens into the model input and its denoised output, and the velocities are read from "
                 "that denoised, as core's samplers step", SAMPLER_NAME)
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{SAMPLER_NAME}: state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    rule = resolve_update(update, contract)
    if update == "auto" and contract is not None:
        log_once(("sampler", "update", contract.variant, rule), "%s: update=auto -> %s (the %s contract's rule)",
                 SAMPLER_NAME, rule, contract.variant)

    ms = patcher.get_model_object("model_sampling") if patcher is not None else base.model_sampling
    patched = patcher is not None and "model_sampling" in getattr(patcher, "object_patches", {})
    to = model_options.get("transformer_options") or {}
    if contract is not None:
        check_sigmas(contract, sigmas)
        check_cfg(guider, contract)
        check_caches(model_options, contract)
        check_shift_patch(contract, ms, patched, to)
        shift_v, shift_a = float(contract.shift_video), float(contract.shift_audio)
    else:
        shift_v = float(getattr(ms, "shift", 0.0) or 0.0)
        shift_a = getattr(ms, "audio_shift", None)
        if shift_a is None or not shift_v > 0:
            raise ValueError(f"{SAMPLER_NAME}: the model's model_sampling ({type(ms).__name__}) has no "
                             f"audio_shift: not an H3 (ModelSamplingAV) model.")
        shift_a = float(shift_a)
        log_once(("sampler", "no-contract"), "%s: no Turbo contract attached; audio grid from model_sampling shifts %g/%g.",
                  SAMPLER_NAME, shift_v, shift_a)

    sv = [float(s) for s in sigmas.detach().double().cpu().tolist()]
    if len(sv) < 2:
        return x
    if contract is not None:
        sa = shifted_grid(contract.nfe, shift_a).tolist()
    else:
        sa = audio_grid_from_video(sv, shift_v, shift_a)
    for s in sv + sa:
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"{SAMPLER_NAME}: sigmas must lie in [0, 1] (flow matching), got {s}")
    if sv[0] == 0.0:
        return x
    from ..runtime import adaln as _adaln, adaln_memo

    if patcher is not None and adaln_memo.memo_of(patcher) is not None:    # adaln=table: one pass (memory.md)
        adaln_memo.prefetch_groups(patcher, list(dict.fromkeys(
            _adaln.forward_timesteps(sv[i], shift_v, _audio_shift_for_call(sv[i], sa[i], shift_v, shift_a), c,
                                     patcher.load_device)
            for i in range(len(sv) - 1) if sv[i] > 0 for c in (None, _adaln.VISUAL_COND_T))))

    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{SAMPLER_NAME}: the noised input latent holds NaN or Inf values ({_nonfinite(x)}); check "
                         "the latent_image input and the nodes before it (e.g. a LatentMultiply by NaN)")
    k = float(base.audio_scale())
    sdtype = torch.float32 if state_dtype == "fp32" else base.get_dtype_inference()
    xv0, ya0 = comfy.utils.unpack_latents(x, shapes)
    x_v = xv0.to(sdtype)
    x_a = (ya0.to(torch.float32) / carry_factor(sv[0], sa[0], k)).to(sdtype)  # carried -> native audio

    s_in = x.new_ones([x.shape[0]])
    pbar = tqdm(total=len(sv) - 1, disable=disable)

    def velocity(i, xv, xa):
        c = carry_factor(sv[i], sa[i], k)
        shift_a_call = _audio_shift_for_call(sv[i], sa[i], shift_v, shift_a)
        cap = _Capture()
        mo = _call_options(model_options, shift_v, shift_a_call, cap)
        pack, _ = comfy.utils.pack_latents([xv.to(x.dtype), (xa.to(torch.float32) * c).to(x.dtype)])
        args = dict(extra_args, model_options=mo)
        den = model(pack, sigmas[i] * s_in, **args)
        if cap.calls >= 1 and not masked:   # (with a mask core replaced the kept tokens of the model input)
            a_in = cap.x_in[1].float()
            err = (a_in - xa.float()).norm() / xa.float().norm().clamp(min=1e-12)
            if err > 1e-2:
                raise RuntimeError(f"{SAMPLER_NAME}: step {i}: the network saw an audio latent {float(err):.3g} "
                                   f"(relative) away from the sampler's state: core's audio carry changed?")
        if cap.calls == 1 and not masked:
            v_v = cap.out[0].float().reshape(xv.shape)
            v_a = cap.out[1].float().reshape(xa.shape)
        elif masked and (cap.calls == 1 or contract is None):
            # a denoise mask: core's masked denoised (kept tokens = the latent image) is what core's samplers step
            v_v, v_a = velocities_from_denoised(pack, den, shapes, sv[i], sa[i], k)
            v_v, v_a = v_v.reshape(xv.shape), v_a.reshape(xa.shape)
        elif contract is None:
            # CFG > 1 (cond + uncond forwards) or a cache that skipped _forward: read the combined
            # velocities from core's packed denoised by inverting core's carried conversion (exact algebra)
            log_once(("sampler", f"from-denoised-{cap.calls}"), "%s: the diffusion model ran %d times in one step (CFG > 1 "
                      "or a denoiser cache); reading the velocities from core's denoised instead of the captured "
                      "output.", SAMPLER_NAME, cap.calls)
            v_v, v_a = velocities_from_denoised(pack, den, shapes, sv[i], sa[i], k)
            v_v, v_a = v_v.reshape(xv.shape), v_a.reshape(xa.shape)
        else:
            raise RuntimeError(
                f"{SAMPLER_NAME}: step {i}: the diffusion model ran {cap.calls} times instead of once; "
                f"something skipped or repeated the model evaluation, which {_who(contract)} does not allow.")
        if callback is not None:
            x0_v = xv.float() - sv[i] * v_v
            x0_a = xa.float() - sa[i] * v_a
            den_cb, _ = comfy.utils.pack_latents([x0_v, k * x0_a])  # carried x0: audio x k
            callback({"x": pack, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": den_cb.to(x.dtype)})
        pbar.update(1)
        return v_v, v_a

    try:
        if rule == "renoise":
            seed = extra_args.get("seed")
            gen = torch.Generator("cpu").manual_seed(int(seed) if seed is not None else 0)
            if seed is None:
                log_once(("sampler", "renoise-noseed"), "%s: update=renoise without a sampler seed: the fresh noise "
                         "uses seed 0", SAMPLER_NAME)
            x_v, x_a = renoise_av_loop(velocity, x_v, x_a, sv, sa, gen)
        else:
            x_v, x_a = euler_av_loop(velocity, x_v, x_a, sv, sa)
    finally:
        pbar.close()
    out, _ = comfy.utils.pack_latents([x_v.to(torch.float32),
                                       x_a.to(torch.float32) * carry_factor(sv[-1], sa[-1], k)])
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{SAMPLER_NAME}: the sampled latent holds NaN or Inf values ({_nonfinite(out)}): the "
                         "model produced them (a damaged model file, a LoRA, or a strength out of its range)")
    return out.to(x.dtype)


def _nonfinite(t: torch.Tensor) -> str:
    """'<n> of <total> values' that are NaN or Inf in ``t``."""
    return f"{int((~torch.isfinite(t)).sum())} of {t.numel()} values"


#: H3 Turbo Sampler predicts its AdaLN timestep groups itself (runtime/adaln_memo.py ``prefetch_groups``)
sample_h3_turbo.h3_turbo_prefetches_adaln = True
