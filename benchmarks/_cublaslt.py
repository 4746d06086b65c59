"""cuBLASLt's FP8 GEMM with an explicit algorithm choice, for ``bench_gemm_algos.py`` (issue 21): the
rowwise-scaled e4m3 GEMM that ``torch._scaled_mm`` runs on Hopper, called through ctypes so that configurations
other than the heuristic's first one can be timed. A benchmark helper, not part of the pack: the study found none
faster beyond the card's run-to-run spread (docs/kernels.md), so the pack keeps ``torch._scaled_mm``.

``D[M, N] = (x8 * sx) @ (w8 * sw)^T`` with x8 e4m3 [M, K] row-major, sx fp32 [M] (one scale per row), w8 e4m3
[N, K] row-major, sw fp32 [N], D bf16 [M, N] row-major; fp32 accumulation with cuBLASLt's FP8 fast accumulation
(``CUBLASLT_MATMUL_DESC_FAST_ACCUM``, what ``use_fast_accum=True`` sets). In cuBLAS's column-major terms:
``D^T [N, M] = op(A) op(B)`` with A = w8 (transposed), B = x8, scale mode ``OUTER_VEC_32F`` for both (cuBLAS 12.9+:
one scale per row of op(A) and per column of op(B)). Public source: the cuBLAS documentation, "cublasLtMatmul",
"cublasLtMatmulAlgoGetHeuristic" and "cublasLtMatmulMatrixScale_t" (docs.nvidia.com/cuda/cublas).

:func:`problem` returns why this module cannot run (no CUDA, no library, cuBLAS below 12.9) or None. Errors:
:class:`CublasLtError` with the failing call and its status. The library is loaded on first use.
"""
from __future__ import annotations

import ctypes
import glob
import itertools
import os
import threading

import torch

# enum values of cublasLt.h / library_types.h / cublas_api.h (CUDA 12.9 - 13)
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_FAST_ACCUM = 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_OUTER_VEC_32F = 3
PREF_MAX_WORKSPACE_BYTES = 1
ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
               "inner_shape": 7, "cluster": 8}
WORKSPACE_BYTES = 32 << 20          # what torch gives cuBLASLt on Hopper (CUBLASLT_WORKSPACE_SIZE's default)


class CublasLtError(RuntimeError):
    pass


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_LOCK = threading.Lock()
_STATE: dict = {}


def _load() -> ctypes.CDLL:
    if "lib" in _STATE:
        return _STATE["lib"]
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so",
             *sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so*")))]
    errs = []
    for n in names:
        try:
            lib = ctypes.CDLL(n)
            break
        except OSError as e:
            errs.append(f"{n}: {e}")
    else:
        raise CublasLtError("libcublasLt not found: " + "; ".join(errs[:3]))
    vp = ctypes.c_void_p
    for fn, args in {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtGetVersion": [],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                       ctypes.c_int64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                           ctypes.POINTER(HeuristicResult), ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, vp, ctypes.c_size_t,
                                                 ctypes.POINTER(ctypes.c_size_t)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, vp, ctypes.c_size_t],
        "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, vp, ctypes.c_size_t,
                                              ctypes.POINTER(ctypes.c_size_t)],
        "cublasLtMatmulAlgoGetIds": [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                     ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmulAlgoInit": [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.POINTER(Algo)],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, ctypes.POINTER(Algo), ctypes.POINTER(HeuristicResult)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(Algo), vp,
                           ctypes.c_size_t, vp],
    }.items():
        f = getattr(lib, fn)
        f.argtypes = args
        f.restype = ctypes.c_size_t if fn == "cublasLtGetVersion" else ctypes.c_int
    _STATE["lib"] = lib
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"cuBLASLt {call} returned status {status}")


def version() -> int:
    """cuBLASLt's version number (e.g. 130100 for 13.1.0)."""
    return int(_load().cublasLtGetVersion())


def problem(device) -> str | None:
    """None if :func:`fp8_matmul` can run on ``device``, else why not."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return f"device {dev} is not CUDA"
    if torch.cuda.get_device_capability(dev) < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability(dev)} has no FP8 tensor cores"
    try:
        v = version()
    except CublasLtError as e:
        return str(e)
    if v < 120900:
        return f"cuBLASLt {v} predates rowwise (outer-vector) FP8 scales (12.9)"
    return None


def _handle(dev: torch.device):
    key = ("handle", dev.index)
    h = _STATE.get(key)
    if h is None:
        h = ctypes.c_void_p()
        _check(_load().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        _STATE[key] = h
    return h


def _workspace(dev: torch.device) -> torch.Tensor:
    key = ("ws", dev.index)
    ws = _STATE.get(key)
    if ws is None:
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        _STATE[key] = ws
    return ws


def _set(fn, obj, attr: int, value) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


class _Problem:
    """The descriptors of one (M, N, K) bf16-output rowwise FP8 GEMM (cached; the scale pointers are set per call)."""

    def __init__(self, m: int, n: int, k: int):
        lib = _load()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        s = lib.cublasLtMatmulDescSetAttribute
        _set(s, self.desc, DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        _set(s, self.desc, DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        _set(s, self.desc, DESC_FAST_ACCUM, ctypes.c_int8(1))
        _set(s, self.desc, DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
        _set(s, self.desc, DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
        self.a, self.b, self.d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), CUDA_R_8F_E4M3, k, n, k), "layout A")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), CUDA_R_8F_E4M3, k, m, k), "layout B")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), CUDA_R_16BF, n, m, n), "layout D")
        self.pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "cublasLtMatmulPreferenceCreate")
        _set(lib.cublasLtMatmulPreferenceSetAttribute, self.pref, PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(WORKSPACE_BYTES))


def _problem(m: int, n: int, k: int) -> _Problem:
    key = ("problem", m, n, k)
    p = _STATE.get(key)
    if p is None:
        p = _STATE[key] = _Problem(m, n, k)
    return p


def heuristics(device, m: int, n: int, k: int, count: int = 16) -> list[tuple[Algo, dict]]:
    """Up to ``count`` algorithms cuBLASLt's heuristic offers for the problem, in its order (the first is what
    ``torch._scaled_mm`` runs with the same workspace), each with its configuration attributes
    (tile / stages / cluster ids etc., the enums of cublasLt.h) and ``waves``."""
    lib = _load()
    dev = torch.device(device)
    p = _problem(m, n, k)
    res = (HeuristicResult * count)()
    got = ctypes.c_int(0)
    with _LOCK:
        # with vector scales the heuristic refuses NULL scale pointers (status 7): any aligned device memory will do
        ws = _workspace(dev).data_ptr()
        _set(lib.cublasLtMatmulDescSetAttribute, p.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(ws))
        _set(lib.cublasLtMatmulDescSetAttribute, p.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(ws))
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(dev), p.desc, p.a, p.b, p.d, p.d, p.pref, count, res,
                                                  ctypes.byref(got)), "cublasLtMatmulAlgoGetHeuristic")
    out = []
    for i in range(got.value):
        r = res[i]
        if r.state != 0:
            continue
        algo = Algo()
        ctypes.memmove(ctypes.byref(algo), ctypes.byref(r.algo), ctypes.sizeof(Algo))
        out.append((algo, {**config_of(algo), "waves": round(float(r.wavesCount), 3),
                           "workspace": int(r.workspaceSize)}))
    return out


def fp8_matmul(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, algo: Algo,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``(x8 * sx) @ (w8 * sw)^T`` -> bf16 [M, N] with algorithm ``algo`` (from :func:`heuristics` / :func:`variants`).

    x8 e4m3 [M, K] and w8 e4m3 [N, K] contiguous, sx fp32 with M elements, sw fp32 with N elements (contiguous, any
    shape), K a multiple of 16, on one CUDA device; ``out`` bf16 [M, N] contiguous (allocated if None). Raises
    ValueError on a bad argument and :class:`CublasLtError` when cuBLASLt refuses the call."""
    m, k = x8.shape
    n = w8.shape[0]
    if x8.dtype != torch.float8_e4m3fn or w8.dtype != torch.float8_e4m3fn or w8.shape[1] != k:
        raise ValueError(f"cublaslt.fp8_matmul: x8 {x8.dtype} {tuple(x8.shape)}, w8 {w8.dtype} {tuple(w8.shape)}: "
                         f"expected e4m3 [M, K] and [N, K]")
    if not (x8.is_contiguous() and w8.is_contiguous() and sx.is_contiguous() and sw.is_contiguous()):
        raise ValueError("cublaslt.fp8_matmul: x8, w8, sx and sw must be contiguous")
    if sx.numel() != m or sw.numel() != n or sx.dtype != torch.float32 or sw.dtype != torch.float32:
        raise ValueError(f"cublaslt.fp8_matmul: scales {sx.dtype} {tuple(sx.shape)} / {sw.dtype} "
                         f"{tuple(sw.shape)}, expected fp32 with {m} / {n} elements")
    if k % 16:
        raise ValueError(f"cublaslt.fp8_matmul: K = {k} is not a multiple of 16")
    dev = x8.device
    if out is None:
        out = torch.empty((m, n), device=dev, dtype=torch.bfloat16)
    elif out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"cublaslt.fp8_matmul: out {out.dtype} {tuple(out.shape)}, expected contiguous bf16 [{m}, {n}]")
    if m == 0:
        return out
    lib = _load()
    p = _problem(m, n, k)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    ws = _workspace(dev)
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
    with _LOCK:
        s = lib.cublasLtMatmulDescSetAttribute
        _set(s, p.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(sw.data_ptr()))
        _set(s, p.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(sx.data_ptr()))
        _check(lib.cublasLtMatmul(_handle(dev), p.desc, ctypes.byref(alpha), ctypes.c_void_p(w8.data_ptr()), p.a,
                                  ctypes.c_void_p(x8.data_ptr()), p.b, ctypes.byref(beta),
                                  ctypes.c_void_p(out.data_ptr()), p.d, ctypes.c_void_p(out.data_ptr()), p.d,
                                  ctypes.byref(algo), ctypes.c_void_p(ws.data_ptr()), WORKSPACE_BYTES, stream),
               "cublasLtMatmul")
    return out


TILES = {20: "128x128", 23: "128x256", 24: "256x128", 29: "128x160", 30: "160x128", 31: "192x128", 32: "128x192",
         18: "128x64", 17: "64x128", 21: "256x64", 19: "64x256"}
CLUSTERS = {0: "auto", 2: "1x1", 3: "2x1", 5: "1x2", 6: "2x2", 4: "4x1", 8: "1x4"}
CAP_TILE_IDS, CAP_CUSTOM_OPTION_MAX, CAP_SWIZZLING = 6, 7, 2


def config_of(algo: Algo) -> dict:
    """The configuration attributes of ``algo`` (ids as in cublasLt.h)."""
    lib = _load()
    cfg = {}
    for name, attr in ALGO_CONFIG.items():
        v = ctypes.c_uint16(0) if name in ("inner_shape", "cluster") else ctypes.c_uint32(0)
        w = ctypes.c_size_t(0)
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v),
                                                    ctypes.byref(w)) == 0:
            cfg[name] = int(v.value)
    return cfg


def _cap_list(algo: Algo, cap: int) -> list[int]:
    lib = _load()
    w = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), cap, None, 0, ctypes.byref(w)) != 0 or not w.value:
        return []
    buf = (ctypes.c_uint32 * (w.value // 4))()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), cap, buf, w.value, ctypes.byref(w)) != 0:
        return []
    return list(buf)


def _cap_int(algo: Algo, cap: int) -> int:
    lib = _load()
    v, w = ctypes.c_int32(0), ctypes.c_size_t(0)
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), cap, ctypes.byref(v), 4, ctypes.byref(w))
    return int(v.value)


def variants(device, m: int, n: int, k: int, tiles=tuple(TILES), clusters=tuple(CLUSTERS), limit: int = 400):
    """Configurations cuBLASLt accepts (``cublasLtMatmulAlgoCheck``) for the problem: the heuristic's algorithm with
    its tile / cluster / stages / custom option / swizzle changed, and every algorithm id of the type combination
    at its default configuration. Returns [(Algo, cfg dict)] (at most ``limit``), the heuristic's first."""
    lib = _load()
    dev = torch.device(device)
    p = _problem(m, n, k)
    h = _handle(dev)
    out, seen = [], set()
    first = heuristics(dev, m, n, k, 1)
    ws = _workspace(dev).data_ptr()

    def check(algo: Algo, extra: dict) -> None:
        r = HeuristicResult()
        if lib.cublasLtMatmulAlgoCheck(h, p.desc, p.a, p.b, p.d, p.d, ctypes.byref(algo), ctypes.byref(r)) != 0:
            return
        if r.workspaceSize > WORKSPACE_BYTES:
            return
        cfg = config_of(algo)
        key = tuple(sorted(cfg.items()))
        if key in seen:
            return
        seen.add(key)
        a = Algo()
        ctypes.memmove(ctypes.byref(a), ctypes.byref(algo), ctypes.sizeof(Algo))
        out.append((a, {**cfg, **extra, "waves": round(float(r.wavesCount), 3), "workspace": int(r.workspaceSize)}))

    with _LOCK:
        _set(lib.cublasLtMatmulDescSetAttribute, p.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(ws))
        _set(lib.cublasLtMatmulDescSetAttribute, p.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(ws))
        if first:
            base, bcfg = first[0]
            check(base, {"source": "heuristic"})
            have_tiles = set(_cap_list(base, CAP_TILE_IDS)) or set(tiles)
            stages = sorted({bcfg.get("stages", 0), 0})
            cmax = max(0, _cap_int(base, CAP_CUSTOM_OPTION_MAX))
            swz = (0, 1) if _cap_int(base, CAP_SWIZZLING) else (0,)
            cs = lib.cublasLtMatmulAlgoConfigSetAttribute
            for t, c, st, cu, sw in itertools.product([t for t in tiles if t in have_tiles], clusters, stages,
                                                      range(min(cmax, 7) + 1), swz):
                a = Algo()
                ctypes.memmove(ctypes.byref(a), ctypes.byref(base), ctypes.sizeof(Algo))
                vals = ((ALGO_CONFIG["tile"], ctypes.c_uint32(t)), (ALGO_CONFIG["cluster"], ctypes.c_uint16(c)),
                        (ALGO_CONFIG["stages"], ctypes.c_uint32(st)), (ALGO_CONFIG["custom"], ctypes.c_uint32(cu)),
                        (ALGO_CONFIG["swizzle"], ctypes.c_uint32(sw)))
                if all(cs(ctypes.byref(a), at, ctypes.byref(v), ctypes.sizeof(v)) == 0 for at, v in vals):
                    check(a, {"source": "variant"})
                if len(out) >= limit:
                    return out
        ids = (ctypes.c_int * 128)()
        got = ctypes.c_int(0)
        if lib.cublasLtMatmulAlgoGetIds(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF,
                                        CUDA_R_16BF, 128, ids, ctypes.byref(got)) == 0:
            for i in range(got.value):
                a = Algo()
                if lib.cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3,
                                              CUDA_R_16BF, CUDA_R_16BF, ids[i], ctypes.byref(a)) == 0:
                    check(a, {"source": f"algo_id {ids[i]}"})
                if len(out) >= limit:
                    break
    return out
