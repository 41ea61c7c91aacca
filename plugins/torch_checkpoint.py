"""torch: the `torch.utils.checkpoint.checkpoint` call itself, where every checkpointing path
meets (hand-written models, FSDP's `checkpoint_wrapper`, libraries calling torch directly).

Patched under every name it is bound to when gcpatch starts (`from torch.utils.checkpoint import
checkpoint` copies, such as FSDP's `torch_utils_checkpoint` and transformers' `checkpoint`) and in
the default arguments captured from it. Calls an enable-time decision covers stand on it (CK4); the
others are decided by the rules below, from the call's own arguments, and the call's own evidence
(CK1, CK5) outranks the enable-time decision where the two disagree.
"""

from __future__ import annotations

from gcpatch.call import checkpoint_call, reentrant_grads
from gcpatch.plugin import (
    CRASH,
    GRAD_INPUT,
    LIFT_BOUND_TENSORS,
    REQUIRED,
    RUN_INLINE,
    TUPLE_OUTPUTS,
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
    Rule(
        "CK1",
        "a reentrant checkpoint call (asked, torch's default, or decided at enable time) with grad"
        " enabled, no positional tensor input that requires grad, and trainable parameters or"
        " grad-requiring tensors reachable inside (modules, bound methods, a partial's arguments"
        " and keywords, closures, default arguments, containers among its arguments; or none"
        " knowable): reentrant would give them no gradient. Where what is inside is known and no"
        " tensor with a graph reaches it unseen, reentrant is kept and made exact (the fix that"
        " changes least, and reentrant tolerates a recompute that saves other tensors than the"
        " forward): the partial's graph tensors become its positional inputs, else one more input"
        " that requires grad is passed (as R2's input-grads hook does for a model's layers); else"
        " non-reentrant. The call's own facts are evidence: they outrank an enable-time decision"
        " that covers the call (CK4)",
        "torch/utils/checkpoint.py (docs: 'At least one input and output must have"
        " requires_grad=True for the reentrant variant'), transformers/modeling_layers.py"
        " (GradientCheckpointingLayer docstring: inputs that require gradients must be passed"
        " positionally), transformers#21381",
    ),
    Rule(
        "CK2",
        "a checkpoint call made while another checkpoint's function runs (FSDP's checkpoint_wrapper"
        " around layers that checkpoint themselves) -> its function runs directly: the outer"
        " checkpoint already frees and recomputes it, the inner one would recompute it a second"
        " time",
        "torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py,"
        " transformers/modeling_layers.py",
    ),
    Rule(
        "CK3",
        "context_fn (selective checkpointing) on a reentrant call -> non-reentrant, the only"
        " variant that takes it; a context_fn call is never made reentrant",
        "torch/utils/checkpoint.py (checkpoint: 'Passing "
        "`context_fn` or `debug` is only supported when use_reentrant=False')",
    ),
    Rule(
        "CK4",
        "a call from a module whose checkpointing gcpatch decided at enable time stands on that"
        " decision (R1-R6, P1, R3, R4, a user's ask, with their strength); only the call's own"
        " evidence (CK1, CK5) outranks it, and the record and the line say which evidence overrode"
        " which rule",
        "gcpatch/call/checkpoint_call.py",
        documents=True,
    ),
    Rule(
        "CK5",
        "a reentrant call whose positional input requires grad, but whose function also reaches a"
        " grad-requiring tensor with a graph of its own by another way (a keyword, a closure, a"
        " default argument, or inside a list, tuple, dict or dataclass argument) -> that tensor is"
        " passed to the checkpoint as a positional input where it is an argument of the partial"
        " (reentrant kept, the user's choice), else non-reentrant: reentrant backward runs that"
        " tensor's graph inside its own backward, which crashes ('Trying to backward through the"
        " graph a second time') when another checkpoint or the rest of the model uses it too. A"
        " tensor without a graph (a leaf) is left as it is: reentrant backward reaches it exactly"
        " (transformers' Mllama cross-attention states passed by keyword)",
        "torch/utils/checkpoint.py (CheckpointFunction.forward saves only tensor arguments;"
        " CheckpointFunction.backward: torch.autograd.backward(outputs, args)),"
        " transformers/models/mllama/modeling_mllama.py (cross_attention_states=...)",
    ),
    Rule(
        "CK6",
        "torch.autograd.grad or backward(inputs=...) through a graph that holds reentrant"
        " checkpoints (torch refuses them there), asking for leaf tensors' gradients, no process"
        " group -> fix mode takes those gradients by one ordinary backward into .grad and gives"
        " every other .grad back, which is what the call returns under non-reentrant; known only"
        " when the gradients are taken. Elsewhere torch's error carries the note naming"
        " use_reentrant=False",
        "torch/utils/checkpoint.py (CheckpointFunction.backward: "
        "'torch.utils.checkpoint is incompatible with .grad()'), gcpatch/call/reentrant_grads.py",
        documents=True,
    ),
    Rule(
        "CK7",
        "a reentrant call whose function returns tensors inside a dict, list, nested tuple or"
        " ModelOutput (anything but a tensor or a tuple of them): reentrant tracks only those, so"
        " the others come back without a graph and everything before them gets no gradient. Seen"
        " at the function's first result, whose call runs again from the same RNG state: the"
        " result passes through the checkpoint as a flat tuple and is rebuilt after it (reentrant"
        " kept), or non-reentrant where torch's pytree cannot flatten it (a dataclass)",
        "torch/utils/checkpoint.py (CheckpointFunction is an autograd.Function: only its tensor"
        " outputs, or a tuple's, are tracked), torch/utils/_pytree.py,"
        " transformers/utils/generic.py (ModelOutput registers itself with pytree)",
    ),
)

INFO = PluginInfo(
    name="torch", framework="torch", versions=">=2.0,<3", rules=RULES, proven=">=2.13,<2.16"
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [
        PatchPoint(
            "torch.utils.checkpoint",
            "checkpoint",
            checkpoint_call.run,
            copies=True,
            guarded=True,
            why="CK1-CK5, CK7: the call every checkpointing path makes",
        ),
        PatchPoint(
            "torch.autograd",
            "grad",
            reentrant_grads.grad,
            guarded=True,
            why="CK6: gradients asked for through reentrant checkpoints",
        ),
        PatchPoint(
            "torch.autograd",
            "backward",
            reentrant_grads.backward,
            guarded=True,
            why="CK6: backward(inputs=...) through reentrant checkpoints",
        ),
    ]


@hookimpl
def gcpatch_call_vote(facts: CallFacts) -> list[Vote]:
    if facts.nested:
        return [
            Vote(
                RUN_INLINE,
                True,
                REQUIRED,
                "CK2",
                "called inside another checkpoint, which already frees and "
                "recomputes it: checkpointing it again would run it a third time",
                short="already inside a checkpoint: one recompute, not two",
            )
        ]
    votes: list[Vote] = []
    if facts.reentrant and facts.context_fn:
        votes.append(
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "CK3",
                "context_fn is taken by non-reentrant checkpointing "
                "only (reentrant raises ValueError)",
                avoids=CRASH,
                short="context_fn needs non-reentrant",
            )
        )
    if facts.reentrant and facts.grad_enabled:
        votes += _ck1(facts) + _ck5(facts) + _ck7(facts)
    return votes


def _ck1(facts: CallFacts) -> list[Vote]:
    """No input requires grad and something inside trains: reentrant kept where it can be made
    exact (the bound graph tensors lifted, or one more input that requires grad), else
    non-reentrant."""
    if facts.inputs_require_grad or facts.trainable_inside is False:
        return []
    short = "no input requires grad: parameters inside would get none"
    unseen = facts.container_graph_tensors or (
        facts.bound_graph_tensors and not facts.bound_graph_liftable
    )
    if facts.trainable_inside and not unseen:
        if facts.bound_graph_tensors:
            return [
                Vote(
                    LIFT_BOUND_TENSORS,
                    True,
                    REQUIRED,
                    "CK1",
                    "no positional tensor input requires grad: the partial's"
                    f" {facts.bound_graph_tensors} grad-requiring tensor(s) with a graph become its"
                    " positional inputs, so reentrant (kept) gives every gradient inside",
                    avoids=WRONG_GRADIENTS,
                    short=short,
                )
            ]
        return [
            Vote(
                GRAD_INPUT,
                True,
                REQUIRED,
                "CK1",
                "no positional tensor input requires grad and trainable parameters or"
                " grad-requiring tensors are inside: one more input that requires grad makes"
                " reentrant (kept) give them their gradients",
                avoids=WRONG_GRADIENTS,
                short=short,
            )
        ]
    inside = (
        "a tensor with a graph reaches it where reentrant cannot see it"
        if facts.trainable_inside
        else "what it uses inside cannot be known"
    )
    return [
        Vote(
            USE_REENTRANT,
            False,
            REQUIRED,
            "CK1",
            f"no positional tensor input requires grad and {inside}: reentrant would give the"
            " parameters inside no gradient",
            avoids=WRONG_GRADIENTS,
            short=short,
        )
    ]


def _ck5(facts: CallFacts) -> list[Vote]:
    if not facts.inputs_require_grad:
        return []
    if facts.container_graph_tensors:
        return [
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "CK5",
                f"{facts.container_graph_tensors} grad-requiring tensor(s) with a graph sit inside"
                " a list, tuple, dict or dataclass argument, which reentrant hands to its"
                " recompute as it is: its backward would run their graph inside its own",
                avoids=CRASH,
                short="a tensor inside a container argument would lose its graph",
            )
        ]
    if not facts.bound_graph_tensors:
        return []
    if facts.bound_graph_liftable:
        return [
            Vote(
                LIFT_BOUND_TENSORS,
                True,
                REQUIRED,
                "CK5",
                f"{facts.bound_graph_tensors} grad-requiring tensor(s) with a graph are bound"
                " into the function: passed as positional inputs, so reentrant backward"
                " returns their gradients instead of running their graph again",
                avoids=CRASH,
                short="bound graph tensors become inputs, reentrant kept",
            )
        ]
    return [
        Vote(
            USE_REENTRANT,
            False,
            REQUIRED,
            "CK5",
            f"{facts.bound_graph_tensors} grad-requiring tensor(s) with a graph reach the"
            " function through a closure or default argument: reentrant backward would run"
            " their graph inside its own, which crashes when anything else uses them",
            avoids=CRASH,
            short="a bound tensor's graph would be run twice",
        )
    ]


def _ck7(facts: CallFacts) -> list[Vote]:
    if not facts.outputs_untracked:
        return []
    if facts.outputs_untracked == "rebuildable":
        return [
            Vote(
                TUPLE_OUTPUTS,
                True,
                REQUIRED,
                "CK7",
                "the function returns tensors inside a dict, list or ModelOutput, which reentrant"
                " returns without a graph: its result passes through the checkpoint as a flat"
                " tuple and is rebuilt after it (reentrant kept)",
                avoids=WRONG_GRADIENTS,
                short="tensors returned in a dict would lose their graph",
            )
        ]
    return [
        Vote(
            USE_REENTRANT,
            False,
            REQUIRED,
            "CK7",
            "the function returns tensors inside an object torch's pytree cannot flatten (a"
            " dataclass), which reentrant returns without a graph",
            avoids=WRONG_GRADIENTS,
            short="tensors returned in an object would lose their graph",
        )
    ]
