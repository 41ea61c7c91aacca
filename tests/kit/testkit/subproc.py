"""What the installed frameworks are, for the fast suite's skips; running a fresh interpreter
is tests/kit/testkit/harness.py's job (every behaviour that depends on start-up or import order is proved
there, as a user would meet it)."""

from __future__ import annotations

import pytest


def transformers_major() -> int | None:
    from importlib import metadata

    try:
        return int(metadata.version("transformers").split(".")[0])
    except metadata.PackageNotFoundError:
        return None


def transformers_version():
    """The installed transformers release (packaging Version), or None."""
    from importlib import metadata

    from packaging.version import Version

    try:
        return Version(metadata.version("transformers"))
    except metadata.PackageNotFoundError:
        return None


requires_transformers = pytest.mark.skipif(
    transformers_major() is None, reason="transformers not installed"
)
