"""torch DDP: `find_unused_parameters=True` with reentrant checkpointing marks a parameter ready
twice ("Expected to mark a variable ready only once", trl#4782, accelerate#2017). DDP wraps the
model after checkpointing was enabled, so the decision is taken again when DDP is built (R4).
Every rank builds DDP with the same arguments: the re-decision is the same on every rank, and
`gcpatch.agreement` checks that every rank's set-up agrees before DDP's own collectives run.
"""

from __future__ import annotations

import inspect
from typing import Any

from gcpatch import agreement
from gcpatch.plugin import (
    CRASH,
    REQUIRED,
    USE_REENTRANT,
    Facts,
    GcpatchError,
    PatchPoint,
    PluginInfo,
    Rule,
    Stage,
    Vote,
    hookimpl,
    redecide_within,
)

RULES = (
    Rule(
        "R4",
        "multi-process DDP with find_unused_parameters=True + reentrant -> non-reentrant",
        "torch/nn/parallel/distributed.py; trl#4782, accelerate#2017, TRL T4",
    ),
)

INFO = PluginInfo(
    name="ddp", framework="torch", versions=">=2.0", rules=RULES, proven=">=2.13,<2.16"
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [
        PatchPoint(
            "torch.nn.parallel.distributed",
            "DistributedDataParallel.__init__",
            _ddp_init,
            why="R4: decide again when DDP wraps a checkpointed model",
        )
    ]


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage == Stage.ENABLE and facts.world_size > 1 and facts.find_unused_parameters:
        return [
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "R4",
                f"DDP over {facts.world_size} processes with find_unused_parameters=True: reentrant"
                " recompute marks parameters ready twice",
                avoids=CRASH,
                short=f"DDP find_unused_parameters on {facts.world_size} processes would crash",
            )
        ]
    return []


def _ddp_init(wrapped: Any, ddp: Any, args: tuple, kwargs: dict) -> Any:
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    module = bound.get("module")
    error = None
    if bound.get("find_unused_parameters") and module is not None:
        try:
            redecide_within(
                module, "DDP(find_unused_parameters=True) (R4)", find_unused_parameters=True
            )
        except GcpatchError as exc:  # strict mode: every rank stops with it, not this one alone
            error = exc
    if module is not None:  # DDP's constructor is collective: every rank of the group gets here
        mesh = bound.get("device_mesh")
        agreement.agree(
            module,
            bound.get("process_group") or (mesh.get_group() if mesh is not None else None),
            error,
        )
    elif error is not None:
        raise error
    return wrapped(*args, **kwargs)
