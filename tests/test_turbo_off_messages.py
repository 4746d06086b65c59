"""H3 Turbo Sigmas with steps=0 on a MODEL without a Turbo contract says why there is none: no Turbo LoRA
(never applied, or switched off by turbo=none / strength 0), an adapter applied with variant none, or an adapter
that is not an official file."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.comfyui


def _sigmas_error(model) -> str:
    from h3_turbo.nodes.sampler import H3TurboSigmas

    with pytest.raises(ValueError) as e:
        H3TurboSigmas.execute(model=model, steps=0)
    return str(e.value)


def _out(o):
    return o.result[0] if hasattr(o, "result") else o[0]


def test_steps0_messages_name_the_reason(comfy, fixtures_dir):
    import nodes

    from h3_turbo.nodes.lora import H3TurboLoRA

    base = nodes.UNETLoader().load_unet("h3_tiny_bf16.safetensors", "default")[0]
    assert "no Turbo LoRA is active on it" in _sigmas_error(base)
    on = _out(H3TurboLoRA.execute(model=base, turbo="4step", strength=1.0))
    for off in (_out(H3TurboLoRA.execute(model=on, turbo="none", strength=1.0)),
                _out(H3TurboLoRA.execute(model=on, turbo="4step", strength=0.0))):
        msg = _sigmas_error(off)
        assert "switched it off with turbo=none or strength 0" in msg and "connect it" not in msg
    msg = _sigmas_error(_out(H3TurboLoRA.execute(model=base, turbo="4step", strength=1.0, variant="none")))
    assert "was applied with variant none" in msg and "not an official file" not in msg


def test_dmd_loader_warns_on_a_core_named_file_without_release(comfy, fixtures_dir, caplog):
    """A plain core-named BF16 H3 picked in Load TurboH3 DMD Model loads (as documented) but says, once, that
    nothing marks it as the DMD model and that it is sampled as one."""
    import logging

    from h3_turbo import state
    from h3_turbo.runtime.dmd import load_dmd_model

    state.LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        load_dmd_model(fixtures_dir["bf16"], adaln="none")
    assert any("no release manifest: nothing in it says it is the TurboH3 DMD model" in r.message
               for r in caplog.records)


def test_resident_content_under_an_official_name_is_checked_as_that_name(comfy, fixtures_dir, tmp_path):
    """The same bytes as a resident adapter, saved under the official 4-step file name, get the checks a fresh
    load of that name gets (its contract's alpha/rank against the tensors), not the resident file's contract."""
    import shutil

    from h3_turbo.adapters import residency, turbo_lora

    residency.clear()
    first = residency.get(fixtures_dir["lora_8step"])
    renamed = tmp_path / "minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16.safetensors"
    shutil.copyfile(fixtures_dir["lora_8step"], renamed)
    with pytest.raises(turbo_lora.TurboLoRAError, match="is recognized as minimax_h3_fl2v_turbo_4step_v1.1"):
        residency.get(str(renamed))
    assert residency.get(fixtures_dir["lora_8step"]) is first     # the resident entry is untouched
    residency.clear()
