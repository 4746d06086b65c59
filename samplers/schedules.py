"""Uniform shifted sigma grids ("uniform shifted training-Euler", LightX2V ``_make_schedule``).

Source: docs/h3-facts.md#sigma-schedules (LightX2V ``lightx2v/models/schedulers/minimax_h3/scheduler.py``).
"""
from __future__ import annotations

import torch


def shifted_grid(nfe: int, shift: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sigmas ``s*b/(1+(s-1)*b)`` with ``b = linspace(1, 0, nfe+1)``; shape [nfe+1], first 1, last exactly 0.

    ``nfe`` is the number of model evaluations (ComfyUI "steps"), not the number of grid points.
    Raises ValueError for nfe < 1 or shift <= 0.
    """
    if int(nfe) != nfe or nfe < 1:
        raise ValueError(f"nfe must be a positive integer (model evaluations), got {nfe!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    b = torch.linspace(1.0, 0.0, int(nfe) + 1, dtype=torch.float64)
    s = float(shift)
    sig = s * b / (1.0 + (s - 1.0) * b)
    sig[-1] = 0.0
    return sig.to(dtype)


def audio_sigma_from_video(sigma_v: torch.Tensor, shift_v: float, shift_a: float) -> torch.Tensor:
    """Core's closed form (``comfy/ldm/minimax/model.py: time_shift_sigma``, docs/h3-facts.md#audio-sigma-in-core):
    ``b = s_v/(shift_v + s_v*(1-shift_v))``, ``s_a = shift_a*b/(1+(shift_a-1)*b)``."""
    b = sigma_v / (shift_v + sigma_v * (1.0 - shift_v))
    return shift_a * b / (1.0 + (shift_a - 1.0) * b)


def audio_shift_for(sigma_v: float, sigma_a: float, shift_v: float) -> float:
    """The per-call audio shift that makes core's closed form map ``sigma_v`` to ``sigma_a``:
    ``s_a = sigma_a*(1-b)/(b*(1-sigma_a))`` with ``b = sigma_v/(shift_v + sigma_v*(1-shift_v))``
    (docs/h3-facts.md#audio-sigma-in-core). Defined for 0 < sigma_v, sigma_a < 1; raises ValueError otherwise."""
    if not (0.0 < sigma_v < 1.0 and 0.0 < sigma_a < 1.0):
        raise ValueError(f"audio_shift_for needs 0 < sigma < 1, got sigma_v={sigma_v}, sigma_a={sigma_a}")
    b = sigma_v / (shift_v + sigma_v * (1.0 - shift_v))
    return sigma_a * (1.0 - b) / (b * (1.0 - sigma_a))


def audio_shift_for_call(sigma_v: float, sigma_a: float, shift_v: float, shift_a_default: float) -> float:
    """The audio shift H3 Turbo Sampler gives core for one forward: :func:`audio_shift_for` of the call's two sigmas,
    or ``shift_a_default`` at ``sigma_v == sigma_a == 1`` (any shift maps 1 to 1). The one rule that the sampler and
    the AdaLN table's timestep groups (``runtime/adaln.py``) share."""
    if sigma_v == 1.0 and sigma_a == 1.0:
        return float(shift_a_default)
    return audio_shift_for(sigma_v, sigma_a, shift_v)


def audio_grid_from_video(sigmas_v, shift_v: float, shift_a: float) -> list[float]:
    """The audio sigma grid that belongs to a video sigma grid under core's closed form
    (:func:`audio_sigma_from_video`), in float64, with the endpoints pinned exactly: video 1 -> audio 1,
    video 0 -> audio 0.

    sigmas_v: a sequence or 1-D tensor of video sigmas (any float dtype). Returns a list of floats of
    the same length. For a uniform shifted grid (:func:`shifted_grid`) this equals
    ``shifted_grid(nfe, shift_a)`` to float64 rounding, because both come from the same ``b``.
    """
    out = []
    for s in (sigmas_v.tolist() if isinstance(sigmas_v, torch.Tensor) else list(sigmas_v)):
        s = float(s)
        if s == 0.0:
            out.append(0.0)
        elif s == 1.0:
            out.append(1.0)
        else:
            out.append(float(audio_sigma_from_video(s, float(shift_v), float(shift_a))))
    return out


def turbo_grids(nfe: int, shift_video: float, shift_audio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, audio) float64 grids of one Turbo contract: ``shifted_grid(nfe, shift_video)`` and
    ``shifted_grid(nfe, shift_audio)``, each of shape [nfe+1] (docs/h3-facts.md#sigma-schedules, #turboh3-dmd-schedule)."""
    return shifted_grid(nfe, shift_video), shifted_grid(nfe, shift_audio)
