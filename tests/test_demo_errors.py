"""The demo's log filter: core's executor traceback is dropped for the pack's own errors (their message names the
file, the key and what was expected) and kept for every other exception (``--traceback`` keeps them all)."""
from __future__ import annotations

import logging
import traceback

from h3_turbo.demo import _no_traceback_for_pack_errors
from h3_turbo.errors import CheckpointError


def _verdicts(exc):
    """The filter's verdicts on core's two records, judged inside the except block as core logs them."""
    try:
        raise exc
    except Exception as e:
        recs = [logging.LogRecord("root", logging.ERROR, __file__, 1, msg, None, None)
                for msg in (f"!!! Exception during processing !!! {e}", traceback.format_exc())]
        assert recs[1].msg.startswith("Traceback (most recent call last)")
        return [_no_traceback_for_pack_errors(r) for r in recs]


def test_pack_error_keeps_its_one_line_and_drops_the_traceback():
    assert _verdicts(CheckpointError("f.safetensors", "shape [2, 3]", key="x", expected="[2, 2]")) == [True, False]


def test_other_exceptions_keep_their_traceback():
    assert _verdicts(RuntimeError("a bug")) == [True, True]
    rec = logging.LogRecord("root", logging.ERROR, __file__, 1, "Traceback (most recent call last): ...", None, None)
    assert _no_traceback_for_pack_errors(rec) is True        # outside an except block: nothing to judge by
