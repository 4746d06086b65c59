"""A style LoRA loaded by core (``LoraLoaderModelOnly`` merged, ``LoraLoaderBypassModelOnly``) beside
``H3TurboLoRA``, through the real ComfyUI on the CPU (small 2+1-block fixtures, H3 Turbo Sampler, 4 steps).

- ``compute=reference``: the pack's loader with both LoRAs samples bit-identically to core's ``UNETLoader`` with the
  same two nodes, and the style LoRA changes the sample (its effect, relative to the latent's largest value,
  > 1e-2: far from the bound 0 of bit-identity, so the comparison can fail);
- ``adaln=table`` with a style LoRA on the projections only: bit-identical to ``adaln=resident``;
- ``adaln=table`` with a style LoRA that also trains AdaLN / time-embedder keys: refused before sampling with an
  InputError naming the keys and ``adaln=resident`` (no weight pass, nothing written), for both loaders; the same
  loaded model then samples the projection-only LoRA; ``adaln=resident`` applies those keys (the sample differs
  from the projection-only LoRA's and core logs no "lora key not loaded").
- the fused fp8 block (its eager ops, the CPU route of its formulas) serves a block whose projections carry the style
  LoRA (merged: re-prepared patched weights; bypass: the wrapped projections run as modules) and the Turbo branch,
  within its bound of core's block, the style's effect >= 10x that error.
The kernel paths (``exact``, ``fp8`` resident and lean) are checked layer by layer under the Triton interpreter:
tests/test_style_lora_interp.py, run by :func:`test_style_lora_on_kernel_paths_interpreted`.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from corpus import av_prompt, write_small_fixtures  # noqa: E402  (tests/ is on sys.path)
from h3_turbo.harness import PromptFailed

pytestmark = pytest.mark.comfyui

SUB = "zz_style"
NODES = ["LoraLoaderModelOnly", "LoraLoaderBypassModelOnly"]
_N = [0]


@pytest.fixture(scope="module")
def style(comfy, tmp_path_factory):
    """The small fixtures plus two style LoRAs made for them (tools/style_lora.py): ``proj`` (the 12 block
    projections) and ``adaln`` (those + every AdaLN / time-embedder Linear); an AdaLN cache folder of its own."""
    from comfy.sd import load_diffusion_model
    from safetensors.torch import save_file

    from h3_turbo.tools import style_lora

    root = tmp_path_factory.mktemp("style_models")
    small = write_small_fixtures(str(root), SUB, str(tmp_path_factory.mktemp("style_src")))
    dm = load_diffusion_model(small["unet_bf16_path"]).model.diffusion_model
    out = dict(small)
    for kind in ("proj", "adaln"):
        sd = style_lora.for_model(dm, adaln=kind == "adaln", rel=0.5)
        name = f"{SUB}/style_{kind}.safetensors"
        save_file(sd, os.path.join(str(root), "loras", name))
        out[kind] = name
    comfy.add_models_dir(root)
    cache = tmp_path_factory.mktemp("style_adaln_cache")
    old = os.environ.get("H3_TURBO_ADALN_CACHE")
    os.environ["H3_TURBO_ADALN_CACHE"] = str(cache)
    yield out
    if old is None:
        os.environ.pop("H3_TURBO_ADALN_CACHE", None)
    else:
        os.environ["H3_TURBO_ADALN_CACHE"] = old


def _prompt(style, loader="ours", adaln="resident", lora=None, node="LoraLoaderModelOnly", turbo=True):
    """av_prompt (loader "1" -> H3TurboLoRA "2" -> H3 Turbo Sigmas/Sampler) with the style LoRA node "1s" between."""
    _N[0] += 1
    p = av_prompt(style["unet"], style["lora_4step"], tag=f"style{_N[0]}")
    if loader == "core":
        p["1"] = {"class_type": "UNETLoader", "inputs": {"unet_name": style["unet"], "weight_dtype": "default"}}
    else:
        p["1"]["inputs"].update(compute="reference", adaln=adaln)
    if lora is not None:
        p["1s"] = {"class_type": node, "inputs": {"model": ["1", 0], "lora_name": style[lora], "strength_model": 1.0}}
        p["2"]["inputs"]["model"] = ["1s", 0]
    if not turbo:
        p["2"]["inputs"]["turbo"] = "none"
    return p


def _run(comfy, prompt, fresh=True):
    if fresh:
        comfy.executor.reset()      # a fresh load (ComfyUI caches node outputs per inputs)
    v, a = comfy.run_latents(prompt, ("11", "12"))
    assert torch.isfinite(v).all() and torch.isfinite(a).all() and float(v.std()) > 0.1
    return v, a


def _eq(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("node", NODES)
def test_reference_style_beside_turbo_equals_core_loader(comfy, style, node):
    ours = _run(comfy, _prompt(style, lora="proj", node=node))
    core = _run(comfy, _prompt(style, loader="core", lora="proj", node=node))
    assert _eq(ours[0], core[0]) and _eq(ours[1], core[1])
    plain = _run(comfy, _prompt(style))
    assert _rel(ours[0], plain[0]) > 1e-2 and _rel(ours[1], plain[1]) > 1e-2     # the style LoRA did something


@pytest.mark.parametrize("node", NODES)
def test_table_with_projection_style_equals_resident(comfy, style, node):
    res = _run(comfy, _prompt(style, adaln="resident", lora="proj", node=node))
    tab = _run(comfy, _prompt(style, adaln="table", lora="proj", node=node))
    assert _eq(res[0], tab[0]) and _eq(res[1], tab[1])


@pytest.mark.parametrize("node", NODES)
def test_table_refuses_adaln_keys_before_sampling_and_resident_applies_them(comfy, style, node, caplog):
    from h3_turbo.runtime.adaln_memo import WEIGHT_READS

    WEIGHT_READS.clear()
    with pytest.raises(PromptFailed) as e:
        _run(comfy, _prompt(style, adaln="table", lora="adaln", node=node))
    msg = str(e.value)
    assert "adaln=table: a LoRA on this MODEL patches 5 AdaLN / time-embedder weights" in msg, msg
    assert "diffusion_model.blocks.0.adaln_proj.linear" in msg and "adaln=resident" in msg
    assert WEIGHT_READS.counts == {"passes": 0, "groups": 0, "cached": 0, "written": 0}
    # the same loaded model (the loader's cached output) still samples a LoRA without AdaLN keys, as resident does
    tab = _run(comfy, _prompt(style, adaln="table", lora="proj", node=node), fresh=False)
    res_proj = _run(comfy, _prompt(style, adaln="resident", lora="proj", node=node))
    assert _eq(tab[0], res_proj[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        res = _run(comfy, _prompt(style, adaln="resident", lora="adaln", node=node))
    assert "lora key not loaded" not in caplog.text and "NOT LOADED" not in caplog.text
    assert _rel(res[0], res_proj[0]) > 1e-3        # the AdaLN keys took effect on the resident model


def test_adaln_lora_keys_lists_merged_and_bypass_patches(comfy, style):
    """The key finder itself: merged patches, bypass adapters, strength 0 ignored; a table model exposes the AdaLN
    keys as 0-byte slots (its ComfyUI size is unchanged)."""
    import folder_paths
    from comfy.sd import load_bypass_lora_for_models, load_lora_for_models
    from comfy.utils import load_torch_file

    from h3_turbo.runtime import adaln_lora, loading

    path = folder_paths.get_full_path_or_raise("loras", style["adaln"])
    lora = load_torch_file(path, safe_load=True)
    unet = folder_paths.get_full_path_or_raise("diffusion_models", style["unet"])
    tab = loading.load_h3_model(unet, "reference", adaln="table")
    size = int(tab.model_size())
    assert adaln_lora.adaln_lora_keys(tab) == []
    merged = load_lora_for_models(tab, None, lora, 1.0, 0)[0]
    bypass = load_bypass_lora_for_models(tab, None, lora, 1.0, 0)[0]
    want = ["diffusion_model.blocks.0.adaln_proj.linear.weight", "diffusion_model.blocks.1.adaln_proj.linear.weight",
            "diffusion_model.final_layer.adaln_proj.linear.weight", "diffusion_model.time_embedder.proj_in.weight",
            "diffusion_model.time_embedder.proj_out.weight"]
    assert adaln_lora.adaln_lora_keys(merged) == want
    assert adaln_lora.adaln_lora_keys(bypass) == [k[:-len(".weight")] for k in want]
    assert adaln_lora.adaln_lora_keys(load_lora_for_models(tab, None, lora, 0.0, 0)[0]) == []
    assert int(tab.model_size()) == size and int(merged.model_size()) == size
    with pytest.raises(Exception, match="adaln=resident"):
        adaln_lora.refuse(merged, "adaln=table")


def test_style_lora_on_kernel_paths_interpreted():
    """tests/test_style_lora_interp.py in a fresh process with TRITON_INTERPRET=1 (set before triton is imported)."""
    pytest.importorskip("triton")
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.join(here, "test_style_lora_interp.py")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]


def _fused_case(comfy, style_files, style):
    """(block 1 of a fresh small NVFP4 load with the style LoRA (None / merged / bypass) and the Turbo branch, loaded
    by ComfyUI, on compute=fp8; its recorded bf16 arguments; the MODEL: ComfyUI unloads a model, removing its
    patches and wrappers, once its patcher is garbage-collected, so the caller keeps it)."""
    import comfy.model_management as mm
    import comfy.patcher_extension as pe
    import folder_paths
    from comfy.sd import load_bypass_lora_for_models, load_lora_for_models
    from comfy.utils import load_torch_file

    from h3_turbo.nodes.lora import H3TurboLoRA
    from h3_turbo.runtime.loading import load_h3_model
    from h3_turbo.runtime.ops import install_compute

    m = load_h3_model(folder_paths.get_full_path_or_raise("diffusion_models", style_files["unet"]), "reference")
    if style is not None:
        lora = load_torch_file(folder_paths.get_full_path_or_raise("loras", style_files["proj"]), safe_load=True)
        m = (load_lora_for_models if style == "merged" else load_bypass_lora_for_models)(m, None, lora, 1.0, 0)[0]
    m = H3TurboLoRA.execute(model=m, turbo=style_files["lora_4step"], strength=1.0).args[0]
    mm.load_models_gpu([m])
    install_compute(m, "fp8")
    rec = {}

    def recorder(args, extra):
        rec.setdefault("a", {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()})
        return extra["original_block"](args)

    to = pe.copy_nested_dicts(m.model_options.get("transformer_options", {}))    # (a clone's collection would
    to.setdefault("patches_replace", {}).setdefault("dit", {})[("double_block", 1)] = recorder   # eject m's wrappers)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.model.diffusion_model([torch.randn(1, 24, 7, 8, 8, generator=g), torch.randn(1, 32, 2, 5, generator=g)],
                                 torch.tensor([800.0]), torch.randn(1, 9, 48, generator=g), transformer_options=to)
    b = m.model.diffusion_model.blocks[1]
    for mod in (b.norm1, b.norm2, b.attn.q_norm, b.attn.k_norm, b.adaln_proj.linear):
        for _, p in mod.named_parameters(recurse=False):
            p.data = p.data.to(torch.bfloat16)
    a = rec["a"]
    return b, {"img": a["img"].to(torch.bfloat16), "t_emb": a["t_emb"].to(torch.bfloat16),
               "mod_segments": a["mod_segments"], "rope_freqs": a["rope_freqs"].to(torch.bfloat16),
               "transformer_options": {}}, m


_FUSED_INPUT: dict = {}


@pytest.mark.parametrize("node", NODES)
def test_fused_block_serves_the_style_lora_beside_turbo(comfy, style, node):
    """The fused fp8 block (its eager ops: the CPU route of the same formulas) on a block whose projections carry a
    core style LoRA (merged: patched NVFP4 weights, prepared again; bypass: wrapped forwards, run as modules) and the
    Turbo branch: it serves the call (no hand-over to core), its update is within the fused block's bound of core's
    block on the same patched layers (relative L2 of the update < 0.15, tests/test_fused.py), and the style LoRA
    changes the update by >= 10x that error."""
    from h3_turbo.kernels import fused as fk
    from h3_turbo.runtime import fused_block as fb

    style_kind = "merged" if node == "LoraLoaderModelOnly" else "bypass"

    def run(kind):       # loads a fresh model (ComfyUI unloads, and so unpatches, the previous one): run it at once
        b, a, m = _fused_case(comfy, style, kind)
        args = _FUSED_INPUT.setdefault("args", a)    # one block input for every case (block 0 differs by style)
        x = args["img"]
        with torch.no_grad():
            core = b(x.clone(), args["t_emb"], args["mod_segments"], args["rope_freqs"], transformer_options={})
            patch = fb.FusedBlockPatch(b, 1, ops=fk.EAGER, devices=("cpu",))
            fused = patch(dict(args, img=x.clone()), {"original_block": None})["img"]
        assert patch.calls == 1 and patch.delegated == 0, (patch.calls, patch.delegated, patch.routes)
        del m
        return core, fused, patch.routes

    if "none" not in _FUSED_INPUT:
        _FUSED_INPUT["none"] = run(None)
    core0, fused0, _ = _FUSED_INPUT["none"]
    core, fused, routes = run(style_kind)
    x = _FUSED_INPUT["args"]["img"]

    def upd(y, ref, x):
        d = ref.double() - x.double()
        return float(((y.double() - x.double()) - d).norm() / d.norm())

    err = upd(fused, core, x)
    effect = upd(core, core0, x)
    assert torch.isfinite(fused).all() and err < 0.15, (err, routes)
    assert effect >= 10 * err, (effect, err, routes)
    if style_kind == "bypass":
        assert routes.get("module", 0) >= 4, routes      # the wrapped projections ran their own forward


def test_fixed_adaln_tables_refuse_adaln_keys(comfy, style, tmp_path_factory):
    """The TurboH3 DMD loader with its release's AdaLN table, and a fixed table patched onto a resident model
    (``adaln.patch``): a LoRA on an AdaLN key is refused before sampling, naming the key and what to do."""
    import folder_paths
    import nodes
    from safetensors.torch import save_file

    from h3_turbo.tools.release import make_dmd_release

    from corpus import PatchTable, turbo_av_prompt

    root = tmp_path_factory.mktemp("style_dmd_models")
    rel = make_dmd_release(str(root / "diffusion_models" / "zz_style_dmd" / "TurboH3-tiny"), adaln_dtype="fp32")
    g = torch.Generator().manual_seed(0)
    os.makedirs(root / "loras", exist_ok=True)
    stem = "diffusion_model.blocks.0.adaln_proj.linear"
    save_file({f"{stem}.lora_A.weight": torch.randn(2, 8, generator=g).to(torch.bfloat16),
               f"{stem}.lora_B.weight": torch.randn(16, 2, generator=g).to(torch.bfloat16),
               f"{stem}.alpha": torch.tensor(2.0)}, str(root / "loras" / "zz_style_adaln_only.safetensors"))
    comfy.add_models_dir(root)
    nodes.NODE_CLASS_MAPPINGS["H3TurboTestStylePatchTable"] = PatchTable
    try:
        lora = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "strength_model": 1.0,
                                                                "lora_name": "zz_style_adaln_only.safetensors"}}
        p = {"1": {"class_type": "H3TurboDMDLoader", "inputs": {"model_name": "zz_style_dmd/TurboH3-tiny/",
                                                                "adaln": "auto", "compute": "reference"}},
             "2": lora, **turbo_av_prompt(["2", 0], prefixes=("h3t/sdmd_v", "h3t/sdmd_a"))}
        with pytest.raises(PromptFailed) as e:
            comfy.run(p)
        assert "a LoRA on this MODEL patches 1 AdaLN / time-embedder weights" in str(e.value), str(e.value)
        assert f"{stem}.weight" in str(e.value) and "adaln=none on Load TurboH3 DMD Model" in str(e.value)
        # a fixed table as object patches on a resident model (the pack's own test node; the table: a cache file
        # that adaln=table wrote for this model): refused as well
        before = {os.path.join(r, f) for r, _, fs in os.walk(os.environ["H3_TURBO_ADALN_CACHE"]) for f in fs}
        _run(comfy, _prompt(style, adaln="table", turbo=True))
        after = {os.path.join(r, f) for r, _, fs in os.walk(os.environ["H3_TURBO_ADALN_CACHE"]) for f in fs}
        table = sorted(after - before)[0] if after - before else sorted(after)[0]
        p = _prompt(style, adaln="resident")
        p["1t"] = {"class_type": "H3TurboTestStylePatchTable", "inputs": {"model": ["1", 0], "table": table}}
        p["1s"] = dict(lora, inputs=dict(lora["inputs"], model=["1t", 0]))
        p["2"]["inputs"]["model"] = ["1s", 0]
        with pytest.raises(PromptFailed, match="without the fixed AdaLN table") as e:
            comfy.run(p)
        assert f"{stem}.weight" in str(e.value)
    finally:
        nodes.NODE_CLASS_MAPPINGS.pop("H3TurboTestStylePatchTable", None)
    assert folder_paths.get_full_path("loras", "zz_style_adaln_only.safetensors")
