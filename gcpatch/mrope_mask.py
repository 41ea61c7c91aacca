"""X6: an attention mask of ones for the Qwen3 multimodal text models of transformers 4.57-5.2.

Given no attention mask and no cache, their text model hands the multimodal rope's temporal row
(`position_ids[0]` of three sections) to `create_causal_mask` as text positions; masking_utils'
`find_packed_sequence_indices` then reads every image token, whose temporal position stands still,
as the start of a new packed sequence, and the tokens around each image stop attending to the
text before it. With a cache, as a plain forward builds one, no packing is looked for. A
checkpointed training forward turns the cache off (4.57.6 utils/generic.py `check_model_inputs`,
5.x `GradientCheckpointingLayer`), and so does R6's config switch in every later forward, so
checkpointing alone changed every gradient and, with R6, the logits of an evaluation forward.
transformers#44158 (5.3.0) passes no text positions there; a mask of ones gives the same causal
mask on the releases before it. A two-dimensional `position_ids` (a packing collator's) is the
user's packing and is left as given.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from gcpatch import lifetime

# the text models whose forward reads a three-section rope's first row as text positions
# (transformers 4.57.6 and 5.2.0: the `else` branch after `position_ids.shape[0] == 4`)
MODELS = (
    ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextModel"),
    ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextModel"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5TextModel"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTextModel"),
    ("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe", "Qwen3OmniMoeThinkerTextModel"),
    ("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe", "Qwen3OmniMoeTalkerModel"),
)
RELEASES = ">=4.57,<5.3"  # transformers#44158 landed in 5.3.0
_names: dict[type, list[str]] = {}  # a text model class -> its forward's parameter names
_said: set[str] = set()  # the models whose mask was said


@lifetime.activation
def reset() -> None:
    _said.clear()


def applies(module: Any) -> bool:
    """Whether the running transformers is one of X6's releases (asked as a model's module is
    imported, so it costs a process that never imports one nothing)."""
    from gcpatch import release_range

    version = getattr(sys.modules.get("transformers"), "__version__", None)
    return version is not None and release_range.contains(RELEASES, version)


def masked(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The text model's forward (wrapt's protocol), with a mask of ones where checkpointing would
    have it read the rope's temporal row as packed sequences."""
    if not getattr(instance, "gradient_checkpointing", False):
        return wrapped(*args, **kwargs)  # every forward of a model not checkpointing: as called
    call = _arguments(wrapped, instance, args, kwargs)
    positions = call.get("position_ids")
    if not (
        call.get("attention_mask") is None
        and call.get("past_key_values") is None
        and getattr(positions, "ndim", 0) == 3
        and positions.shape[0] == 3
    ):
        return wrapped(*args, **kwargs)
    torch = sys.modules["torch"]
    call["attention_mask"] = torch.ones(
        positions.shape[1:], dtype=torch.long, device=positions.device
    )
    _say(type(instance).__name__)
    return wrapped(**call)


def _arguments(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (the callers pass them by keyword; a positional one is named
    from the forward's signature, read once per class)."""
    if not args:
        return dict(kwargs)
    import inspect

    names = _names.get(type(instance))
    if names is None:
        names = _names[type(instance)] = list(inspect.signature(wrapped).parameters)
    return {**dict(zip(names, args)), **kwargs}


def _say(model: str) -> None:
    if model in _said:
        return
    _said.add(model)
    from gcpatch import console, headline, record, settings

    version = sys.modules["transformers"].__version__
    line = (
        f"gcpatch: {model}: an attention mask of ones where a forward gives none (X6): with no"
        f" cache, which checkpointing turns off, transformers {version}"
        " reads each image in the multimodal rope's positions as a new packed sequence"
        " (transformers#44158, fixed in 5.3.0)"
    )
    console.say(headline.wrap(line), line, f"X6/{model}")
    record.event(
        {"stage": "call", "model": model, "line": line, "rules": ["X6"]},
        settings.read().record_dir,
    )
