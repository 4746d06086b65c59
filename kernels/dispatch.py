"""Compute-path dispatch for NVFP4 linears: THE interface the loader uses.

Paths (``resolve_compute``):

- ``"reference"``: pure torch; dequantize per call (:func:`.nvfp4_ref.dequant_exact`) + ``F.linear``.
  Works everywhere (CPU included). Same numbers as ``"exact"`` up to GEMM summation order.
- ``"exact"``: W4A16 on CUDA + Triton. The weight is the reference dequant bit for bit
  (``(E2M1[q] * block_scale) * weight_scale_2`` in fp32, rounded once to the activation dtype);
  bf16 tensor-core products, fp32 accumulation. Two strategies, same numbers up to summation order:
  ``fused`` (Triton dequant-GEMM, weight never materialised) and ``tiled`` (the weight dequantized in
  row tiles of ``TILE_ROWS`` into a reused buffer on a side stream, overlapped with cuBLAS GEMMs on the
  output's column slices). ``EXACT_STRATEGY`` picks ("auto": fused for M <= ``FUSED_MAX_M`` rows).
  Measured on an H200 (benchmarks/results/bench_linear_h200.md): tiled 0.96-1.07x bf16 cuBLAS at
  19584-37632 rows, 1.04-1.11x at 4096; the fused kernel runs ~290 TF/s (2.3x bf16) at large M and
  only wins over tiling below ~256 rows.
- ``"fp8"``: W8A8 on FP8 tensor cores (``torch._scaled_mm`` rowwise): at load the NVFP4 weight is
  re-expressed as e4m3 with one fp32 scale per output row (amax/448); activations are quantized per
  row on the fly (Triton). Approximate: 3.9-4.2% relative from the exact GEMM; 0.50-0.61x the bf16
  time on an H200 (benchmarks/results). Needs sm_89+. Weight memory: N*K bytes (twice NVFP4's).
- ``"blackwell_fp4"``: cc >= 10 with torch built for CUDA >= 13: comfy-kitchen ``scaled_mm_nvfp4``
  (activations quantized to NVFP4 per call as core does, W4A4; approximate).

Errors: requesting a path the device cannot run raises ``ValueError`` (never a silent fallback);
``linear`` falls back to the reference computation only for inputs the fast kernels do not take
(fp32 activations, K mismatch is an error), logging the reason once.
"""
from __future__ import annotations

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
#: exact strategy: "auto" | "fused" | "tiled"
EXACT_STRATEGY = "auto"
#: with EXACT_STRATEGY "auto", the fused Triton kernel serves M <= FUSED_MAX_M rows, "tiled" the rest
#: (H200 crossover between 256 and 1024 rows: bench_linear_h200.md "Small M")
FUSED_MAX_M = 256
#: rows of W dequantized per tile by the tiled strategy
TILE_ROWS = 3072
_logged: set = set()


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


@dataclass
class PreparedFP8:
    w8: torch.Tensor          # float8_e4m3fn [Npad16, K]
    sw: torch.Tensor          # fp32 [1, Npad16]
    out_features: int
    in_features: int


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
        return PreparedExact(qs, sc, gs.to(qs.device), n, k)
    if path == "fp8":
        npad = ref.fmt.roundup(n, 16)
        dev = packed.qdata.device
        w8 = torch.zeros((npad, k), dtype=torch.float8_e4m3fn, device=dev)
        sw = torch.ones((npad,), dtype=torch.float32, device=dev)
        qs, _ = ref.split_pack(packed.qdata, n, k)
        sc = ref.plain_scales(packed.block_scale, packed.qdata, n, k)
        gs = gs.to(dev)
        step = 4096
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            if dev.type == "cuda" and _has_triton():
                from . import triton_nvfp4 as tk
                wf = tk.dequant(qs[r0:r1], sc[r0:r1], gs, r1 - r0, k, out_dtype=torch.float32)
            else:
                wf = ref.dequant_split(qs[r0:r1], sc[r0:r1], gs, r1 - r0, k, torch.float32)
            w8[r0:r1], sw[r0:r1] = ref.fp8_rowwise_from_weight(wf)
        return PreparedFP8(w8, sw.reshape(1, npad), n, k)
    raise ValueError(f"prepare: unknown path {path!r} (expected one of exact, fp8, reference, blackwell_fp4)")


# --------------------------------------------------------------------------- linear

def _reference_weight(prepared, dtype) -> torch.Tensor:
    if isinstance(prepared, _PreparedPacked):
        p = prepared.packed
        return ref.dequant_exact(p.qdata, p.block_scale, p.global_scale, p.out_features, p.in_features, dtype)
    if isinstance(prepared, PreparedExact):
        return ref.dequant_split(prepared.qs, prepared.scales, prepared.gs, prepared.out_features,
                                 prepared.in_features, dtype)
    if isinstance(prepared, PreparedFP8):
        n = prepared.out_features
        return (prepared.w8[:n].float() * prepared.sw[0, :n, None]).to(dtype)
    raise TypeError(f"not a prepared NVFP4 weight: {type(prepared).__name__}")


_TILE_BUFS: dict = {}
_SIDE: dict = {}


def _exact_tiled(x2d, p: PreparedExact, lora: tuple | None = None) -> torch.Tensor:
    """Dequantize W in row tiles (Triton, side stream, double buffer) overlapped with cuBLAS GEMMs
    writing column slices of the output.

    lora: optional (A [blocks*r, K], Bc [N, r], scale, rows per block NB): each transient bf16 tile gets
    the rank-r update ``tile += scale * Bc[rows] @ A[block]`` (cuBLAS, fp32 accumulation, one rounding)
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


def _linear2d(x2d: torch.Tensor, prepared, path: str) -> torch.Tensor:
    n = prepared.out_features
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
        strat = EXACT_STRATEGY
        if strat == "auto":
            strat = "fused" if x2d.shape[0] <= FUSED_MAX_M else "tiled"
        if strat == "tiled":
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
                     qkv_blocks: int = 1) -> torch.Tensor:
    """base(x) + scale * B(A(x)) with a block-diagonal qkv LoRA computed as ``qkv_blocks`` rank-r products.

    A: lora_down [qkv_blocks*r, K]; B: lora_up [N, qkv_blocks*r] block-diagonal (off-diagonal blocks are
    ignored) or compact [N, r] (block i of N/qkv_blocks rows uses h[:, i*r:(i+1)*r]); scale: alpha/r
    times strength. Exact path, fused kernel: h = A(x) in x.dtype, the B product added in the GEMM
    epilogue (fp32). Exact path, tiled strategy: the rank-r update is applied to each transient bf16 weight
    tile (see ``_exact_tiled``; NVFP4 storage untouched). Other paths: h = A(x) in x.dtype and the B
    product added to the output with ``addmm_`` per block (the unfused branch). Returns [..., N] in x.dtype.
    """
    n, k = prepared.out_features, prepared.in_features
    if x.shape[-1] != k or A.shape[1] != k:
        raise ValueError(f"linear_with_lora: x {tuple(x.shape)} / A {tuple(A.shape)} do not match in_features {k}")
    r, nb, bc = _lora_blocks(A, B, n, qkv_blocks)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    a = A.to(x2d.dtype)
    bc = bc.to(x2d.dtype).contiguous()
    strat = None
    if (path == "exact" and x2d.device.type == "cuda" and x2d.dtype in (torch.bfloat16, torch.float16)
            and isinstance(prepared, PreparedExact)):
        strat = EXACT_STRATEGY
        if strat == "auto":
            strat = "fused" if x2d.shape[0] <= FUSED_MAX_M else "tiled"
        if strat == "fused" and nb % 64:
            strat = None
    if strat == "tiled":
        return _exact_tiled(x2d, prepared, lora=(a, bc, float(scale), nb)).reshape(*lead, n)
    h = F.linear(x2d, a)                                             # [M, blocks*r]
    if strat == "fused":
        from . import triton_nvfp4 as tk
        out = tk.gemm_exact(x2d, prepared.qs, prepared.scales, prepared.gs, n, k,
                            lora=(h, bc, float(scale), nb))
    else:
        out = _linear2d(x2d, prepared, path)
        for i in range(qkv_blocks):
            out[:, i * nb:(i + 1) * nb].addmm_(h[:, i * r:(i + 1) * r], bc[i * nb:(i + 1) * nb].t(),
                                               alpha=float(scale))
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
