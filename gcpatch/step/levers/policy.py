"""torch's selective checkpointing (`create_selective_checkpoint_contexts`) with a policy that must
save some operators' outputs and prefers to recompute the rest (their `.default` overloads: a
policy naming the packet matches nothing, pytorch/pytorch#176065). Offered only where a layer's
checkpoint function is non-reentrant (selective checkpointing needs that) and carries no
`context_fn` of the user's (the user's own selective checkpointing stands as given)."""

from __future__ import annotations

import functools
from typing import Any

CONTEXT_FN = "context_fn"


class Keep:
    """The policy of one layer: keep `ops`' outputs, recompute the rest; counts what its forwards
    kept (a layer that kept nothing did not run as planned)."""

    def __init__(self, ops: frozenset) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        self.ops = ops
        self.save, self.recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
        self.kept = 0

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in self.ops:
            if not getattr(ctx, "is_recompute", False):
                self.kept += 1
            return self.save
        return self.recompute

    def context(self) -> Any:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(self)


def selectable(func: Any) -> str | None:
    """Why `func` cannot take a policy (None: a partial of a checkpoint function, non-reentrant,
    without a context_fn of its own)."""
    if not isinstance(func, functools.partial):
        return "the layers' checkpoint function takes no context_fn"
    if CONTEXT_FN in func.keywords:
        return "the user's own context_fn stands as given"
    if func.keywords.get("use_reentrant") is not False:
        return (
            "reentrant checkpointing, which selective checkpointing cannot run under"
            " (use_reentrant=False offers it)"
        )
    return None


def keeping(func: functools.partial, policy: Keep) -> functools.partial:
    """The layer's own checkpoint function (every argument as decided), keeping what `policy`
    says."""
    return functools.partial(func.func, *func.args, **{**func.keywords, CONTEXT_FN: policy.context})


def policy_of(func: Any) -> Keep | None:
    """The policy `func` keeps by, where it is one `keeping` made."""
    if isinstance(func, functools.partial):
        context = func.keywords.get(CONTEXT_FN)
        found = getattr(context, "__self__", None)
        if isinstance(found, Keep):
            return found
    return None


def without(func: functools.partial) -> functools.partial:
    """`func` without the policy `keeping` added."""
    rest = {k: v for k, v in func.keywords.items() if k != CONTEXT_FN}
    return functools.partial(func.func, *func.args, **rest)
