"""Issue 16 through the real ComfyUI (CPU): a tiny TurboH3 DMD release written by the fixture code in exact
Diffusers naming (3 shards + index + config), exported to W8A8 by the pack's exporter, with an AdaLN table and a
manifest, verified by ``verify-release``, loaded by ``H3TurboDMDLoader`` (BF16 and W8A8) and sampled with the DMD
contract (4 updates, 12/3) with both update rules.

- the BF16 DMD load samples bit-identically to the same weights in core naming through core's ``UNETLoader``;
- table-driven AdaLN = weight-driven AdaLN, bit for bit (every forward found its timestep group: no composition);
- W8A8 (int8 and reference) samples stay close to BF16; re-noise reproduces with its seed and differs from Euler;
- ``H3TurboLoRA`` refuses the DMD model; a W8A8 load without a table is refused naming the file.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

from h3_turbo.adapters import contracts

from corpus import PatchTable, model_node, turbo_av_prompt  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.comfyui

SUB = "h3t_dmd"


_AttachDMD = model_node(lambda m: contracts.attach(m, contracts.TURBOH3_DMD),
                        "Test-only: attach the TurboH3 DMD contract to a core-loaded MODEL (UNETLoader).")


@pytest.fixture(scope="module")
def release(comfy, fixtures_dir, tmp_path_factory):
    import folder_paths
    import nodes

    from h3_turbo.tools.release import make_dmd_release

    root = os.path.join(fixtures_dir["root"], "diffusion_models", SUB, "TurboH3-tiny")
    rel = make_dmd_release(root, adaln_dtype="fp32")           # ComfyUI on the CPU computes in fp32
    tables = tmp_path_factory.mktemp("h3turbo_adaln")
    os.symlink(rel["adaln"], tables / "tiny_dmd_fp32.safetensors")
    folder_paths.add_model_folder_path("h3turbo_adaln", str(tables), is_default=True)
    nodes.NODE_CLASS_MAPPINGS["H3TurboTestAttachDMD"] = _AttachDMD
    nodes.NODE_CLASS_MAPPINGS["H3TurboTestPatchTable"] = PatchTable
    yield rel
    nodes.NODE_CLASS_MAPPINGS.pop("H3TurboTestAttachDMD", None)
    nodes.NODE_CLASS_MAPPINGS.pop("H3TurboTestPatchTable", None)


INDEX = f"{SUB}/TurboH3-tiny/transformer/diffusion_pytorch_model.safetensors.index.json"
FOLDER = f"{SUB}/TurboH3-tiny/"
W8A8 = f"{SUB}/TurboH3-tiny/w8a8/model_w8a8.safetensors"


def _dmd(name, adaln="auto", compute="reference"):
    return {"class_type": "H3TurboDMDLoader", "inputs": {"model_name": name, "adaln": adaln, "compute": compute}}


_N = [0]


def _prompt(loader: dict, update: str, seed: int = 42, core: bool = False, table: str | None = None) -> dict:
    _N[0] += 1                      # a fresh output name per run: ComfyUI caches identical graphs
    p = {"1": loader}
    m = ["1", 0]
    if core:
        p["2"] = {"class_type": "H3TurboTestAttachDMD", "inputs": {"model": m}}
        m = ["2", 0]
    if table:
        p["3"] = {"class_type": "H3TurboTestPatchTable", "inputs": {"model": m, "table": table}}
        m = ["3", 0]
    p.update(turbo_av_prompt(m, update=update, seed=seed, prefixes=(f"h3t/dmd{_N[0]}_v", f"h3t/dmd{_N[0]}_a")))
    return p


def _sample(comfy, loader, update, seed=42, core=False, table=None):
    v, a = comfy.run_latents(_prompt(loader, update, seed, core, table), ("12", "13"))
    assert torch.isfinite(v).all() and torch.isfinite(a).all() and v.shape[1] == 24 and a.shape[1] == 32
    return v, a


def _eq(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm())


def test_release_verifies(release):
    from h3_turbo.tools.release import verify_release

    problems, summary = verify_release(release["root"], show_progress=False)
    assert problems == [] and summary["files"] == 8 and summary["not_in_manifest"] == []


@pytest.mark.parametrize("update", ["euler", "renoise"])
def test_bf16_dmd_samples_bit_identical_to_core_unetloader(comfy, release, update):
    core = {"class_type": "UNETLoader", "inputs": {"unet_name": f"{SUB}/TurboH3-tiny_core_bf16.safetensors",
                                                   "weight_dtype": "default"}}
    cv, ca = _sample(comfy, core, update, core=True)
    v, a = _sample(comfy, _dmd(INDEX, "none"), update)
    assert _eq(v, cv) and _eq(a, ca)
    assert float(v.std()) > 0.1


def test_table_driven_adaln_equals_weight_driven(comfy, release, caplog):
    from h3_turbo import state

    from h3_turbo.runtime.adaln import LOOKUPS

    w = _sample(comfy, _dmd(INDEX, "none"), "renoise")
    state.LOGGED.clear()
    LOOKUPS.clear()
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        t = _sample(comfy, _dmd(INDEX, "tiny_dmd_fp32.safetensors"), "renoise")
        auto = _sample(comfy, _dmd(FOLDER, "auto", "reference"), "renoise")     # the release's adaln/ + BF16
    # the same table as object patches on core's UNETLoader model (core naming)
    core = {"class_type": "UNETLoader", "inputs": {"unet_name": f"{SUB}/TurboH3-tiny_core_bf16.safetensors",
                                                   "weight_dtype": "default"}}
    patched = _sample(comfy, core, "renoise", core=True, table=release["adaln"])
    assert _eq(t[0], w[0]) and _eq(t[1], w[1]) and _eq(auto[0], w[0]) and _eq(auto[1], w[1])
    assert _eq(patched[0], w[0]) and _eq(patched[1], w[1])
    assert LOOKUPS.counts == {"group": 3 * 4, "nearest": 0, "composed": 0}   # 3 samplings x 4 forwards: exact groups
    assert not [r for r in caplog.records if "not stored as one batch" in r.getMessage()]


def test_table_rows_equal_core_adaln_per_forward(comfy, release):
    """Every timestep group of the DMD schedule: the table's rows = core's own time_embedder + adaln_proj output
    on the loaded BF16 model (the same batch), bit for bit; a timestep outside the table is an error."""
    from h3_turbo.errors import CheckpointError
    from h3_turbo.runtime import adaln as A
    from h3_turbo.runtime.dmd import load_dmd_model

    mp = load_dmd_model(release["index"], "none", "reference")
    dm = mp.model.diffusion_model
    table = A.read_table(release["adaln"])
    groups = A.timestep_groups(A.schedule("dmd"))
    assert len(groups) == 8 and [len(g) for g in groups] == [1, 2, 2, 2, 2, 3, 3, 3]   # step 0: t_v = t_a = 0
    for g in groups:
        t = torch.tensor(g, dtype=torch.float32)
        idx = table.rows_for(t)
        temb = dm.time_embedder(t).to(dm.dtype)
        for i, blk in enumerate(dm.blocks):
            core = torch.cat(blk.adaln_proj(temb), -1).reshape(len(g), -1)
            assert torch.equal(core, table.blocks[i][idx]), (g, i)
        assert torch.equal(torch.cat(dm.final_layer.adaln_proj(temb), -1).reshape(len(g), -1), table.final[idx])
    with pytest.raises(CheckpointError, match=r"adaln_dmd.safetensors: timestep 0.30000001192092896 \(fp32 bits "
                                              r"0x3e99999a\) of this forward is not in the AdaLN table"):
        table.rows_for(torch.tensor([0.3, 0.5]))


def test_w8a8_int8_and_reference_sample_close_to_bf16(comfy, release):
    for update in ("euler", "renoise"):
        ref = _sample(comfy, _dmd(INDEX, "none"), update)
        # the folder with compute=int8 loads w8a8/ + adaln/; the W8A8 file with reference dequantizes it
        i8 = _sample(comfy, _dmd(FOLDER, "auto", "int8"), update)
        r8 = _sample(comfy, _dmd(W8A8, "tiny_dmd_fp32.safetensors", "reference"), update)
        for v, a in (i8, r8):
            assert not _eq(v, ref[0]) and _rel(v, ref[0]) < 0.02 and _rel(a, ref[1]) < 0.02, update
        assert not _eq(i8[0], r8[0]) and _rel(i8[0], r8[0]) < 0.02   # activation quantization: small, not zero


def test_renoise_reproduces_with_its_seed_and_differs_from_euler(comfy, release):
    a = _sample(comfy, _dmd(INDEX, "none"), "renoise", seed=7)
    b = _sample(comfy, _dmd(INDEX, "none"), "renoise", seed=7)
    c = _sample(comfy, _dmd(INDEX, "none"), "renoise", seed=8)
    e = _sample(comfy, _dmd(INDEX, "none"), "euler", seed=7)
    auto = _sample(comfy, _dmd(INDEX, "none"), "auto", seed=7)       # auto = the DMD contract's rule (renoise)
    assert _eq(a[0], b[0]) and _eq(a[1], b[1]) and _eq(auto[0], a[0])
    assert _rel(a[0], c[0]) > 1e-3 and _rel(a[0], e[0]) > 1e-3


def test_dmd_contract_lora_refusal_and_missing_table(comfy, release, tmp_path):
    import shutil

    from h3_turbo.errors import CheckpointError, TurboLoRAError
    from h3_turbo.runtime.dmd import load_dmd_model
    from h3_turbo.nodes.dmd import H3TurboDMDLoader
    from h3_turbo.nodes.lora import H3TurboLoRA

    mp = H3TurboDMDLoader.execute(W8A8, "tiny_dmd_fp32.safetensors", "int8")[0]
    c = contracts.get(mp.model_options)
    assert (c.variant, c.nfe, c.shift_video, c.shift_audio, c.update) == ("turboh3-dmd", 4, 12.0, 3.0, "renoise")
    with pytest.raises(TurboLoRAError, match="TurboH3 DMD model .* takes no Turbo LoRA"):
        H3TurboLoRA.execute(mp, "4step", 1.0)
    assert H3TurboLoRA.execute(mp, "none", 1.0)[0] is mp
    lone = tmp_path / "model_w8a8.safetensors"                     # outside any release folder
    shutil.copy(release["w8a8"], lone)
    with pytest.raises(CheckpointError, match=r"model_w8a8.safetensors: no AdaLN weights and no adaln/ table beside "
                                              r"them \(no release folder with adaln/ in this file's folder or up to 2"):
        load_dmd_model(str(lone), "auto", "int8")
    with pytest.raises(CheckpointError, match="adaln=none computes the AdaLN from the weights, but these weights have none"):
        H3TurboDMDLoader.execute(FOLDER, "none", "int8")


def test_failed_dmd_loads_leave_a_loaded_model_untouched(comfy, release, tmp_path):
    import shutil

    from corpus import model_fingerprint  # tests/ is on sys.path
    from h3_turbo.errors import CheckpointError
    from h3_turbo.runtime.dmd import load_dmd_model

    mp = load_dmd_model(release["root"], "auto", "int8")
    before = model_fingerprint(mp)
    bad = shutil.copytree(release["root"], tmp_path / "rel")
    os.remove(bad / "transformer" / "diffusion_pytorch_model-00003-of-00003.safetensors")
    (bad / "adaln" / "adaln_dmd.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(CheckpointError, match="missing shard"):
        load_dmd_model(str(bad), "none", "reference")
    with pytest.raises(CheckpointError, match="Git LFS pointer"):
        load_dmd_model(str(bad), "auto", "int8")
    assert model_fingerprint(mp) == before


@pytest.mark.parametrize("which,compute", [("index", "reference"), ("root", "int8"), ("index", "int8")])
def test_streamed_placeholders_build_the_same_model(release, monkeypatch, which, compute):
    """Large tensors are placeholders while core builds the model and are streamed in afterwards
    (runtime/dmd.py PLACEHOLDER_BYTES; the tiny model has none that large): streaming every tensor gives the same
    model, bit for bit (BF16, W8A8 from the file, BF16 quantized on load)."""
    from h3_turbo.runtime import dmd

    def sd_of(mp):
        return {k: v for k, v in mp.model.diffusion_model.state_dict().items()}

    adaln = "none" if which == "index" else "auto"
    ref = sd_of(dmd.load_dmd_model(release[which], adaln, compute))
    monkeypatch.setattr(dmd, "PLACEHOLDER_BYTES", 1)
    got = sd_of(dmd.load_dmd_model(release[which], adaln, compute))
    assert sorted(got) == sorted(ref)
    assert [k for k in ref if not (got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]))] == []
    assert any(k.endswith("int8_weight") for k in ref) == (compute == "int8")


@pytest.mark.parametrize("path", ["fp8", "exact"])
def test_bf16_dmd_quantized_to_nvfp4_on_load(comfy, release, monkeypatch, path):
    """compute=fp8 / exact: the BF16 shards' block projections become ComfyUI-native NVFP4 layers on the NVFP4
    loader's compute path. The kernels need CUDA: on the CPU the request is refused naming the device; with the
    resolution forced, the layers run core's NVFP4 path on the CPU (the kernels' CPU fallback) and sample close to
    the BF16 model (NVFP4 rounding of the weights: small, not zero). W8A8 weights are refused for it."""
    from h3_turbo.errors import CheckpointError, NoCapablePathError
    from h3_turbo.kernels import registry
    from h3_turbo.runtime import dmd

    with pytest.raises(NoCapablePathError, match=f"compute={path}: compute '{path}' needs a CUDA GPU"):
        dmd.load_dmd_model(release["index"], "none", path)
    real = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda c, d, wf="nvfp4": (path, "forced by the test") if
                        (wf, c) == ("nvfp4", path) else real(c, d, wf))
    mp = dmd.load_dmd_model(release["index"], "none", path)
    ref = dmd.load_dmd_model(release["index"], "none", "reference")
    dm, dr = mp.model.diffusion_model, ref.model.diffusion_model
    n, g = 0, torch.Generator().manual_seed(0)
    for name, mod in dm.named_modules():
        if name.startswith("blocks.") and name.split(".", 2)[-1] in dmd.QUANTIZED_PROJECTIONS:
            n += 1
            assert mod._h3_path == path and "NVFP4Layout" in repr(mod.weight)   # core's NVFP4 QuantizedTensor
            x = torch.randn(7, mod.in_features, generator=g)
            r = _rel(mod(x), dr.get_submodule(name)(x))
            assert 0.02 < r < 0.15, (name, r)            # NVFP4 rounding of Gaussian weights: ~10% per layer
    assert n == 4 * len(dm.blocks)
    from h3_turbo.runtime import fused_block

    assert fused_block.structure_problem(dm.blocks[0]) is None        # the Fused Blocks node installs on it
    entry = contracts.copy_entry(mp.model_options)
    assert entry.get("compute") == path and entry.get("weights") in ("resident", "lean")
    with pytest.raises(CheckpointError, match=r"model_w8a8.safetensors.*only the W8A8 int8 weights"):
        dmd.load_dmd_model(release["w8a8"], release["adaln"], path)
    for update in (("renoise",) if path == "fp8" else ()):
        want = _sample(comfy, _dmd(INDEX, "none"), update)
        got = _sample(comfy, _dmd(FOLDER, "auto", path), update)       # the folder: BF16 weights + adaln/ table
        assert not _eq(got[0], want[0]) and _rel(got[0], want[0]) < 0.03 and _rel(got[1], want[1]) < 0.03  # ~0.45%


# ---- issue 40: the release as it ships (files inside the release folder, the inferred 11-row adaln/ layout)

ROWS = f"{SUB}/TurboH3-rows/"


@pytest.fixture(scope="module")
def release_rows(comfy, release, fixtures_dir):
    """A second release folder: the same transformer/ and w8a8/, its adaln/ in the inferred release layout (11 rows
    of the i2va plan keyed by diffusers' fp32(1 - sigma), BF16, per-block [3R, 6H], the schedule in the metadata)."""
    import shutil

    from h3_turbo.tools.release import make_release_rows_table, write_manifest

    root = os.path.join(fixtures_dir["root"], "diffusion_models", SUB, "TurboH3-rows")
    for d in ("transformer", "w8a8"):
        shutil.copytree(os.path.join(release["root"], d), os.path.join(root, d))
    make_release_rows_table(release["index"], os.path.join(root, "adaln"), dtype="bf16")
    write_manifest(root)
    return root


def test_files_inside_a_release_use_its_adaln_table(comfy, release):
    """adaln=auto with the W8A8 file or the BF16 index picked inside the release folder: the release's adaln/
    table, the same samples as the folder itself (same weights, same table)."""
    from h3_turbo.nodes.dmd import adaln_options

    assert f"{SUB}/TurboH3-tiny/adaln/" in adaln_options()
    by_file = _sample(comfy, _dmd(W8A8, "auto", "int8"), "euler")
    by_folder = _sample(comfy, _dmd(FOLDER, "auto", "int8"), "euler")
    assert _eq(by_file[0], by_folder[0]) and _eq(by_file[1], by_folder[1])
    by_index = _sample(comfy, _dmd(INDEX, "auto"), "euler")
    picked = _sample(comfy, _dmd(INDEX, f"{SUB}/TurboH3-tiny/adaln/"), "euler")      # the combo's release entry
    ref = _sample(comfy, _dmd(FOLDER, "auto", "reference"), "euler")
    assert _eq(by_index[0], ref[0]) and _eq(picked[0], ref[0]) and _eq(by_index[1], ref[1])


def test_release_rows_layout_loads_and_samples(comfy, release, release_rows, monkeypatch):
    """The inferred 11-row layout is detected and read; core's forwards find their rows by the nearest key (the audio
    timestep 16 ulp / 4 ulp away from fp32(1 - sigma)); samples stay within BF16 rounding of the weight-driven
    AdaLN. Negative control: with the tolerance at 0 core's step-1 audio timestep is refused."""
    from h3_turbo.errors import CheckpointError
    from h3_turbo.nodes.dmd import adaln_options
    from h3_turbo.runtime import adaln as A

    table = A.read_table(os.path.join(release_rows, "adaln"))
    assert (table.layout, table.rows, [len(g) for g in table.groups]) == ("turboh3_release_rows", 11, [2, 3, 3, 3])
    assert f"{ROWS}adaln/" in adaln_options()
    core_groups = A.timestep_groups(A.schedule("dmd"), conds=(A.VISUAL_COND_T,))
    assert len(core_groups) == 4
    A.LOOKUPS.clear()
    for g in core_groups:
        table.rows_for(torch.tensor(g, dtype=torch.float32))
    assert A.LOOKUPS["nearest"] >= 2 and A.LOOKUPS["composed"] == 0          # steps 1 and 2: audio t off by ulps
    with monkeypatch.context() as mp:
        mp.setattr(A, "TOLERANCE", 0.0)
        with pytest.raises(CheckpointError, match=r"timestep 0.10000014305114746 .* the nearest stored timestep is "
                                                  r"0.10000002384185791 .*\|dt\| = 1.19e-07 > the tolerance 0"):
            table.rows_for(torch.tensor(core_groups[1], dtype=torch.float32))
    ref = _sample(comfy, _dmd(INDEX, "none"), "euler")
    for loader in (_dmd(ROWS, "auto", "reference"), _dmd(INDEX, f"{ROWS}adaln/")):
        got = _sample(comfy, loader, "euler")
        # BF16 rows (measured 1.1e-3 / 0.8e-3 relative to the weight-driven fp32 AdaLN): BF16 rounding of the rows
        assert not _eq(got[0], ref[0]) and _rel(got[0], ref[0]) < 5e-3 and _rel(got[1], ref[1]) < 5e-3
    w8 = _sample(comfy, _dmd(f"{ROWS}w8a8/model_w8a8.safetensors", "auto", "int8"), "renoise")
    ref8 = _sample(comfy, _dmd(INDEX, "none"), "renoise")
    assert _rel(w8[0], ref8[0]) < 0.01 and _rel(w8[1], ref8[1]) < 0.01          # measured 1.4e-3 / 1.5e-3


def test_release_with_lightx2v_table_keyed_by_one_minus_sigma_samples(comfy, release, release_rows):
    """The issue's case: a release folder whose adaln/ is LightX2V's adaln_cache layout keyed by fp32(1 - sigma)
    (the same rows as the inferred-layout fixture). Core's audio timestep at the DMD schedule's step 1 (16 ulp away)
    used to be refused at the first audio step; now it finds its key, and the W8A8 file inside the release samples
    exactly as the inferred-layout release does (the same rows)."""
    import json
    import shutil

    from h3_turbo.runtime import adaln as A

    rows = A.read_table(os.path.join(release_rows, "adaln"))
    root = os.path.join(os.path.dirname(release_rows), "TurboH3-lx")
    shutil.copytree(os.path.join(release_rows, "w8a8"), os.path.join(root, "w8a8"))
    d = os.path.join(root, "adaln")
    os.makedirs(d)
    H, entries, sd = rows.hidden, [], {}
    for k, (g, s) in enumerate(zip(rows.groups, rows.starts)):
        name = f"conditioned_step_{k:03d}"
        entries.append({"name": name, "timestep_bits": list(g)})
        for i, b in enumerate(rows.blocks):
            sd[f"block_{i:03d}.{name}"] = b[s:s + len(g)].reshape(len(g) * 3, 6 * H).contiguous()
        sd[f"norm_out.{name}"] = rows.final[s:s + len(g)].contiguous()
    from safetensors.torch import save_file

    save_file(sd, os.path.join(d, "adaln_cache.safetensors"))
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"format_version": 2, "infer_steps": 4, "num_layers": len(rows.blocks), "hidden_size": H,
                   "entries": entries}, f)
    lx = _sample(comfy, _dmd(f"{SUB}/TurboH3-lx/w8a8/model_w8a8.safetensors", "auto", "int8"), "euler")
    ref = _sample(comfy, _dmd(f"{ROWS}w8a8/model_w8a8.safetensors", "auto", "int8"), "euler")
    assert _eq(lx[0], ref[0]) and _eq(lx[1], ref[1])
