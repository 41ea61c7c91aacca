"""gcpatch/step/heap.py: on glibc the C heap's free pages go back to the operating system after
each of gcpatch's measuring steps (integration/test_budget_selective.py measures what that saves
a whole job)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from gcpatch.step import heap

MIB = 2**20


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_on_glibc_freed_heap_pages_go_back_to_the_operating_system():
    # 125 MiB of heap chunks (each below malloc's mmap threshold), freed beneath one still alive:
    # free() alone leaves them resident, as a measuring step's freed tensors were
    chunks = [bytearray(64 * 1024) for _ in range(2000)]
    above = bytearray(64 * 1024)
    del chunks
    freed = _resident()
    heap.release()
    assert freed - _resident() >= 100 * MIB
    del above
