"""Issue 18, item 7: the Turbo contract table (``adapters/contracts.py``) against the public sources, one quoted
source per row, and against the table in docs/h3-facts.md#turbo-lora-files (no ComfyUI needed)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from h3_turbo.adapters import contracts

DOCS = Path(__file__).resolve().parent.parent / "docs" / "h3-facts.md"

# file stem: (variant, NFE, shift video, shift audio, alpha/rank, SHA-256 or None, the public source, quoted)
PUBLIC = {
    "minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16": (
        "4step", 4, 6.0, 3.0, 1.0, "449d80f301ac571622c72e28b8fd72a4b3681b7a8df8a92f17c8f6ec43f56558",
        "Hugging Face lightx2v/Minimax-h3-Turbo discussion #42: 'v1.1 recommended euler/simple, shift 6/3, 4 steps'; "
        "header reads: qkv alpha 384 / rank 384, others 128 / 128; LFS SHA-256 at revision ec01fa4c"),
    "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16": (
        "8step", 8, 12.0, 3.0, 1 / 16, "2339acdf19bfe123f46b971ea35d367a84adb85de43627e1eceafa5a5b2b111e",
        "ModelTC/Minimax-H3-Turbo README.md model specs: 'FL2VA 8step v1.0 | 544p mixed AR | 12/3 | 8'; header "
        "dump: training_rank 128, training_alpha 8.0, training_scale 0.0625; LFS SHA-256 at revision ec01fa4c"),
    "minimax_h3_fl2v_turbo_4step_v1.0_768p_comfyui_bf16": (
        "4step", 4, 6.0, 3.0, 1.0, None,
        "ModelTC/Minimax-H3-Turbo README.md model specs: 'FL2VA 4step v1.0 768p | 1344x768 | 6/3 | 4', "
        "'--lora-alpha 128'; vllm-project/vllm-omni #6017: the ComfyUI twin embeds per-layer alpha 128"),
    "minimax_h3_fl2v_turbo_8step_v1.0_768p_comfyui_bf16": (
        "8step", 8, 6.0, 3.0, 1 / 16, None,
        "ModelTC/LightX2V configs/minimax_h3/dmd/minimax_h3_fp8_8step.json and minimax_h3_int8_convrot_8step.json: "
        "1344x768, 'infer_steps': 8, 'video_flow_shift': 6.0, audio 3.0, 'alpha': 8"),
    "minimax_h3_fl2v_turbo_4step_v1.2_768p_comfyui_bf16": (
        "4step", 4, 6.0, 3.0, 1 / 16, None,
        "vllm-project/vllm-omni PR #7062 table: 'fl2v_turbo_4step_v1.2_768p | 768p | 6/3 | 4 | alpha 8'"),
    "minimax_h3_fl2v_turbo_4step_v0.1": (
        "4step", 4, 12.0, 3.0, 1 / 16, "5ff4a12c8b4599fec716e1b15a45e504e0d1129111896bdcde5ac4a15e395b29",
        "ModelTC/Minimax-H3-Turbo README.md model specs: 'FL2VA 4step v0.1 | 544p mixed AR | 12/3 | 4 | alpha 8 "
        "by default'; vllm-omni PR #7062 review: 'the metadata-free 4step_v0.1 needs alpha 8'; Hugging Face "
        "lightx2v/Minimax-h3-Turbo listing: minimax_h3_fl2v_turbo_4step_v0.1.safetensors, LFS SHA-256 5ff4a12c..."),
}


def _row(a: contracts.KnownArtifact):
    c = a.contract
    return (c.variant, c.nfe, c.shift_video, c.shift_audio, c.alpha_over_rank, a.sha256)


def test_every_known_artifact_is_the_public_sources_row():
    table = {a.filename[: -len(".safetensors")]: _row(a) for a in contracts.KNOWN_ARTIFACTS}
    assert set(table) == set(PUBLIC)
    for stem, (*want, quote) in PUBLIC.items():
        assert table[stem] == tuple(want), f"{stem}: {table[stem]} vs the source: {quote}"
        assert contracts.by_filename(stem + ".safetensors").contract.name == stem
        if want[-1]:
            assert contracts.by_sha256(want[-1]).filename == stem + ".safetensors"


@pytest.mark.parametrize("stem", sorted(PUBLIC))
def test_docs_table_row_matches(stem):
    """docs/h3-facts.md#turbo-lora-files states the same NFE, shifts and alpha/rank for the file."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Turbo LoRA files"):text.index("## Other LoRA layouts")]
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| `{stem}`"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    variant, nfe, sv, sa, aor, _, _ = PUBLIC[stem]
    assert int(cells[1]) == nfe and cells[2] == f"{sv:g}/{sa:g}"
    num, _, den = cells[4].partition("/")
    assert float(num) / float(den or 1) == aor


def test_aliases_are_the_readme_contracts():
    """The variant input's 4step / 8step are the README's aliases: 4-step v1.1 768p (4 at 6/3) and 8-step
    v1.0 544p (8 at 12/3)."""
    got = {v: _row(contracts.by_filename(f + ".safetensors"))[:4] for v, f in contracts.ALIASES.items()}
    assert got == {"4step": ("4step", 4, 6.0, 3.0), "8step": ("8step", 8, 12.0, 3.0)}
    readme = (DOCS.parent.parent / "README.md").read_text(encoding="utf-8")
    for v, f in contracts.ALIASES.items():
        assert re.search(rf"\| `{v}` \| `{re.escape(f)}`", readme), v


def test_choose_contract():
    four = contracts.by_filename(contracts.ALIASES["4step"] + ".safetensors").contract
    assert contracts.choose(None, "auto", "x.safetensors") is None
    assert contracts.choose(four, "none", "x.safetensors") is None
    assert contracts.choose(four, "4step", "x.safetensors") is four
    user = contracts.choose(None, "8step", "mine.safetensors")
    assert (user.variant, user.nfe, user.shift_video, user.shift_audio, user.alpha_over_rank, user.source, user.name) \
        == ("8step", 8, 12.0, 3.0, None, "user", "mine.safetensors")
    with pytest.raises(ValueError, match=r"variant '8step' contradicts 'x.safetensors', whose own contract is 4step"):
        contracts.choose(four, "8step", "x.safetensors")
    with pytest.raises(ValueError, match="variant 'fast' is not one of auto, 4step, 8step, none"):
        contracts.choose(four, "fast", "x.safetensors")
