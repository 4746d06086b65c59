"""LoRA patches on the AdaLN / time-embedder weights of a model whose AdaLN is served by a table (``adaln=table``:
:mod:`.adaln_memo`; a fixed table: :func:`.adaln.patch`). Refused before sampling, never dropped (docs/lora.md,
"A style LoRA beside Turbo").

A table holds the AdaLN outputs computed from the *unpatched* weights, so a LoRA that trains ``adaln_proj`` or the
time embedder cannot take effect through it. Core's LoRA loaders (``comfy.sd.load_lora_for_models``, merged;
``load_bypass_lora_for_models``, bypass) map a LoRA key only when the model's ``state_dict()`` holds it, and drop the
others with a "lora key not loaded" log line:

- :func:`add_key_slots` puts a :class:`KeySlot` (0-element ``weight`` and ``bias`` buffers: no data, no size) at
  each AdaLN Linear's path of a model whose AdaLN modules were taken out, so core maps those keys and keeps their
  patches (merged: ``ModelPatcher.patches``; bypass: the ``BypassInjectionManager`` of the ``bypass_lora``
  injection);
- :func:`adaln_lora_keys` lists the AdaLN keys a MODEL patches (merged, hook and bypass patches, strength != 0);
- :func:`refuse` raises :class:`~h3_turbo.errors.InputError` naming them and the fix (``adaln=resident``); the
  OUTER_SAMPLE wrappers call it before core loads the model, so nothing is patched or sampled.
"""
from __future__ import annotations

import logging
import re

import torch

from ..errors import InputError
from ..logs import log_once

#: core key names (without ``diffusion_model.``) of the weights an AdaLN table stands for
_ADALN_KEY = re.compile(r"^(blocks\.\d+\.adaln_proj\.|final_layer\.adaln_proj\.|time_embedder\.)")
_PREFIX = "diffusion_model."
_SHOW = 6


class KeySlot(torch.nn.Module):
    """Holds the state-dict keys ``weight`` / ``bias`` of an AdaLN Linear that a table replaced, as 0-element buffers
    (0 bytes in ComfyUI's model size), so that core's LoRA loaders keep a LoRA's patches on it where :func:`refuse`
    finds them. Never called by the table's forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.empty(0))
        self.register_buffer("bias", torch.empty(0))

    def forward(self, *args, **kwargs):
        raise RuntimeError("H3 Turbo: an AdaLN Linear replaced by a table was called (KeySlot holds keys only)")


def add_key_slots(diffusion_model) -> int:
    """A :class:`KeySlot` at every AdaLN Linear path of a built core H3 whose ``adaln_proj`` / ``time_embedder``
    modules are table stand-ins (``blocks.N.adaln_proj.linear``, ``final_layer.adaln_proj.linear``,
    ``time_embedder.proj_in`` / ``proj_out``); returns how many were added."""
    dm = diffusion_model
    n = 0
    for mod, child in [(b.adaln_proj, "linear") for b in dm.blocks] + [(dm.final_layer.adaln_proj, "linear"),
                                                                     (dm.time_embedder, "proj_in"),
                                                                     (dm.time_embedder, "proj_out")]:
        if child not in mod._modules:
            mod.add_module(child, KeySlot())
            n += 1
    return n


def is_adaln_key(key: str) -> bool:
    """Whether a core weight key (``diffusion_model.`` prefix optional) belongs to the AdaLN / time-embedder path."""
    return bool(_ADALN_KEY.match(key[len(_PREFIX):] if key.startswith(_PREFIX) else key))


def _bypass_adapters(model_patcher) -> dict[str, float]:
    """{module key: strength} of the bypass adapters of ``model_patcher``'s injections (core's
    ``BypassInjectionManager``, reached through its ``inject_all`` closure)."""
    try:
        from comfy.weight_adapter import BypassInjectionManager
    except ImportError:                      # a core without bypass LoRAs
        return {}
    out: dict[str, float] = {}
    for name, injs in (getattr(model_patcher, "injections", None) or {}).items():
        found = False
        for inj in injs:
            for cell in getattr(getattr(inj, "inject", None), "__closure__", None) or ():
                try:
                    obj = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(obj, BypassInjectionManager):
                    found = True
                    for k, (_, strength) in obj.adapters.items():
                        out[k] = float(strength)
        if name == "bypass_lora" and not found:
            log_once(("adaln-lora-bypass-unread", name), "H3 Turbo: this ComfyUI's bypass LoRA injection could not be "
                     "read (no BypassInjectionManager in it): if that LoRA has AdaLN / time-embedder keys, they do not "
                     "apply to a model whose AdaLN is a table (adaln=resident applies them)", level=logging.WARNING)
    return out


def adaln_lora_keys(model_patcher) -> list[str]:
    """The AdaLN / time-embedder keys ``model_patcher`` patches with a non-zero strength: merged patches
    (``patches``), hook patches (``hook_patches``) and bypass adapters (``injections``), sorted."""
    keys = set()
    for k, plist in (getattr(model_patcher, "patches", None) or {}).items():
        if is_adaln_key(k) and any(p[0] != 0 and p[2] != 0 for p in plist):
            keys.add(k)
    for per_hook in (getattr(model_patcher, "hook_patches", None) or {}).values():
        keys.update(k for k in per_hook if is_adaln_key(k))
    keys.update(k for k, s in _bypass_adapters(model_patcher).items() if s != 0 and is_adaln_key(k))
    return sorted(keys)


#: what to do instead, for a model loaded with adaln=table by the NVFP4 loader
FIX_LOADER = "Load the model with adaln=resident (H3TurboNVFP4Loader input 'adaln')"


def refuse(model_patcher, what: str, fix: str = FIX_LOADER) -> None:
    """InputError when ``model_patcher`` patches AdaLN keys (:func:`adaln_lora_keys`); ``what`` names the table
    (e.g. ``adaln=table``), ``fix`` the way out."""
    keys = adaln_lora_keys(model_patcher)
    if not keys:
        return
    shown = ", ".join(keys[:_SHOW]) + (f", ... ({len(keys)} in all)" if len(keys) > _SHOW else "")
    raise InputError(f"H3 Turbo {what}: a LoRA on this MODEL patches {len(keys)} AdaLN / time-embedder weights "
                     f"({shown}). The AdaLN here comes from a table computed from the unpatched weights, so these "
                     f"patches cannot apply and are not dropped silently. {fix}, or use a LoRA without AdaLN keys.")


def refuse_wrapper_for(what: str, fix: str = FIX_LOADER):
    """A ComfyUI ``WrappersMP.OUTER_SAMPLE`` wrapper that calls :func:`refuse` before sampling."""

    def h3turbo_adaln_lora_check(executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
        refuse(executor.class_obj.model_patcher, what, fix)
        return executor(noise, latent_image, sampler, sigmas, *args, **kwargs)

    return h3turbo_adaln_lora_check
