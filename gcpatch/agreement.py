"""Rank agreement: every rank of a DDP group checkpoints the same way, or every rank stops with
the same error. Never a silent split, never a hang.

Facts are rank-independent by design, so ranks decide the same; a failure on one rank only (it
fails open to the framework's behaviour while the others apply R4) would still split them, and
a split is DDP's "mark a variable ready only once" crash or a hang. The check runs inside DDP's
constructor, which every rank of the group must reach anyway (it is itself collective), and
exchanges through the process group's key-value store, not a collective: `store.wait` has a
timeout and cannot desynchronise the group's own collectives. On a timeout the check is skipped
with one line, leaving DDP as it would have been.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from datetime import timedelta
from typing import Any

from gcpatch import apply, console, context, lifetime, record
from gcpatch.errors import GcpatchError
from gcpatch.facts import checkpoint_layers
from gcpatch.ranks import default_store

log = logging.getLogger("gcpatch")
RULE = "gcpatch:ranks"
DEFAULT_TIMEOUT_S = (
    1800.0  # as long as DDP's own collectives wait by default (gloo and NCCL: 30 min)
)
# DDP constructions per group, the same count on every rank
_rounds: dict[tuple[int, ...], int] = {}


@lifetime.activation
def reset() -> None:
    _rounds.clear()


def fingerprint(root: Any) -> dict[str, Any]:
    """What this rank actually applied inside `root`: per checkpointed layer, whether it
    checkpoints and with which use_reentrant; per decided model, its input-grads hooks and
    use_cache. Read from the modules, not from the record: a rank that failed open has none."""
    layers = []
    for layer in checkpoint_layers(root):
        func = getattr(layer, "_gradient_checkpointing_func", None)
        for _ in range(10):  # R5's eval-mode fix wraps transformers' functools.partial
            if isinstance(func, functools.partial) or not hasattr(func, "func"):
                break
            func = func.func
        keywords = getattr(func, "keywords", None) or {}
        layers.append(
            [
                bool(getattr(layer, "gradient_checkpointing", False)),
                repr(keywords.get("use_reentrant")),
            ]
        )
    models = []
    for module in context.decided_within(root):
        config = getattr(module, "config", None)
        models.append(
            [
                type(module).__name__,
                bool(apply.input_hooks_installed(module)),
                repr(getattr(config, "use_cache", None)),
            ]
        )
    return {"layers": layers, "models": models}


def agree(
    root: Any, group: Any = None, error: BaseException | None = None, timeout_s: float | None = None
) -> None:
    """Compare this rank's set-up of `root` with every other rank of `group` (default: the
    world). Raises the same GcpatchError on every rank when they differ or when one of them
    raised `error` (strict mode); re-raises `error` when there is no one to compare with."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        _reraise(error)
        return
    ranks = (
        tuple(dist.get_process_group_ranks(group))
        if group is not None
        else tuple(range(dist.get_world_size()))
    )
    store = default_store(dist)
    if len(ranks) < 2 or store is None:
        _reraise(error)
        return
    me = dist.get_rank()
    _rounds[ranks] = round_ = _rounds.get(ranks, 0) + 1
    prefix = f"gcpatch/agree/{'-'.join(map(str, ranks))}/{round_}/"
    payload: dict[str, Any] = {
        "error": f"{type(error).__name__}: {error}" if error else None,
        "failed_open": _last_failure(),
    }
    try:
        payload["state"] = fingerprint(root)
    except Exception as exc:  # noqa: BLE001 (published, so no rank waits for a key that never comes)
        payload["state"] = None
        payload["unreadable"] = f"{type(exc).__name__}: {exc}"
    store.set(prefix + str(me), json.dumps(payload))
    wait = timedelta(seconds=timeout_s if timeout_s is not None else _timeout_s(store))
    try:
        store.wait([prefix + str(r) for r in ranks], wait)
        found = {r: json.loads(store.get(prefix + str(r))) for r in ranks}
    except Exception as exc:  # noqa: BLE001
        log.warning(
            "gcpatch: rank %d could not compare its checkpointing set-up with ranks %s within %ss "
            "(%s: %s); DDP goes on unchecked",
            me,
            list(ranks),
            wait.total_seconds(),
            type(exc).__name__,
            exc,
        )
        _reraise(error)
        return
    console.exchange(store)  # every rank is here: rank 0's decision lines are published by now
    verdict = _verdict(found)
    if verdict:
        raise GcpatchError(
            verdict,
            rule=RULE,
            fix=(
                "fix the failure the differing rank logged, or run every rank "
                "unpatched with GCPATCH=0"
            ),
        ) from error
    for r, data in found.items():
        if data.get("unreadable"):
            log.warning(
                "gcpatch: rank %d's checkpointing set-up could not be read (%s); not compared",
                r,
                data["unreadable"],
            )
    _reraise(error)


def _verdict(found: dict[int, dict[str, Any]]) -> str:
    """The one message every rank raises (built from the same data, in rank order), or ''."""
    errors = {r: d["error"] for r, d in sorted(found.items()) if d.get("error")}
    if errors:
        named = "; ".join(f"rank {r}: {text}" for r, text in errors.items())
        return (
            f"gcpatch stopped every rank at DDP construction because {len(errors)} of {len(found)}"
            f" ranks raised ({named}); the others would wait for them forever"
        )
    states = {r: d["state"] for r, d in sorted(found.items()) if d.get("state") is not None}
    distinct = {json.dumps(s, sort_keys=True) for s in states.values()}
    if len(distinct) <= 1:
        return ""
    groups: dict[str, list[int]] = {}
    for r, state in states.items():
        groups.setdefault(json.dumps(state, sort_keys=True), []).append(r)
    described = []
    for ranks in groups.values():
        state = states[ranks[0]]
        reentrant = sorted({layer[1] for layer in state["layers"] if layer[0]}) or [
            "(not checkpointing)"
        ]
        why = "; ".join(
            sorted({found[r]["failed_open"] for r in ranks if found[r].get("failed_open")})
        )
        described.append(
            f"rank(s) {', '.join(map(str, ranks))}: use_reentrant={'/'.join(reentrant)}, "
            f"input-grads hooks {[m[1] for m in state['models']]}"
            + (f", failed open ({why})" if why else "")
        )
    return (
        "ranks checkpoint differently at DDP construction, which crashes DDP (a parameter marked"
        " ready twice) or hangs it: "
        + " | ".join(described)
        + "; gcpatch stopped every rank with this same error"
    )


def _last_failure() -> str:
    for entry in reversed(record.history()):
        if "failed_open" in entry:
            return f"{entry.get('stage')}: {entry['failed_open']}"
    return ""


def _timeout_s(store: Any) -> float:
    try:
        return min(float(store.timeout.total_seconds()), DEFAULT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        log.debug(
            "gcpatch: R4: the store has no readable timeout (%s); waiting %s s for the other ranks",
            exc,
            DEFAULT_TIMEOUT_S,
        )
        return DEFAULT_TIMEOUT_S


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error
