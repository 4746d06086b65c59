"""Issue 2: the pack imports without ComfyUI, the fixtures have the real layouts, core loads them,
and the main job runs end to end through the real ComfyUI."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]


def test_root_imports_without_comfyui():
    # a fresh interpreter with no ComfyUI on the path: importing the pack root must work and be light
    code = ("import sys, h3_turbo; assert 'comfy' not in sys.modules and 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('comfy','torch')); "
            "import inspect; assert inspect.iscoroutinefunction(h3_turbo.comfy_entrypoint); print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_pyproject_has_comfy_registry_fields():
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert cfg["project"]["name"] == "h3-turbo"
    assert cfg["project"]["urls"]["Repository"].startswith("https://")
    comfy = cfg["tool"]["comfy"]
    assert comfy["DisplayName"] == "H3 Turbo" and comfy["PublisherId"] and comfy["Icon"]


def _keys(path):
    with safe_open(path, "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}, f.metadata()


def test_fixture_model_layout(fixtures_dir):
    keys, _ = _keys(fixtures_dir["bf16"])
    blocks = {k.split(".")[1] for k in keys if k.startswith("blocks.")}
    refiner = {k.split(".")[2] for k in keys if k.startswith("token_refiner.blocks.")}
    assert len(blocks) == 50 and len(refiner) == 2
    assert keys["blocks.0.attn.qkv_proj.weight"] == ("BF16", (192, 64))
    assert keys["blocks.49.mlp.fc1.weight"] == ("BF16", (256, 64))
    assert keys["token_refiner.blocks.1.mlp.fc2.weight"] == ("BF16", (64, 128))
    assert keys["video_patch_proj.weight"] == ("F32", (64, 96))          # latents_dim 24 x patch 4
    assert keys["final_layer.audio_out.weight"] == ("F32", (32, 64))     # audio latents 32
    assert keys["condition_proj.weight"] == ("BF16", (64, 48))           # text_dim 48 != hidden 64


def test_fixture_nvfp4_layout(fixtures_dir):
    if "nvfp4" not in fixtures_dir:
        pytest.skip("comfy-kitchen not installed: NVFP4 fixture not generated")
    keys, _ = _keys(fixtures_dir["nvfp4"])
    quant = [k[: -len(".comfy_quant")] for k in keys if k.endswith(".comfy_quant")]
    assert len(quant) == 208
    p = "blocks.7.attn.qkv_proj"
    assert keys[p + ".weight"] == ("U8", (192, 32))
    assert keys[p + ".weight_scale"] == ("F8_E4M3", (256, 4))  # rows padded to 128, K/16 padded to 4
    assert keys[p + ".weight_scale_2"] == ("F32", ())
    assert "condition_proj.comfy_quant" not in keys and "time_embedder.proj_in.comfy_quant" not in keys


@pytest.mark.parametrize("name,scale", [("lora_4step", 1.0), ("lora_8step", 1 / 16)])
def test_fixture_lora_layout(fixtures_dir, name, scale):
    keys, meta = _keys(fixtures_dir[name])
    assert len(keys) == 624
    stems = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in keys}
    assert len(stems) == 208 and all(s.startswith("diffusion_model.") for s in stems)
    assert float(meta["training_scale"]) == scale
    with safe_open(fixtures_dir[name], "pt") as f:
        a = f.get_tensor("diffusion_model.blocks.3.attn.qkv_proj.lora_A.weight")
        b = f.get_tensor("diffusion_model.blocks.3.attn.qkv_proj.lora_B.weight")
        al = f.get_tensor("diffusion_model.blocks.3.attn.qkv_proj.alpha")
        al_o = f.get_tensor("diffusion_model.blocks.3.mlp.fc2.alpha")
    assert a.shape == (12, 64) and b.shape == (192, 12) and a.dtype == b.dtype == torch.bfloat16
    assert al.item() / 12 == pytest.approx(scale) and al_o.item() / 4 == pytest.approx(scale)
    # block-diagonal B: off-diagonal blocks exactly zero, diagonal blocks not
    for i in range(3):
        for j in range(3):
            blk = b[i * 64:(i + 1) * 64, j * 4:(j + 1) * 4]
            assert (blk.abs().sum() == 0) == (i != j)


def test_fixtures_are_deterministic(tmp_path):
    from h3_turbo.tools.fixtures import make_fixtures

    a = make_fixtures(str(tmp_path / "a"), nvfp4=False)
    b = make_fixtures(str(tmp_path / "b"), nvfp4=False)
    # the same bytes (the writer's metadata order is normalised), hence the same tensors and metadata
    for k in a:
        (ka, ma), (kb, mb) = _keys(a[k]), _keys(b[k])
        assert ka == kb and ma == mb, k
        assert Path(a[k]).read_bytes() == Path(b[k]).read_bytes(), k
        with safe_open(a[k], "pt") as fa, safe_open(b[k], "pt") as fb:
            for key in fa.keys():
                assert torch.equal(fa.get_tensor(key).reshape(-1).view(torch.uint8), fb.get_tensor(key).reshape(-1).view(torch.uint8)), key


@pytest.mark.comfyui
@pytest.mark.parametrize("unet", ["bf16", "nvfp4"])
def test_core_loaders_load_fixtures_fully(comfy, fixtures_dir, caplog, unet):
    """Core's UNETLoader detects the tiny H3 and LoraLoaderModelOnly loads every LoRA key."""
    if unet not in fixtures_dir:
        pytest.skip("comfy-kitchen not installed")
    import nodes

    name = os.path.basename(fixtures_dir[unet])
    (model,) = nodes.UNETLoader().load_unet(name, "default")
    dm = model.model.diffusion_model
    assert type(dm).__name__ == "MiniMaxH3Model" and len(dm.blocks) == 50
    with caplog.at_level(logging.WARNING):
        for lora in ("lora_4step", "lora_8step"):
            (patched,) = nodes.LoraLoaderModelOnly().load_lora_model_only(
                model, os.path.basename(fixtures_dir[lora]), 1.0)
            assert len(patched.patches) == 208
    assert "lora key not loaded" not in caplog.text


@pytest.mark.comfyui
def test_main_job_end_to_end(tmp_path):
    """README's main-job command, as a subprocess against the real ComfyUI."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "h3_turbo.demo", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "workflow execution:" in r.stdout and "total:" in r.stdout
    mp4 = list(out.rglob("*.mp4"))
    latents = list(out.rglob("*.latent"))
    assert mp4 and mp4[0].stat().st_size > 1000
    assert len(latents) == 2
    # the latents are real, finite samples of the tiny model
    from safetensors.torch import load_file

    for p in latents:
        t = load_file(str(p))["latent_tensor"]
        assert torch.isfinite(t).all() and t.float().std() > 0.01
