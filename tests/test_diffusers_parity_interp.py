"""Parity with diffusers (c): the NVFP4 ``exact`` path, its Triton kernel run by the interpreter on the CPU, vs
diffusers on the same weights dequantized by comfy-kitchen (core's ``QuantizedTensor.dequantize``). The BF16 DMD
shards (written by diffusers' ``save_pretrained``) are quantized on load (``compute=exact``); the forward computes
in BF16 (the kernel's activation dtype). docs/parity.md.

Run through tests/test_diffusers_parity.py::test_nvfp4_exact_path_interpreted (a fresh process with
TRITON_INTERPRET=1); collected in-process without that variable, the module skips itself."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: run via "
                "tests/test_diffusers_parity.py::test_nvfp4_exact_path_interpreted", allow_module_level=True)

pytest.importorskip("diffusers")

import torch  # noqa: E402

from h3_turbo.tools.release import ensure_comfy, tiny_dmd_config  # noqa: E402

ensure_comfy("cpu")

import diffusers_ref as R  # noqa: E402
import test_diffusers_parity as P  # noqa: E402

#: relative L2 of the whole BF16-compute forward vs diffusers in fp32 on the dequantized weights
FORWARD_BOUND = 2e-2


def test_nvfp4_exact_forward_matches_diffusers_on_dequantized_weights(tmp_path, monkeypatch, record_property):
    from diffusers.utils import logging as dlog

    from h3_turbo.kernels import registry
    from h3_turbo.kernels import triton_nvfp4 as tk
    from h3_turbo.kernels.paths import exact
    from h3_turbo.runtime import dmd

    dlog.set_verbosity_error()
    assert tk.INTERPRET
    cfg = tiny_dmd_config()
    sd = P.parity_state_dict(cfg)
    index = P.save_diffusers_shards(R.model_from_core(sd, cfg), str(tmp_path / "transformer"))
    real = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda c, d, wf="nvfp4": ("exact", "forced by the test") if
                        (wf, c) == ("nvfp4", "exact") else real(c, d, wf))
    # the interpreter runs the kernels on CPU tensors: let the path take them (it takes CUDA tensors only)
    monkeypatch.setattr(exact.ExactPath, "takes", lambda self, x: x.dtype in (torch.bfloat16, torch.float16))
    launches = []
    gemm = tk.gemm_exact
    monkeypatch.setattr(tk, "gemm_exact", lambda *a, **k: launches.append(a[0].shape) or gemm(*a, **k))
    mp = dmd.load_dmd_model(index, "none", "exact")
    dm = mp.model.diffusion_model
    deq, n = dict(sd), 0
    for name, mod in dm.named_modules():
        if name.split(".", 2)[-1] in dmd.QUANTIZED_PROJECTIONS and name.startswith("blocks."):
            assert "NVFP4Layout" in repr(mod.weight)
            deq[name + ".weight"] = mod.weight.dequantize().float()[: mod.out_features, : mod.in_features]
            x = torch.randn(9, mod.in_features, generator=torch.Generator().manual_seed(n)).bfloat16()
            with torch.no_grad():
                y = mod(x)
            want = x.double() @ deq[name + ".weight"].double().t()
            err = P._rel(y, want)
            assert err < exact.PATH.error_bound, (name, err)                 # per layer: the path's own bound
            n += 1
    assert n == 4 * cfg.num_layers and len(launches) >= n                    # the Triton kernel ran (interpreted)
    ref_deq = R.model_from_core(deq, cfg, torch.float32)
    ref_bf16 = R.fp32(R.model_from_core(sd, cfg))                            # negative control: not quantized
    par = {"cfg": cfg, "inputs": P.parity_inputs(cfg)}
    sigma = float(R.schedulers(5, 12.0, 3.0)[0].sigmas[1])
    cv, ca = R.rows(*P.core_forward(mp, par, sigma, False, torch.bfloat16))
    rv, ra, _ = P.ref_forward(ref_deq, par, 1, False)
    nv, na, _ = P.ref_forward(ref_bf16, par, 1, False)
    err, neg = max(P._rel(cv, rv), P._rel(ca, ra)), max(P._rel(cv, nv), P._rel(ca, na))
    record_property("nvfp4_exact_forward_rel_l2", err)
    record_property("negative_unquantized_weights", neg)
    print(f"NVFP4-EXACT forward rel L2 {err:.3g} (vs BF16 weights {neg:.3g}), {len(launches)} kernel launches")
    assert err < FORWARD_BOUND and neg > 4 * err, (err, neg)    # the NVFP4 rounding of the weights is resolved
