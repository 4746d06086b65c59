"""The sampler refuses a non-finite input latent (a NaN upstream would otherwise give an all-NaN result
that ComfyUI reports as a success), naming what it found; the client refuses a timeout that is not > 0."""
from __future__ import annotations

import pytest

from corpus import euler_av_prompt  # tests/ is on sys.path


@pytest.mark.comfyui
def test_nan_latent_is_refused_by_the_sampler(comfy, fixtures_dir):
    from h3_turbo.harness import PromptFailed

    p = {"1": {"class_type": "H3TurboNVFP4Loader", "inputs": {"unet_name": "h3_tiny_nvfp4.safetensors",
                                                              "compute": "reference"}},
         **euler_av_prompt(["1", 0], prefixes=("h3t/nan_v", "h3t/nan_a"))}
    p["7"] = {"class_type": "H3TurboSampler", "inputs": {}}
    lat = next(k for k, n in p.items() if n["class_type"] == "EmptyMiniMaxH3LatentAV")
    p["90"] = {"class_type": "LatentMultiply", "inputs": {"samples": [lat, 0], "multiplier": float("nan")}}
    for n in p.values():
        if n["class_type"] == "SamplerCustomAdvanced":
            n["inputs"]["latent_image"] = ["90", 0]
    with pytest.raises(PromptFailed, match=r"noised input latent holds NaN or Inf values \(\d+ of \d+ values\)"):
        comfy.run(p)


def test_client_timeout_must_be_positive(capsys):
    from h3_turbo.client.__main__ import build_parser

    for bad in ("-5", "0", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["submit", "wf.json", "--timeout", bad])
    assert "expected a number of seconds > 0" in capsys.readouterr().err
    assert build_parser().parse_args(["submit", "wf.json", "--timeout", "2.5"]).timeout == 2.5
