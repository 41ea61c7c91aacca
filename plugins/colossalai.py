"""ColossalAI never calls the enable method itself, and `Booster.boost` does not put the model in
train mode (C1): LoRA added by `booster.enable_lora` and checkpointing enabled in any order meet
in the boosted model. gcpatch decides again there, where the model is final; a model left in
eval mode is handled by R5 at its first training forward, including shardformer's replacement
forwards, whose `self.training` check sits on the decoder stack rather than on the layers.
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
        "C1",
        "model.train() is ColossalAI's caller's job; left in eval mode, checkpointing does nothing:"
        " R5 makes it take effect",
        "applications/Colossal-LLaMA/train.py; colossalai/booster/booster.py (0.5.0: boost)",
        documents=True,
    ),
    Rule(
        "C2",
        "non-reentrant recommended (a recommendation; LoRA + checkpointing is broken for some"
        " models, e.g. ChatGLM)",
        "ColossalAI #5507",
    ),
)

INFO = PluginInfo(
    name="colossalai", framework="colossalai", versions=">=0.4,<0.6", rules=RULES, proven="==0.5.*"
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [
        PatchPoint(
            "colossalai.booster.booster",
            "Booster.boost",
            _boost,
            why="C1/C2: decide again once the model is boosted (LoRA, plugin wrappers in place)",
        )
    ]


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage == Stage.ENABLE and facts.source.startswith("colossalai"):
        return [
            Vote(
                USE_REENTRANT,
                False,
                RECOMMENDED,
                "C2",
                "ColossalAI recommends non-reentrant",
                short="ColossalAI's recommendation",
            )
        ]
    return []


def _boost(wrapped: Any, booster: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    if model is not None and hasattr(model, "modules"):
        redecide_within(model, "colossalai Booster.boost (C1)")
    return result
