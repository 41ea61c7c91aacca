"""torch FSDP: which parameters a module sees changes when FSDP wraps it (FSDP1's
`FullyShardedDataParallel`, FSDP2's `fully_shard`, both as accelerate's FSDP plugin uses them), and
FSDP's own activation checkpointing (`apply_activation_checkpointing` / `checkpoint_wrapper`)
checkpoints blocks that transformers may checkpoint too. Both are facts of the decision
(gcpatch/facts.py `fsdp_facts`), taken again when FSDP wraps the model or adds its wrappers, as
DDP's wrap is (R4): the record says what FSDP did, and the rules decide with the wrapped model.

Where the checkpoint call wraps an FSDP unit from outside (model families before transformers'
GradientCheckpointingLayer: `self._gradient_checkpointing_func(decoder_layer.__call__, ...)` on the
wrapped layer), reentrant recompute runs the unit's forward again inside backward: FSDP1 all-gathers
the unit's parameters a second time (transformers#30404, pytorch#105635), FSDP2 runs its forward
prefetch again. Non-reentrant recompute does not (F2; integration/test_fsdp_all_gather.py counts
them). It is a cost, not a failure: F2 recommends non-reentrant, and an explicit reentrant ask is
kept and told the cost. With the checkpoint inside the unit (GradientCheckpointingLayer) both
variants all-gather as often as no checkpointing, and F2 does not vote.
"""
from __future__ import annotations

from typing import Any

from gcpatch.hookspecs import hookimpl
from gcpatch.pipeline import redecide_within
from gcpatch.schema import RECOMMENDED, USE_REENTRANT, Facts, PatchPoint, PluginInfo, Rule, Vote

RULES = (
    Rule("F1", "FSDP wrapping (FSDP1, FSDP2 fully_shard, accelerate's FSDP plugin) and FSDP's own activation "
         "checkpointing are facts of the decision, decided again when FSDP wraps the model or adds its checkpoint "
         "wrappers",
         "torch/distributed/fsdp/_fully_shard/_fully_shard.py, torch/distributed/algorithms/_checkpoint/"
         "checkpoint_wrapper.py", documents=True),
    Rule("F2", "FSDP (FSDP1, or FSDP2 with forward prefetch) + a checkpoint call outside the FSDP unit (layers "
         "without GradientCheckpointingLayer) -> non-reentrant recommended: reentrant recompute all-gathers each "
         "unit again in backward; an explicit reentrant ask is kept and told the cost",
         "transformers#30404, pytorch#105635; torch/distributed/fsdp/_flat_param.py "
         "(FlatParamHandle._all_gather_flat_param); transformers/modeling_layers.py (4.52+)"),
)

INFO = PluginInfo(name="fsdp", framework="torch", versions=">=2.6,<3", rules=RULES, proven="==2.13.*")


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [
        PatchPoint("torch.distributed.fsdp", "fully_shard", _fully_shard, copies=True,
                   why="F1: FSDP2 wraps the model: decide again with the wrap as a fact"),
        PatchPoint("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel.__init__",
                   _fsdp1_init, why="F1: FSDP1 wraps the model: decide again with the wrap as a fact"),
        PatchPoint("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "apply_activation_checkpointing",
                   _apply_activation_checkpointing, copies=True,
                   why="F1: FSDP's own activation checkpointing is a fact of the decision"),
    ]


# What reentrant recompute outside the unit costs under each FSDP: in the record, told to a kept ask,
# in the one-line log.
_COSTS = {
    "fsdp1": ("reentrant recompute makes FSDP1 all-gather every checkpointed unit's parameters a second time in "
              "backward", "each FSDP1 unit is all-gathered twice in backward", "reentrant gathers FSDP1 units twice"),
    "fsdp2": ("reentrant recompute runs FSDP2's forward prefetch again in backward (an extra all-gather per unit "
              "where set_modules_to_forward_prefetch is set)", "FSDP2's forward prefetch runs again in backward",
              "reentrant re-runs FSDP2 prefetch"),
}


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    kinds = facts.fsdp.split(", ") if facts.fsdp else []
    if facts.stage != "enable" or not kinds or not facts.checkpointed_layers or facts.checkpoint_layer_api:
        return []
    cost, kept, short = _COSTS["fsdp1" if any(kind.endswith("fsdp1") for kind in kinds) else "fsdp2"]
    return [Vote(USE_REENTRANT, False, RECOMMENDED, "F2",
                 f"the checkpoint call wraps each FSDP unit from outside ({facts.model_class}'s layers predate "
                 f"GradientCheckpointingLayer): {cost} (transformers#30404)",
                 short=short, kept_cost=f"{kept}; use_reentrant=False avoids it (transformers#30404)")]


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
