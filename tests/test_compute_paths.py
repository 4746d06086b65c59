"""Every registered compute path (kernels/registry.py), parametrized: its contract on the CPU, its
capability reasons, its memory accounting, the loader combo, and its kernels against the float64
reference under TRITON_INTERPRET=1 (tests/test_kernels_interp.py::test_registered_path_kernel_within_bound)."""
from __future__ import annotations

import logging

import pytest
import torch

from h3_turbo import state
from h3_turbo.errors import H3TurboError, NoCapablePathError
from h3_turbo.kernels import dispatch as dsp
from h3_turbo.kernels import registry
from h3_turbo.kernels.paths import base

from test_kernels import make_packed, rel  # noqa: E402  (tests/ is on sys.path)

NAMES = list(registry.paths_for("nvfp4"))   # the NVFP4 loader's paths (int8: tests/test_int8_path.py)


def test_registry_lists_every_path_once_with_reference_last():
    assert NAMES == ["blackwell_fp4", "fp8", "exact", "reference"]
    assert registry.choices() == ("auto", "exact", "fp8", "reference", "blackwell_fp4")
    for name, p in registry.PATHS.items():
        assert p.name == name and registry.get(name) is p
    assert list(registry.PATHS) == ["blackwell_fp4", "fp8", "exact", "int8", "reference"]
    with pytest.raises(NoCapablePathError, match="unknown path 'int4'"):
        registry.get("int4")


@pytest.mark.parametrize("name", NAMES)
def test_path_on_cpu_equals_reference_exactly(name, caplog):
    """On the CPU every path's linear is the eager reference (kernel paths log the fallback once)."""
    p = registry.get(name)
    if name == "blackwell_fp4":
        pytest.skip("comfy-kitchen's FP4 op runs only on cc >= 10 (mock-tested in test_kernels.py)")
    pk = make_packed(48, 64, seed=3)
    prepared = dsp.prepare(pk, name)
    x = torch.randn(5, 64).to(torch.bfloat16)
    state.LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        y = dsp.linear(x, prepared, name)
        y2 = dsp.linear(x, prepared, name)
    want = torch.nn.functional.linear(x, p.reference_weight(prepared, torch.bfloat16))
    assert torch.equal(y, want) and torch.equal(y2, want)
    fallbacks = [r for r in caplog.records if "not supported by the kernels" in r.message]
    assert len(fallbacks) == (1 if p.kernel else 0)
    w64 = dsp.lora_reference(x, pk, torch.zeros(1, 64), torch.zeros(48, 1), 0.0)
    assert rel(y, w64) < p.error_bound


@pytest.mark.parametrize("name", NAMES)
def test_supports_cpu_gives_a_reason_and_resolve_refuses_by_name(name):
    ok, why = registry.get(name).supports(torch.device("cpu"))
    assert why and ok == (name == "reference")
    if name == "reference":
        assert registry.resolve(name, torch.device("cpu")) == ("reference", "requested")
    else:
        with pytest.raises(NoCapablePathError, match="needs a CUDA GPU") as e:
            registry.resolve(name, torch.device("cpu"))
        assert isinstance(e.value, H3TurboError) and isinstance(e.value, ValueError)


def test_auto_without_fast_path_lists_every_reason(monkeypatch):
    monkeypatch.setattr(base, "capability", lambda d: (7, 5))
    monkeypatch.setattr(base, "has_triton", lambda: True)
    state.LOGGED.clear()
    path, why = registry.resolve("auto", torch.device("cuda", 0))
    assert path == "reference"
    for name in ("blackwell_fp4", "fp8", "exact"):
        assert f"{name}: " in why
    assert "no FP4 tensor cores" in why and "no FP8 tensor cores" in why and "no bf16 tensor cores" in why


SHAPES = [(5376 * 3, 5376), (5376, 5376), (28672, 5376), (5376, 14336)]


@pytest.mark.parametrize("name", NAMES)
def test_memory_accounting(name):
    """prepared_bytes / workspace_bytes of the full H3 block projections, from the layouts (docs/kernels.md)."""
    p = registry.get(name)
    pb, wb = p.prepared_bytes(SHAPES), p.workspace_bytes(SHAPES)
    if name == "exact":
        assert pb == p.prepared_bytes(SHAPES, lean=True) == 4 * len(SHAPES)   # no copy: the native storage
        assert wb == 28672 * 5376 * 2 + 2 * 3072 * (5376 + 14336) * 2
    elif name == "fp8":
        assert pb == sum(n * k + 8 * n for n, k in SHAPES)                     # e4m3 copy + sw + amax
        assert p.prepared_bytes(SHAPES, lean=True) == sum(12 * n for n, _ in SHAPES)
        assert wb == 28672 * 5376 + 4 * 28672
    else:
        assert pb == 0 and wb == 0
    assert p.workspace_bytes([]) == 0


def test_settings_are_per_path_objects():
    ex, f8 = registry.get("exact"), registry.get("fp8")
    assert ex.settings.strategy == "auto" and ex.settings.fused_max_m == 256 and ex.settings.tile_rows == 3072
    assert f8.settings.lora_fold and f8.settings.fold_min_m == 1024
    assert ex.strategy(256) == "fused" and ex.strategy(257) == "full"
