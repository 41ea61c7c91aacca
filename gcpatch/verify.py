"""Verify mode's documented entry: `gcpatch.verify.check` (what the `gcpatch_verify` pytest fixture
runs) and its `Report`. The first step's verification lives in gcpatch/step/verify.py."""

from __future__ import annotations

from gcpatch.step.verify import Report, check

__all__ = ["Report", "check"]
