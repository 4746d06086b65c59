"""Compute-path dispatch for NVFP4 linears: THE interface the loader uses.

Paths (``resolve_compute``):

- ``"reference"``: pure torch; dequantize per call (:func:`.nvfp4_ref.dequant_exact`) + ``F.linear``.
  Works everywhere (CPU included). Same numbers as ``"exact"`` up to GEMM summation order.
- ``"exact"``: W4A16 on CUDA + Triton. The weight is the reference dequant bit for bit
  (``(E2M1[q] * block_scale) * weight_scale_2`` in fp32, rounded once to the activation dtype);
  bf16 tensor-core products, fp32 accumulation. Three strategies, same numbers up to summation order:
  ``fused`` (Triton dequant-GEMM, weight never materialised), ``full`` (the whole weight dequantized from
  the native storage into one reused buffer by ``triton_nvfp4.fold_weight``, then one cuBLAS GEMM) and
  ``tiled`` (row tiles of ``TILE_ROWS`` dequantized on a side stream, overlapped with cuBLAS GEMMs on the
  output's column slices). ``EXACT_STRATEGY`` picks ("auto": fused for M <= ``FUSED_MAX_M`` rows, else
  ``LARGE_M_STRATEGY``). Measured on an H200: benchmarks/results/bench_linear_h200*.md. The fused kernel
  runs ~290 TF/s (2.3x bf16) at large M and only wins below ~256 rows.
- ``"fp8"``: W8A8 on FP8 tensor cores (``torch._scaled_mm`` rowwise): at load the NVFP4 weight is
  re-expressed as e4m3 with one fp32 scale per output row (amax/448); activations are quantized per
  row on the fly (Triton). Approximate: 3.9-4.2% relative from the exact GEMM; 0.50-0.61x the bf16
  time on an H200 (benchmarks/results). Needs sm_89+. Weight memory: N*K bytes (twice NVFP4's). With the
  Turbo LoRA (``linear_with_lora`` + ``fold_key``) the same e4m3 slot holds W + s*B*A until another key or
  the base is needed (``PreparedFP8.state``; re-derived from the packed storage, base bit-identical).
- ``"blackwell_fp4"``: cc >= 10 with torch built for CUDA >= 13: comfy-kitchen ``scaled_mm_nvfp4``
  (activations quantized to NVFP4 per call as core does, W4A4; approximate).

Errors: requesting a path the device cannot run raises ``ValueError`` (never a silent fallback);
``linear`` falls back to the reference computation only for inputs the fast kernels do not take
(fp32 activations, K mismatch is an error), logging the reason once.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import nvfp4_ref as ref

log = logging.getLogger("h3_turbo")

PATHS = ("auto", "exact", "fp8", "reference", "blackwell_fp4")
#: exact strategy: "auto" | "fused" | "tiled" | "full"
EXACT_STRATEGY = "auto"
#: with EXACT_STRATEGY "auto", the fused Triton kernel serves M <= FUSED_MAX_M rows, LARGE_M_STRATEGY the rest
#: (H200 crossover between 256 and 1024 rows: bench_linear_h200.md "Small M")
FUSED_MAX_M = 256
#: exact strategy above FUSED_MAX_M rows: "full" (whole weight dequantized, LoRA folded in, into one reused
#: buffer; one cuBLAS GEMM) or "tiled" (row tiles on a side stream)
LARGE_M_STRATEGY = "full"
#: exact "full" + LoRA from this many rows; below, the tiled fold (bench_linear_h200_fold2: at 4096 rows the
#: whole-weight LoRA fold, ~0.3 ms for fc1, is not hidden; tiles overlap it with the GEMMs)
FULL_LORA_MIN_M = 8192
#: fold the Turbo LoRA into the per-call weight (exact above FUSED_MAX_M rows; fp8 from FP8_FOLD_MIN_M rows)
#: instead of the unfused branch (two extra passes over activations and output). False: always unfused.
LORA_FOLD = True
#: fp8 + LoRA: the fold costs one pass over the weight per call, the unfused branch costs passes over x and y
#: that grow with M; the fold wins from about this many rows (bench_linear_h200.md)
FP8_FOLD_MIN_M = 1024
#: rows of W dequantized per tile by the tiled strategy
TILE_ROWS = 3072
_logged: set = set()
#: how linear_with_lora computed each call, by route (diagnostics, benchmarks, tests): "fused_epilogue",
#: "full_fold", "tiled_fold", "fp8_slot", "fp8_percall", "unfused"
LORA_ROUTES: collections.Counter = collections.Counter()


def _log_once(key, msg, *args, level=logging.INFO):
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


@dataclass
class PackedNVFP4:
    """One NVFP4 linear weight in ComfyUI's native storage (H3_FACTS §3).

    qdata: uint8 [Np, Kp/2] (Np = roundup(N,16), Kp = roundup(K,16); element 2j in the HIGH nibble).
    block_scale: float8_e4m3fn [roundup(Np,128), roundup(Kp/16,4)], cuBLAS to_blocked layout.
    global_scale: fp32 scalar tensor (``weight_scale_2``). out_features N, in_features K.
    """
    qdata: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    out_features: int
    in_features: int

    def validate(self, where: str = "PackedNVFP4") -> None:
        """Raise ValueError naming the field and the expected shape/dtype."""
        n, k = self.out_features, self.in_features
        rnd = ref.fmt.roundup
        if self.qdata.dtype != torch.uint8 or self.qdata.dim() != 2:
            raise ValueError(f"{where}: qdata must be a 2-D uint8 tensor, got {self.qdata.dtype} "
                             f"{tuple(self.qdata.shape)}")
        np_, kh = self.qdata.shape
        if k % 16 or np_ < n or np_ % 16 or kh * 2 != rnd(k, 16):
            raise ValueError(f"{where}: qdata shape {tuple(self.qdata.shape)} does not hold a [{n}, {k}] "
                             f"NVFP4 weight (expected [{rnd(n, 16)}, {rnd(k, 16) // 2}], K % 16 == 0)")
        exp = (rnd(np_, 128), rnd(kh * 2 // 16, 4))
        if self.block_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"{where}: block_scale must be float8_e4m3fn, got {self.block_scale.dtype}")
        if tuple(self.block_scale.shape) != exp:
            raise ValueError(f"{where}: block_scale shape {tuple(self.block_scale.shape)} != swizzled {exp}")
        if self.global_scale.numel() != 1:
            raise ValueError(f"{where}: global_scale (weight_scale_2) must be a scalar, "
                             f"got shape {tuple(self.global_scale.shape)}")


@dataclass
class _PreparedPacked:
    """A path that keeps the packed NVFP4 tensors as they are (no load-time re-expression)."""

    packed: PackedNVFP4

    @property
    def out_features(self) -> int:
        return self.packed.out_features

    @property
    def in_features(self) -> int:
        return self.packed.in_features


class PreparedReference(_PreparedPacked):
    """``reference``: dequantize + F.linear per call."""


@dataclass
class PreparedExact:
    qs: torch.Tensor          # uint8 [N, Kp/2] split-packed (nvfp4_ref.split_pack)
    scales: torch.Tensor      # uint8 [N, Kp/16] plain e4m3 bytes
    gs: torch.Tensor          # fp32 [1]
    out_features: int
    in_features: int
    packed: PackedNVFP4 | None = None   # the native storage (same tensors, no copy): "full" strategy / fold


@dataclass
class PreparedFP8:
    w8: torch.Tensor          # float8_e4m3fn [Npad16, K]
    sw: torch.Tensor          # fp32 [1, Npad16]
    out_features: int
    in_features: int
    packed: PackedNVFP4 | None = None   # the native storage (same tensors, no copy): LoRA fold
    amax_w: torch.Tensor | None = None  # fp32 [N]: max |W[n, :]| of the exact NVFP4 weight
    #: what w8/sw hold: None = the base weight; else the key of the Turbo LoRA folded into them (see
    #: :func:`linear_with_lora` ``fold_key``). One slot: the fp8 path keeps one e4m3 copy per layer either way.
    state: object = None
    refolds: int = 0                    # times w8/sw were re-derived (adapter switch, Turbo on/off)


class PreparedBlackwell(_PreparedPacked):
    """``blackwell_fp4``: comfy-kitchen ``scaled_mm_nvfp4`` on the packed tensors."""


# --------------------------------------------------------------------------- capability checks

def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _probe_fp8(device_index: int) -> tuple[bool, str]:
    """Run a tiny rowwise ``torch._scaled_mm`` on the device; (works, reason)."""
    try:
        dev = torch.device("cuda", device_index)
        a = torch.ones(16, 32, device=dev).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=dev).to(torch.float8_e4m3fn)
        sa = torch.ones(16, 1, device=dev)
        sb = torch.ones(1, 16, device=dev)
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        ok = bool((out.float() == 32).all())
        return ok, "rowwise torch._scaled_mm works" if ok else "torch._scaled_mm gave wrong values"
    except Exception as e:  # noqa: BLE001 - any failure means "no fp8 here"
        return False, f"torch._scaled_mm (fp8 rowwise) failed: {type(e).__name__}: {e}"


def _cuda_major() -> int:
    v = torch.version.cuda
    return int(v.split(".")[0]) if v else 0


def _has_ck_fp4() -> bool:
    try:
        import comfy_kitchen as ck  # noqa: F401
        return hasattr(ck, "scaled_mm_nvfp4")
    except Exception:  # noqa: BLE001
        return False


def resolve_compute(requested: str, device: torch.device) -> tuple[str, str]:
    """Map a requested compute mode to the path this device runs: returns (path, reason).

    requested: "auto" | "exact" | "fp8" | "reference" (also "blackwell_fp4"). device: torch.device.
    auto: "blackwell_fp4" on cc >= 10 with torch CUDA >= 13 and comfy-kitchen; "fp8" on cc >= 8.9
    where rowwise ``torch._scaled_mm`` works; "exact" on other CUDA GPUs with Triton (cc >= 8.0);
    "reference" elsewhere (CPU). Raises ValueError for an unknown mode or an explicit mode the device
    cannot run. The auto choice is logged once per device.
    """
    if requested not in PATHS:
        raise ValueError(f"compute mode {requested!r} is not one of {PATHS}")
    device = torch.device(device)
    if requested == "reference":
        return "reference", "requested"
    is_cuda = device.type == "cuda"
    if not is_cuda:
        if requested == "auto":
            reason = f"device {device} is not CUDA: pure-torch reference (dequantize + F.linear)"
            _log_once(("auto", str(device)), "H3 Turbo compute: reference (%s)", reason)
            return "reference", reason
        raise ValueError(f"compute {requested!r} needs a CUDA GPU, but the device is {device}; "
                         f"use 'reference' or 'auto'")
    cc = _capability(device)
    triton_ok = _has_triton()
    idx = device.index if device.index is not None else torch.cuda.current_device()

    def exact_ok():
        if not triton_ok:
            return False, "Triton is not installed"
        if cc < (8, 0):
            return False, f"compute capability {cc[0]}.{cc[1]} < 8.0 (no bf16 tensor cores)"
        return True, f"Triton fused dequant-GEMM on sm_{cc[0]}{cc[1]}"

    def fp8_ok():
        if cc < (8, 9):
            return False, f"compute capability {cc[0]}.{cc[1]} has no FP8 tensor cores (needs 8.9+)"
        if not triton_ok:
            return False, "Triton is not installed (activation quantization kernel)"
        works, why = _probe_fp8(idx)
        return works, why

    def bw_ok():
        if cc < (10, 0):
            return False, f"compute capability {cc[0]}.{cc[1]} < 10.0 (no FP4 tensor cores)"
        if _cuda_major() < 13:
            return False, f"torch is built for CUDA {torch.version.cuda}; FP4 scaled_mm needs CUDA 13 (cu130)"
        if not _has_ck_fp4():
            return False, "comfy-kitchen with scaled_mm_nvfp4 is not importable"
        return True, f"comfy-kitchen scaled_mm_nvfp4 on sm_{cc[0]}{cc[1]}"

    checks = {"exact": exact_ok, "fp8": fp8_ok, "blackwell_fp4": bw_ok}
    if requested != "auto":
        ok, why = checks[requested]()
        if not ok:
            raise ValueError(f"compute {requested!r} cannot run on {device} "
                             f"(sm_{cc[0]}{cc[1]}): {why}")
        return requested, why
    for path in ("blackwell_fp4", "fp8", "exact"):
        ok, why = checks[path]()
        if ok:
            _log_once(("auto", str(device)), "H3 Turbo compute on %s: %s (%s)", device, path, why)
            return path, why
    reason = f"no fast path on sm_{cc[0]}{cc[1]} (Triton {'present' if triton_ok else 'missing'})"
    _log_once(("auto", str(device)), "H3 Turbo compute on %s: reference (%s)", device, reason)
    return "reference", reason


# --------------------------------------------------------------------------- prepare

def prepare(packed: PackedNVFP4, path: str):
    """Load-time work for ``path``; returns the object ``linear`` takes.

    exact: split-pack the codes (``nvfp4_ref.split_pack``) and unswizzle the scales to plain bytes.
    fp8: dequantize exactly in fp32 (row chunks), re-express per row as e4m3 (``fp8_rowwise_from_weight``).
    reference / blackwell_fp4: keep the packed tensors. Raises ValueError on malformed input or NaN scales.
    """
    packed.validate()
    n, k = packed.out_features, packed.in_features
    bs_u8 = packed.block_scale.view(torch.uint8)
    if path in ("exact", "fp8"):
        if bool(((bs_u8 & 0x7F) == 0x7F).any()):
            raise ValueError("NVFP4 block_scale (weight_scale) holds NaN bytes (0x7f/0xff)")
    gs = packed.global_scale.detach().float().reshape(1)
    if path == "reference":
        return PreparedReference(packed)
    if path == "blackwell_fp4":
        return PreparedBlackwell(packed)
    if path == "exact":
        qs, _ = ref.split_pack(packed.qdata, n, k)
        sc = ref.plain_scales(packed.block_scale, packed.qdata, n, k)
        return PreparedExact(qs, sc, gs.to(qs.device), n, k, packed)
    if path == "fp8":
        npad = ref.fmt.roundup(n, 16)
        dev = packed.qdata.device
        w8 = torch.zeros((npad, k), dtype=torch.float8_e4m3fn, device=dev)
        sw = torch.ones((npad,), dtype=torch.float32, device=dev)
        amax_w = torch.zeros((n,), dtype=torch.float32, device=dev)
        _fp8_base_into(packed, w8, sw, amax_w)
        return PreparedFP8(w8, sw.reshape(1, npad), n, k, packed, amax_w)
    raise ValueError(f"prepare: unknown path {path!r} (expected one of exact, fp8, reference, blackwell_fp4)")


def _fp8_base_into(packed: PackedNVFP4, w8: torch.Tensor, sw: torch.Tensor, amax_w: torch.Tensor | None,
                   step: int = 4096, use_triton: bool | None = None) -> None:
    """The fp8 path's base weight, written into w8 [>=N, K] e4m3 / sw [>=N] fp32 (and amax_w [N]): per chunk of
    ``step`` rows (a multiple of 128, so the swizzled block scales slice by rows), the exact fp32 dequant
    (Triton ``fold_weight`` on CUDA, ``nvfp4_ref.dequant_exact`` elsewhere: the same fp32 values) re-expressed
    by ``nvfp4_ref.fp8_rowwise_from_weight`` (torch). :func:`prepare` and the restore after a Turbo fold
    (:func:`_fp8_set_state`) both call this, so the restored base is the prepared one bit for bit."""
    n, k = packed.out_features, packed.in_features
    dev = packed.qdata.device
    gs = packed.global_scale.detach().float().reshape(1).to(dev)
    if use_triton is None:
        use_triton = dev.type == "cuda" and _has_triton()
    if step % 128:
        raise ValueError(f"_fp8_base_into: step {step} must be a multiple of 128 (swizzled scale tiles)")
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        q = packed.qdata[r0:r1]
        bs = packed.block_scale[r0:r0 + ref.fmt.roundup(r1 - r0, 128)]
        if use_triton:
            from . import triton_nvfp4 as tk
            wf = torch.empty((r1 - r0, k), device=dev, dtype=torch.float32)
            tk.fold_weight(q, bs, gs, r1 - r0, k, wf)
        else:
            wf = ref.dequant_exact(q, bs, gs, r1 - r0, k, torch.float32)
        w8[r0:r1], sw[r0:r1] = ref.fp8_rowwise_from_weight(wf)
        if amax_w is not None:
            amax_w[r0:r1] = wf.abs().amax(dim=1)


# --------------------------------------------------------------------------- linear

def _reference_weight(prepared, dtype) -> torch.Tensor:
    if isinstance(prepared, _PreparedPacked):
        p = prepared.packed
        return ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, p.out_features, p.in_features, dtype)
    if isinstance(prepared, PreparedExact):
        return ref.dequant_split(prepared.qs, prepared.scales, prepared.gs, prepared.out_features,
                                 prepared.in_features, dtype)
    if isinstance(prepared, PreparedFP8):
        if prepared.state is not None:          # a Turbo fold occupies the slot: the base first
            _fp8_set_state(prepared, None, None)
        n = prepared.out_features
        return (prepared.w8[:n].float() * prepared.sw[0, :n, None]).to(dtype)
    raise TypeError(f"not a prepared NVFP4 weight: {type(prepared).__name__}")


_TILE_BUFS: dict = {}
_SIDE: dict = {}


def _exact_tiled(x2d, p: PreparedExact, lora: tuple | None = None) -> torch.Tensor:
    """Dequantize W in row tiles (Triton, side stream, double buffer) overlapped with cuBLAS GEMMs
    writing column slices of the output.

    lora: optional (A [blocks*r, K], Bc [N, r], scale, rows per block NB): each transient bf16 tile gets
    the rank-r update ``tile += scale * Bc[rows] @ A[block]`` (cuBLAS addmm_, fp32 accumulation; the tile is
    already the rounded bf16 weight, so W + update is rounded twice, unlike ``_exact_full``'s fold)
    before its GEMM, so the LoRA costs a [t, r] x [r, K] product per tile and no pass over activations
    or outputs. The NVFP4 storage is never modified (this is not core's requantizing merge)."""
    from . import triton_nvfp4 as tk
    n, k = p.out_features, p.in_features
    m = x2d.shape[0]
    out = torch.empty((m, n), device=x2d.device, dtype=x2d.dtype)
    t = min(TILE_ROWS, n)
    key = (x2d.device, x2d.dtype, t, k)
    bufs = _TILE_BUFS.get(key)
    if bufs is None:
        bufs = [torch.empty((t, k), device=x2d.device, dtype=x2d.dtype) for _ in range(2)]
        _TILE_BUFS[key] = bufs
    cuda = x2d.device.type == "cuda"  # CPU (tests, TRITON_INTERPRET=1): same code, no streams
    if cuda:
        side = _SIDE.get(x2d.device)
        if side is None:
            side = _SIDE[x2d.device] = torch.cuda.Stream(x2d.device)
        main = torch.cuda.current_stream(x2d.device)
        free = [torch.cuda.Event(), torch.cuda.Event()]
        free[0].record(main)
        free[1].record(main)
    for i, r0 in enumerate(range(0, n, t)):
        r1 = min(n, r0 + t)
        b = bufs[i % 2][: r1 - r0]
        if cuda:
            ready = torch.cuda.Event()
        with (torch.cuda.stream(side) if cuda else contextlib.nullcontext()):
            if cuda:
                side.wait_event(free[i % 2])
            tk.dequant(p.qs[r0:r1], p.scales[r0:r1], p.gs, r1 - r0, k, out=b)
            if lora is not None:
                a, bc, scale, nb = lora
                r = bc.shape[1]
                for blk in range(r0 // nb, (r1 - 1) // nb + 1):
                    s0, s1 = max(r0, blk * nb), min(r1, (blk + 1) * nb)
                    b[s0 - r0:s1 - r0].addmm_(bc[s0:s1], a[blk * r:(blk + 1) * r], alpha=scale)
            if cuda:
                ready.record(side)
        if cuda:
            main.wait_event(ready)
        torch.mm(x2d, b.t(), out=out[:, r0:r1])
        if cuda:
            free[i % 2] = torch.cuda.Event()
            free[i % 2].record(main)
    return out


_SCRATCH: dict = {}


def workspace_bytes(shapes: list[tuple[int, int]], path: str, act_bytes: int = 2) -> int:
    """GPU bytes of the per-process buffers this module reuses across layers for ``path`` (allocated at
    first use, kept until :func:`release_workspace`). shapes: logical [N, K] of every NVFP4 layer.
    exact: the largest layer's whole-weight buffer (``_scratch``, N*K activations) plus the row-tile double
    buffers (``_TILE_BUFS``, 2 x min(TILE_ROWS, N) x K per distinct tile shape); fp8: the largest layer's
    per-call LoRA fold buffer (e4m3 roundup(N,16)*K + fp32 row scales); others: 0. ``act_bytes``: bytes per
    activation element (bf16/fp16: 2). The buffers are shared by every model of the process (one set per
    device and activation dtype) and freed when a model using them is unloaded (the ``ON_DETACH`` callback
    of ``nodes.loader.install_compute``); each model counts them, so two H3 models loaded at once
    over-reserve."""
    from ..formats.nvfp4 import roundup as r

    if not shapes:
        return 0
    if path == "exact":
        tiles = {(min(TILE_ROWS, n), k) for n, k in shapes}
        return max(n * k for n, k in shapes) * act_bytes + sum(2 * t * k * act_bytes for t, k in tiles)
    if path == "fp8":
        return max(r(n, 16) * k for n, k in shapes) + 4 * max(r(n, 16) for n, _ in shapes)
    return 0


def release_workspace() -> int:
    """Drop the reused per-call buffers (``_SCRATCH``, ``_TILE_BUFS``) of every device; they are allocated
    again at the next call that needs them. Returns the bytes released. The loader calls this when ComfyUI
    detaches (unloads) a model that uses the kernels, so the memory ComfyUI counted for them is freed."""
    n = sum(b.numel() * b.element_size() for b in _SCRATCH.values())
    n += sum(t.numel() * t.element_size() for bufs in _TILE_BUFS.values() for t in bufs)
    _SCRATCH.clear()
    _TILE_BUFS.clear()
    return n


def _scratch(device, dtype, numel: int) -> torch.Tensor:
    """A flat reusable buffer of >= numel elements per (device, dtype) for the per-call weight (grown to the
    largest layer; zero-filled when allocated so unused fp8 rows stay finite). Logged once per size."""
    key = (str(device), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(key, None)
        buf = torch.zeros(numel, device=device, dtype=dtype)
        _SCRATCH[key] = buf
        _log_once(("scratch", key, numel), "H3 Turbo: per-call weight buffer %s %s: %.0f MiB (one per device and "
                  "dtype, reused by every layer)", device, dtype, numel * buf.element_size() / 2**20)
    return buf[:numel]


def _exact_strategy(m: int) -> str:
    strat = EXACT_STRATEGY
    if strat == "auto":
        strat = "fused" if m <= FUSED_MAX_M else LARGE_M_STRATEGY
    return strat


def _exact_full(x2d: torch.Tensor, p: PreparedExact, lora: tuple | None = None) -> torch.Tensor:
    """Dequantize the whole weight (Triton, from the native storage, optionally with the LoRA folded in:
    ``triton_nvfp4.fold_weight``) into the reused buffer, then one cuBLAS GEMM. Same numbers as ``fused``/
    ``tiled`` up to GEMM summation order (bit-identical weight)."""
    from . import triton_nvfp4 as tk
    pk = p.packed
    n, k = p.out_features, p.in_features
    w = _scratch(x2d.device, x2d.dtype, n * k).view(n, k)
    tk.fold_weight(pk.qdata, pk.block_scale, p.gs, n, k, w, lora=lora)
    return torch.mm(x2d, w.t())


def _fp8_fold(x2d: torch.Tensor, p: PreparedFP8, lora: tuple) -> torch.Tensor:
    """fp8 + LoRA: W' = W + scale * Bc @ A re-expressed per call as e4m3 with one scale per row (an upper
    bound of max |W'| per row, ``fold_weight``), from the native NVFP4 storage (one rounding of W'); x quantized
    per row; one rowwise ``torch._scaled_mm``. The W part is re-expressed exactly as :func:`prepare` does it
    except for the (larger) row scale."""
    from . import triton_nvfp4 as tk
    pk = p.packed
    n, k = p.out_features, p.in_features
    npad = p.w8.shape[0]
    w = _scratch(x2d.device, torch.float8_e4m3fn, npad * k).view(npad, k)
    so = _scratch(x2d.device, torch.float32, npad)
    tk.fold_weight(pk.qdata, pk.block_scale, pk.global_scale.float().reshape(1).to(x2d.device), n, k, w, lora=lora,
                   amax_w=p.amax_w, scale_out=so)
    x8, sx = tk.quant_rows_fp8(x2d)
    out = torch._scaled_mm(x8, w.t(), scale_a=sx, scale_b=so.view(1, npad), out_dtype=x2d.dtype,
                           use_fast_accum=True)
    return out[:, :n] if npad != n else out


def _fp8_set_state(p: PreparedFP8, key, lora: tuple | None) -> None:
    """Make ``p.w8``/``p.sw`` hold the base weight (key None) or W + scale * Bc @ A (the ``lora`` tuple of
    :func:`triton_nvfp4.fold_weight`), re-derived in place from the packed NVFP4 storage when ``p.state`` differs.
    The base is re-derived by the function :func:`prepare` used (:func:`_fp8_base_into`): bit-identical."""
    if p.state == key:
        return
    pk = p.packed
    n, k = p.out_features, p.in_features
    p.state = _INVALID   # a failure below must not leave a half-written weight marked valid
    # w8/sw were made by prepare(), usually under ComfyUI's inference_mode (inference tensors): update them in
    # the same mode, so a caller outside inference_mode can still switch the slot
    with torch.inference_mode(p.w8.is_inference()):
        if key is None:
            _fp8_base_into(pk, p.w8, p.sw.view(-1), None)
        else:
            from . import triton_nvfp4 as tk
            tk.fold_weight(pk.qdata, pk.block_scale, pk.global_scale.float().reshape(1).to(p.w8.device), n, k,
                           p.w8, lora=lora, amax_w=p.amax_w, scale_out=p.sw.view(-1))
    p.state = key
    p.refolds += 1


_INVALID = object()


def _linear2d(x2d: torch.Tensor, prepared, path: str) -> torch.Tensor:
    n = prepared.out_features
    if isinstance(prepared, PreparedFP8) and prepared.state is not None:
        _fp8_set_state(prepared, None, None)   # a Turbo LoRA was folded in by an earlier call: back to the base
    if path == "reference" or isinstance(prepared, PreparedReference):
        return F.linear(x2d, _reference_weight(prepared, x2d.dtype))
    if path == "blackwell_fp4":
        return _blackwell_linear(x2d, prepared)
    if x2d.dtype not in (torch.bfloat16, torch.float16) or x2d.device.type != "cuda":
        _log_once(("fallback", path, str(x2d.dtype), x2d.device.type),
                  "H3 Turbo %s path: input %s on %s is not supported by the kernels; using the reference "
                  "dequantize + F.linear for such inputs", path, x2d.dtype, x2d.device.type,
                  level=logging.WARNING)
        return F.linear(x2d, _reference_weight(prepared, x2d.dtype))
    if path == "exact":
        from . import triton_nvfp4 as tk
        strat = _exact_strategy(x2d.shape[0])
        if strat == "full" and prepared.packed is not None:
            return _exact_full(x2d, prepared)
        if strat in ("tiled", "full"):
            return _exact_tiled(x2d, prepared)
        return tk.gemm_exact(x2d, prepared.qs, prepared.scales, prepared.gs, n, prepared.in_features)
    if path == "fp8":
        from . import triton_nvfp4 as tk
        x8, sx = tk.quant_rows_fp8(x2d)
        out = torch._scaled_mm(x8, prepared.w8.t(), scale_a=sx, scale_b=prepared.sw,
                               out_dtype=x2d.dtype, use_fast_accum=True)
        return out[:, :n] if out.shape[1] != n else out
    raise ValueError(f"linear: unknown path {path!r}")


def _blackwell_linear(x2d: torch.Tensor, prepared: PreparedBlackwell) -> torch.Tensor:
    """W4A4 through comfy-kitchen, exactly as core does on Blackwell: x quantized to NVFP4 with
    ``amax(|x|)/(448*6)`` (rows/cols zero-padded to 16), ``scaled_mm_nvfp4(qx, qw, sx, gs, bsx, bsw)``,
    output sliced to [M, N]."""
    import comfy_kitchen as ck
    p = prepared.packed
    m, k = x2d.shape
    sx = (x2d.abs().amax().float() / (448.0 * 6.0)).reshape(())
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    pad = (m % 16 != 0) or (k % 16 != 0)
    qx, bsx = ck.quantize_nvfp4(x2d, sx, 0.0, pad)
    out = ck.scaled_mm_nvfp4(qx, p.qdata, tensor_scale_a=sx, tensor_scale_b=p.global_scale.float().reshape(()),
                             block_scale_a=bsx, block_scale_b=p.block_scale, out_dtype=x2d.dtype)
    return out[:m, : p.out_features]


def linear(x: torch.Tensor, prepared, path: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a prepared NVFP4 weight.

    x: [..., K] bf16/fp16 (other dtypes and CPU tensors run the reference computation, logged once).
    Returns [..., N] in x.dtype. Raises ValueError when x's last dim is not in_features.
    """
    k = prepared.in_features
    if x.shape[-1] != k:
        raise ValueError(f"linear: input last dim {x.shape[-1]} != in_features {k}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    out = _linear2d(x2d, prepared, path)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, prepared.out_features)


def _lora_blocks(A, B, n, qkv_blocks):
    if A.dim() != 2 or B.dim() != 2:
        raise ValueError(f"LoRA A {tuple(A.shape)} and B {tuple(B.shape)} must both be 2-D ([R, K] and [N, R])")
    if qkv_blocks not in (1, 3):
        raise ValueError(f"qkv_blocks must be 1 or 3, got {qkv_blocks}")
    rt = A.shape[0]
    if rt % qkv_blocks:
        raise ValueError(f"LoRA A has {rt} rows, not divisible by qkv_blocks={qkv_blocks}")
    r = rt // qkv_blocks
    if n % qkv_blocks:
        raise ValueError(f"out_features {n} not divisible by qkv_blocks={qkv_blocks}")
    nb = n // qkv_blocks
    if B.shape[0] != n or B.shape[1] not in (r, rt):
        raise ValueError(f"LoRA B shape {tuple(B.shape)}: expected [{n}, {rt}] (block-diagonal) or [{n}, {r}]")
    if B.shape[1] == r:
        bc = B
    else:  # diagonal blocks of the block-diagonal up matrix
        bc = torch.cat([B[i * nb:(i + 1) * nb, i * r:(i + 1) * r] for i in range(qkv_blocks)], 0)
    return r, nb, bc


def linear_with_lora(x: torch.Tensor, prepared, path: str, A: torch.Tensor, B: torch.Tensor, scale: float,
                     qkv_blocks: int = 1, bias: torch.Tensor | None = None,
                     amax_a: torch.Tensor | None = None, fold_key=None) -> torch.Tensor:
    """base(x) (+ bias) + scale * B(A(x)) with a block-diagonal qkv LoRA as ``qkv_blocks`` rank-r products.

    A: lora_down [qkv_blocks*r, K]; B: lora_up [N, qkv_blocks*r] block-diagonal (off-diagonal blocks are
    ignored) or compact [N, r] (block i of N/qkv_blocks rows uses h[:, i*r:(i+1)*r]); scale: alpha/r
    times strength; amax_a: optional fp32 [qkv_blocks*r] = max |A| per row (the caller's cache; fp8 fold).
    How (source of the formula: research/lightx2v-h3.md §1.1; the branch sees x itself, never a smoothed x):

    - exact, M <= FUSED_MAX_M: fused Triton dequant-GEMM, h = A(x) in x.dtype, B product added in the epilogue.
    - exact, M >= FULL_LORA_MIN_M ("full"): weight-side fold W' = W + scale * Bc @ A[blk] (fp32, one rounding
      to bf16) into the reused buffer, one cuBLAS GEMM (``LORA_FOLD``); below that ("tiled"): the update added
      to each rounded bf16 weight tile (two roundings of W').
    - fp8 with ``fold_key`` (the runtime branch passes one per adapter target and strength): the fold quantized
      per row to e4m3 is kept in the layer's one fp8 weight slot until another key (or the base) is needed, so
      the branch costs nothing per call and one fold per layer on an adapter switch (``_fp8_set_state``).
    - fp8 without a key, M >= FP8_FOLD_MIN_M: the same fold per call into a reused buffer (``_fp8_fold``).
    - otherwise (and with ``LORA_FOLD`` off): the unfused branch, h = A(x), ``addmm_`` per block into y.

    The NVFP4 storage is never modified. Returns [..., N] in x.dtype. Raises ValueError on shape mismatches.
    """
    n, k = prepared.out_features, prepared.in_features
    if x.shape[-1] != k or A.shape[1] != k:
        raise ValueError(f"linear_with_lora: x {tuple(x.shape)} / A {tuple(A.shape)} do not match in_features {k}")
    r, nb, bc = _lora_blocks(A, B, n, qkv_blocks)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    m = x2d.shape[0]
    a = A.to(x2d.dtype)
    bc = bc.to(x2d.dtype).contiguous()
    fast = x2d.device.type == "cuda" and x2d.dtype in (torch.bfloat16, torch.float16)
    out = None
    if fast and path == "exact" and isinstance(prepared, PreparedExact):
        from . import triton_nvfp4 as tk
        strat = _exact_strategy(m)
        if strat == "fused" and nb % 64 == 0:
            h = F.linear(x2d, a)
            out = tk.gemm_exact(x2d, prepared.qs, prepared.scales, prepared.gs, n, k,
                                lora=(h, bc, float(scale), nb))
            LORA_ROUTES["fused_epilogue"] += 1
        elif (LORA_FOLD and strat == "full" and m >= FULL_LORA_MIN_M and prepared.packed is not None
              and tk.fold_bn(nb) is not None):
            out = _exact_full(x2d, prepared, lora=(a, bc, float(scale), nb))
            LORA_ROUTES["full_fold"] += 1
        elif LORA_FOLD and strat in ("tiled", "full"):
            out = _exact_tiled(x2d, prepared, lora=(a, bc, float(scale), nb))
            LORA_ROUTES["tiled_fold"] += 1
    elif (fast and LORA_FOLD and path == "fp8" and isinstance(prepared, PreparedFP8)
          and prepared.packed is not None and prepared.amax_w is not None):
        from . import triton_nvfp4 as tk
        if tk.fold_bn(nb) is not None:
            lt = (a, bc, float(scale), nb, amax_a)
            if fold_key is not None:
                _fp8_set_state(prepared, (fold_key, float(scale)), lt)
                x8, sx = tk.quant_rows_fp8(x2d)
                out = torch._scaled_mm(x8, prepared.w8.t(), scale_a=sx, scale_b=prepared.sw, out_dtype=x2d.dtype,
                                       use_fast_accum=True)
                out = out[:, :n] if out.shape[1] != n else out
                LORA_ROUTES["fp8_slot"] += 1
            elif m >= FP8_FOLD_MIN_M:
                out = _fp8_fold(x2d, prepared, lora=lt)
                LORA_ROUTES["fp8_percall"] += 1
    if out is None:
        LORA_ROUTES["unfused"] += 1
        h = F.linear(x2d, a)                                             # [M, blocks*r]
        out = _linear2d(x2d, prepared, path)
        for i in range(qkv_blocks):
            out[:, i * nb:(i + 1) * nb].addmm_(h[:, i * r:(i + 1) * r], bc[i * nb:(i + 1) * nb].t(),
                                               alpha=float(scale))
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, n)


def lora_reference(x, packed_or_prepared, A, B, scale, qkv_blocks: int = 1) -> torch.Tensor:
    """Unfused float64 reference of base + scale * B(A(x)) (tests, benchmarks): [..., N] float64."""
    p = packed_or_prepared
    if isinstance(p, PackedNVFP4):
        w = ref.dequant_fp64(p.qdata, p.block_scale, p.global_scale, p.out_features, p.in_features)
    else:
        w = _reference_weight(p, torch.float32).double()
    n = w.shape[0]
    r, nb, bc = _lora_blocks(A, B, n, qkv_blocks)
    xd = x.reshape(-1, x.shape[-1]).double()
    out = xd @ w.t()
    h = xd @ A.double().t()
    for i in range(qkv_blocks):
        out[:, i * nb:(i + 1) * nb] += scale * (h[:, i * r:(i + 1) * r] @ bc[i * nb:(i + 1) * nb].double().t())
    return out.reshape(*x.shape[:-1], n)
