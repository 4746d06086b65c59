"""Issue 16 without ComfyUI: the TurboH3 DMD formats (formats/dmd.py, formats/schemes/diffusers_*.py, w8a8_int8.py),
the exporter and verify-release (tools/release.py), the AdaLN table readers and lookup (runtime/adaln.py) and the
re-noise update (samplers/training_euler.py), on the tiny release the fixture code writes.

The Diffusers -> core conversion is exact (every tensor bit for bit, 12 fp32 tensors kept fp32); a flipped byte, a
missing shard, a missing ``scale`` tensor and an unknown tensor family are each refused with the name."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3_turbo.errors import CheckpointError
from h3_turbo.formats import dmd as D
from h3_turbo.kernels import int8_block as ib
from h3_turbo.runtime import adaln as A
from h3_turbo.tools import release as R


@pytest.fixture(scope="module")
def rel(tmp_path_factory):
    return R.make_dmd_release(str(tmp_path_factory.mktemp("dmd") / "TurboH3-tiny"), adaln_dtype=None)


def _bytes_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def test_diffusers_shards_convert_to_core_exactly(rel):
    det = D.detect_dmd(rel["index"])
    assert det.errors == [] and det.format == "diffusers_bf16" and det.qkv == "split" and det.naming == "diffusers"
    assert len(det.source.files) == 3 and det.has_adaln and det.has_final_adaln
    core = rel["state_dict"]
    got = dict(D.iter_core(det))
    assert sorted(got) == sorted(core)                      # incl. rope.inv_freq, recomputed from config.json
    assert [k for k in core if not _bytes_equal(got[k], core[k])] == []
    # precision kept: the 12 fp32-island tensors (weight + bias of 6 layers) fp32, every other stored tensor bf16
    counts = det.dtype_counts
    L, Rf = R.DMD_TINY_LAYERS
    assert counts == {"F32": 12, "BF16": 2 + (10 * Rf + 1) + 12 * L + 3}


def test_release_counts_for_the_real_model():
    """The converter's plan at H3's real sizes: 626 BF16 + 12 FP32 Diffusers tensors (the TurboH3 card)."""
    cfg = D.DMDConfig(hidden=5376, heads=56, head_dim=128, ffn=14336, layers=50, refiner_layers=2, text_dim=5120,
                      latents_dim=24, audio_latents_dim=32, freq_dim=256, time_hidden=5376, time_dim=2688,
                      rope_freq_dim=16)
    want = D._expected(cfg)
    qkv = sum(1 for k in want if k.endswith("qkv_proj.weight"))
    fp32 = sum(1 for k in want if k.rpartition(".")[0] in D.FP32_CORE)
    assert fp32 == 12 and len(want) - fp32 + 2 * qkv == 626          # qkv_proj -> to_q, to_k, to_v


def test_w8a8_export_follows_the_recipe_and_loads_fused(rel, tmp_path):
    sd8 = load_file(rel["w8a8"])
    bf = {**load_file(os.path.join(os.path.dirname(rel["index"]), "diffusion_pytorch_model-00001-of-00003.safetensors")),
          **load_file(os.path.join(os.path.dirname(rel["index"]), "diffusion_pytorch_model-00002-of-00003.safetensors")),
          **load_file(os.path.join(os.path.dirname(rel["index"]), "diffusion_pytorch_model-00003-of-00003.safetensors"))}
    w = bf["transformer_blocks.1.ff.net.2.weight"]
    q, s = ib.quantize_blocks(w)
    assert torch.equal(sd8["transformer_blocks.1.ff.net.2.int8_weight"], q) and torch.equal(
        sd8["transformer_blocks.1.ff.net.2.scale"], s)
    qkv = torch.cat([bf[f"transformer_blocks.0.attn.to_{p}.weight"] for p in "qkv"])
    assert torch.equal(sd8["transformer_blocks.0.attn.to_qkv.int8_weight"], ib.quantize_blocks(qkv)[0])
    assert not any(".adaln_proj." in k for k in sd8) and "norm_out.linear.weight" in sd8
    assert "token_refiner.refiner_blocks.0.attn.to_q.weight" in sd8        # the refiner stays BF16 (200 = 50 x 4)
    prov = json.load(open(rel["w8a8"][:-len(".safetensors")] + ".json"))
    assert prov["format"] == "h3_fl2va_turbo_w8a8_128" and prov["layers_w8a8"] == 4 * R.DMD_TINY_LAYERS[0]
    assert prov["output"]["sha256"] == R.sha256_file(rel["w8a8"]) and prov["block_adaln"].startswith("omitted")
    # core layout: fc1 halves swapped exactly (int8 rows and 128-row scale blocks)
    det = D.detect_dmd(rel["w8a8"])
    assert det.errors == [] and det.format == "turboh3_w8a8" and det.qkv == "fused" and not det.has_adaln
    core = dict(D.iter_core(det))
    f = sd8["transformer_blocks.0.ff.net.0.proj.int8_weight"]
    assert torch.equal(core["blocks.0.mlp.fc1.weight"], torch.cat(f.chunk(2)[::-1]))
    # split to_q/to_k/to_v (N % 128 != 0): fused on load with per-row scales, the dequantized weight exactly the parts'
    split = str(tmp_path / "split.safetensors")
    R.export_w8a8(rel["index"], split, fuse_qkv=False)
    ds = D.detect_dmd(split)
    assert ds.errors == [] and ds.qkv == "split"
    cs = dict(D.iter_core(ds))
    sp = load_file(split)
    parts = [ib.Int8Weight(sp[f"transformer_blocks.0.attn.to_{p}.int8_weight"], sp[f"transformer_blocks.0.attn.to_{p}.scale"])
             for p in "qkv"]
    fused = ib.Int8Weight(cs["blocks.0.attn.qkv_proj.weight"], cs["blocks.0.attn.qkv_proj.int8_scale"], 1)
    assert torch.equal(ib.dequantize(fused, torch.float32), torch.cat([ib.dequantize(p, torch.float32) for p in parts]))


def test_missing_shard_is_refused_with_its_name(rel, tmp_path):
    d = shutil.copytree(os.path.dirname(rel["index"]), tmp_path / "t")
    os.remove(d / "diffusion_pytorch_model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"missing shard\(s\): diffusion_pytorch_model-00002-of-00003.safetensors "
                                              r"\(\d+ tensors\) of 3"):
        D.detect_dmd(str(d / "diffusion_pytorch_model.safetensors.index.json"))


def test_index_that_disagrees_with_its_shards_is_refused(rel, tmp_path):
    d = shutil.copytree(os.path.dirname(rel["index"]), tmp_path / "t")
    idx = d / "diffusion_pytorch_model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    k = next(iter(obj["weight_map"]))
    obj["weight_map"][k] = "diffusion_pytorch_model-00003-of-00003.safetensors"
    idx.write_text(json.dumps(obj))
    with pytest.raises(CheckpointError, match=f"tensor '{k}': the index maps it to diffusion_pytorch_model-00003"):
        D.detect_dmd(str(idx))


def _one_file(rel, tmp_path, change):
    det = D.detect_dmd(rel["index"])
    sd = {}
    with det.source.reader() as r:
        for k in det.source.header.tensors:
            sd[k] = r.get(k)
    change(sd)
    p = str(tmp_path / "one.safetensors")
    save_file(sd, p)
    return D.detect_dmd(p)


def test_unknown_tensor_family_is_refused_with_the_list(rel, tmp_path):
    def change(sd):
        sd["transformer_blocks.0.attn.to_gate_compress.weight"] = torch.zeros(2, 64, dtype=torch.bfloat16)
        sd["transformer_blocks.1.attn.to_gate_compress.weight"] = torch.zeros(2, 64, dtype=torch.bfloat16)
        sd["vdn_head.proj.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)

    det = _one_file(rel, tmp_path, change)
    msg = str(det.errors[0])
    assert "3 tensor(s) of 2 unknown families" in msg
    assert "transformer_blocks.N.attn.to_gate_compress.weight (2x, e.g. transformer_blocks.0.attn.to_gate_compress.weight)" in msg
    assert "vdn_head.proj.weight (1x" in msg
    with pytest.raises(CheckpointError, match="unknown families"):
        det.raise_if_errors()


def test_missing_and_wrong_tensors_are_named_in_diffusers_names(rel, tmp_path):
    def change(sd):
        del sd["transformer_blocks.1.attn.to_k.weight"]
        sd["transformer_blocks.0.ff.net.2.weight"] = sd["transformer_blocks.0.ff.net.2.weight"][:, :64].contiguous()

    det = _one_file(rel, tmp_path, change)
    msgs = [str(f) for f in det.errors]
    assert any("transformer_blocks.1.attn.to_k.weight: split Q/K/V incomplete: to_k missing" in m for m in msgs), msgs
    assert any("transformer_blocks.0.ff.net.2.weight -> blocks.0.mlp.fc2.weight: shape [64, 64] (expected [64, 128])"
               in m for m in msgs), msgs


def test_missing_scale_is_refused_with_its_name(rel, tmp_path):
    sd = load_file(rel["w8a8"])
    del sd["transformer_blocks.1.attn.to_out.0.scale"]
    p = str(tmp_path / "w8.safetensors")
    save_file(sd, p, metadata={"format": "h3_fl2va_turbo_w8a8_128"})
    det = D.detect_dmd(p)
    assert [str(f) for f in det.errors][0] == ("[error] transformer_blocks.1.attn.to_out.0.scale: missing 'scale' for an "
                                               "Int8Linear layer (int8_weight without its 128x128 block scales)")
    sd["transformer_blocks.1.attn.to_out.0.scale"] = torch.ones(2, 2)
    save_file(sd, p)
    assert "scale is F32 [2, 2] (expected float32 [1, 1]" in str(D.detect_dmd(p).errors[0])


def test_config_json_disagreeing_with_the_weights_is_refused(rel, tmp_path):
    d = shutil.copytree(os.path.dirname(rel["index"]), tmp_path / "t")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_layers"] = 50
    (d / "config.json").write_text(json.dumps(cfg))
    det = D.detect_dmd(str(d / "diffusion_pytorch_model.safetensors.index.json"))
    assert [str(f) for f in det.errors] == ["[error] config.json:num_layers: config.json sets num_layers = 50 but the "
                                            "weights say 2"]


def test_verify_release_names_a_flipped_byte_and_a_missing_file(rel, tmp_path):
    root = shutil.copytree(rel["root"], tmp_path / "r")
    assert R.verify_release(str(root), show_progress=False)[0] == []
    shard = root / "transformer" / "diffusion_pytorch_model-00002-of-00003.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x01
    shard.write_bytes(bytes(raw))
    os.remove(root / "w8a8" / "model_w8a8.json")
    problems, _ = R.verify_release(str(root), show_progress=False)
    assert problems[0] == "missing: w8a8/model_w8a8.json"
    assert problems[1].startswith("sha256 mismatch: transformer/diffusion_pytorch_model-00002-of-00003.safetensors: ")
    assert len(problems) == 2
    from h3_turbo.tools.__main__ import main

    assert main(["verify-release", str(root), "--quiet"]) == 1


def test_manifest_schemas(tmp_path):
    sha = "ab" * 32
    for obj in ({"files": [{"path": "a/b.bin", "size": 3, "sha256": sha}]}, {"files": {"a/b.bin": {"size": 3, "sha256": sha}}},
                [{"name": "a/b.bin", "bytes": 3, "hash": "sha256:" + sha}], {"repo": "x", "a/b.bin": {"size": 3, "sha256": sha}}):
        p = tmp_path / "manifest.json"
        p.write_text(json.dumps(obj))
        assert R.manifest_entries(str(p)) == {"a/b.bin": R.ManifestEntry("a/b.bin", 3, sha)}
    p.write_text(json.dumps({"version": 2, "total": 7}))
    with pytest.raises(CheckpointError, match=r"unknown manifest schema \(top level: \['total', 'version'\]\)"):
        R.manifest_entries(str(p))


def test_inspect_understands_both_formats(rel):
    from h3_turbo.tools.inspect_ckpt import inspect_file

    rep, findings = inspect_file(rel["root"])
    assert rep["kind"] == "dmd" and rep["ok"]
    fmts = {w["format"]: w for w in rep["weights"]}
    assert fmts["diffusers_bf16"]["qkv"] == "split" and fmts["turboh3_w8a8"]["w8a8_layers"] == 8
    assert fmts["turboh3_w8a8"]["metadata_format"] == "h3_fl2va_turbo_w8a8_128"
    rep8, _ = inspect_file(rel["w8a8"])
    assert rep8["weights"][0]["format"] == "turboh3_w8a8" and not rep8["weights"][0]["adaln_weights"]


# --------------------------------------------------------------------------------------------- AdaLN tables

def _synthetic_table(path, hidden=4, layers=2):
    groups = [(0.0,), (0.25, 0.5), (0.25, 0.5, 0.999)]
    n = sum(len(g) for g in groups)
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(n, 18 * hidden, generator=g).to(torch.bfloat16) for _ in range(layers)]
    final = torch.randn(n, 2 * hidden, generator=g).to(torch.bfloat16)
    A.write_table(path, blocks, final, groups, {"schedule": {"name": "test"}})
    return groups, blocks, final


def test_own_table_lookup_exact_group_composed_or_refused(tmp_path, caplog):
    p = str(tmp_path / "t.safetensors")
    groups, blocks, final = _synthetic_table(p)
    t = A.read_table(p)
    assert t.layout == "h3_turbo" and t.hidden == 4 and len(t.blocks) == 2 and t.rows == 6
    assert t.rows_for(torch.tensor([0.25, 0.5])).tolist() == [1, 2]
    assert t.rows_for(torch.tensor([0.25, 0.5, 0.999])).tolist() == [3, 4, 5]
    with caplog.at_level(logging.INFO, logger="h3_turbo"):
        assert t.rows_for(torch.tensor([0.0, 0.5])).tolist() == [0, 2]         # composed per timestep, logged
    assert any("not stored as one batch" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match=r"t.safetensors: timestep 0.75 \(fp32 bits 0x3f400000\) of this forward "
                                              r"is not in the AdaLN table t.safetensors \(h3_turbo: 2 blocks, 3 timestep "
                                              r"groups, timesteps 0, 0.25, 0.5, 0.999\): the nearest stored timestep is "
                                              r"0.9990000128746033 \(fp32 bits 0x3f7fbe77\), \|dt\| = 0.249 > the "
                                              r"tolerance 2e-06; .* never interpolated"):
        t.rows_for(torch.tensor([0.5, 0.75]))
    with pytest.raises(CheckpointError, match="AdaLN table for 2 blocks x hidden 4, the model has 50 x 5376"):
        t.check_fits(50, 5376, need_final=True)


def _lightx2v(dir_, groups, blocks, final, per_block):
    H = blocks[0].shape[1] // 18
    entries = [{"name": f"conditioned_step_{i:03d}", "timestep_bits": list(A._bits(g))} for i, g in enumerate(groups)]
    os.makedirs(dir_, exist_ok=True)
    with open(os.path.join(dir_, "manifest.json"), "w") as f:
        json.dump({"format_version": 2, "infer_steps": 3, "num_layers": len(blocks), "hidden_size": H, "entries": entries}, f)
    starts = [0, 1, 3]
    if per_block:
        for i, b in enumerate(blocks):
            save_file({e["name"]: b[s:s + len(g)].reshape(len(g) * 3, 6 * H).contiguous()
                       for e, g, s in zip(entries, groups, starts)}, os.path.join(dir_, f"block_{i:03d}.safetensors"))
        save_file({e["name"]: final[s:s + len(g)].contiguous() for e, g, s in zip(entries, groups, starts)},
                  os.path.join(dir_, "norm_out.safetensors"))
        open(os.path.join(dir_, "READY"), "w").close()
    else:
        sd = {f"block_{i:03d}.{e['name']}": b[s:s + len(g)].reshape(len(g) * 3, 6 * H).contiguous()
              for i, b in enumerate(blocks) for e, g, s in zip(entries, groups, starts)}
        sd.update({f"norm_out.{e['name']}": final[s:s + len(g)].contiguous() for e, g, s in zip(entries, groups, starts)})
        save_file(sd, os.path.join(dir_, "adaln_cache.safetensors"))


@pytest.mark.parametrize("per_block", [False, True], ids=["adaln_cache", "block_files_READY"])
def test_lightx2v_layouts_read_to_the_same_rows(tmp_path, per_block):
    groups, blocks, final = _synthetic_table(str(tmp_path / "t.safetensors"))
    d = str(tmp_path / "lx")
    _lightx2v(d, groups, blocks, final, per_block)
    t = A.read_table(os.path.join(d, "manifest.json"))
    assert t.layout == ("lightx2v_ready" if per_block else "lightx2v") and t.starts == [0, 1, 3]
    assert all(torch.equal(a, b) for a, b in zip(t.blocks, blocks)) and torch.equal(t.final, final)
    assert t.rows_for(torch.tensor([0.25, 0.5, 0.999])).tolist() == [3, 4, 5]


def test_unknown_table_layout_is_refused_with_what_was_found(tmp_path):
    d = tmp_path / "adaln"
    d.mkdir()
    save_file({"mod_table": torch.zeros(13, 6, 8, dtype=torch.bfloat16)}, str(d / "adaln.safetensors"),
              metadata={"timestep_mlp_dtype": "float32"})
    (d / "adaln.json").write_text(json.dumps({"timestep_mlp_dtype": "float32", "steps": 5}))
    with pytest.raises(CheckpointError) as e:
        A.read_table(str(d))
    msg = str(e.value)
    assert "unknown AdaLN table layout: files ['adaln.json', 'adaln.safetensors']" in msg
    assert "adaln.json: JSON keys ['steps', 'timestep_mlp_dtype']" in msg
    assert "adaln.safetensors: 1 tensors (mod_table BF16 [13, 6, 8]); metadata keys ['timestep_mlp_dtype']" in msg
    assert "expected one of: the pack's format" in msg


# --------------------------------------------------------------------------------------------- update rule

def test_renoise_loop_fresh_noise_from_the_generator_and_x0_at_the_end():
    from h3_turbo.samplers.training_euler import renoise_av_loop, renoise_update, resolve_update
    from h3_turbo.adapters import contracts

    sv, sa = [1.0, 0.972973, 0.923077, 0.8, 0.0], [1.0, 0.9, 0.75, 0.5, 0.0]
    x0v, x0a = torch.randn(2, 3), torch.randn(4)

    def vel(i, xv, xa):                 # an oracle: v = noise - x0 with the implied noise
        return (xv - x0v) / sv[i], (xa - x0a) / sa[i]

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return renoise_av_loop(vel, torch.randn(2, 3, generator=torch.Generator().manual_seed(1)),
                               torch.randn(4, generator=torch.Generator().manual_seed(2)), sv, sa, g)

    a, b = run(5), run(5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.allclose(a[0], x0v, atol=1e-6) and torch.allclose(a[1], x0a, atol=1e-6)   # exact x0 oracle
    n = torch.randn(3)
    assert torch.equal(renoise_update(torch.ones(3), 0.5, 0.25, torch.full((3,), 2.0), n), 0.75 * torch.zeros(3) + 0.25 * n)
    assert resolve_update("auto", contracts.TURBOH3_DMD) == "renoise"
    assert resolve_update("auto", contracts.KNOWN_ARTIFACTS[0].contract) == "euler" and resolve_update("auto", None) == "euler"
    with pytest.raises(ValueError, match="update must be one of"):
        resolve_update("ddim", None)


def test_core_named_bf16_is_read_and_nvfp4_is_sent_to_the_nvfp4_loader(rel, tmp_path):
    det = D.detect_dmd(rel["core"])
    assert det.errors == [] and det.format == "diffusers_bf16" and det.naming == "core" and det.qkv == "fused"
    got = dict(D.iter_core(det))
    assert all(_bytes_equal(got[k], v) for k, v in rel["state_dict"].items()) and sorted(got) == sorted(rel["state_dict"])
    sd = dict(rel["state_dict"])
    sd["blocks.0.mlp.fc2.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    p = str(tmp_path / "q.safetensors")
    save_file(sd, p)
    assert "core-named quantized MiniMax H3 (NVFP4 / ComfyUI quant formats): load it with Load H3 NVFP4" in \
        str(D.detect_dmd(p).errors[0])


def test_adaln_memo_device_slots_serve_exact_rows_when_the_ring_wraps():
    """adaln=table's lookups read a per-device copy of the memo rows (runtime/adaln_memo.py ``_Staged``): 12 groups
    of 3 timesteps through a 32-row ring (it wraps and overwrites), twice and in both orders; every lookup of every
    block and of the final layer returns exactly that group's memo rows."""
    from h3_turbo.runtime import adaln as A
    from h3_turbo.runtime import adaln_memo as M

    hid, nb = 4, 3
    memo = M.Memo(None, [None] * nb, None, "test")
    g = torch.Generator().manual_seed(0)
    groups = []
    for j in range(12):
        key = (j * 10, j * 10 + 1, j * 10 + 2)
        blocks = [torch.randn(3, 18 * hid, generator=g).to(torch.bfloat16) for _ in range(nb)]
        final = torch.randn(3, 2 * hid, generator=g).to(torch.bfloat16)
        memo._add(key, blocks, final)
        groups.append((key, blocks, final))
    mods = [M.MemoAdaLN(memo, i, 6, 3, hid) for i in range(nb)]
    fin = M.MemoAdaLN(memo, None, 2, 1, hid)
    assert 12 * 3 > M._Staged.ROWS
    for order in (groups, groups[::-1], groups):
        for key, blocks, final in order:
            with memo.lock:
                at = memo.slot(key, "cpu")
            assert 0 <= at <= M._Staged.ROWS - 3
            t_emb = A._encode(torch.arange(at, at + 3), "cpu").to(torch.bfloat16)     # core's .to(dtype)
            for i, m in enumerate(mods):
                assert torch.equal(torch.cat(m(t_emb), -1), blocks[i].reshape(9, 6 * hid))
            assert torch.equal(torch.cat(fin(t_emb), -1), final)
    with pytest.raises(ValueError, match="distinct timesteps"):
        with memo.lock:
            memo._add(tuple(range(1000, 1033)), [torch.zeros(33, 18 * hid, dtype=torch.bfloat16)] * nb,
                      torch.zeros(33, 2 * hid, dtype=torch.bfloat16))
            memo.slot(tuple(range(1000, 1033)), "cpu")
