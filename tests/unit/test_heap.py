"""gcpatch/step/heap.py: on glibc the C heap's free pages go back to the operating system after
each of gcpatch's measuring steps (integration/test_budget_selective.py measures what that saves)."""

from __future__ import annotations

import platform

import pytest

from gcpatch.step import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_on_glibc_the_heap_is_trimmed():
    assert heap._malloc_trim() is not None
    buffers = [bytearray(256 * 1024) for _ in range(64)]  # heap chunks, then freed
    del buffers
    assert heap.release() is None
