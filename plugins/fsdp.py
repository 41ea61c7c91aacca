"""torch FSDP: which parameters a module sees changes when FSDP wraps it (FSDP1's
`FullyShardedDataParallel`, FSDP2's `fully_shard`, both as accelerate's FSDP plugin uses them), and
FSDP's own activation checkpointing (`apply_activation_checkpointing` / `checkpoint_wrapper`)
checkpoints blocks that transformers may checkpoint too. Both are facts of the decision
(gcpatch/facts.py `fsdp_facts`), taken again when FSDP wraps the model or adds its wrappers, as
DDP's wrap is (R4): the record says what FSDP did, and the rules decide with the wrapped model.

No rule here changes `use_reentrant` for FSDP. The extra all-gather of reentrant recompute under
FSDP1 FULL_SHARD (transformers#30404, pytorch#105635, verl#114) does not occur under FSDP2 on torch
2.13: integration/test_fsdp_frozen.py counts the same backward all-gathers with either variant, and
FSDP1 needs an accelerator to run at all, so a rule for it could not be proven here (F1's text).
"""
from __future__ import annotations

from typing import Any

from gcpatch.hookspecs import hookimpl
from gcpatch.pipeline import redecide_within
from gcpatch.schema import PatchPoint, PluginInfo, Rule

RULES = (
    Rule("F1", "FSDP wrapping (FSDP1, FSDP2 fully_shard, accelerate's FSDP plugin) and FSDP's own activation "
         "checkpointing are facts of the decision, decided again when FSDP wraps the model or adds its checkpoint "
         "wrappers; use_reentrant is not changed for FSDP: the reentrant extra all-gather of FSDP1 FULL_SHARD "
         "(transformers#30404) is not seen under FSDP2 on torch 2.13 (same backward all-gathers measured)",
         "torch/distributed/fsdp/_fully_shard/_fully_shard.py, torch/distributed/algorithms/_checkpoint/"
         "checkpoint_wrapper.py, transformers#30404, pytorch#105635", documents=True),
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
