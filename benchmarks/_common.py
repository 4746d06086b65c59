"""Pieces shared by the benchmark scripts (run from the repo root as ``python3 benchmarks/<script>.py``, also on
machines where the pack is not installed).

import_package: ``import h3_turbo`` from this checkout.
collect_logs: INFO logging to stderr, and the pack's log lines appended to a list (the result JSON's ``log``).
h3_config: the fixture config (``tools.fixtures.TinyH3Config``) with the real H3's widths, or tiny widths for DRY.
cuda_median_ms: median CUDA-event time of a callable (ms).
gpu_tag: the current CUDA device's short name for result file names (h200, h100, ...).
q_row_codes: the fused route's per-row INT8 Q codes and scales of a q.
lora_routes: kernels.dispatch.LORA_ROUTES summed over every loaded copy of that module.
rel_l2: relative L2 of one tensor against another in float64.
h3_qkv: attention inputs with H3's statistics in core ComfyUI's layout (``comfy/ldm/minimax/model.py``):
q, k, v are [1, heads, S, d] strided views of one [S, 3*heads*d] bf16 qkv buffer, q and k per-head
RMS-normalised times a per-channel gain in [1, 1.5), v cloned (as core's attention receives them).
"""
import importlib.util
import logging
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_tag() -> str:
    """The current CUDA device's short name for result file names: h200, h100, b200, a100, else its full name with
    underscores."""
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "b200", "a100"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


def import_package():
    """Make ``import h3_turbo`` load THIS checkout (the repo root is the package; its ``__init__`` imports
    nothing heavy), whether or not the pack is installed. Returns the package module."""
    if "h3_turbo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("h3_turbo", os.path.join(REPO, "__init__.py"),
                                                      submodule_search_locations=[REPO])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["h3_turbo"] = pkg
        spec.loader.exec_module(pkg)
    return sys.modules["h3_turbo"]


def h3_qkv(S: int, heads: int, d: int, dev, seed: int = 0):
    """Returns (qkv [S, 3*heads*d] bf16, (q, k, v) each [1, heads, S, d] strided views/clone). Deterministic per
    (S, seed, device)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn(S, 3 * heads * d, device=dev, dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.split(heads * d, dim=-1)
    for t in (q, k):                     # per-head RMSNorm with a gain, in place in the buffer
        tv = t.view(S, heads, d)
        gain = 1.0 + 0.5 * torch.rand(heads, d, device=dev, generator=g)
        tv.copy_((tv.float() * torch.rsqrt(tv.float().pow(2).mean(-1, keepdim=True) + 1e-6) * gain).to(tv.dtype))
    qv = q.view(S, heads, d)
    kv = k.view(S, heads, d)
    vv = v.view(S, heads, d).clone()
    return qkv, tuple(t.transpose(0, 1).unsqueeze(0) for t in (qv, kv, vv))   # [1, H, S, D] strided


def cuda_median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median of ``rep`` CUDA-event timings of ``fn()`` after ``warmup`` calls, in ms."""
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


def q_row_codes(q, rotate: bool = True):
    """q [1, H, L, D] -> (int8 [L, H, D] contiguous, float32 [L, H] = max|q_row| / 127): the fused route's Q_ROW
    codes, rounded as the kernels round (``int8_kernels._round_half_away``); ``rotate``: of q times the Hadamard
    matrix, as the kernels' default ``ROTATE`` expects (``int8_kernels.fwht``)."""
    from h3_turbo.kernels.attention import int8_kernels as K

    x = q[0].transpose(0, 1).float()                                   # [L, H, D]
    if rotate:
        x = K.fwht(x)
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    q8 = K._round_half_away(x * inv[..., None], 127.0).to(torch.int8).contiguous()
    return q8, (amax / 127.0).contiguous()


def collect_logs(lines: list, width: int = 400) -> None:
    """``logging.basicConfig`` at INFO, and every record of the ``h3_turbo`` logger appended to ``lines`` as
    "LEVEL message" (cut to ``width`` characters): the benchmarks keep the pack's decisions in their JSON."""

    class _Collect(logging.Handler):
        def emit(self, record):
            try:
                lines.append(f"{record.levelname} {record.getMessage()}"[:width])
            except Exception:  # noqa: BLE001
                pass

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("h3_turbo").addHandler(_Collect())


def h3_config(num_layers: int, dry: bool = False):
    """``tools.fixtures.TinyH3Config`` with the real H3's widths (hidden 5376, 56 x 128 heads, FFN 14336, text 5120,
    time embedder 256 -> 5376 -> 2688; 2 refiner blocks; Turbo LoRA rank 128) and ``num_layers`` DiT blocks; ``dry``:
    the tiny widths the benchmarks' CPU checks use."""
    from h3_turbo.tools.fixtures import TinyH3Config

    if dry:
        return TinyH3Config(hidden=128, heads=4, head_dim=32, ffn=256, text_dim=96, num_layers=num_layers,
                            refiner_layers=2, lora_rank=8)
    return TinyH3Config(hidden=5376, heads=56, head_dim=128, ffn=14336, text_dim=5120, timestep_input_dim=256,
                        time_embed_hidden=5376, time_embed_dim=2688, rope_len=16, num_layers=num_layers,
                        refiner_layers=2, lora_rank=128)


def lora_routes() -> dict:
    """kernels.dispatch.LORA_ROUTES summed over every loaded copy of the module (ComfyUI may import the pack's
    folder under another module name than h3_turbo)."""
    tot: dict = {}
    for name, mod in list(sys.modules.items()):
        if name.endswith("kernels.dispatch") and hasattr(mod, "LORA_ROUTES"):
            for k, v in mod.LORA_ROUTES.items():
                tot[k] = tot.get(k, 0) + v
    return tot


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
