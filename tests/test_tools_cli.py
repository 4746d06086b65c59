"""Issue 3: ``python -m h3_turbo.tools inspect | quantize | convert``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from h3_turbo.tools.__main__ import main
from h3_turbo.tools.variants import damage, make_format_variants

EXAMPLES = Path(__file__).resolve().parents[1] / "example_workflows"


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


# ----------------------------------------------------------------------------------------- inspect: Turbo LoRA
def _rewrite_lora(src: str, dst, edit=None, meta_edit=None) -> str:
    """A copy of LoRA ``src`` at ``dst`` with ``edit(tensors)`` / ``meta_edit(metadata)`` applied in place."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(src, framework="pt") as f:
        meta = dict(f.metadata())
    t = load_file(src)
    if edit:
        edit(t)
    if meta_edit:
        meta_edit(meta)
    save_file(t, str(dst), metadata=meta)
    return str(dst)


def test_inspect_good_turbo_lora(fixtures_dir, capsys):
    import hashlib

    p = fixtures_dir["lora_8step"]
    assert main(["inspect", p]) == 0
    out = capsys.readouterr().out
    assert "kind: Turbo LoRA, ComfyUI layout, keys diffusion_model.<block>.<projection>.*" in out
    assert "targets: 208 (50 blocks + 2 refiner blocks x 4 projections), 624 tensors in the file" in out
    assert "fits: H3 of hidden 64, attention 64, FFN 128\n" in out
    # rank and alpha per projection (qkv fused: rank and alpha x3), alpha/rank 1/16 like the official 8-step
    assert "  attn.qkv_proj   52 targets  rank 12  alpha 0.75  alpha/rank 0.0625\n" in out
    for proj in ("attn.out_proj", "mlp.fc1", "mlp.fc2"):
        assert f"  {proj:<14}  52 targets  rank 4  alpha 0.25  alpha/rank 0.0625\n" in out
    assert "contract: 8step: 8 model evaluations, shifts 12/3 (video/audio), from the file's metadata\n" in out
    assert f"sha256: {hashlib.sha256(open(p, 'rb').read()).hexdigest()}\n" in out
    assert "published artifact: no\n" in out
    assert "[warning] sized for an H3 of hidden 64" in out  # the tiny fixture is not the 33 B model's size
    assert "[error]" not in out and out.rstrip().endswith("RESULT: OK")
    assert main(["inspect", "--json", p]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["kind"], rep["ok"], rep["errors"], rep["targets"]) == ("turbo_lora", True, 0, 208)
    assert rep["projections"]["attn.qkv_proj"] == {"targets": 52, "rank": {"12": 52}, "alpha": {"0.75": 52},
                                                  "alpha_over_rank": {"0.0625": 52}}
    assert rep["contract"]["variant"] == "8step" and rep["contract"]["nfe"] == 8


def test_inspect_recognizes_a_published_turbo_lora_by_hash(fixtures_dir, monkeypatch, capsys):
    """A file whose SHA-256 is a published one is the official artifact under any name (here: the fixture stands
    in for the published 4-step file)."""
    from h3_turbo.adapters import contracts
    from h3_turbo.adapters.turbo_lora import sha256_file

    p = fixtures_dir["lora_4step"]
    official = contracts.KNOWN_ARTIFACTS[0]
    assert official.contract.variant == "4step" and official.sha256
    fake = contracts.KnownArtifact(official.filename, sha256_file(p), official.contract)
    monkeypatch.setattr(contracts, "KNOWN_ARTIFACTS", (fake,) + contracts.KNOWN_ARTIFACTS[1:])
    assert main(["inspect", p]) == 0
    out = capsys.readouterr().out
    assert (f"published artifact: yes, {official.filename} (lightx2v/Minimax-h3-Turbo), renamed here\n") in out
    assert "contract: 4step: 4 model evaluations, shifts 6/3 (video/audio), from the official artifact\n" in out


def test_inspect_turbo_lora_without_contract_warns(fixtures_dir, tmp_path, capsys):
    p = _rewrite_lora(fixtures_dir["lora_4step"], tmp_path / "mine.safetensors",
                      meta_edit=lambda m: m.pop("h3_turbo_fixture"))
    assert main(["inspect", p]) == 0
    out = capsys.readouterr().out
    assert "contract: none\n" in out and "[warning] no Turbo contract" in out and "RESULT: OK" in out


def _drop_target(t, target="blocks.7.mlp.fc2"):
    for k in [k for k in t if f".{target}." in k]:
        del t[k]


def _nan(t):
    t["diffusion_model.blocks.3.attn.out_proj.lora_B.weight"][0, 0] = float("nan")


def _alpha(t):
    t["diffusion_model.blocks.9.mlp.fc1.alpha"] = torch.tensor(3.0)


def _foreign(t):
    t["diffusion_model.blocks.0.adaln_proj.lora_A.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)


def _wide_a(t):
    t["diffusion_model.blocks.0.attn.out_proj.lora_A.weight"] = torch.zeros(4, 67, dtype=torch.bfloat16)


@pytest.mark.parametrize("edit,name,finding", [
    (_drop_target, "x.safetensors", "missing targets (an adapter must cover all four projections of every block): "
                                    "1 [blocks.7.mlp.fc2]"),
    (_nan, "x.safetensors", "tensors with NaN or Inf values: 1 [diffusion_model.blocks.3.attn.out_proj.lora_B.weight: "
                            "1 NaN and 0 Inf values of "),
    (_alpha, "x.safetensors", "alpha/rank disagreeing with __metadata__ training_scale 0.0625: 1 "
                              "[blocks.9.mlp.fc1: alpha 3 / rank 4 = 0.75]"),
    (_foreign, "x.safetensors", "also targets modules outside the 208 block projections"),
    (_wide_a, "x.safetensors", "targets of one projection have different sizes (attn.out_proj: [out 64, in 64] in 51 "
                               "target(s); [out 64, in 67] in blocks.0.attn.out_proj): not one H3 model"),
    (None, "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors",
     "named like the official minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors but its SHA-256"),
])
def test_inspect_bad_turbo_lora_names_the_finding(fixtures_dir, tmp_path, capsys, edit, name, finding):
    p = _rewrite_lora(fixtures_dir["lora_8step"], tmp_path / name, edit=edit)
    assert main(["inspect", p]) == 1
    out = capsys.readouterr().out
    assert finding in out and out.rstrip().endswith("RESULT: ERRORS"), out


def test_inspect_turbo_lora_with_the_wrong_alpha_for_its_official_name(fixtures_dir, tmp_path, capsys):
    """A 4-step file (alpha/rank 1) under the official 8-step name (1/16) would run 16x too strong."""
    p = _rewrite_lora(fixtures_dir["lora_4step"], tmp_path / "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors",
                      meta_edit=lambda m: m.pop("training_scale"))
    assert main(["inspect", p]) == 1
    out = capsys.readouterr().out
    assert "whose alpha/rank is 0.0625, but the file says otherwise" in out


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


# ----------------------------------------------------------------------------------------- help texts
@pytest.mark.parametrize("argv", [
    ("h3_turbo.tools", ["--help"]), ("h3_turbo.tools", ["inspect", "--help"]),
    ("h3_turbo.tools", ["quantize", "--help"]), ("h3_turbo.tools", ["convert", "--help"]),
    ("h3_turbo.tools", ["make-fixtures", "--help"]), ("h3_turbo.tools.workflows", ["--help"]),
    ("h3_turbo.demo", ["--help"]), ("h3_turbo.client", ["submit", "--help"]), ("h3_turbo.client", ["ready", "--help"]),
], ids=lambda a: " ".join([a[0], *a[1]]))
def test_cli_help_is_plain_text(argv, capsys):
    """--help reads as plain text: no reST markup (double backticks, :func: roles) from docstrings."""
    import importlib

    mod, args = argv
    m = importlib.import_module(mod if mod != "h3_turbo.tools" and mod != "h3_turbo.client" else mod + ".__main__")
    with pytest.raises(SystemExit) as ei:
        m.main(args)
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m ") and "``" not in out and not any(
        r in out for r in (":func:", ":class:", ":data:", ":mod:")), out


def test_demo_help_says_what_models_does(capsys):
    from h3_turbo import demo

    with pytest.raises(SystemExit):
        demo.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "With --models DIR: uses the ComfyUI models tree DIR as it is and writes nothing into it." in out
    assert "python -m h3_turbo.tools make-fixtures DIR" in out


@pytest.mark.comfyui
def test_demo_refuses_an_unreadable_workflow_before_making_fixtures(comfy, tmp_path, capsys, monkeypatch):
    """A missing or non-API workflow exits 2 naming it, before any fixture is written or ComfyUI is booted."""
    from h3_turbo import demo
    from h3_turbo.tools import fixtures

    def no_fixtures(*a, **k):
        raise AssertionError("fixtures were made before the workflow was read")

    monkeypatch.setattr(fixtures, "make_fixtures", no_fixtures)
    missing = tmp_path / "nope.json"
    assert demo.main(["--workflow", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert f"{missing}: cannot read the workflow JSON" in capsys.readouterr().err
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    assert demo.main(["--workflow", str(lst), "--out", str(tmp_path / "o")]) == 2
    assert f"{lst}: not an API-format workflow" in capsys.readouterr().err
    ui = EXAMPLES / "h3turbo_tiny_demo.json"          # the UI-format example: refused, its api/ twin named
    assert demo.main(["--workflow", str(ui), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{ui}: this is a UI-format workflow (nodes/links)" in err
    assert "example_workflows/api/h3turbo_tiny_demo.json" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_demo_refuses_a_named_comfyui_that_is_not_one(tmp_path, capsys, monkeypatch):
    """``--comfyui DIR`` that is not a ComfyUI with H3 exits 2 naming DIR, even when a valid ComfyUI is elsewhere
    ($COMFYUI_PATH / ~/ComfyUI): a named path is never silently replaced."""
    from h3_turbo import demo, harness

    good = tmp_path / "good"
    (good / "comfy" / "ldm" / "minimax").mkdir(parents=True)
    (good / "comfy" / "ldm" / "minimax" / "model.py").write_text("")
    (good / "execution.py").write_text("")
    monkeypatch.setenv("COMFYUI_PATH", str(good))
    bad = tmp_path / "not_comfy"
    bad.mkdir()
    assert demo.main(["--comfyui", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: not a ComfyUI checkout with MiniMax H3 support" in err and str(good) not in err
    with pytest.raises(harness.ComfyUINotFound, match="not_comfy"):
        harness.find_comfyui(bad)
    with pytest.raises(harness.ComfyUINotFound, match="not a ComfyUI checkout"):
        harness.find_comfyui("")                  # an empty name is not "no name"
    assert harness.find_comfyui(good) == good.resolve()
    assert harness.find_comfyui() == good.resolve()
    assert not (tmp_path / "o").exists()


def test_a_wrong_comfyui_path_env_is_logged_when_another_is_used(tmp_path, monkeypatch, caplog):
    """A $COMFYUI_PATH that is not a ComfyUI falls through to the next place, with a warning naming both."""
    from h3_turbo import harness

    good = tmp_path / "home" / "ComfyUI"
    (good / "comfy" / "ldm" / "minimax").mkdir(parents=True)
    (good / "comfy" / "ldm" / "minimax" / "model.py").write_text("")
    (good / "execution.py").write_text("")
    monkeypatch.setattr(harness, "DEFAULT_COMFYUI", good)
    monkeypatch.setattr(harness, "PACK_DIR", tmp_path / "pack")     # not under a custom_nodes/ folder
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "missing"))
    with caplog.at_level("WARNING", logger="h3_turbo"):
        assert harness.find_comfyui() == good.resolve()
    assert f"$COMFYUI_PATH={tmp_path / 'missing'} is not a ComfyUI with H3 support; using {good}" in caplog.text
    monkeypatch.setattr(harness, "DEFAULT_COMFYUI", tmp_path / "none")
    with pytest.raises(harness.ComfyUINotFound, match="missing"):
        harness.find_comfyui()


@pytest.mark.comfyui
def test_failed_demo_workflow_reads_as_text(comfy):
    """A rejected workflow lists ComfyUI's errors per node (not raw dicts); a failed node is named with its error."""
    from h3_turbo import demo
    from h3_turbo.harness import PromptFailed

    bad = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": "h3_tiny_nvfp4.safetensors",
                                                                "compute": "auto"}},
           "2": {"class_type": "H3TurboSaveLatentPreview", "inputs": {"av_latent": ["1", 0], "filename_prefix": "x"}}}
    with pytest.raises(PromptFailed) as ei:
        comfy.run(bad)
    msg = demo._failure(ei.value)
    assert msg.startswith("ComfyUI rejected the workflow: Prompt outputs failed validation")
    assert "\n  node 2 (H3TurboSaveLatentPreview) input 'av_latent': Return type mismatch between linked nodes" in msg
    assert "{" not in msg and "extra_info" not in msg
    err = PromptFailed("boom", {"node_id": "5", "node_type": "H3TurboSigmas", "exception_type": "TurboContractError",
                                "exception_message": "wants 4 model evaluations, got steps=5\n"})
    assert demo._failure(err) == "node 5 (H3TurboSigmas) failed: TurboContractError: wants 4 model evaluations, got steps=5"


@pytest.mark.comfyui
def test_make_fixtures_writes_an_extra_model_paths_file(comfy, tmp_path, monkeypatch, capsys):
    """``make-fixtures DIR`` also writes DIR/extra_model_paths.yaml, which ComfyUI's own reader
    (``--extra-model-paths-config``) turns into exactly the two fixture folders (README "Serve the tiny demo")."""
    import folder_paths
    from utils.extra_config import load_extra_path_config  # ComfyUI's

    fx = tmp_path / "fx"
    assert main(["make-fixtures", str(fx)]) == 0
    assert f"--extra-model-paths-config {fx / 'extra_model_paths.yaml'}" in capsys.readouterr().out
    added = []
    monkeypatch.setattr(folder_paths, "add_model_folder_path",
                        lambda name, path, is_default=False: added.append((name, path)))
    load_extra_path_config(str(fx / "extra_model_paths.yaml"))
    assert sorted(added) == [("diffusion_models", str(fx / "diffusion_models")), ("loras", str(fx / "loras"))]
    assert (fx / "diffusion_models" / "h3_tiny_nvfp4.safetensors").is_file()
