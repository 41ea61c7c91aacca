"""torch: the `torch.utils.checkpoint.checkpoint` call itself, where every checkpointing path
meets (hand-written models, FSDP's `checkpoint_wrapper`, libraries calling torch directly).

Patched under every name it is bound to when gcpatch starts (`from torch.utils.checkpoint import
checkpoint` copies, such as FSDP's `torch_utils_checkpoint` and transformers' `checkpoint`) and in
the default arguments captured from it. Calls an enable-time decision covers follow it (CK4); the
others are decided by the rules below, from the call's own arguments.
"""
from __future__ import annotations

from gcpatch import checkpoint_call
from gcpatch.plugin import (
    CRASH,
    REQUIRED,
    RUN_INLINE,
    USE_REENTRANT,
    WRONG_GRADIENTS,
    CallFacts,
    PatchPoint,
    PluginInfo,
    Rule,
    Vote,
    hookimpl,
)

RULES = (
    Rule("CK1", "a reentrant checkpoint call (asked or torch's default) with grad enabled, no tensor input that "
         "requires grad and trainable parameters inside (or none knowable) -> non-reentrant: reentrant would give "
         "those parameters no gradient", "torch/utils/checkpoint.py (docs: 'At least one input and output must have "
         "requires_grad=True for the reentrant variant'), transformers#21381"),
    Rule("CK2", "a checkpoint call made while another checkpoint's function runs (FSDP's checkpoint_wrapper around "
         "layers that checkpoint themselves) -> its function runs directly: the outer checkpoint already frees and "
         "recomputes it, the inner one would recompute it a second time",
         "torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py, transformers/modeling_layers.py"),
    Rule("CK3", "context_fn (selective checkpointing) on a reentrant call -> non-reentrant, the only variant that "
         "takes it; a context_fn call is never made reentrant", "torch/utils/checkpoint.py (checkpoint: 'Passing "
         "`context_fn` or `debug` is only supported when use_reentrant=False')"),
    Rule("CK4", "a call from a module whose checkpointing gcpatch decided at enable time follows that decision "
         "and is not decided again (R1-R6, P1, R3, R4 stand, including R3's reentrant under ZeRO-3)",
         "gcpatch/checkpoint_call.py", documents=True),
)

INFO = PluginInfo(name="torch", framework="torch", versions=">=2.0,<3", rules=RULES, proven="==2.13.*")


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [PatchPoint("torch.utils.checkpoint", "checkpoint", checkpoint_call.run, copies=True,
                       guarded=True, why="CK1-CK4: the call every checkpointing path makes")]


@hookimpl
def gcpatch_call_vote(facts: CallFacts) -> list[Vote]:
    if facts.nested:
        return [Vote(RUN_INLINE, True, REQUIRED, "CK2", "called inside another checkpoint, which already frees and "
                     "recomputes it: checkpointing it again would run it a third time",
                     short="already inside a checkpoint: one recompute, not two")]
    votes: list[Vote] = []
    if facts.reentrant and facts.context_fn:
        votes.append(Vote(USE_REENTRANT, False, REQUIRED, "CK3", "context_fn is taken by non-reentrant checkpointing "
                          "only (reentrant raises ValueError)", avoids=CRASH,
                          short="context_fn needs non-reentrant"))
    if facts.reentrant and facts.grad_enabled and not facts.inputs_require_grad and facts.trainable_inside is not False:
        inside = "trainable parameters inside" if facts.trainable_inside else "parameters inside cannot be known"
        votes.append(Vote(USE_REENTRANT, False, REQUIRED, "CK1", f"no tensor input requires grad and {inside}: "
                          "reentrant would give them no gradient", avoids=WRONG_GRADIENTS,
                          short="no input requires grad: parameters inside would get none"))
    return votes
