"""The bad-input corpus of issue 8, generated at test time from the tiny fixtures (no binaries committed).

``build_model_corpus(fixtures, out_dir)`` -> {case: path} of damaged / foreign diffusion-model files;
``build_adapter_corpus(fixtures, out_dir)`` -> {case: path} of Turbo LoRA files (bad ones and accepted
alternative layouts). Both are deterministic and idempotent (the same bytes every call), and memoized per
``out_dir`` so a pytest session builds them once. Container damage reuses ``h3_turbo.tools.variants.damage``.

``model_fingerprint(model_patcher)`` hashes everything a failed request could have changed on a loaded
model: every parameter and buffer (bytes, dtype, shape; NVFP4 ``QuantizedTensor`` by its packed data and
scales), and the patcher's ``patches``, ``object_patches``, ``model_options`` (wrappers, callbacks,
transformer options, the Turbo contract), the patcher's own ``wrappers`` / ``callbacks`` / ``injections`` /
``additional_models`` / ``attachments`` / hook state, and the ``forward`` overrides on modules.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch

MODEL_CASES = (
    "truncated", "lfs_pointer", "header_too_long", "trailing_bytes", "json_garbage",
    "scale_wrong_dtype", "global_scale_nan", "global_scale_inf", "global_scale_zero", "block_scale_nan",
    "missing_weight_scale", "wan_like", "bf16_shape_vs_config",
)
# BF16 files whose __metadata__["config"]["transformer"] (merged by core's detect_unet_config over the
# sizes read from the shapes) disagrees with the shapes / is a legitimate non-shape override
CONFIG_CASES = {"bf16_config_ffn": {"ffn_hidden_size": 192}, "bf16_config_layers": {"num_layers": 51},
                "bf16_config_shift": {"sigma_shift_video": 7.0}}
ADAPTER_BAD_CASES = ("missing_targets", "extra_adaln_proj", "extra_final_layer", "other_hidden", "alpha_missing",
                     "lora_b_missing", "alpha_vs_metadata")
ADAPTER_OK_CASES = ("bare_keys", "peft_default", "diffusers_twin", "diffusers_twin_fc1_swapped")
# issue 18: more layouts from the wild (diffusers ``loaders/lora_conversion_utils.py``), each the same adapter
# as the official-layout fixture, and bad values / a DiffSynth file without alpha
LAYOUT_CASES = ("kohya", "lora_unet", "lora_unet_diffusers", "diffusers_prefixed", "diffusers_model_prefixed",
                "diffsynth")
ADAPTER_BAD_VALUE_CASES = ("diffsynth_no_alpha", "alpha_zero", "alpha_negative", "lora_nan", "metadata_alpha_zero")

# the layer every value-damage case touches (an NVFP4 block projection of the tiny fixture)
DAMAGED_LAYER = "blocks.3.attn.out_proj"

_MEMO: dict[tuple[str, str], dict[str, str]] = {}


def _load(path):
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _save(sd, path, meta=None):
    from safetensors.torch import save_file

    save_file(sd, path, metadata=meta or None)
    return path


def build_model_corpus(fixtures: dict, out_dir: str) -> dict[str, str]:
    """Write one file per :data:`MODEL_CASES` into ``out_dir`` (from the NVFP4 / BF16 fixtures)."""
    key = ("model", os.path.abspath(out_dir))
    if key in _MEMO:
        return dict(_MEMO[key])
    from h3_turbo.tools.variants import damage

    os.makedirs(out_dir, exist_ok=True)
    p = lambda n: os.path.join(out_dir, f"{n}.safetensors")  # noqa: E731
    out = {}
    for kind in ("truncated", "lfs_pointer", "header_too_long", "trailing_bytes", "json_garbage"):
        out[kind] = damage(fixtures["nvfp4"], kind, p(kind))
    sd, meta = _load(fixtures["nvfp4"])
    L = DAMAGED_LAYER

    def variant(name, **changes):
        d = dict(sd)
        for k, v in changes.items():
            k = k.replace("__", ".")
            if v is None:
                d.pop(f"{L}.{k}")
            else:
                d[f"{L}.{k}"] = v
        out[name] = _save(d, p(name), meta)

    variant("scale_wrong_dtype", weight_scale=sd[f"{L}.weight_scale"].float())          # F32 block scales
    variant("global_scale_nan", weight_scale_2=torch.tensor(float("nan")))
    variant("global_scale_inf", weight_scale_2=torch.tensor(float("inf")))
    variant("global_scale_zero", weight_scale_2=torch.tensor(0.0))
    bs = sd[f"{L}.weight_scale"].view(torch.uint8).clone()
    bs[0, 0] = 0x7F                                                                          # e4m3 NaN byte
    variant("block_scale_nan", weight_scale=bs.view(torch.float8_e4m3fn))
    variant("missing_weight_scale", weight_scale=None)
    # a Wan 2.x-like key set (small tensors, real Wan names)
    g = torch.Generator().manual_seed(5)
    wan = {"patch_embedding.weight": torch.randn(64, 16, 1, 2, 2, generator=g).to(torch.bfloat16),
           "text_embedding.0.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
           "time_embedding.0.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
           "head.head.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16)}
    for i in range(2):
        for m in ("self_attn", "cross_attn"):
            for q in ("q", "k", "v", "o"):
                wan[f"blocks.{i}.{m}.{q}.weight"] = torch.randn(64, 64, generator=g).to(torch.bfloat16)
        wan[f"blocks.{i}.ffn.0.weight"] = torch.randn(128, 64, generator=g).to(torch.bfloat16)
        wan[f"blocks.{i}.ffn.2.weight"] = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    out["wan_like"] = _save(wan, p("wan_like"), {"model_type": "t2v"})
    # BF16: __metadata__ declares the fixture config (ffn 128), block 7's fc1 is [2*192, 64]
    bsd, bmeta = _load(fixtures["bf16"])
    cfg = json.loads(bmeta["h3_turbo_fixture"])
    assert cfg["ffn"] == 128
    bsd["blocks.7.mlp.fc1.weight"] = torch.zeros(2 * 192, cfg["hidden"], dtype=torch.bfloat16)
    out["bf16_shape_vs_config"] = _save(bsd, p("bf16_shape_vs_config"), bmeta)
    assert set(out) == set(MODEL_CASES)
    bsd, bmeta = _load(fixtures["bf16"])
    for name, tr in CONFIG_CASES.items():
        out[name] = _save(bsd, p(name), dict(bmeta, config=json.dumps({"transformer": tr})))
    _MEMO[key] = out
    return dict(out)


def _diffusers_twin(t: dict, swap_fc1: bool = False) -> dict:
    """The ComfyUI-layout fixture adapter re-expressed as the Diffusers/PEFT twin (split q/k/v, fc1 rows
    [up; gate]); ``swap_fc1`` keeps ComfyUI's [gate; up] order instead (the mistake a converter makes)."""
    out = {}
    for k, v in t.items():
        if not k.endswith("lora_A.weight"):
            continue
        stem = k[len("diffusion_model."):-len(".lora_A.weight")]
        sep = ".attn." if ".attn." in stem else ".mlp."
        blk, name = stem.split(sep)
        proj = sep[1:] + name
        if blk.startswith("token_refiner.blocks."):
            dblk = blk.replace("token_refiner.blocks.", "token_refiner.refiner_blocks.")
        else:
            dblk = blk.replace("blocks.", "transformer_blocks.")
        A, B = v, t[f"diffusion_model.{stem}.lora_B.weight"]
        if proj == "attn.qkv_proj":
            r, o = A.shape[0] // 3, B.shape[0] // 3
            for j, n in enumerate(("to_q", "to_k", "to_v")):
                out[f"{dblk}.attn.{n}.lora_A.weight"] = A[j * r:(j + 1) * r].contiguous()
                out[f"{dblk}.attn.{n}.lora_B.weight"] = B[j * o:(j + 1) * o, j * r:(j + 1) * r].contiguous()
            continue
        name = {"attn.out_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2"}[proj]
        if proj == "mlp.fc1" and not swap_fc1:
            h = B.shape[0] // 2
            B = torch.cat([B[h:], B[:h]], 0)
        out[f"{dblk}.{name}.lora_A.weight"] = A.contiguous()
        out[f"{dblk}.{name}.lora_B.weight"] = B.contiguous()
    return out


def interleave_qkv_rows(B: torch.Tensor, head_dim: int) -> torch.Tensor:
    """core's qkv rows [q_all; k_all; v_all] -> per head [h0: q k v, h1: q k v, ...] (the raw MiniMax order a
    DiffSynth-Studio LoRA is trained in); the inverse of ``turbo_lora.deinterleave_qkv_rows``."""
    n = B.shape[0]
    return B.reshape(3, n // (3 * head_dim), head_dim, *B.shape[1:]).transpose(0, 1).reshape(B.shape).contiguous()


def as_layout(t: dict, meta: dict, layout: str, head_dim: int = 32) -> tuple[dict, dict]:
    """The official-layout adapter ``t`` (``diffusion_model.<target>.{lora_A.weight, lora_B.weight, alpha}``)
    written in another layout: ``kohya`` (``lora_down`` / ``lora_up``, dotted names), ``lora_unet`` (kohya /
    musubi ``lora_unet_blocks_N_attn_qkv_proj.*``), ``lora_unet_diffusers`` (the same on Diffusers module names,
    per-module alpha = fused alpha / 3 for q/k/v), ``diffusers_prefixed`` / ``diffusers_model_prefixed`` (the
    Diffusers twin under ``diffusion_model.`` / ``model.``), ``diffsynth`` (core's names with ``.default.``,
    qkv B rows interleaved per head, alpha tensors kept). Returns (tensors, metadata)."""
    part = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight", "alpha": "alpha"}
    out: dict = {}
    if layout in ("kohya", "lora_unet"):
        for k, v in t.items():
            suffix = next(s for s in part if k.endswith("." + s))
            stem = k[len("diffusion_model."):-len(suffix) - 1]
            name = f"diffusion_model.{stem}" if layout == "kohya" else "lora_unet_" + stem.replace(".", "_")
            out[f"{name}.{part[suffix]}"] = v
        return out, meta
    if layout == "diffsynth":
        for k, v in t.items():
            if k.endswith("attn.qkv_proj.lora_B.weight"):
                v = interleave_qkv_rows(v, head_dim)
            k = k[len("diffusion_model."):].replace(".lora_A.weight", ".lora_A.default.weight").replace(
                ".lora_B.weight", ".lora_B.default.weight")
            out[k] = v
        return out, meta
    twin = _diffusers_twin(t)
    dmeta = dict(meta, alpha=str(float(t["diffusion_model.blocks.0.mlp.fc2.alpha"])))
    if layout in ("diffusers_prefixed", "diffusers_model_prefixed"):
        pfx = "diffusion_model." if layout == "diffusers_prefixed" else "model."
        return {pfx + k: v for k, v in twin.items()}, dmeta
    assert layout == "lora_unet_diffusers", layout
    for k, v in twin.items():
        suffix = "lora_A.weight" if k.endswith("lora_A.weight") else "lora_B.weight"
        stem = k[:-len(suffix) - 1]
        name = "lora_unet_" + stem.replace(".", "_")
        out[f"{name}.{part[suffix]}"] = v
        if suffix == "lora_A.weight":
            comfy = stem.replace("transformer_blocks.", "blocks.").replace("token_refiner.refiner_blocks.",
                                                                           "token_refiner.blocks.")
            for d, c in ((".attn.to_q", ".attn.qkv_proj"), (".attn.to_k", ".attn.qkv_proj"),
                         (".attn.to_v", ".attn.qkv_proj"), (".attn.to_out.0", ".attn.out_proj"),
                         (".ff.net.0.proj", ".mlp.fc1"), (".ff.net.2", ".mlp.fc2")):
                if comfy.endswith(d):
                    comfy = comfy[:-len(d)] + c
                    break
            a = t[f"diffusion_model.{comfy}.alpha"]
            out[f"{name}.alpha"] = a / 3 if comfy.endswith("qkv_proj") else a
    return out, {k: v for k, v in meta.items() if k != "alpha"}


def build_adapter_corpus(fixtures: dict, out_dir: str) -> dict[str, str]:
    """Write one Turbo LoRA per :data:`ADAPTER_BAD_CASES` + :data:`ADAPTER_OK_CASES` (from the 4-step fixture)."""
    key = ("adapter", os.path.abspath(out_dir))
    if key in _MEMO:
        return dict(_MEMO[key])
    import dataclasses

    from h3_turbo.tools.fixtures import TinyH3Config, make_turbo_lora

    os.makedirs(out_dir, exist_ok=True)
    p = lambda n: os.path.join(out_dir, f"{n}.safetensors")  # noqa: E731
    t, meta = _load(fixtures["lora_4step"])
    out = {}
    out["missing_targets"] = _save({k: v for k, v in t.items() if not k.startswith("diffusion_model.blocks.1.")},
                                   p("missing_targets"), meta)
    ad = dict(t)
    ad["diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight"] = torch.zeros(4, 32, dtype=torch.bfloat16)
    ad["diffusion_model.blocks.0.adaln_proj.linear.lora_B.weight"] = torch.zeros(1152, 4, dtype=torch.bfloat16)
    ad["diffusion_model.blocks.0.adaln_proj.linear.alpha"] = torch.tensor(4.0)
    out["extra_adaln_proj"] = _save(ad, p("extra_adaln_proj"), meta)
    fl = dict(t)
    fl["diffusion_model.final_layer.video_out.lora_A.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)
    fl["diffusion_model.final_layer.video_out.lora_B.weight"] = torch.zeros(96, 4, dtype=torch.bfloat16)
    out["extra_final_layer"] = _save(fl, p("extra_final_layer"), meta)
    wide, wmeta = make_turbo_lora({}, dataclasses.replace(TinyH3Config(), hidden=96), alpha_over_rank=1.0, nfe=4)
    out["other_hidden"] = _save(wide, p("other_hidden"), wmeta)
    out["alpha_missing"] = _save({k: v for k, v in t.items() if k != "diffusion_model.blocks.0.mlp.fc1.alpha"},
                                 p("alpha_missing"), meta)
    out["lora_b_missing"] = _save({k: v for k, v in t.items() if k != "diffusion_model.blocks.1.mlp.fc2.lora_B.weight"},
                                  p("lora_b_missing"), meta)
    dis = dict(t)
    dis["diffusion_model.blocks.1.attn.out_proj.alpha"] = torch.tensor(1.0)   # alpha/rank 0.25, metadata says 1
    out["alpha_vs_metadata"] = _save(dis, p("alpha_vs_metadata"), meta)
    # accepted layouts
    out["bare_keys"] = _save({k[len("diffusion_model."):]: v for k, v in t.items()}, p("bare_keys"), meta)
    # core's names with the PEFT .default. infix = DiffSynth-Studio: qkv rows interleaved per head (issue 18)
    out["peft_default"] = _save(as_layout(t, meta, "diffsynth")[0], p("peft_default"), meta)
    dmeta = dict(meta, alpha=str(4.0))  # per-projection alpha r=4 -> alpha/rank 1 (the 4-step fixture)
    out["diffusers_twin"] = _save(_diffusers_twin(t), p("diffusers_twin"), dmeta)
    out["diffusers_twin_fc1_swapped"] = _save(_diffusers_twin(t, swap_fc1=True), p("diffusers_twin_fc1_swapped"), dmeta)
    for case in LAYOUT_CASES:
        lt, lm = as_layout(t, meta, case)
        out[case] = _save(lt, p(case), lm)
    ds, _ = as_layout(t, meta, "diffsynth")
    out["diffsynth_no_alpha"] = _save({k: v for k, v in ds.items() if not k.endswith(".alpha")},
                                      p("diffsynth_no_alpha"), {k: v for k, v in meta.items() if k != "training_scale"})
    nts = {k: v for k, v in meta.items() if k != "training_scale"}   # so that only the alpha check speaks
    out["alpha_zero"] = _save(dict(t, **{"diffusion_model.blocks.1.mlp.fc2.alpha": torch.tensor(0.0)}),
                              p("alpha_zero"), nts)
    out["alpha_negative"] = _save(dict(t, **{"diffusion_model.blocks.1.attn.qkv_proj.alpha": torch.tensor(-12.0)}),
                                  p("alpha_negative"), nts)
    nan_b = t["diffusion_model.blocks.1.mlp.fc1.lora_B.weight"].clone()
    nan_b[3, 1] = float("nan")
    out["lora_nan"] = _save(dict(t, **{"diffusion_model.blocks.1.mlp.fc1.lora_B.weight": nan_b}), p("lora_nan"), meta)
    out["metadata_alpha_zero"] = _save(_diffusers_twin(t), p("metadata_alpha_zero"), dict(nts, alpha="0"))
    assert set(out) == set(ADAPTER_BAD_CASES) | set(ADAPTER_OK_CASES) | set(LAYOUT_CASES) | set(ADAPTER_BAD_VALUE_CASES)
    _MEMO[key] = out
    return dict(out)


def av_prompt(unet: str, turbo: str, steps=0, length=5, seed=42, tag="rel", sample=True) -> dict:
    """API prompt: H3TurboNVFP4Loader -> H3TurboLoRA -> test conditioning -> BasicGuider, H3TurboSigmas,
    H3TurboSampler, EmptyMiniMaxH3LatentAV 64x64 -> SamplerCustomAdvanced -> SaveLatent (video "11",
    audio "12"). ``sample=False``: loader -> LoRA -> Sigmas -> PreviewAny only (no model evaluation)."""
    p = {
        "1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": unet, "compute": "auto"}},
        "2": {"class_type": "H3TurboLoRA", "inputs": {"model": ["1", 0], "turbo": turbo, "strength": 1.0}},
        "5": {"class_type": "H3TurboSigmas", "inputs": {"model": ["2", 0], "steps": steps}},
    }
    if not sample:
        p["20"] = {"class_type": "PreviewAny", "inputs": {"source": ["5", 0]}}
        return p
    p.update({
        "3": {"class_type": "H3TurboTestConditioning", "inputs": {"model": ["2", 0], "seed": 0, "tokens": 16}},
        "4": {"class_type": "BasicGuider", "inputs": {"model": ["2", 0], "conditioning": ["3", 0]}},
        "6": {"class_type": "H3TurboSampler", "inputs": {"state_dtype": "fp32"}},
        "7": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "8": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": length}},
        "9": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["7", 0], "guider": ["4", 0],
                                                                "sampler": ["6", 0], "sigmas": ["5", 0],
                                                                "latent_image": ["8", 0]}},
        "10": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["9", 0]}},
        "11": {"class_type": "SaveLatent", "inputs": {"samples": ["10", 0], "filename_prefix": f"h3rel/{tag}_v"}},
        "12": {"class_type": "SaveLatent", "inputs": {"samples": ["10", 1], "filename_prefix": f"h3rel/{tag}_a"}},
    })
    return p


def euler_av_prompt(model: list, *, steps: int = 1, shifts=(6.0, 3.0), tokens: int = 8, size=(64, 64, 5),
                    prefixes=("h3t/x_v", "h3t/x_a")) -> dict:
    """API prompt nodes "3".."13" of the plain core graph: MiniMaxH3SigmaShift on ``model`` (a link such as
    ``["2", 0]``) -> H3TurboTestConditioning (seed 0, ``tokens``), BasicGuider, BasicScheduler simple
    (``steps``), euler, RandomNoise 42, EmptyMiniMaxH3LatentAV (width, height, length = ``size``) ->
    SamplerCustomAdvanced -> LTXVSeparateAVLatent -> SaveLatent video "12" / audio "13" (``prefixes``).
    The caller adds the model nodes ("1", "2", ...)."""
    w, h, length = size
    return {
        "3": {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": model, "shift_video": shifts[0],
                                                              "shift_audio": shifts[1]}},
        "4": {"class_type": "H3TurboTestConditioning", "inputs": {"model": ["3", 0], "seed": 0, "tokens": tokens}},
        "5": {"class_type": "BasicGuider", "inputs": {"model": ["3", 0], "conditioning": ["4", 0]}},
        "6": {"class_type": "BasicScheduler", "inputs": {"model": ["3", 0], "scheduler": "simple", "steps": steps,
                                                         "denoise": 1.0}},
        "7": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "8": {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}},
        "9": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": w, "height": h, "length": length}},
        "10": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["8", 0], "guider": ["5", 0],
                                                                 "sampler": ["7", 0], "sigmas": ["6", 0],
                                                                 "latent_image": ["9", 0]}},
        "11": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["10", 0]}},
        "12": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": prefixes[0]}},
        "13": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 1], "filename_prefix": prefixes[1]}},
    }


SMALL_LAYERS = (2, 1)  # DiT blocks, refiner blocks of the small sampling fixture


def write_small_fixtures(models_root: str, sub: str, work_dir: str) -> dict[str, str]:
    """The tiny fixtures at depth 2+1 (same widths and latent sizes; 12 adapter targets), ~10x faster to sample,
    written as ``<models_root>/diffusion_models/<sub>/h3rel_small_{nvfp4,bf16}.safetensors`` and
    ``<models_root>/loras/<sub>/h3rel_small_turbo_{4,8}step.safetensors``. Returns {"unet", "unet_bf16",
    "lora_4step", "lora_8step"}: names as ComfyUI lists them (``<sub>/<file>``), plus the same keys + "_path"."""
    import dataclasses

    from h3_turbo.tools.fixtures import TinyH3Config, make_fixtures

    src = make_fixtures(work_dir, dataclasses.replace(TinyH3Config(), num_layers=SMALL_LAYERS[0],
                                                      refiner_layers=SMALL_LAYERS[1]))
    out = {}
    for key, folder, name in (("unet", "diffusion_models", "h3rel_small_nvfp4.safetensors"),
                              ("unet_bf16", "diffusion_models", "h3rel_small_bf16.safetensors"),
                              ("lora_4step", "loras", "h3rel_small_turbo_4step.safetensors"),
                              ("lora_8step", "loras", "h3rel_small_turbo_8step.safetensors")):
        d = os.path.join(models_root, folder, sub)
        os.makedirs(d, exist_ok=True)
        shutil.copy(src[{"unet": "nvfp4", "unet_bf16": "bf16"}.get(key, key)], os.path.join(d, name))
        out[key] = f"{sub}/{name}"
        out[key + "_path"] = os.path.join(d, name)
    return out


def copy_into(paths: dict[str, str], folder: str) -> dict[str, str]:
    """Copy corpus files into ``folder`` (e.g. a server's models/loras/zz_rel); returns {case: new path}."""
    os.makedirs(folder, exist_ok=True)
    res = {}
    for k, src in paths.items():
        dst = os.path.join(folder, os.path.basename(src))
        if not os.path.exists(dst):
            shutil.copy(src, dst)
        res[k] = dst
    return res


# ----------------------------------------------------------------------------------------------- fingerprint
def _hash_tensor(h, t) -> None:
    try:
        from comfy.quant_ops import QuantizedTensor
    except ImportError:  # pragma: no cover
        QuantizedTensor = ()
    if isinstance(t, torch.nn.Parameter):
        t = t.data
    if QuantizedTensor and isinstance(t, QuantizedTensor):
        h.update(b"Q" + type(t._params).__name__.encode())
        _hash_tensor(h, t._qdata)
        for k, v in sorted(vars(t._params).items()):
            h.update(k.encode())
            if isinstance(v, torch.Tensor):
                _hash_tensor(h, v)
            else:
                h.update(repr(v).encode())
        return
    t = t.detach()
    h.update(f"{t.dtype}{tuple(t.shape)}{t.device.type}".encode())
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())


def _hash_obj(h, o, depth=0) -> None:
    """Structural hash: dicts/lists recursively, tensors by bytes, callables by qualified name + identity of
    the bound object / closure cells (a new wrapper or a changed closure changes the hash)."""
    if depth > 12:
        h.update(b"<deep>")
        return
    if isinstance(o, torch.Tensor):
        _hash_tensor(h, o)
    elif isinstance(o, dict):
        h.update(b"{")
        for k in sorted(o, key=repr):
            h.update(repr(k).encode())
            _hash_obj(h, o[k], depth + 1)
        h.update(b"}")
    elif isinstance(o, (list, tuple)):
        h.update(b"[")
        for v in o:
            _hash_obj(h, v, depth + 1)
        h.update(b"]")
    elif isinstance(o, (str, int, float, bool, type(None))):
        h.update(repr(o).encode())
    elif callable(o):
        h.update(f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', type(o).__name__)}@{id(o)}".encode())
    else:
        d = getattr(o, "__dict__", None)
        h.update(f"<{type(o).__module__}.{type(o).__qualname__}@{id(o)}>".encode())
        if isinstance(d, dict) and depth < 3:
            _hash_obj(h, {k: v for k, v in d.items() if not isinstance(v, torch.nn.Module)}, depth + 1)


# ModelPatcher state that ``clone()`` carries over (comfy/model_patcher.py, 2026-08), minus load-time state
PATCHER_ATTRS = ("patches", "patches_uuid", "object_patches", "weight_wrapper_patches", "model_options", "wrappers",
                 "callbacks", "injections", "skip_injection", "additional_models", "attachments", "hook_patches",
                 "hook_patches_backup", "cached_hook_patches", "current_hooks", "forced_hooks", "hook_mode",
                 "force_cast_weights", "cached_patcher_init", "weight_inplace_update", "load_device", "offload_device")


def model_fingerprint(model_patcher) -> str:
    """SHA-256 over a ModelPatcher's model parameters/buffers and its patch state (see module doc).

    Parts: ``params`` (every ``named_parameters`` / ``named_buffers`` tensor of ``model_patcher.model``), one
    per :data:`PATCHER_ATTRS` (patches, object_patches, model_options, the patcher's own wrappers / callbacks /
    injections / additional_models / attachments, hook state...), and ``forward_overrides`` (modules
    carrying an instance ``forward``, i.e. injected code).
    Use :func:`fingerprint_parts` to see which part changed.
    """
    return hashlib.sha256(json.dumps(fingerprint_parts(model_patcher), sort_keys=True).encode()).hexdigest()


def fingerprint_parts(model_patcher) -> dict[str, str]:
    parts = {}
    h = hashlib.sha256()
    m = model_patcher.model
    for name, t in list(m.named_parameters(recurse=True)) + list(m.named_buffers(recurse=True)):
        h.update(name.encode())
        _hash_tensor(h, t)
    parts["params"] = h.hexdigest()
    for attr in PATCHER_ATTRS:
        h = hashlib.sha256()
        _hash_obj(h, getattr(model_patcher, attr, None))
        parts[attr] = h.hexdigest()
    h = hashlib.sha256()
    for name, mod in m.named_modules():
        if "forward" in mod.__dict__:
            h.update(f"{name}:{mod.__dict__['forward']!r}".encode())
    parts["forward_overrides"] = h.hexdigest()
    return parts


# ----------------------------------------------------------------------------------------------- issue 18
#: model files of issue 18: bad values anywhere (item 3), missing blocks (item 5), newer-core variants (item 11)
MODEL_CASES_2 = ("bf16_nan_projection", "bf16_inf_output_head", "nvfp4_nan_output_bias", "depth_49", "depth_25",
                 "block_hole", "pdd_heads")


def build_model_corpus_2(fixtures: dict, out_dir: str) -> dict[str, str]:
    """One file per :data:`MODEL_CASES_2` into ``out_dir`` (from the 50+2-block BF16 / NVFP4 fixtures)."""
    key = ("model2", os.path.abspath(out_dir))
    if key in _MEMO:
        return dict(_MEMO[key])
    os.makedirs(out_dir, exist_ok=True)
    p = lambda n: os.path.join(out_dir, f"{n}.safetensors")  # noqa: E731
    bf, bmeta = _load(fixtures["bf16"])
    nv, nmeta = _load(fixtures["nvfp4"])
    out = {}

    def put(name, base, meta, **set_):
        d = dict(base)
        for k, v in set_.items():
            d[k.replace("__", ".")] = v
        out[name] = _save(d, p(name), meta)

    w = bf["blocks.3.attn.out_proj.weight"].clone()
    w[0, 0] = float("nan")
    put("bf16_nan_projection", bf, bmeta, blocks__3__attn__out_proj__weight=w)
    w = bf["final_layer.video_out.weight"].clone()
    w[1, 2] = float("inf")
    put("bf16_inf_output_head", bf, bmeta, final_layer__video_out__weight=w)
    b = nv["final_layer.audio_out.bias"].clone()
    b[5] = float("nan")
    put("nvfp4_nan_output_bias", nv, nmeta, final_layer__audio_out__bias=b)
    for name, gone in (("depth_49", range(49, 50)), ("depth_25", range(25, 50)), ("block_hole", range(10, 11))):
        drop = tuple(f"blocks.{i}." for i in gone)
        out[name] = _save({k: v for k, v in nv.items() if not k.startswith(drop)}, p(name), nmeta)
    pdd = dict(bf)
    for head in ("video_out", "audio_out"):   # a bank of 2 heads: rows [head 0; head 1 - head 0]
        for s in ("weight", "bias"):
            t = bf[f"final_layer.{head}.{s}"]
            pdd[f"final_layer.{head}.{s}"] = torch.cat([t, t * 0.01], 0)
    out["pdd_heads"] = _save(pdd, p("pdd_heads"), bmeta)
    assert set(out) == set(MODEL_CASES_2)
    _MEMO[key] = out
    return dict(out)


def with_vsa_gates(src: str, dst: str) -> str:
    """``src`` plus an ``attn.to_gate_compress.weight`` [inner, hidden] bf16 on every DiT block (FastVideo's VSA
    gate, which core's dense forward ignores)."""
    sd, meta = _load(src)
    g = torch.Generator().manual_seed(18)
    for k in [k for k in sd if k.endswith(".attn.qkv_proj.weight") and k.startswith("blocks.")]:
        hidden, inner = sd[k.replace("qkv_proj", "out_proj")].shape     # a bf16 file: out_proj [hidden, inner]
        gate = torch.randn(inner, hidden, generator=g) * 0.02
        sd[k.replace("qkv_proj", "to_gate_compress")] = gate.to(torch.bfloat16)
    return _save(sd, dst, meta)


def model_node(mutate, doc: str, inputs: dict | None = None, name: str = "H3TurboTestNode"):
    """A test-only ComfyUI node class: MODEL (+ the widget ``inputs``) -> ``mutate(clone, **values)`` applied to a
    clone of the MODEL, which it returns (the shape of every test node that patches a MODEL)."""
    extra = dict(inputs or {})

    class Node:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"model": ("MODEL",), **extra}}

        RETURN_TYPES = ("MODEL",)
        FUNCTION = "go"
        CATEGORY = "h3_turbo_tests"

        def go(self, model, **values):
            m = model.clone()
            mutate(m, **values)
            return (m,)

    Node.__doc__ = doc
    Node.__name__ = Node.__qualname__ = name
    return Node


def _patch_table(m, table):
    from h3_turbo.runtime import adaln

    adaln.patch(m, adaln.read_table(table))


PatchTable = model_node(_patch_table, "Test-only ComfyUI node: put a fixed AdaLN table on a clone of an H3 MODEL "
                        "(``runtime/adaln.py`` ``patch``).", {"table": ("STRING", {"default": ""})}, "PatchTable")


def turbo_av_prompt(model: list, *, update: str = "auto", seed: int = 42, tokens: int = 8, size=(64, 64, 5),
                    prefixes=("h3t/x_v", "h3t/x_a")) -> dict:
    """API prompt nodes "4".."13" of the Turbo graph on ``model`` (a link such as ``["1", 0]``):
    H3TurboTestConditioning (seed 0, ``tokens``), BasicGuider, H3TurboSigmas (steps 0: the contract's),
    H3TurboSampler (fp32 states, ``update``), RandomNoise ``seed``, EmptyMiniMaxH3LatentAV (``size``) ->
    SamplerCustomAdvanced -> LTXVSeparateAVLatent -> SaveLatent video "12" / audio "13" (``prefixes``)."""
    w, h, length = size
    return {
        "4": {"class_type": "H3TurboTestConditioning", "inputs": {"model": model, "seed": 0, "tokens": tokens}},
        "5": {"class_type": "BasicGuider", "inputs": {"model": model, "conditioning": ["4", 0]}},
        "6": {"class_type": "H3TurboSigmas", "inputs": {"model": model, "steps": 0}},
        "7": {"class_type": "H3TurboSampler", "inputs": {"state_dtype": "fp32", "update": update}},
        "8": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "9": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": w, "height": h, "length": length}},
        "10": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["8", 0], "guider": ["5", 0],
                                                                 "sampler": ["7", 0], "sigmas": ["6", 0],
                                                                 "latent_image": ["9", 0]}},
        "11": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["10", 0]}},
        "12": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": prefixes[0]}},
        "13": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 1], "filename_prefix": prefixes[1]}},
    }
