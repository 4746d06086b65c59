"""``adaln=table``'s streamed pass over the AdaLN weights (runtime/adaln_memo.py ``streamed_rows``; docs/memory.md
"The streamed pass"), on the CPU with core's own modules of the tiny fixture model:

- the streamed pass gives the plain pass's rows bit for bit (``torch.equal``, every group, block and the final
  layer) with staging pieces far smaller than a tensor (the ring wraps many times, a tensor spans many pieces), with
  one staging buffer, and with pieces larger than any module (and under ``torch.inference_mode``); in the
  fp32 and the bf16 compute dtype;
- negative control: dropping one piece per tensor (the chunking the pass relies on) changes rows;
- a failing streamed pass is logged once as a WARNING naming the error, gives the plain pass's rows, and the memo
  does not try it again; ``auto`` runs plain on the CPU; a bad ``mode`` is refused by name.

The CUDA-only parts (pinned staging, side stream, events) are checked on the GPU by
``benchmarks/bench_adaln_pass.py`` (``torch.equal`` between the two passes at H3's real sizes).
"""
from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.comfyui

GROUPS = [(0.25, 0.5), (0.3, 0.75, 0.999), (1.0,), (0.125, 0.6)]


@pytest.fixture(scope="module")
def memo(comfy, fixtures_dir):
    from h3_turbo.runtime import adaln_memo, loading

    m = adaln_memo.memo_of(loading.load_h3_model(fixtures_dir["bf16"], "reference", adaln="table"))
    assert m is not None and len(m._mods.modules["blocks"]) >= 2
    return m


def _groups():
    return [torch.tensor(g, dtype=torch.float32) for g in GROUPS]


def _same(a, b) -> bool:
    """Every group's block and final rows equal (dtype, shape, bits)."""
    assert len(a) == len(b) == len(GROUPS)
    for (ba, fa), (bb, fb) in zip(a, b):
        for x, y in list(zip(ba, bb)) + [(fa, fb)]:
            if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                return False
    return True


def test_pieces_and_layout_tables():
    from h3_turbo.runtime import adaln_memo as M

    assert M._pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert M._pieces(8, 4) == [(0, 4), (4, 4)] and M._pieces(3, 4) == [(0, 3)] and M._pieces(0, 4) == []
    t = {"w": torch.empty(3, 5, dtype=torch.bfloat16), "b": torch.empty(513, dtype=torch.uint8),
         "s": torch.empty((), dtype=torch.float32)}
    assert M._layout(t) == ({"w": 0, "b": 512, "s": 1536}, 2048)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_pass_equals_plain_pass_bit_for_bit(memo, dtype):
    from h3_turbo.runtime import adaln_memo as M

    plain = memo.compute(_groups(), dtype, mode="plain")
    biggest = max(t.numel() * t.element_size() for m in M._order(memo._mods.modules) for t in M._tensors_of(m).values())
    assert biggest > 10 * 1000          # the small pieces below split every weight into many
    for staging in ((1000, 3), (768, 1), (4 * biggest, 2)):
        got = memo.compute(_groups(), dtype, mode="streamed", staging=staging)
        assert _same(got, plain), staging
        assert memo.last_pass[0] == "streamed" and memo.last_pass[1] > 0
    with torch.inference_mode():       # as ComfyUI's executor runs sampling
        assert _same(memo.compute(_groups(), dtype, mode="streamed", staging=(1000, 2)), plain)
    assert memo.stream_ok
    # rows are distinct per block and per group (a mix-up of modules or groups would show)
    b0 = plain[0][0]
    assert not torch.equal(b0[0], b0[1]) and not torch.equal(plain[0][0][0], plain[3][0][0])
    assert plain[1][0][0].shape[0] == 3 and plain[1][1].shape[0] == 3 and plain[0][0][0].dtype == dtype


def test_negative_control_a_dropped_piece_changes_rows(memo, monkeypatch):
    from h3_turbo.runtime import adaln_memo as M

    plain = memo.compute(_groups(), torch.float32, mode="plain")
    real = M._pieces
    monkeypatch.setattr(M, "_pieces", lambda n, size: real(n, size)[:-1] if n > size else real(n, size))
    got = memo.compute(_groups(), torch.float32, mode="streamed", staging=(1000, 3))
    assert memo.stream_ok and not _same(got, plain)


def test_failed_streamed_pass_is_logged_once_and_falls_back(memo, monkeypatch, caplog):
    from h3_turbo import state
    from h3_turbo.runtime import adaln_memo as M

    plain = memo.compute(_groups(), torch.float32, mode="plain")
    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise RuntimeError("cudaHostAlloc refused (test)")

    monkeypatch.setattr(M, "streamed_rows", refuse)
    monkeypatch.setattr(memo, "stream_ok", True)
    state.LOGGED.clear()
    M.WEIGHT_READS.clear()
    with caplog.at_level(logging.WARNING, logger="h3_turbo"):
        first = memo.compute(_groups(), torch.float32, mode="streamed")
        second = memo.compute(_groups(), torch.float32, mode="streamed")
    assert _same(first, plain) and _same(second, plain)
    assert calls == [1] and memo.stream_ok is False and memo.last_pass[0] == "plain"
    warns = [r for r in caplog.records if "streamed pass over the AdaLN weights failed" in r.getMessage()]
    assert len(warns) == 1 and warns[0].levelno == logging.WARNING
    assert "RuntimeError: cudaHostAlloc refused (test)" in warns[0].getMessage()
    assert M.WEIGHT_READS.counts["passes"] == 2 and M.WEIGHT_READS.counts["groups"] == 2 * len(GROUPS)


def test_auto_is_plain_on_the_cpu_and_a_bad_mode_is_refused(memo, monkeypatch):
    from h3_turbo.runtime import adaln_memo as M

    def never(*a, **k):
        raise AssertionError("streamed on the CPU")

    monkeypatch.setattr(M, "streamed_rows", never)
    monkeypatch.setattr(memo, "stream_ok", True)
    assert _same(memo.compute(_groups(), torch.float32), memo.compute(_groups(), torch.float32, mode="plain"))
    with pytest.raises(ValueError, match="mode='fast': expected auto, plain or streamed"):
        memo.compute(_groups(), torch.float32, mode="fast")


def test_auto_mode_streams_only_contiguous_cpu_weights_on_cuda(memo):
    """The choice ``auto`` makes, per device and weight layout: streamed for contiguous CPU weights on a CUDA device;
    plain on the CPU; plain, with the reason, for a strided weight (the streamed pass computes on contiguous copies,
    which could sum in another order)."""
    from h3_turbo.runtime import adaln_memo as M

    mods = memo._mods.modules
    assert M.auto_mode(mods, torch.device("cuda")) == ("streamed", None)
    assert M.auto_mode(mods, torch.device("cpu")) == ("plain", None)
    fin = torch.nn.Linear(4, 6, bias=False)
    fin.weight = torch.nn.Parameter(torch.zeros(4, 6).t(), requires_grad=False)     # a strided [6, 4] weight
    assert M.auto_mode(dict(mods, final=fin), torch.device("cuda")) == ("plain", "a non-contiguous AdaLN weight")
