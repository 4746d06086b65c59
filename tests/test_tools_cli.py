"""Issue 3: ``python -m h3_turbo.tools inspect | quantize | convert``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from h3_turbo.tools.__main__ import main
from h3_turbo.tools.variants import damage, make_format_variants


@pytest.fixture(scope="module")
def variants(fixtures_dir, tmp_path_factory):
    if "nvfp4" not in fixtures_dir:
        pytest.skip("comfy-kitchen missing: no NVFP4 fixture")
    return make_format_variants(fixtures_dir["nvfp4"], fixtures_dir["bf16"], str(tmp_path_factory.mktemp("cli_var")))


def _bytes_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].contiguous().reshape(-1).view(torch.uint8),
                                                 b[k].contiguous().reshape(-1).view(torch.uint8)) for k in a)


def test_inspect_native_text(fixtures_dir, capsys):
    assert main(["inspect", fixtures_dir["nvfp4"]]) == 0
    out = capsys.readouterr().out
    assert "format: comfy_native  (nibbles hi_first (format), block scales swizzled (format))" in out
    assert ("H3 config: hidden 64, heads 2 x 32, ffn 128, blocks 50 + refiner 2, text_dim 48, latents 24/32, "
            "unpruned") in out
    assert "layers: nvfp4 208 (block projections 208/208), other quantized 0" in out
    assert "findings: 0 (none)" in out and out.rstrip().endswith("RESULT: OK")


def test_inspect_json_bf16(fixtures_dir, capsys):
    assert main(["inspect", "--json", fixtures_dir["bf16"]]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["format"] == "bf16" and rep["layers_nvfp4"] == 0 and rep["block_projections"] == 208
    assert rep["tensors_by_dtype"] == {"BF16": 314 + 208, "F32": 13}
    assert rep["parameter_bytes"] == sum(t.nbytes for t in load_file(fixtures_dir["bf16"]).values())


def test_inspect_modelopt_reports_assumption(variants, capsys):
    assert main(["inspect", variants["modelopt_lo_linear"]]) == 0
    out = capsys.readouterr().out
    assert "nibbles lo_first (assumed), block scales linear (shapes)" in out
    assert "[warning] modelopt: nibble order not stated in metadata; ASSUMED lo_first" in out


def test_inspect_errors_exit_1(fixtures_dir, tmp_path, capsys):
    p = damage(fixtures_dir["bf16"], "truncated", str(tmp_path / "t.safetensors"))
    assert main(["inspect", p]) == 1
    out = capsys.readouterr().out
    assert "file is truncated" in out and out.rstrip().endswith("RESULT: ERRORS")
    assert main(["inspect", fixtures_dir["lora_4step"]]) == 1
    assert "looks like a LoRA adapter" in capsys.readouterr().out


def test_inspect_subprocess_exit_codes(fixtures_dir, tmp_path):
    p = damage(fixtures_dir["nvfp4"] if "nvfp4" in fixtures_dir else fixtures_dir["bf16"], "trailing_bytes",
               str(tmp_path / "d.safetensors"))
    r = subprocess.run([sys.executable, "-m", "h3_turbo.tools", "inspect", p], capture_output=True, text=True)
    assert r.returncode == 1 and "100 trailing bytes after the last tensor" in r.stdout
    r = subprocess.run([sys.executable, "-m", "h3_turbo.tools", "inspect", fixtures_dir["bf16"]],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "RESULT: OK" in r.stdout


def test_quantize_cli_matches_fixture(fixtures_dir, tmp_path, capsys):
    if "nvfp4" not in fixtures_dir:
        pytest.skip("no NVFP4 fixture")
    out = str(tmp_path / "q.safetensors")
    assert main(["quantize", fixtures_dir["bf16"], out]) == 0
    assert "208 NVFP4 layers quantized" in capsys.readouterr().out
    assert _bytes_equal(load_file(out), load_file(fixtures_dir["nvfp4"]))


def test_quantize_cli_patterns_and_refusals(fixtures_dir, tmp_path, capsys):
    out = str(tmp_path / "q.safetensors")
    assert main(["quantize", fixtures_dir["bf16"], out, "--include", "token_refiner.*", "--exclude", "*.fc2"]) == 0
    assert "6 NVFP4 layers quantized" in capsys.readouterr().out
    assert main(["quantize", out, str(tmp_path / "again.safetensors")]) == 1
    assert "already quantized (comfy_native); use `convert` instead" in capsys.readouterr().err
    assert main(["convert", fixtures_dir["bf16"], str(tmp_path / "c.safetensors")]) == 1
    assert "use `quantize` instead" in capsys.readouterr().err
    assert main(["quantize", fixtures_dir["bf16"], fixtures_dir["bf16"]]) == 1
    assert "is this same file (compared by file identity, through links)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["modelopt_lo_linear", "modelopt_lo_swizzled_meta", "metadata", "prefixed"])
def test_convert_cli_bit_preserving(variants, tmp_path, name, capsys):
    out = str(tmp_path / "c.safetensors")
    assert main(["convert", variants[name], out]) == 0
    assert "208 NVFP4 layers converted from" in capsys.readouterr().out
    assert _bytes_equal(load_file(out), load_file(variants["native_input_scale"]))


def test_convert_cli_overrides(variants, tmp_path):
    out = str(tmp_path / "c.safetensors")
    # a hi-first file declared in metadata: overriding to lo_first must swap every byte's nibbles
    assert main(["convert", variants["modelopt_hi_linear_meta"], out, "--nibble-order", "lo_first"]) == 0
    ref = load_file(variants["native_input_scale"])["blocks.3.attn.qkv_proj.weight"]
    got = load_file(out)["blocks.3.attn.qkv_proj.weight"]
    assert torch.equal(got, ((ref << 4) | (ref >> 4)).to(torch.uint8))
