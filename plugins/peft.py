"""peft: the kbit preparation under every name it is exported as (P3), and the wrap paths
(`get_peft_model`/`PeftModel`, transformers' `add_adapter`) so the decision is the same
whichever order the user enables checkpointing and wraps the model (transformers#26334, #25841).

peft reads `inspect.signature(model.gradient_checkpointing_enable)`: wrapt keeps signatures.
"""

from __future__ import annotations

from typing import Any

from gcpatch.plugin import (
    INPUT_GRADS_HOOK,
    REQUIRED,
    WRONG_GRADIENTS,
    Facts,
    PatchPoint,
    PluginInfo,
    Rule,
    Stage,
    Vote,
    asking,
    hookimpl,
    redecide,
)

RULES = (
    Rule(
        "P1",
        "k-bit model + reentrant -> the input-grads hook (its frozen quantized weights never make"
        " the first checkpointed input require grad); non-reentrant needs none",
        "peft/utils/other.py (0.21.2: prepare_model_for_kbit_training)",
    ),
    Rule(
        "P2",
        "gradient_checkpointing_kwargs needs transformers > 4.34.1: below gcpatch's transformers"
        " range, so never met",
        "peft/utils/other.py (0.21.2)",
        documents=True,
    ),
    Rule(
        "P3",
        "prepare_model_for_kbit_training is re-exported (peft, peft.utils, peft.utils.other) and"
        " imported by name elsewhere (trl): every name is patched, and the enable it makes is"
        " recorded as peft's",
        "peft/__init__.py, peft/utils/__init__.py (0.21.2)",
        documents=True,
    ),
    Rule(
        "P4",
        "wrapping a checkpointed model with PEFT (get_peft_model, PeftModel.from_pretrained,"
        " add_adapter) decides again with the adapter in place, so both orders end the same",
        "transformers#26334, #25841",
        documents=True,
    ),
)

INFO = PluginInfo(
    name="peft", framework="peft", versions=">=0.10,<1", rules=RULES, proven=">=0.10,<=0.21.2"
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [
        PatchPoint(
            "peft.utils.other",
            "prepare_model_for_kbit_training",
            _prepare_kbit,
            copies=True,
            why="P3: every exported name and copy",
        ),
        PatchPoint(
            "peft.peft_model",
            "PeftModel.__init__",
            _wrapped_by_peft,
            why="P4: decide again once the base model is wrapped",
        ),
        PatchPoint(
            "transformers.integrations.peft",
            "PeftAdapterMixin.add_adapter",
            _add_adapter,
            why="P4: transformers' native adapter path",
        ),
    ]


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage == Stage.ENABLE and facts.kbit:
        return [
            Vote(
                INPUT_GRADS_HOOK,
                True,
                REQUIRED,
                "P1",
                "k-bit weights never require grad: under reentrant the first checkpointed input"
                " needs the hook",
                avoids=WRONG_GRADIENTS,
                short="k-bit weights never require grad",
            )
        ]
    return []


def _prepare_kbit(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    with asking(caller="peft.prepare_model_for_kbit_training"):
        return wrapped(*args, **kwargs)


def _wrapped_by_peft(wrapped: Any, peft_model: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    redecide(peft_model.get_base_model(), f"wrapped by {type(peft_model).__name__} (P4)")
    return result


def _add_adapter(wrapped: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    redecide(model, "add_adapter (P4)")
    return result
