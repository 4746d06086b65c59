"""``fp8``: W8A8 on FP8 tensor cores (sm_89+: Ada, Hopper) with rowwise ``torch._scaled_mm``.

At load the NVFP4 weight is re-expressed as e4m3 with one fp32 scale per output row (amax/448) from the
exact fp32 dequant; activations are quantized per row on the fly (Triton). Approximate: ~4% relative from
the exact GEMM (bounded by ``error_bound`` in the tests).

Two weight modes (the loader's ``weights`` input):

- resident: prepared memory roundup(N,16)*K e4m3 bytes + fp32 row factors per layer. With a Turbo LoRA and a
  ``fold_key`` the same e4m3 slot holds W + s*B*A until another key (or the base) is needed
  (:class:`PreparedFP8` ``state``; re-derived from the packed storage, the base bit-identical to
  :meth:`FP8Path.prepare`'s);
- lean: only the fp32 row factors (12 bytes per row) stay; every call derives the e4m3 weight (with the Turbo
  LoRA folded in when one is active) from the packed NVFP4 storage into one reused buffer per device
  (:func:`triton_nvfp4.fold_weight`), with the very arithmetic of the resident mode, so both modes give the same
  output bit for bit. Measurements: docs/kernels.md, docs/memory.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import nvfp4_ref as ref
from . import base
from .base import ComputePath, LoRAOperands, PackedNVFP4


@dataclass
class FP8Settings:
    #: fold the Turbo LoRA into the e4m3 weight (slot or per call); False: always the unfused branch
    lora_fold: bool = True
    #: without a fold key, the per-call fold (one pass over W) beats the unfused branch from this many rows
    fold_min_m: int = 1024
    #: rows re-expressed per chunk at load (a multiple of 128: the swizzled scales slice by 128 rows)
    base_step: int = 4096


@dataclass
class PreparedFP8:
    w8: torch.Tensor | None   # float8_e4m3fn [Npad16, K]; None in lean mode (derived per call)
    sw: torch.Tensor          # fp32 [1, Npad16]
    out_features: int
    in_features: int
    packed: PackedNVFP4 | None = None   # the native storage (same tensors, no copy): LoRA fold
    amax_w: torch.Tensor | None = None  # fp32 [N]: max |W[n, :]| of the exact NVFP4 weight
    #: what w8/sw hold: None = the base weight; else the key of the Turbo LoRA folded into them
    state: object = None
    refolds: int = 0                    # times w8/sw were re-derived (adapter switch, Turbo on/off)
    inv_w: torch.Tensor | None = None   # fp32 [N]: 448 / amax' per row (lean: the base weight's factors)

    @property
    def lean(self) -> bool:
        return self.w8 is None


_INVALID = object()


class FP8Path(ComputePath):
    name = "fp8"
    approximate = True
    error_bound = 5e-2
    has_lean_mode = True

    def __init__(self):
        self.settings = FP8Settings()

    def supports(self, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"needs a CUDA GPU, but the device is {device}"
        cc = base.capability(device)
        if cc < (8, 9):
            return False, f"compute capability {cc[0]}.{cc[1]} has no FP8 tensor cores (needs 8.9+)"
        if not base.has_triton():
            return False, "Triton is not installed (activation quantization kernel)"
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return base.probe_fp8(idx)

    def prepare(self, packed: PackedNVFP4, lean: bool = False) -> PreparedFP8:
        """Resident: the e4m3 copy [roundup(N,16), K] + row factors. ``lean``: the row factors only."""
        packed.check_finite_scales()
        n, k = packed.out_features, packed.in_features
        npad = ref.fmt.roundup(n, 16)
        dev = packed.qdata.device
        w8 = None if lean else torch.zeros((npad, k), dtype=torch.float8_e4m3fn, device=dev)
        sw = torch.ones((npad,), dtype=torch.float32, device=dev)
        amax_w = torch.zeros((n,), dtype=torch.float32, device=dev)
        inv_w = torch.zeros((n,), dtype=torch.float32, device=dev) if lean else None
        base_into(packed, w8, sw, amax_w, step=self.settings.base_step, inv_w=inv_w)
        return PreparedFP8(w8, sw.reshape(1, npad), n, k, packed, amax_w, inv_w=inv_w)

    def reference_weight(self, p: PreparedFP8, dtype) -> torch.Tensor:
        n = p.out_features
        if p.lean:
            pk = p.packed
            w8, sw = ref.fp8_rowwise_from_weight(ref.dequant_exact(pk.qdata, pk.block_scale, pk.global_scale, n,
                                                                   p.in_features, torch.float32))
            return (w8.float() * sw[:, None]).to(dtype)
        if p.state is not None:          # a Turbo fold occupies the slot: the base first
            set_state(p, None, None)
        return (p.w8[:n].float() * p.sw[0, :n, None]).to(dtype)

    def weight_operands(self, p: PreparedFP8, device, lora: LoRAOperands | None = None) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        """The weight as ``torch._scaled_mm`` takes it: (w8 e4m3 [Npad16, K], sw fp32 [1, Npad16]) of the base
        (``lora`` None) or of W + scale * Bc @ A (``lora`` with a ``fold_key``; its nb must suit
        :func:`triton_nvfp4.fold_bn`). Resident: the layer's own slot, switched as :meth:`lora` switches it;
        lean: derived now into the reused per-device buffer (valid until the next lean call on this device; Triton).
        The same bytes in both modes. ValueError for a LoRA without a fold key."""
        if lora is not None and lora.fold_key is None:
            raise ValueError("fp8 weight_operands: a LoRA needs a fold_key (the slot it occupies)")
        lt = None if lora is None else (lora.a, lora.bc, float(lora.scale), lora.nb, lora.amax_a)
        if not p.lean:
            set_state(p, None if lora is None else (lora.fold_key, float(lora.scale)), lt)
            return p.w8, p.sw
        return derive(p, device, lt)

    def kernel_linear(self, x2d: torch.Tensor, p: PreparedFP8) -> torch.Tensor:
        if p.lean:
            return _scaled_mm(x2d, *derive(p, x2d.device), p.out_features)
        return _scaled_mm(x2d, p.w8, p.sw, p.out_features)

    def lora(self, x2d: torch.Tensor, p, lo: LoRAOperands):
        from .. import triton_nvfp4 as tk
        s = self.settings
        if not (s.lora_fold and isinstance(p, PreparedFP8) and p.packed is not None and p.amax_w is not None):
            return None
        if tk.fold_bn(lo.nb) is None:
            return None
        lt = (lo.a, lo.bc, float(lo.scale), lo.nb, lo.amax_a)
        if p.lean and (lo.fold_key is not None or x2d.shape[0] >= s.fold_min_m):
            # what the resident slot would hold, derived per call by the same kernel: the same bytes
            return fold_per_call(x2d, p, lt), "fp8_lean_fold"
        if lo.fold_key is not None:
            set_state(p, (lo.fold_key, float(lo.scale)), lt)
            return _scaled_mm(x2d, p.w8, p.sw, p.out_features), "fp8_slot"
        if x2d.shape[0] >= s.fold_min_m:
            return fold_per_call(x2d, p, lt), "fp8_percall"
        return None

    def prepared_bytes(self, shapes: list[tuple[int, int]], lean: bool = False) -> int:
        """Resident: e4m3 roundup(N,16)*K + fp32 sw [Npad] + amax [N]; lean: sw + amax + inv (12 bytes per row)."""
        r = ref.fmt.roundup
        if lean:
            return sum(4 * r(n, 16) + 8 * n for n, _ in shapes)
        return sum(r(n, 16) * k + 4 * r(n, 16) + 4 * n for n, k in shapes)

    def workspace_bytes(self, shapes: list[tuple[int, int]], act_bytes: int = 2) -> int:
        """The largest layer's per-call LoRA fold buffer: e4m3 roundup(N,16)*K + fp32 row scales."""
        if not shapes:
            return 0
        r = ref.fmt.roundup
        return max(r(n, 16) * k for n, k in shapes) + 4 * max(r(n, 16) for n, _ in shapes)


def _scaled_mm(x2d, w8, sw, n):
    from .. import triton_nvfp4 as tk
    x8, sx = tk.quant_rows_fp8(x2d)
    out = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x2d.dtype, use_fast_accum=True)
    return out[:, :n] if out.shape[1] != n else out


def base_into(packed: PackedNVFP4, w8: torch.Tensor | None, sw: torch.Tensor, amax_w: torch.Tensor | None,
              step: int = 4096, use_triton: bool | None = None, inv_w: torch.Tensor | None = None) -> None:
    """The fp8 base weight, written into w8 [>=N, K] e4m3 (None: lean, factors only) / sw [>=N] fp32 (and
    amax_w [N], inv_w [N] = 448 / amax' when given): per chunk of
    ``step`` rows (a multiple of 128, so the swizzled block scales slice by rows), the exact fp32 dequant
    (Triton ``fold_weight`` on CUDA, ``nvfp4_ref.dequant_exact`` elsewhere: the same fp32 values) re-expressed
    by ``nvfp4_ref.fp8_rowwise_from_weight``. :meth:`FP8Path.prepare` and the restore after a Turbo fold
    (:func:`set_state`) both call this, so the restored base is the prepared one bit for bit."""
    n, k = packed.out_features, packed.in_features
    dev = packed.qdata.device
    gs = packed.global_scale.detach().float().reshape(1).to(dev)
    if use_triton is None:
        use_triton = dev.type == "cuda" and base.has_triton()
    if step % 128:
        raise ValueError(f"_fp8_base_into: step {step} must be a multiple of 128 (swizzled scale tiles)")
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        q = packed.qdata[r0:r1]
        bs = packed.block_scale[r0:r0 + ref.fmt.roundup(r1 - r0, 128)]
        if use_triton:
            from .. import triton_nvfp4 as tk
            wf = torch.empty((r1 - r0, k), device=dev, dtype=torch.float32)
            tk.fold_weight(q, bs, gs, r1 - r0, k, wf)
        else:
            wf = ref.dequant_exact(q, bs, gs, r1 - r0, k, torch.float32)
        amax, inv, sw[r0:r1] = ref.fp8_row_factors(wf)       # = nvfp4_ref.fp8_rowwise_from_weight's
        if w8 is not None:
            w8[r0:r1] = ref.e4m3_rows(wf, inv)
        if amax_w is not None:
            amax_w[r0:r1] = amax
        if inv_w is not None:
            inv_w[r0:r1] = inv


def derive(p: PreparedFP8, device, lora: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 weight (w [Npad16, K], sw fp32 [1, Npad16]) derived now from the native NVFP4 storage into the reused
    per-device buffers (``triton_nvfp4.fold_weight``): the base with the stored factors 448/amax (the resident
    copy's bytes; needs ``p.inv_w``, i.e. a lean ``p``), or W' = W + scale * Bc @ A with one scale per row (an
    upper bound of max |W'| per row; one rounding of W'). ``lora`` = (A, Bc, scale, nb, amax_a). Valid until the
    next derivation on this device."""
    from .. import triton_nvfp4 as tk
    pk = p.packed
    n, k = p.out_features, p.in_features
    npad = p.sw.shape[1]
    w = base.scratch(device, torch.float8_e4m3fn, npad * k).view(npad, k)
    gs = pk.global_scale.float().reshape(1).to(device)
    if lora is None:
        if p.inv_w is None:
            raise ValueError("fp8 derive: the base weight needs the lean factors (prepare(lean=True))")
        tk.fold_weight(pk.qdata, pk.block_scale, gs, n, k, w, inv_w=p.inv_w)
        return w, p.sw
    so = base.scratch(device, torch.float32, npad)
    tk.fold_weight(pk.qdata, pk.block_scale, gs, n, k, w, lora=lora, amax_w=p.amax_w, scale_out=so)
    return w, so.view(1, npad)


def fold_per_call(x2d: torch.Tensor, p: PreparedFP8, lora: tuple) -> torch.Tensor:
    """fp8 + LoRA in one rowwise ``torch._scaled_mm``: W' derived per call (:func:`derive`), x quantized per row.
    ``lora`` = (A, Bc, scale, nb, amax_a)."""
    return _scaled_mm(x2d, *derive(p, x2d.device, lora), p.out_features)


def set_state(p: PreparedFP8, key, lora: tuple | None) -> None:
    """Make ``p.w8``/``p.sw`` hold the base weight (key None) or W + scale * Bc @ A (``lora`` = the tuple of
    :func:`triton_nvfp4.fold_weight`), re-derived in place from the packed NVFP4 storage when ``p.state``
    differs. The base is re-derived by the function :meth:`FP8Path.prepare` used (:func:`base_into`)."""
    if p.state == key:
        return
    pk = p.packed
    n, k = p.out_features, p.in_features
    p.state = _INVALID   # a failure below must not leave a half-written weight marked valid
    # w8/sw were made by prepare(), usually under ComfyUI's inference_mode (inference tensors): update them in
    # the same mode, so a caller outside inference_mode can still switch the slot
    with torch.inference_mode(p.w8.is_inference()):
        if key is None:
            base_into(pk, p.w8, p.sw.view(-1), None, step=PATH.settings.base_step)
        else:
            from .. import triton_nvfp4 as tk
            tk.fold_weight(pk.qdata, pk.block_scale, pk.global_scale.float().reshape(1).to(p.w8.device), n, k,
                           p.w8, lora=lora, amax_w=p.amax_w, scale_out=p.sw.view(-1))
    p.state = key
    p.refolds += 1


PATH = FP8Path()
