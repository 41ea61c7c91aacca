"""gcpatch marks its checkpoint frames for torch.compile when dynamo loads (checkpoint_call
`_eager_under_dynamo`), inside the host's own import of torch._dynamo: a dynamo without the hook it
uses, or one whose hook fails, leaves the import alone and says so in one line."""

from __future__ import annotations

import logging
import types

import pytest

torch = pytest.importorskip("torch")
from gcpatch import checkpoint_call, patching  # noqa: E402


def test_each_frame_gcpatch_decides_in_is_handed_to_dynamo(caplog):
    handed = []
    checkpoint_call._eager_under_dynamo(types.SimpleNamespace(skip_code=handed.append))
    assert handed[0] is patching.FUNCTION_WRAPPER_CODE and handed[1] is checkpoint_call.run.__code__
    assert handed[2] is checkpoint_call._inside_checkpoint(len).__code__ and len(handed) == 3
    assert not caplog.records


def test_a_dynamo_without_skip_code_is_said_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        checkpoint_call._eager_under_dynamo(types.SimpleNamespace())
    assert [r.getMessage() for r in caplog.records] == [
        "gcpatch: this torch's dynamo has no skip_code; a checkpoint call in a frame torch.compile gives back "
        "to eager may add a graph break"
    ]


def test_a_failing_skip_code_never_reaches_the_import(caplog):
    def broken(code):
        raise RuntimeError("no such strategy")

    with caplog.at_level(logging.INFO, logger="gcpatch"):
        checkpoint_call._eager_under_dynamo(types.SimpleNamespace(skip_code=broken))
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert "RuntimeError: no such strategy" in caplog.records[0].getMessage()


def test_the_wrapper_code_is_the_code_of_every_plain_function_wrapper():
    wrapper = patching._function_wrapper(abs, patching._passthrough)
    assert wrapper.__code__ is patching.FUNCTION_WRAPPER_CODE and wrapper(-2) == 2
