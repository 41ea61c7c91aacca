"""Which process this is in a job, and the process group's key-value store: the one place that
reads the launcher's rank variables, so the record, the console and the crash notes never
disagree about a rank.

One fallback order: RANK, else the process group's rank (`mp.spawn` sets no variable), else
LOCAL_RANK (one node: the same number), else 0. The local rank reads LOCAL_RANK first. A rank is
for records and for choosing who speaks, never a decision input (a decision that differs between
ranks deadlocks DDP).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from gcpatch import settings

log = logging.getLogger("gcpatch")
_MEANING = "this process's rank (records and console lines only)"


def rank() -> int:
    """This process's global rank: RANK, else the process group's, else LOCAL_RANK, else 0."""
    if "RANK" in os.environ:
        return settings.int_env("RANK", 0, _MEANING)
    group = group_rank()
    if group is not None:
        return group
    return settings.int_env("LOCAL_RANK", 0, _MEANING)


def local_rank() -> int:
    """This process's rank on its node: LOCAL_RANK, else the global rank."""
    if "LOCAL_RANK" in os.environ:
        return settings.int_env("LOCAL_RANK", 0, _MEANING)
    return rank()


def group_rank() -> int | None:
    """The default process group's rank, or None where there is no process group (yet)."""
    dist = _initialized()
    if dist is None:
        return None
    try:
        return int(dist.get_rank())
    except Exception as exc:  # noqa: BLE001
        log.debug("gcpatch: no process-group rank (%s: %s)", type(exc).__name__, exc)
        return None


def store() -> Any:
    """The default process group's key-value store where the group has two or more processes,
    else None (nothing to compare with)."""
    dist = _initialized()
    try:
        if dist is None or dist.get_world_size() < 2:
            return None
    except Exception as exc:  # noqa: BLE001
        log.debug("gcpatch: no process-group size (%s: %s)", type(exc).__name__, exc)
        return None
    return default_store(dist)


def default_store(dist: Any) -> Any:
    """The process group's key-value store, or None (logged) where there is none."""
    getter = getattr(getattr(dist, "distributed_c10d", None), "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception as exc:  # noqa: BLE001
        log.debug("gcpatch: no process-group store to compare ranks with (%s)", exc)
        return None


def _initialized() -> Any:
    """torch.distributed when it is imported and its default group exists; never imports it."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception as exc:  # noqa: BLE001
        log.debug(
            "gcpatch: cannot tell whether a process group exists (%s: %s)", type(exc).__name__, exc
        )
    return None


# how long the ranks' agreement on a step's plan waits for every rank (a rank that never joins
# fails it with a line: that step checkpoints every layer)
AGREE_TIMEOUT_S = 300.0


def agree_max(values: list[int], device: Any = None) -> list[int] | None:
    """Each value's largest over the ranks of the default group (one all_reduce, waited for at
    most AGREE_TIMEOUT_S; the values themselves without a group of several ranks), or None where
    it failed (said)."""
    dist = _initialized()
    if dist is None or dist.get_world_size() < 2:
        return list(values)
    torch = sys.modules["torch"]
    from datetime import timedelta

    try:
        if device is None and "nccl" in str(dist.get_backend()):
            device = torch.device("cuda", torch.cuda.current_device())
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        work.wait(timeout=timedelta(seconds=AGREE_TIMEOUT_S))
        return [int(v) for v in tensor.tolist()]
    except Exception as exc:  # noqa: BLE001 (the caller falls back to its strongest plan)
        log.warning(
            "gcpatch: rank %d: the ranks did not agree on a plan within %g s (%s: %s)",
            rank(),
            AGREE_TIMEOUT_S,
            type(exc).__name__,
            exc,
        )
        return None
