"""Issue 3: header validation, format/config detection, conversion and quantization (no ComfyUI)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3_turbo.formats import convert as C
from h3_turbo.formats.detect import check_block_scales, detect
from h3_turbo.formats.safetensors_io import CheckpointError, read_header
from h3_turbo.tools.variants import DAMAGE_KINDS, damage, make_format_variants


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: dict, b: dict, skip=()) -> list[str]:
    """Keys whose tensors differ (dtype, shape or any byte), plus keys present in one dict only."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b) - set(skip)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bytes(x), _bytes(y)):
            bad.append(k)
    return bad


@pytest.fixture(scope="module")
def nv(fixtures_dir):
    if "nvfp4" not in fixtures_dir:
        pytest.skip("comfy-kitchen missing: no NVFP4 fixture")
    return fixtures_dir["nvfp4"]


@pytest.fixture(scope="module")
def variants(nv, fixtures_dir, tmp_path_factory):
    return make_format_variants(nv, fixtures_dir["bf16"], str(tmp_path_factory.mktemp("variants")))


def _write(tmp_path, sd, meta=None, name="x.safetensors"):
    p = str(tmp_path / name)
    save_file(sd, p, metadata=meta)
    return p


# ----------------------------------------------------------------------------- container damage

EXPECT = {
    "lfs_pointer": "Git LFS pointer",
    "header_too_long": "header length field says",
    "json_garbage": "not valid UTF-8 JSON",
    "truncated": "file is truncated",
    "trailing_bytes": "100 trailing bytes",
    "shape_mismatch": "needs 147456 bytes but data_offsets",
    "too_small": "too small for a safetensors header",
}


@pytest.mark.parametrize("kind", DAMAGE_KINDS)
def test_damaged_container_messages(fixtures_dir, tmp_path, kind):
    p = damage(fixtures_dir["bf16"], kind, str(tmp_path / f"{kind}.safetensors"))
    with pytest.raises(CheckpointError) as ei:
        read_header(p)
    msg = str(ei.value)
    assert msg.startswith(p + ": ") and EXPECT[kind] in msg and "(expected " in msg, msg
    if kind in ("truncated", "shape_mismatch"):
        assert ei.value.key is not None and f"tensor '{ei.value.key}'" in msg


def test_gap_between_tensors_is_an_error(tmp_path, fixtures_dir):
    import struct

    raw = open(fixtures_dir["bf16"], "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    first = min((v for k, v in hdr.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
    first["data_offsets"] = [first["data_offsets"][0] + 2, first["data_offsets"][1] + 2]
    first["dtype"], first["shape"] = "U8", [first["data_offsets"][1] - first["data_offsets"][0]]
    h = json.dumps(hdr).encode()
    p = tmp_path / "gap.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    with pytest.raises(CheckpointError, match="leaves a gap of 2 bytes"):
        read_header(str(p))


# ----------------------------------------------------------------------------- detection

def test_detect_native_fixture(nv):
    d = detect(read_header(nv))
    assert d.model == "h3" and d.format == "comfy_native" and d.prefix == "" and d.errors == []
    c = d.config
    assert (c.hidden, c.heads, c.head_dim, c.ffn, c.layers, c.refiner_layers, c.text_dim, c.latents_dim,
            c.audio_latents_dim, c.form) == (64, 2, 32, 128, 50, 2, 48, 24, 32, "unpruned")
    assert len(d.quant_layers) == 208 and set(d.quant_layers) == set(c.projection_stems())
    # packed bytes per block: qkv 192x32 + 256x4, out 64x32 + 128x4, fc1 256x32 + 256x4, fc2 64x64 + 128x8,
    # each + 4 (weight_scale_2) + 19 (comfy_quant JSON)
    per_block = (192 * 32 + 256 * 4) + (64 * 32 + 128 * 4) + (256 * 32 + 256 * 4) + (64 * 64 + 128 * 8) + 4 * 23
    assert d.packed_bytes == 52 * per_block
    assert check_block_scales(nv, d) == []


def test_detect_bf16_fixture(fixtures_dir):
    d = detect(read_header(fixtures_dir["bf16"]))
    assert d.format == "bf16" and d.errors == [] and not d.quant_layers and d.config.layers == 50
    assert d.projection_dtypes == {"BF16": 208}


@pytest.mark.parametrize("name,fmt,prefix,nibbles,layout", [
    ("metadata", "comfy_metadata", "", ("hi_first", "format"), ("swizzled", "format")),
    ("modelopt_lo_linear", "modelopt", "", ("lo_first", "assumed"), ("linear", "shapes")),
    ("modelopt_hi_linear_meta", "modelopt", "", ("hi_first", "metadata"), ("linear", "metadata")),
    ("modelopt_lo_swizzled_meta", "modelopt", "", ("lo_first", "metadata"), ("swizzled", "metadata")),
    ("lightx2v", "lightx2v", "", ("lo_first", "assumed"), ("swizzled", "format")),
    ("prefixed", "comfy_native", "model.diffusion_model.", ("hi_first", "format"), ("swizzled", "format")),
    ("bf16_prefixed", "bf16", "diffusion_model.", ("hi_first", "format"), ("swizzled", "format")),
])
def test_detect_each_format(variants, name, fmt, prefix, nibbles, layout):
    d = detect(read_header(variants[name]))
    assert d.errors == [], d.errors
    assert (d.format, d.prefix) == (fmt, prefix)
    assert (d.nibble_order, d.nibble_order_source) == nibbles
    assert (d.scale_layout, d.scale_layout_source) == layout
    assert d.config.layers == 50 and d.config.refiner_layers == 2
    assert len(d.quant_layers) == (0 if fmt == "bf16" else 208)
    assumed = [f for f in d.findings if "ASSUMED" in f.message]
    assert len(assumed) == (1 if "assumed" in (nibbles[1], layout[1]) else 0)


def test_modelopt_ambiguous_layout_is_reported(nv, tmp_path):
    # only fc1 quantized: its [256, 4] scales are the same shape plain or swizzled -> assumed + warning
    sd = load_file(nv)
    foreign = C.native_to_foreign(sd, "modelopt", "lo_first", "linear")
    for k in [k for k in foreign if k.endswith("weight_scale_2") and ".mlp.fc1." not in k]:
        stem = k[: -len(".weight_scale_2")]
        for s in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            foreign.pop(f"{stem}.{s}", None)
        foreign[f"{stem}.weight"] = torch.zeros(1)   # placeholder replaced below
    plain = load_file(nv.replace("nvfp4", "bf16"))
    for k in list(foreign):
        if foreign[k].shape == (1,) and k.endswith(".weight"):
            foreign[k] = plain[k]
    d = detect(read_header(_write(tmp_path, foreign)))
    assert d.errors == [] and len(d.quant_layers) == 52
    assert (d.scale_layout, d.scale_layout_source) == ("linear", "assumed")
    assert any("block-scale layout cannot be told" in f.message for f in d.findings)


@pytest.mark.parametrize("keys,expect", [
    ({"patch_embedding.weight": [8, 4], "blocks.0.self_attn.q.weight": [8, 8]}, "Wan 2.x"),
    ({"double_blocks.0.img_attn.qkv.weight": [8, 8]}, "Flux"),
    ({"diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight": [4, 8]}, "LoRA adapter"),
    ({"foo.bar": [2]}, "unknown"),
])
def test_not_h3_says_what_it_looks_like(tmp_path, keys, expect):
    p = _write(tmp_path, {k: torch.zeros(s) for k, s in keys.items()})
    d = detect(read_header(p))
    assert d.model == "not-h3" and expect in d.looks_like
    with pytest.raises(CheckpointError, match="not a MiniMax H3 diffusion model: looks like"):
        d.raise_if_errors()


def test_pruned_curve_form_detected(fixtures_dir, tmp_path):
    sd = load_file(fixtures_dir["bf16"])
    for k in [k for k in sd if k.startswith("time_embedder.")]:
        del sd[k]
    sd["adaln_t_table"] = torch.randn(33, 8)
    for i in range(50):
        sd[f"blocks.{i}.adaln_proj.linear.weight"] = torch.randn(6 * 64 * 3, 8)
    d = detect(read_header(_write(tmp_path, sd)))
    assert d.errors == [] and d.config.form == "pruned"


def _mut(nv, tmp_path, fn, meta=None):
    sd = load_file(nv)
    fn(sd)
    return detect(read_header(_write(tmp_path, sd, meta)))


@pytest.mark.parametrize("case,key,text", [
    ("missing_projection", "blocks.7.mlp.fc2.weight", "block projection missing (expected [64, 128])"),
    ("wrong_n", "blocks.3.mlp.fc1.weight", "holds a [240, 64] matrix (expected [256, 64]"),
    ("missing_scale2", "blocks.5.attn.out_proj.weight_scale_2", "missing weight_scale_2"),
    ("extra_bias", "blocks.2.attn.qkv_proj.bias", "unexpected key on a bias-free block projection"),
    ("orphan_scale", "condition_proj.weight_scale", "orphan quantization key"),
    ("inf_scale2", "blocks.9.mlp.fc2.weight_scale_2", "weight_scale_2 is inf"),
    ("neg_scale2", "blocks.9.mlp.fc2.weight_scale_2", "weight_scale_2 is -0.5 (expected > 0)"),
    ("bad_scale_shape", "blocks.4.mlp.fc1.weight_scale", "block-scale shape [128, 4]"),
    ("scale_dtype", "blocks.4.mlp.fc1.weight_scale", "block scales are F32"),
    ("bad_json", "blocks.1.mlp.fc1.comfy_quant", "comfy_quant is not UTF-8 JSON"),
    ("unknown_fmt", "blocks.1.mlp.fc1", "unknown quantization format 'nvfp5'"),
    ("gap_in_blocks", None, "DiT blocks missing: blocks.20 (the file has blocks.0..49 except these; a checkpoint "
                            "shard missing?); core would build only blocks.0..19 and ignore the rest"),
    ("quantized_condition_proj", "condition_proj.weight", "core's H3 detector reads its input width"),
])
def test_validation_findings(nv, tmp_path, case, key, text):
    def fn(sd):
        if case == "missing_projection":
            for s in ("weight", "weight_scale", "weight_scale_2", "comfy_quant"):
                del sd[f"blocks.7.mlp.fc2.{s}"]
        elif case == "wrong_n":
            sd["blocks.3.mlp.fc1.weight"] = sd["blocks.3.mlp.fc1.weight"][:240].clone()
        elif case == "missing_scale2":
            del sd["blocks.5.attn.out_proj.weight_scale_2"]
        elif case == "extra_bias":
            sd["blocks.2.attn.qkv_proj.bias"] = torch.zeros(192)
        elif case == "orphan_scale":
            sd["condition_proj.weight_scale"] = torch.ones(1)
        elif case == "inf_scale2":
            sd["blocks.9.mlp.fc2.weight_scale_2"] = torch.tensor(float("inf"))
        elif case == "neg_scale2":
            sd["blocks.9.mlp.fc2.weight_scale_2"] = torch.tensor(-0.5)
        elif case == "bad_scale_shape":
            sd["blocks.4.mlp.fc1.weight_scale"] = sd["blocks.4.mlp.fc1.weight_scale"][:128].clone()
        elif case == "scale_dtype":
            sd["blocks.4.mlp.fc1.weight_scale"] = sd["blocks.4.mlp.fc1.weight_scale"].float()
        elif case == "bad_json":
            sd["blocks.1.mlp.fc1.comfy_quant"] = torch.tensor([0xFF, 0x7B], dtype=torch.uint8)
        elif case == "unknown_fmt":
            sd["blocks.1.mlp.fc1.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp5"}'), dtype=torch.uint8)
        elif case == "gap_in_blocks":
            for k in [k for k in sd if k.startswith("blocks.20.")]:
                del sd[k]
        elif case == "quantized_condition_proj":
            from h3_turbo.formats import nvfp4

            q, bs, s = nvfp4.quantize(sd.pop("condition_proj.weight"))
            sd.update({"condition_proj.weight": q, "condition_proj.weight_scale": bs,
                       "condition_proj.weight_scale_2": s,
                       "condition_proj.comfy_quant": C.marker_tensor()})
    d = _mut(nv, tmp_path, fn)
    hits = [f for f in d.errors if text in f.message and (key is None or f.key == key)]
    assert hits, [str(f) for f in d.errors]
    with pytest.raises(CheckpointError) as ei:
        d.raise_if_errors()
    assert str(ei.value).startswith(d.path + ": ") and text in str(ei.value)


def test_nan_and_negative_block_scales(nv, tmp_path):
    def fn(sd):
        b = sd["blocks.6.attn.qkv_proj.weight_scale"].view(torch.uint8).clone()
        b[0, 0], b[0, 1], b[5, 2] = 0x7F, 0xFF, 0x80 | 0x38
        sd["blocks.6.attn.qkv_proj.weight_scale"] = b.view(torch.float8_e4m3fn)
    d = _mut(nv, tmp_path, fn)
    assert d.errors == []                          # header-level checks pass ...
    found = check_block_scales(d.path, d)          # ... the value scan finds both problems
    msgs = sorted(f.message for f in found)
    assert msgs == ["2 block scales are NaN (e4m3 0x7F/0xFF; expected finite)",
                    "2 block scales are negative (expected >= 0)"]
    assert all(f.key == "blocks.6.attn.qkv_proj.weight_scale" for f in found)


def test_mixed_schemes_rejected(nv, tmp_path):
    sd = load_file(nv)
    sd["blocks.0.mlp.fc1.weight_global_scale"] = torch.tensor(1.0)
    d = detect(read_header(_write(tmp_path, sd)))
    assert any("mixed quantization schemes" in f.message for f in d.errors)


# ----------------------------------------------------------------------------- conversion

@pytest.mark.parametrize("name", ["metadata", "modelopt_lo_linear", "modelopt_hi_linear_meta",
                                  "modelopt_lo_swizzled_meta", "prefixed"])
def test_convert_lossless(variants, name, tmp_path):
    ref = load_file(variants["native_input_scale"])
    out = str(tmp_path / "out.safetensors")
    C.write_native(variants[name], out)
    assert _same(ref, load_file(out)) == []


def test_convert_lightx2v(variants, tmp_path):
    ref = load_file(variants["native_input_scale"])
    out = str(tmp_path / "out.safetensors")
    plan = C.write_native(variants["lightx2v"], out)
    got = load_file(out)
    # codes, block scales, everything else bit-identical; the global scales go through 1/x twice in fp32
    s2 = [k for k in ref if k.endswith(("weight_scale_2", "input_scale"))]
    assert _same(ref, got, skip=s2) == []
    for k in s2:
        a, b = float(ref[k]), float(got[k])
        assert abs(a - b) <= abs(a) * 2 ** -23, (k, a, b)
    assert plan.nibble_order == "lo_first"


def test_wrong_nibble_override_changes_codes(variants, tmp_path):
    ref = load_file(variants["native_input_scale"])
    out = str(tmp_path / "out.safetensors")
    C.write_native(variants["modelopt_lo_linear"], out, nibble_order="hi_first")
    got = load_file(out)
    assert not torch.equal(got["blocks.0.mlp.fc1.weight"], ref["blocks.0.mlp.fc1.weight"])
    assert torch.equal(got["blocks.0.mlp.fc1.weight"], (ref["blocks.0.mlp.fc1.weight"] << 4) | (ref["blocks.0.mlp.fc1.weight"] >> 4))


def test_quantize_bf16_equals_comfy_kitchen_fixture(nv, fixtures_dir, tmp_path):
    out = str(tmp_path / "q.safetensors")
    seen = []
    plan = C.write_native(fixtures_dir["bf16"], out, progress=lambda d, t: seen.append((d, t)))
    assert len(plan.quantize) == 208 and seen[-1] == (208, 208) and len(seen) == 208
    assert _same(load_file(nv), load_file(out)) == []     # the fixture was made with comfy-kitchen's quantizer


def test_quantize_include_exclude(fixtures_dir, tmp_path):
    out = str(tmp_path / "q.safetensors")
    plan = C.write_native(fixtures_dir["bf16"], out, include=["blocks.*.mlp.*", "blocks.0.adaln_proj.linear"],
                          exclude=["blocks.4?.*"])
    assert len(plan.quantize) == 40 * 2 + 1
    d = detect(read_header(out))
    assert d.errors == [] and len(d.quant_layers) == 81 and "blocks.45.mlp.fc1" not in d.quant_layers
    got, src = load_file(out), load_file(fixtures_dir["bf16"])
    assert torch.equal(got["blocks.0.adaln_proj.linear.bias"], src["blocks.0.adaln_proj.linear.bias"])
    assert got["blocks.0.adaln_proj.linear.weight"].shape == (1152, 16)   # [6*H*3, TD/2] packed
    with pytest.raises(CheckpointError, match="must stay unquantized"):
        C.write_native(fixtures_dir["bf16"], out, include=["condition_proj"])


def test_streaming_writer_checks_plan_and_cleans_up(tmp_path):
    p = str(tmp_path / "o.safetensors")
    items = iter([("a", torch.zeros(2)), ("b", torch.zeros(3))])
    with pytest.raises(ValueError, match="does not match the planned b F32"):
        C.write_safetensors_stream(p, items, [("a", "F32", (2,)), ("b", "F32", (4,))], {})
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "o.safetensors.part").exists()
    n = C.write_safetensors_stream(p, iter([("a", torch.arange(2.0))]), [("a", "F32", (2,))], {"m": "1"})
    assert n == (tmp_path / "o.safetensors").stat().st_size and read_header(p).metadata == {"m": "1"}
    assert torch.equal(load_file(p)["a"], torch.arange(2.0))


def test_iter_native_streams_one_layer_at_a_time(fixtures_dir, monkeypatch):
    # the generator must read the input lazily: after the first quantized layer only a few tensors were read
    from h3_turbo.formats import safetensors_io as S

    reads = []
    real = S.open_tensors

    class Spy:
        def __init__(self, f):
            self.f = f

        def get_tensor(self, k):
            reads.append(k)
            return self.f.get_tensor(k)

    from contextlib import contextmanager

    @contextmanager
    def spy_open(path, device="cpu", header=None):
        with real(path, device, header) as f:
            yield Spy(f)

    monkeypatch.setattr(C, "open_tensors", spy_open)
    plan = C.make_plan(detect(read_header(fixtures_dir["bf16"])))
    it = C.iter_native(plan)
    first_q = None
    for k, t in it:
        if k.endswith(".comfy_quant"):
            first_q = k
            break
    assert first_q is not None and len(reads) < 40
    total = len(read_header(fixtures_dir["bf16"]).tensors)
    for _ in it:
        pass
    assert len(reads) == total and len(set(reads)) == total    # every input tensor read exactly once


def test_metadata_file_keeps_other_core_formats(nv, tmp_path):
    # a whole-file-metadata checkpoint with one fp8 layer: the fp8 layer gets its own comfy_quant marker
    sd = load_file(nv)
    layers = {k[: -len(".comfy_quant")]: {"format": "nvfp4"} for k in sd if k.endswith(".comfy_quant")}
    sd = {k: v for k, v in sd.items() if not k.endswith(".comfy_quant")}
    # fp8 on adaln of block 0 (condition_proj must stay plain for detection)
    a = load_file(nv)["blocks.0.adaln_proj.linear.weight"]
    sd["blocks.0.adaln_proj.linear.weight"] = a.to(torch.float8_e4m3fn)
    sd["blocks.0.adaln_proj.linear.weight_scale"] = torch.tensor(1.0)
    layers["blocks.0.adaln_proj.linear"] = {"format": "float8_e4m3fn"}
    p = _write(tmp_path, sd, {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})})
    d = detect(read_header(p))
    assert d.errors == [] and d.other_quant == {"blocks.0.adaln_proj.linear"} and len(d.quant_layers) == 208
    assert any("'float8_e4m3fn'" in f.message for f in d.findings if f.level == "warning")
    out = str(tmp_path / "o.safetensors")
    C.write_native(p, out)
    got = load_file(out)
    assert bytes(got["blocks.0.adaln_proj.linear.comfy_quant"].tolist()) == b'{"format": "float8_e4m3fn"}'
    assert got["blocks.0.adaln_proj.linear.weight"].dtype == torch.float8_e4m3fn
    assert sum(k.endswith(".comfy_quant") for k in got) == 209
