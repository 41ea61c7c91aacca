"""X6's releases: the Qwen3 multimodal text models' forward is wrapped on transformers 4.57-5.2
and on nothing else (transformers#44158 landed in 5.3.0; Qwen3-VL came with 4.57.0)."""

from __future__ import annotations

import sys

import pytest

transformers = pytest.importorskip("transformers")

from gcpatch import mrope_mask  # noqa: E402


@pytest.mark.parametrize(
    "version, wrapped",
    [
        ("4.56.2", False),
        ("4.57.0", True),
        ("4.57.6", True),
        ("5.0.0", True),
        ("5.2.0", True),
        ("5.3.0", False),
        ("5.24.0", False),
    ],
)
def test_the_mask_is_handed_only_on_the_releases_before_the_fix(monkeypatch, version, wrapped):
    # the running transformers, as the module the patch point reads (another test may have
    # imported a second copy)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    assert mrope_mask.applies(None) is wrapped
