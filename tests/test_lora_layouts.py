"""Issue 18, item 8 (no ComfyUI): the LoRA layouts in the wild that diffusers' ``loaders/lora_conversion_utils.py``
converts are read EXACTLY into the canonical fused form: each layout of the same adapter gives the same A, B,
alpha and qkv split as the official ComfyUI-layout file, so the weight deltas are equal (bit for bit). Also:
DiffSynth-Studio's per-head interleaved qkv rows are de-interleaved (and a DiffSynth file without alpha is
refused), and every adapter tensor is value-checked (NaN, alpha <= 0). The graph-level twins of these tests
are in tests/test_reliability2.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import LAYOUT_CASES, _load, as_layout, interleave_qkv_rows  # noqa: E402

from h3_turbo.adapters import turbo_lora  # noqa: E402
from h3_turbo.errors import TurboLoRAError  # noqa: E402

HEAD_DIM = 32   # the tiny fixture's (tools/fixtures.py TinyH3Config)
STYLES = {"kohya": ("comfy", "kohya"), "lora_unet": ("comfy", "lora_unet"),
          "lora_unet_diffusers": ("diffusers", "lora_unet"), "diffusers_prefixed": ("diffusers", "diffusers"),
          "diffusers_model_prefixed": ("diffusers", "diffusers"), "diffsynth": ("diffsynth", "diffsynth")}


@pytest.fixture(scope="module")
def official(fixtures_dir):
    t, meta = _load(fixtures_dir["lora_4step"])
    return t, meta, turbo_lora.load_turbo_lora(fixtures_dir["lora_4step"])


def _save(tmp_path, name, tensors, meta):
    p = str(tmp_path / f"{name}.safetensors")
    save_file(tensors, p, metadata=meta or None)
    return p


def test_every_layout_case_has_an_expected_style():
    assert set(STYLES) == set(LAYOUT_CASES)


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_layout_converts_exactly(official, tmp_path, layout):
    t, meta, ref = official
    tt, mm = as_layout(t, meta, layout, HEAD_DIM)
    assert not {k for k in tt if not k.endswith(".alpha")} & set(t)   # really other A/B key names
    lora = turbo_lora.load_turbo_lora(_save(tmp_path, layout, tt, mm), head_dim=HEAD_DIM)
    assert (lora.layout, lora.key_style) == STYLES[layout]
    assert lora.targets.keys() == ref.targets.keys() and len(lora.targets) == 208
    for k, tl in lora.targets.items():
        r = ref.targets[k]
        assert torch.equal(tl.A, r.A) and torch.equal(tl.B, r.B), k
        assert (tl.alpha, tl.rank, tl.splits) == (r.alpha, r.rank, r.splits), k
        assert torch.equal(tl.delta_weight(), r.delta_weight()), k


def test_lora_unet_names_map_to_core_modules():
    """kohya / musubi flatten the module path with "_" although core's names hold "_" themselves: the mapping
    is by the known H3 module names, not by replacing every "_"."""
    cases = {"lora_unet_token_refiner_blocks_1_attn_qkv_proj.lora_down.weight":
             ("comfy", "token_refiner.blocks.1", "attn.qkv_proj", "A", "lora_unet"),
             "lora_unet_blocks_49_mlp_fc2.alpha": ("comfy", "blocks.49", "mlp.fc2", "alpha", "lora_unet"),
             "lora_unet_token_refiner_refiner_blocks_0_ff_net_0_proj.lora_up.weight":
             ("diffusers", "token_refiner.refiner_blocks.0", "ff.net.0.proj", "B", "lora_unet"),
             "diffusion_model.blocks.3.attn.out_proj.lora_up.weight":
             ("comfy", "blocks.3", "attn.out_proj", "B", "kohya"),
             "model.transformer_blocks.7.attn.to_v.lora_A.default.weight":
             ("diffusers", "transformer_blocks.7", "attn.to_v", "A", "diffusers"),
             "blocks.7.attn.qkv_proj.lora_B.default.weight": ("comfy", "blocks.7", "attn.qkv_proj", "B", "diffsynth")}
    for k, want in cases.items():
        assert turbo_lora.parse_key(k) == want, k
    assert turbo_lora.parse_key("lora_unet_blocks_3_adaln_proj_linear.lora_down.weight") is None


def test_deinterleave_is_the_inverse_of_the_raw_minimax_order():
    """Rows [h0: q k v, h1: q k v] -> [q_all; k_all; v_all]: row h*3*d + j*d + i goes to j*H*d + h*d + i."""
    H, d, r = 3, 4, 2
    raw = torch.arange(3 * H * d * r, dtype=torch.float32).reshape(3 * H * d, r)
    out = turbo_lora.deinterleave_qkv_rows(raw, d)
    for h in range(H):
        for j in range(3):
            for i in range(d):
                assert torch.equal(out[j * H * d + h * d + i], raw[h * 3 * d + j * d + i])
    assert torch.equal(turbo_lora.deinterleave_qkv_rows(interleave_qkv_rows(out, d), d), out)
    with pytest.raises(ValueError, match="not a multiple of 3 x head_dim 5"):
        turbo_lora.deinterleave_qkv_rows(raw, 5)


def test_diffsynth_read_as_contiguous_thirds_would_be_wrong(official, tmp_path):
    """The hazard: DiffSynth's interleaved rows taken as [Q; K; V] thirds put Q/K/V deltas on the wrong rows."""
    t, meta, ref = official
    tt, mm = as_layout(t, meta, "diffsynth", HEAD_DIM)
    B = tt["blocks.0.attn.qkv_proj.lora_B.default.weight"]
    assert not torch.equal(B, ref.targets["blocks.0.attn.qkv_proj"].B)
    lora = turbo_lora.load_turbo_lora(_save(tmp_path, "ds", tt, mm), head_dim=HEAD_DIM)
    assert torch.equal(lora.targets["blocks.0.attn.qkv_proj"].B, ref.targets["blocks.0.attn.qkv_proj"].B)
    assert lora.head_dim == HEAD_DIM and any("de-interleaved" in n for n in lora.notes)


def test_diffsynth_needs_the_head_size(official, tmp_path):
    t, meta, _ = official
    p = _save(tmp_path, "ds", *as_layout(t, meta, "diffsynth", HEAD_DIM))
    with pytest.raises(TurboLoRAError, match=r"DiffSynth-Studio layout .* interleaved per attention head; "
                                             r"de-interleaving them needs the model's head size"):
        turbo_lora.load_turbo_lora(p)


def test_diffsynth_without_alpha_is_refused_and_metadata_alpha_is_used(official, tmp_path):
    t, meta, ref = official
    ds, _ = as_layout(t, meta, "diffsynth", HEAD_DIM)
    noalpha = {k: v for k, v in ds.items() if not k.endswith(".alpha")}
    nts = {k: v for k, v in meta.items() if k != "training_scale"}
    with pytest.raises(TurboLoRAError) as ei:
        turbo_lora.load_turbo_lora(_save(tmp_path, "na", noalpha, nts), head_dim=HEAD_DIM)
    assert ("targets without alpha (DiffSynth-Studio layout: no alpha tensors and no __metadata__['alpha']; the "
            "alpha it was trained with is not in the file): 208 [blocks.0.attn.out_proj (missing alpha)") in str(ei.value)
    lora = turbo_lora.load_turbo_lora(_save(tmp_path, "ma", noalpha, dict(nts, alpha="4")), head_dim=HEAD_DIM)
    assert {tl.alpha for tl in lora.targets.values()} == {4.0}   # one alpha per module, as declared
    assert lora.targets["blocks.0.mlp.fc2"].scale == ref.targets["blocks.0.mlp.fc2"].scale


@pytest.mark.parametrize("case,change,want", [
    ("alpha_zero", {"diffusion_model.blocks.2.mlp.fc2.alpha": torch.tensor(0.0)},
     "alpha <= 0 (0 switches the target off, a negative alpha flips the sign of its delta; expected alpha > 0): "
     "1 [blocks.2.mlp.fc2: alpha 0]"),
    ("alpha_negative", {"diffusion_model.blocks.2.attn.qkv_proj.alpha": torch.tensor(-12.0)},
     "alpha <= 0 (0 switches the target off, a negative alpha flips the sign of its delta; expected alpha > 0): "
     "1 [blocks.2.attn.qkv_proj: alpha -12]"),
    ("alpha_inf", {"diffusion_model.blocks.2.mlp.fc1.alpha": torch.tensor(float("inf"))},
     "tensors with NaN or Inf values: 1 [diffusion_model.blocks.2.mlp.fc1.alpha: 0 NaN and 1 Inf values of 1 "
     "(expected finite values)]"),
])
def test_bad_alpha_is_refused_naming_the_target(official, tmp_path, case, change, want):
    t, meta, _ = official
    nts = {k: v for k, v in meta.items() if k != "training_scale"}
    with pytest.raises(TurboLoRAError) as ei:
        turbo_lora.load_turbo_lora(_save(tmp_path, case, dict(t, **change), nts))
    assert want in str(ei.value), str(ei.value)


def test_nan_in_lora_b_is_refused_naming_the_tensor(official, tmp_path):
    t, meta, _ = official
    b = t["diffusion_model.blocks.4.mlp.fc1.lora_B.weight"].clone()
    b[3, 1], b[0, 0] = float("nan"), float("-inf")
    with pytest.raises(TurboLoRAError) as ei:
        turbo_lora.load_turbo_lora(_save(tmp_path, "nan", dict(t, **{"diffusion_model.blocks.4.mlp.fc1.lora_B.weight": b}),
                                         meta))
    assert ("tensors with NaN or Inf values: 1 [diffusion_model.blocks.4.mlp.fc1.lora_B.weight: 1 NaN and 1 Inf "
            "values of 1024 (expected finite values)]") in str(ei.value)


def test_kohya_qkv_alphas_must_agree(official, tmp_path):
    t, meta, _ = official
    tt, mm = as_layout(t, meta, "lora_unet_diffusers", HEAD_DIM)
    tt["lora_unet_transformer_blocks_5_attn_to_k.alpha"] = torch.tensor(9.0)
    with pytest.raises(TurboLoRAError, match=r"q/k/v alphas that differ \(one fused qkv target needs one "
                                             r"alpha/rank\): 1 \[blocks.5.attn.qkv_proj: 4, 9, 4\]"):
        turbo_lora.load_turbo_lora(_save(tmp_path, "k", tt, mm))
