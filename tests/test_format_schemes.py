"""The checkpoint-format registry (formats/registry.py, formats/schemes/): parametrized over every registered
scheme, so a new format is tested by adding it to the registry. CPU only, tiny shapes, no ComfyUI.

- round trip: ``from_native`` -> exactly that scheme claims the file -> ``detect`` finds no error ->
  conversion back to native (``write_native``: ``to_native`` + the planned header) equals the input bit for bit;
- two schemes claiming one file is a :class:`CheckpointError` naming both and their evidence;
- a file no scheme claims keeps the ``unknown`` / not-H3 findings.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3_turbo.errors import CheckpointError
from h3_turbo.formats import convert as C
from h3_turbo.formats import nvfp4, registry
from h3_turbo.formats.detect import detect
from h3_turbo.formats.safetensors_io import read_header
from h3_turbo.formats.schemes.base import Evidence, Scheme
from h3_turbo.formats.schemes.plain import UNCLAIMED
from h3_turbo.tools.fixtures import TinyH3Config, make_tiny_h3_state_dict

SCHEMES = registry.SCHEMES
NVFP4_SCHEMES = [s for s in SCHEMES if not s.is_plain]
CFG = dataclasses.replace(TinyH3Config(), num_layers=2, refiner_layers=1)
E2M1 = torch.tensor(nvfp4.E2M1_VALUES)


def _exact_weight(o: int, i: int, g: torch.Generator) -> torch.Tensor:
    """A weight NVFP4 represents exactly: E2M1 codes x e4m3 block scale in [1, 448] x 2^-6, every block of 16
    holding a +-6 and one block scale 448, so float -> NVFP4 -> float -> NVFP4 gives the same bits."""
    codes = torch.randint(0, 16, (o, i), generator=g)
    codes[:, ::16] = torch.where(torch.rand(o, i // 16, generator=g) < 0.5, 7, 15)   # +-6 in every block
    bs = torch.randint(0x38, 0x7F, (o, i // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    bs[0, 0] = 448.0
    return E2M1[codes] * bs.repeat_interleave(16, 1) * 2.0 ** -6


def _native(input_scale: bool) -> dict[str, torch.Tensor]:
    """The tiny H3 at depth 2 + 1 with its 12 block projections in native NVFP4 (``nvfp4.quantize``)."""
    g = torch.Generator().manual_seed(3)

    def layer(w):
        q, bs, s = nvfp4.quantize(_exact_weight(*w.shape, g).to(torch.bfloat16))
        return {"weight": q, "weight_scale": bs, "weight_scale_2": s, "comfy_quant": C.marker_tensor()}

    sd = make_tiny_h3_state_dict(CFG, seed=0, projection=layer)
    if input_scale:
        for s in [k[:-len(".comfy_quant")] for k in sd if k.endswith(".comfy_quant")]:
            sd[f"{s}.input_scale"] = torch.tensor(2.0 ** -7)
    return sd


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _differ(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    return bad + [k for k in sorted(set(a) & set(b)) if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                  or not torch.equal(_bytes(a[k]), _bytes(b[k]))]


def _write(tmp_path, sd, meta, name="f.safetensors") -> str:
    p = str(tmp_path / name)
    save_file(sd, p, metadata=meta or None)
    return p


def test_registry_keeps_the_format_names():
    names = [s.name for s in SCHEMES]
    assert names == ["comfy_native", "comfy_metadata", "lightx2v", "modelopt", "bf16", "fp16", "fp32", "mixed-plain"]
    assert all(registry.get(n) is s for n, s in zip(names, SCHEMES)) and registry.get("unknown") is UNCLAIMED
    assert [s.name for s in SCHEMES if s.is_native] == ["comfy_native"]
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        registry.get("gguf")


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_round_trip(scheme, tmp_path):
    native = _native(input_scale=not scheme.is_plain)    # a plain file has no activation scale to carry
    foreign, meta = scheme.from_native(native, {"note": "x"})
    path = _write(tmp_path, foreign, meta)
    hdr = read_header(path)
    found = registry.claims(hdr)
    assert [s for s, _ in found] == [scheme], [(s.name, str(e)) for s, e in found]
    assert str(found[0][1])
    det = detect(hdr)
    assert det.errors == [], [str(f) for f in det.errors]
    assert det.scheme is scheme and det.format == scheme.name and det.is_native == scheme.is_native
    if not scheme.is_native:
        assert _differ(native, foreign)          # from_native did write another layout
    out = str(tmp_path / "native.safetensors")
    plan = C.write_native(path, out)
    assert len(plan.quantize if scheme.is_plain else plan.convert) == 12
    assert plan.converts == (not scheme.is_native and not scheme.is_plain)
    assert _differ(native, load_file(out)) == []
    assert read_header(out).metadata["h3_turbo_source_format"] == scheme.name


@pytest.mark.parametrize("scheme", NVFP4_SCHEMES, ids=lambda s: s.name)
def test_plain_projections_with_one_quantized_layer_are_not_plain(scheme, tmp_path):
    # BF16 block projections, only one adaln layer NVFP4 (what `quantize --include` can write): the NVFP4
    # scheme alone claims the file, no plain scheme does
    sd = make_tiny_h3_state_dict(CFG, seed=0)
    q, bs, s = nvfp4.quantize(sd.pop("blocks.0.adaln_proj.linear.weight"))
    sd.update({"blocks.0.adaln_proj.linear.weight": q, "blocks.0.adaln_proj.linear.weight_scale": bs,
               "blocks.0.adaln_proj.linear.weight_scale_2": s, "blocks.0.adaln_proj.linear.comfy_quant": C.marker_tensor()})
    foreign, meta = scheme.from_native(sd)
    hdr = read_header(_write(tmp_path, foreign, meta))
    assert [c for c, _ in registry.claims(hdr)] == [scheme]
    d = detect(hdr)
    assert d.errors == [] and list(d.quant_layers) == ["blocks.0.adaln_proj.linear"] and d.projection_dtypes == {}


def _split(native: dict, stems: set[str]) -> tuple[dict, dict]:
    """(tensors of ``stems``, everything else)."""
    a = {k: v for k, v in native.items() if k.rpartition(".")[0] in stems}
    return a, {k: v for k, v in native.items() if k not in a}


@pytest.mark.parametrize("first,second", list(itertools.combinations(NVFP4_SCHEMES, 2)),
                         ids=lambda s: s.name)
def test_two_claims_are_an_error_naming_both(first, second, tmp_path):
    native = _native(input_scale=True)
    stems = {k[:-len(".comfy_quant")] for k in native if k.endswith(".comfy_quant")}
    part, rest = _split(native, {s for s in stems if s.startswith("blocks.0.")})
    a, meta_a = first.from_native(part)
    b, meta_b = second.from_native(rest)
    path = _write(tmp_path, {**a, **b}, {**meta_a, **meta_b})
    hdr = read_header(path)
    with pytest.raises(CheckpointError) as ei:
        registry.identify(hdr)
    err = ei.value
    assert [s for s, _ in err.claims] == [first, second]
    msg = str(err)
    assert msg.startswith(path + ": mixed quantization schemes in one file: " f"{first.name}, {second.name}")
    for s, ev in err.claims:
        assert f"{s.name}: {ev}" in msg and str(ev)
    det = detect(hdr)                              # detect reports it and goes on with the first claimer
    assert det.scheme is first and any(f.message == err.cause for f in det.errors)
    with pytest.raises(CheckpointError, match="mixed quantization schemes"):
        det.raise_if_errors()


def test_any_two_claimers_are_reported(monkeypatch, tmp_path):
    class Always(Scheme):
        def __init__(self, name):
            self.name = name

        def claims(self, view):
            return Evidence(f"{self.name} says so")

    x, y = Always("x"), Always("y")
    monkeypatch.setattr(registry, "SCHEMES", (x, y))
    p = _write(tmp_path, {"a": torch.zeros(1)}, None)
    with pytest.raises(CheckpointError) as ei:
        registry.identify(read_header(p))
    assert "x, y" in str(ei.value) and "x: x says so; y: y says so" in str(ei.value)
    monkeypatch.setattr(registry, "SCHEMES", (x,))
    assert registry.identify(read_header(p)) == (x, Evidence("x says so"))


def test_unclaimed_not_h3_keeps_findings(tmp_path):
    p = _write(tmp_path, {"patch_embedding.weight": torch.zeros(8, 4), "blocks.0.self_attn.q.weight": torch.zeros(8, 8)},
               None)
    assert registry.identify(read_header(p)) == (UNCLAIMED, None)
    d = detect(read_header(p))
    assert (d.format, d.scheme, d.evidence, d.model) == ("unknown", UNCLAIMED, None, "not-h3")
    assert [f.message for f in d.errors] == ["not a MiniMax H3 diffusion model: looks like Wan 2.x (not MiniMax H3)"]


def test_unclaimed_h3_keeps_findings(tmp_path):
    # fp8 block projections with a stray fp32 weight_scale: no scheme explains them
    sd = make_tiny_h3_state_dict(CFG, seed=0)
    for k in [k for k in sd if k.endswith(("qkv_proj.weight", "out_proj.weight", "fc1.weight", "fc2.weight"))]:
        sd[k] = sd[k].to(torch.float8_e4m3fn)
    sd["blocks.0.mlp.fc1.weight_scale"] = torch.tensor(1.0)
    hdr = read_header(_write(tmp_path, sd, None))
    assert registry.claims(hdr) == []
    d = detect(hdr)
    assert (d.format, d.scheme, d.evidence, d.model) == ("unknown", UNCLAIMED, None, "h3")
    assert d.projection_dtypes == {"F8_E4M3": 12} and not d.quant_layers
    msgs = {(f.key, f.message) for f in d.errors}
    assert (None, "block projections stored as ['F8_E4M3'] without quantization markers (no comfy_quant / "
                  "_quantization_metadata / weight_scale_2): cannot tell the format") in msgs
    assert ("blocks.0.mlp.fc1.weight_scale",
            "quantization key in a plain unknown checkpoint (no layer is marked quantized)") in msgs
    assert ("blocks.1.mlp.fc2.weight",
            "dtype F8_E4M3 without quantization scales (expected BF16/F16/F32 or NVFP4)") in msgs
    with pytest.raises(CheckpointError, match="cannot tell the format"):
        C.make_plan(d)
