"""torch FSDP (FSDP1's `FullyShardedDataParallel`, FSDP2's `fully_shard`, as accelerate uses them)
and its own activation checkpointing: facts of the decision (gcpatch/facts.py `fsdp_facts`), taken
again when FSDP wraps the model or adds its wrappers, as DDP's wrap is (R4).

F2: where the checkpoint call encloses FSDP's unshard, reentrant recompute runs it again inside
backward (FSDP1: transformers#30404, pytorch#105635; FSDP2: its forward prefetch). Which FSDP is
enclosed depends on `Facts.checkpoint_site`: "loop" both, "layer_call" (transformers 4.52-5.22)
FSDP2's hooks, "layer_forward" (5.23+) neither. A cost, not a failure: F2 recommends
non-reentrant, and keeps an explicit reentrant ask, told the cost.
"""

from __future__ import annotations

from typing import Any

from gcpatch.plugin import (
    RECOMMENDED,
    USE_REENTRANT,
    Facts,
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
        "F1",
        "FSDP wrapping (FSDP1, FSDP2 fully_shard, accelerate's FSDP plugin) and FSDP's own"
        " activation checkpointing are facts of the decision, decided again when FSDP wraps the"
        " model or adds its checkpoint wrappers",
        "torch/distributed/fsdp/_fully_shard/_fully_shard.py,"
        " torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py",
        documents=True,
    ),
    Rule(
        "F2",
        "FSDP + a checkpoint call that encloses FSDP's unshard (FSDP1: layers checkpointed by the"
        " stack's loop, before GradientCheckpointingLayer; FSDP2: also GradientCheckpointingLayer's"
        " __call__, transformers 4.52-5.22) -> non-reentrant recommended: reentrant recompute"
        " all-gathers again in backward (FSDP1 each unit, FSDP2 its forward prefetch); an explicit"
        " reentrant ask is kept and told the cost",
        "transformers#30404, pytorch#105635; torch/distributed/fsdp/_flat_param.py"
        " (FlatParamHandle._all_gather_flat_param); transformers/modeling_layers.py"
        " (GradientCheckpointingLayer 4.52-5.22 __call__, 5.23 forward)",
    ),
)

INFO = PluginInfo(
    name="fsdp", framework="torch", versions=">=2.6,<3", rules=RULES, proven=">=2.13,<2.16"
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [
        PatchPoint(
            "torch.distributed.fsdp",
            "fully_shard",
            _fully_shard,
            copies=True,
            why="F1: FSDP2 wraps the model: decide again with the wrap as a fact",
        ),
        PatchPoint(
            "torch.distributed.fsdp.fully_sharded_data_parallel",
            "FullyShardedDataParallel.__init__",
            _fsdp1_init,
            why="F1: FSDP1 wraps the model: decide again with the wrap as a fact",
        ),
        PatchPoint(
            "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
            "apply_activation_checkpointing",
            _apply_activation_checkpointing,
            copies=True,
            why="F1: FSDP's own activation checkpointing is a fact of the decision",
        ),
    ]


# What reentrant recompute outside the unit costs under each FSDP: in the record, told to a kept
# ask,
# in the one-line log.
_COSTS = {
    "fsdp1": (
        (
            "reentrant recompute makes FSDP1 all-gather every checkpointed unit's parameters a"
            " second time in backward"
        ),
        "each FSDP1 unit is all-gathered twice in backward",
        "reentrant gathers FSDP1 units twice",
    ),
    "fsdp2": (
        (
            "reentrant recompute runs FSDP2's forward prefetch again in backward (an extra"
            " all-gather per unit where set_modules_to_forward_prefetch is set)"
        ),
        "with forward prefetch set, FSDP2 all-gathers again in backward",
        "reentrant re-runs FSDP2 prefetch",
    ),
}


# The checkpoint sites whose reentrant recompute runs each FSDP's unshard again
# (facts.checkpoint_site).
_ENCLOSED = {"fsdp1": ("loop",), "fsdp2": ("loop", "layer_call")}


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage != Stage.ENABLE or not facts.fsdp:
        return []
    kinds = ["fsdp1" if kind.endswith("fsdp1") else "fsdp2" for kind in facts.fsdp.split(", ")]
    enclosed = [kind for kind in kinds if facts.checkpoint_site in _ENCLOSED[kind]]
    if not enclosed:
        return []
    cost, kept, short = _COSTS[enclosed[0]]
    return [
        Vote(
            USE_REENTRANT,
            False,
            RECOMMENDED,
            "F2",
            "the checkpoint call encloses FSDP's unshard (checkpoint site:"
            f" {facts.checkpoint_site}, {facts.model_class}): {cost} (transformers#30404)",
            short=short,
            kept_cost=f"{kept}; use_reentrant=False avoids it (transformers#30404)",
        )
    ]


def _fully_shard(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    module = args[0] if args else kwargs.get("module")
    for root in module if isinstance(module, (list, tuple)) else (module,):
        if root is not None and hasattr(root, "modules"):
            redecide_within(root, "fully_shard (FSDP2, F1)", fsdp="fsdp2")
    return result


def _fsdp1_init(wrapped: Any, fsdp: Any, args: tuple, kwargs: dict) -> Any:
    module = args[0] if args else kwargs.get("module")
    if module is not None:  # before the wrap: FSDP1 flattens the parameters the facts count
        redecide_within(module, "FullyShardedDataParallel (FSDP1, F1)", fsdp="fsdp1")
    return wrapped(*args, **kwargs)


def _apply_activation_checkpointing(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    if model is not None and hasattr(model, "modules"):
        redecide_within(model, "apply_activation_checkpointing (FSDP, F1)")
    return result
