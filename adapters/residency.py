"""Process-wide residency of Turbo LoRA adapters, and their installation on a ModelPatcher clone.

- Adapters are cached by content (SHA-256 of the file; the hash itself is cached by path + size +
  mtime, see :func:`turbo_lora.sha256_file`), so alternating 4step/8step requests on one loaded base
  never rebuild the base and never re-read an adapter from disk. ``LOAD_STATS["loads"]`` counts file
  reads (tests assert it).
- LRU eviction under a byte budget: ``$H3TURBO_LORA_BUDGET_MB`` (default 8192 MiB; the two official
  files are 1.96 GB each). The adapter being requested is never evicted; adapters still referenced by
  a live MODEL stay alive until that MODEL is gone (eviction only drops the cache entry).
- Each adapter lives in an ``AdapterModule`` wrapped in a ComfyUI ``ModelPatcher``; :func:`install`
  registers it on the clone with ``set_additional_models("h3turbo_lora", [...])`` so ComfyUI loads and
  offloads it together with the diffusion model and counts its bytes.
- ``state.record_resident_turbo`` / ``drop_resident_turbo`` mirror the cache for ``/h3turbo/ready``: ``file`` is the
  name the adapter was last requested under, ``files`` every file name its content was read under (one resident
  adapter per content, whatever the names); ``state.set_current_turbo`` is called when a sampling run starts
  (``WrappersMP.OUTER_SAMPLE``).
"""
from __future__ import annotations

import logging
import os
import dataclasses
from collections import OrderedDict
from types import SimpleNamespace
from dataclasses import dataclass, field

import torch

from .. import state
from . import contracts, turbo_lora
from .branch import AdapterModule, TurboBranch

log = logging.getLogger("h3_turbo")

WRAPPER_KEY = "h3turbo_lora"
BUDGET_ENV = "H3TURBO_LORA_BUDGET_MB"
DEFAULT_BUDGET_MB = 8192

def _drop_all(cache: dict) -> None:
    for k in list(cache):
        state.drop_resident_turbo(k)


#: resident adapters by SHA-256, least recently used first (state store; clear() drops them all)
_RESIDENT = state.Store("turbo_adapters", ordered=True, on_clear=_drop_all,
                        describe=lambda d: {"adapters": len(d), "bytes": sum(r.nbytes for r in d.values())})
_cache: "OrderedDict[str, ResidentAdapter]" = _RESIDENT.data
_lock = _RESIDENT.lock
#: file reads, cache hits and evictions (tests assert them)
LOAD_STATS = state.Counters("turbo_adapter_loads", ("loads", "hits", "evictions")).data


@dataclass
class ResidentAdapter(contracts.AdapterFileNames):
    """A loaded, validated (model-independently) adapter. ``key`` = SHA-256 of the file."""

    key: str
    path: str
    contract: contracts.TurboContract | None
    layout: str
    key_style: str
    module: AdapterModule
    notes: list[str] = field(default_factory=list)
    head_dim: int | None = None   # the head size its qkv rows were de-interleaved for (DiffSynth layout)
    _patcher: object = None
    #: every file name (base name) this content was requested under, first use first; shared by the copies
    #: :func:`_renamed` makes, so the cache entry knows them all
    names: list[str] = field(default_factory=list)
    #: the path of the most recent request (:func:`get`), which :func:`install` reports as the adapter's file
    requested: str | None = None

    @property
    def nbytes(self) -> int:
        return self.module.nbytes

    def validate_for(self, dims: dict[str, tuple[int, int]]) -> None:
        """Raise TurboLoRAError unless the adapter's targets and sizes match ``dims`` exactly."""
        turbo_lora.validate_targets(self.module.shapes(), dims, self.path)

    def patcher(self):
        """The ComfyUI ModelPatcher holding :attr:`module` (created once; lazy ComfyUI import)."""
        if self._patcher is None:
            import comfy.model_management as mm
            import comfy.model_patcher

            self._patcher = comfy.model_patcher.ModelPatcher(
                self.module, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device(),
                size=self.nbytes)
        return self._patcher


def budget_bytes() -> int:
    """The residency budget in bytes from ``$H3TURBO_LORA_BUDGET_MB`` (ValueError if not a number >= 0)."""
    raw = os.environ.get(BUDGET_ENV, "")
    if not raw:
        return DEFAULT_BUDGET_MB << 20
    try:
        mb = float(raw)
    except ValueError as e:
        raise ValueError(f"{BUDGET_ENV}={raw!r} is not a number of MiB") from e
    if mb < 0:
        raise ValueError(f"{BUDGET_ENV}={raw!r} must be >= 0")
    return int(mb * (1 << 20))


def _record(r: ResidentAdapter, file: str | None = None) -> None:
    """Mirror ``r`` in ``state`` for ``/h3turbo/ready``: ``file`` = the name it is used under now (``file``, else
    its last request), ``files`` = every name it was requested under."""
    name = os.path.basename(file or r.requested or r.path)
    state.record_resident_turbo(r.key, variant=r.variant, file=name, files=list(r.names) or [name], bytes=r.nbytes,
                                device=str(r.module.param_device()), layout=r.layout,
                                verified=r.contract.extra.get("verified") if r.contract is not None else None)


def _known_as(r: ResidentAdapter, path: str) -> None:
    """Note that ``r``'s content was requested under ``path`` now."""
    name = os.path.basename(path)
    if name not in r.names:
        r.names.append(name)
    r.requested = path


def get(path: str, dims: dict[str, tuple[int, int]] | None = None, head_dim: int | None = None) -> ResidentAdapter:
    """The resident adapter for ``path``: from the cache (by content hash) or loaded now.

    ``dims``: the requesting model's targets ({target: (out, in)}, see ``turbo_lora.model_target_dims``);
    when given, the adapter is validated against them and a newly loaded adapter that does not fit is
    not cached. ``head_dim``: the model's head size (``turbo_lora.model_head_dim``; the DiffSynth-Studio layout
    needs it). Raises turbo_lora.TurboLoRAError for bad files (nothing is cached then).
    """
    with _lock:
        sha = turbo_lora.cached_sha256(path)
        if sha is None:
            if not os.path.isfile(path):
                raise turbo_lora.TurboLoRAError(f"Turbo LoRA file not found: {path}")
            turbo_lora.read_header(path)  # fail fast on non-safetensors files before hashing
            sha = turbo_lora.sha256_file(path)
        hit = _cache.get(sha)
        if hit is not None:
            _cache.move_to_end(sha)
            LOAD_STATS["hits"] += 1
            if os.path.realpath(hit.path) != os.path.realpath(path):
                log.info("Turbo LoRA %s has the same content as resident %s; reusing it", path, hit.path)
            entry, hit = hit, _renamed(hit, path, sha)
            if hit.head_dim is not None and head_dim is not None and hit.head_dim != head_dim:
                raise turbo_lora.TurboLoRAError(
                    f"Turbo LoRA {os.path.basename(path)!r} (DiffSynth-Studio layout) is resident with its qkv rows "
                    f"de-interleaved for head size {hit.head_dim}, but this model's heads are {head_dim} wide: it "
                    f"was made for another base. File: {path}")
            if dims is not None:
                hit.validate_for(dims)
            _known_as(entry, path)     # once this name's checks passed (a renamed copy shares the names)
            hit.requested = path
            _record(hit)
            return hit
        lora = turbo_lora.load_turbo_lora(path, sha256=sha, head_dim=head_dim)
        LOAD_STATS["loads"] += 1
        module = AdapterModule(lora)
        res = ResidentAdapter(sha, path, lora.contract, lora.layout, lora.key_style, module, list(lora.notes),
                              lora.head_dim, names=[os.path.basename(path)], requested=path)
        del lora
        if dims is not None:
            res.validate_for(dims)
        _cache[sha] = res
        _record(res)
        _evict(keep=sha)
        log.info("Turbo LoRA %s loaded: %s, %d targets, %.1f MiB, contract %s (%s)", path, res.layout,
                 len(module.targets), res.nbytes / 2**20, res.variant,
                 res.contract.source if res.contract is not None else "none determined")
        return res


def _renamed(hit: ResidentAdapter, path: str, sha: str) -> ResidentAdapter:
    """The resident adapter ``hit`` as read under another file name: the same tensors, with the contract that
    name and header give (an official name checked against the tensors' alpha/rank, as a fresh load does)."""
    if os.path.realpath(hit.path) == os.path.realpath(path):
        return hit
    _, metadata = turbo_lora.read_header(path)
    contract = turbo_lora.contract_for(path, metadata, sha)
    def terms(c):   # what sampling and the checks depend on (not the file name it was read under)
        return None if c is None else (c.variant, c.nfe, c.shift_video, c.shift_audio, c.alpha_over_rank, c.source)

    if terms(contract) == terms(hit.contract):
        return hit
    scales = {t: SimpleNamespace(scale=hit.module.get(t).coef) for t in hit.module.targets}
    turbo_lora.check_contract_alpha(scales, contract, path)
    return dataclasses.replace(hit, path=path, contract=contract)


def _evict(keep: str) -> None:
    budget = budget_bytes()
    total = sum(r.nbytes for r in _cache.values())
    for k in list(_cache.keys()):
        if total <= budget:
            break
        if k == keep:
            continue
        r = _cache.pop(k)
        total -= r.nbytes
        LOAD_STATS["evictions"] += 1
        state.drop_resident_turbo(k)
        log.info("Turbo LoRA %s evicted from the resident cache (budget %d MiB)", r.path, budget >> 20)
    if total > budget:
        log.warning("Turbo LoRA residency: %.1f MiB resident exceeds %s=%d MiB (the adapter in use is kept)",
                    total / 2**20, BUDGET_ENV, budget >> 20)


def find(key: str | None) -> ResidentAdapter | None:
    """The resident adapter with SHA-256 ``key`` (None when it is not resident)."""
    with _lock:
        return _cache.get(key) if key else None


def resident_keys() -> list[str]:
    """Cache keys (SHA-256), least recently used first."""
    with _lock:
        return list(_cache.keys())


def clear() -> None:
    """Drop every cached adapter (tests)."""
    _RESIDENT.clear()


def note_sampling_run(model_options: dict) -> str:
    """Record in ``state`` which Turbo adapter the sampling run that starts now uses ("none" if off).

    Idempotent; reads ``model_options["h3_turbo"]["adapter"]`` (set by :func:`install`). Returns the name.
    """
    entry = (model_options or {}).get(contracts.MODEL_OPTIONS_KEY) or {}
    name = entry.get("adapter") or "none"
    state.set_current_turbo(name)
    return name


def refuse_merged_duplicate(model_patcher, resident: ResidentAdapter, alias: str) -> None:
    """Raise TurboLoRAError when the sampled MODEL also carries ``resident``'s own weights as a MERGED
    LoRA patch (e.g. core's LoraLoaderModelOnly with the same file after this node): the adapter would
    then act twice (runtime branch + merged weights = 2x strength).

    Identified by comparing each target's LoRA ``A`` (down) tensor in core's weight patches with the
    resident adapter's ``A`` (bit-exact, same shape). Other merged LoRAs (styles...) are allowed.
    """
    patches = getattr(model_patcher, "patches", None) or {}
    if not patches:
        return
    dup = []
    for target in resident.module.targets:
        for p in patches.get(f"diffusion_model.{target}.weight", ()):
            weights = getattr(p[1], "weights", None)
            if not weights or len(weights) < 2 or not isinstance(weights[1], torch.Tensor):
                continue
            down, a = weights[1], resident.module.get(target).A
            if down.shape == a.shape and torch.equal(down.to(a.device, a.dtype), a):
                dup.append(target)
                break
        if len(dup) >= 3:
            break
    if dup:
        raise turbo_lora.TurboLoRAError(
            f"Turbo LoRA {alias!r} ({resident.file}) is applied twice: as the H3 Turbo runtime branch AND merged "
            f"into the weights by another LoRA loader (same tensors on {', '.join(dup)}...). That is 2x strength. "
            "Remove the core LoRA loader (LoraLoaderModelOnly) for this file: H3TurboLoRA already applies it.")


def uninstall(model_patcher) -> str | None:
    """Remove the Turbo branch that :func:`install` put on ``model_patcher`` (must be a CLONE): injections,
    wrappers, the adapter as additional model and the contract. Returns the removed adapter's alias, or
    None when the MODEL carried none (then nothing is changed)."""
    import comfy.patcher_extension as pe

    entry = contracts.copy_entry(model_patcher.model_options)
    if not entry.get("adapter"):
        return None
    model_patcher.remove_injections(WRAPPER_KEY)
    model_patcher.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    model_patcher.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    model_patcher.remove_additional_models(WRAPPER_KEY)
    # keep the pack's other entries (e.g. the loader's compute info); drop what install() attached
    rest = {k: v for k, v in entry.items() if k not in _INSTALL_KEYS}
    if rest:
        model_patcher.model_options[contracts.MODEL_OPTIONS_KEY] = rest
    else:
        model_patcher.model_options.pop(contracts.MODEL_OPTIONS_KEY, None)
    return entry["adapter"]


_FILE = object()  # install(contract=...) default: the adapter file's own contract
_INSTALL_KEYS = ("contract", "adapter", "adapter_file", "adapter_sha256", "strength")


def install(model_patcher, resident: ResidentAdapter, strength: float, alias: str, contract=_FILE) -> tuple:
    """Install the branch of ``resident`` at ``strength`` on ``model_patcher`` (must be a CLONE).

    ``contract``: the Turbo contract the MODEL carries (default: the adapter file's own, ``resident.contract``;
    None: no contract, see ``contracts.choose``).

    Validates against the model's targets first (raises TurboLoRAError, nothing changed), then:
    injections (key ``h3turbo_lora``), a DIFFUSION_MODEL coverage wrapper, an OUTER_SAMPLE wrapper that
    records the current Turbo in ``state``, the adapter as additional model, and the contract
    (``contracts.attach(..., adapter=alias, adapter_file=..., strength=...)``). Returns (branch, patcher).
    """
    import comfy.patcher_extension as pe

    dm = model_patcher.model.diffusion_model
    resident.validate_for(turbo_lora.model_target_dims(dm))
    previous = contracts.copy_entry(model_patcher.model_options)
    if previous.get("adapter"):
        log.warning("Apply H3 Turbo LoRA: this MODEL already carries the Turbo adapter %r (%s); it is replaced by "
                    "%r (%s): Turbo adapters do not stack", previous["adapter"], previous.get("adapter_file"),
                    alias, resident.file)
    used_as = resident.requested or resident.path   # the file this request named (same content, maybe other name)
    branch = TurboBranch(resident.module, strength, name=alias)
    model_patcher.set_injections(WRAPPER_KEY, branch.patcher_injections())
    model_patcher.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, branch.diffusion_model_wrapper())

    def on_start(executor):
        guider = getattr(executor, "class_obj", None)
        refuse_merged_duplicate(getattr(guider, "model_patcher", None), resident, alias)
        state.set_current_turbo(alias)
        with _lock:
            if resident.key in _cache:
                _record(resident, file=used_as)

    model_patcher.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, branch.outer_sample_wrapper(on_start))
    model_patcher.set_additional_models(WRAPPER_KEY, [resident.patcher()])
    contracts.attach(model_patcher, resident.contract if contract is _FILE else contract, adapter=alias,
                     adapter_file=os.path.basename(used_as),
                     adapter_sha256=resident.key, strength=float(strength))
    return branch, model_patcher
