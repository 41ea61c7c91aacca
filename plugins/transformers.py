"""transformers: both API generations (X1), the Trainer's re-enable (X3), and the rules that
hold without PEFT (R1, R2, R5, R6; X6: a mask of ones where a Qwen3 multimodal text model would
read its images as packed sequences). Patch points, proved per version by
tests/process/test_patch_points.py:
- 4.x: `PreTrainedModel.gradient_checkpointing_enable`, the only entry; the Trainer calls it.
- 5.x: `PreTrainedModel._activation_checkpointing_enable`, which `activation_checkpointing_enable`
  and its deprecated alias `gradient_checkpointing_enable` both reach. Wrapping the public names
  on the class would make `_is_overridden()` true and reroute 5.x's dispatch (X1), and
  wrapping a layer's `forward` would switch checkpointing off (`is_outermost`), so neither is done.
- the disable of each generation, to undo what gcpatch added.
- `Trainer.train`, to know that an enable call is the Trainer's re-enable (X3).
- X6 (4.57-5.2): the Qwen3 multimodal text models' `forward` (gcpatch/mrope_mask.py).
- `TrainingArguments.__post_init__`, to remember which checkpoint kwargs the user set, so a
  value a framework writes in later (TRL's T1/T2) is not taken for the user's ask.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

from packaging.version import InvalidVersion, Version

from gcpatch import apply, context, mrope_mask
from gcpatch.plugin import (
    EVAL_MODE_FIX,
    INPUT_GRADS_HOOK,
    NO_MEMORY_SAVED,
    RECOMMENDED,
    REQUIRED,
    USE_CACHE_OFF,
    USE_REENTRANT,
    WRONG_GRADIENTS,
    ZERO3_NONREENTRANT_RECOMPUTE,
    EnableCall,
    Facts,
    PatchPoint,
    PluginInfo,
    Rule,
    Source,
    Stage,
    Vote,
    hookimpl,
    installed_version,
    run_disable,
    run_enable,
)

_V5_CHOKE = "_activation_checkpointing_enable"
_USER_KWARGS = "_gcpatch_user_checkpoint_kwargs"

RULES = (
    Rule(
        "X1",
        "5.x renamed the API to activation_checkpointing_enable (gradient_checkpointing_enable is a"
        " deprecated alias); both reach _activation_checkpointing_enable, which gcpatch wraps",
        "transformers/modeling_utils.py (5.23.0: activation_checkpointing_enable, _is_overridden)",
        ">=5.0",
        documents=True,
    ),
    Rule(
        "X2",
        "transformers installs its input-grads hook only for input_ids models or a loaded adapter;"
        " inputs_embeds, vision and audio inputs are not covered; 5.23 adds one more hook at every"
        " enable_input_require_grads call (its own enable, peft's, TRL's): gcpatch leaves one per"
        " embedding",
        "transformers/modeling_utils.py (5.23.0: _activation_checkpointing_enable; 4.57.6: PEFT"
        " only)",
        documents=True,
    ),
    Rule(
        "X3",
        "the Trainer re-enables checkpointing from TrainingArguments and would overwrite a"
        " model-level choice; gcpatch keeps the user's model-level ask unless TrainingArguments"
        " names one",
        "transformers/trainer.py (4.57.6: _inner_training_loop; 5.23.0: train), transformers#26221",
        documents=True,
    ),
    Rule(
        "X4",
        "FSDP's own activation checkpointing together with the Trainer's is refused by the Trainer "
        "itself; gcpatch leaves that error as it is",
        "transformers/trainer.py (5.23.0: create_accelerator_and_postprocess)",
        documents=True,
    ),
    Rule(
        "X5",
        "the enable's own default where the ask names no use_reentrant: 4.38-4.57 reentrant, 5.x"
        " non-reentrant, 4.35-4.37 and kwargs without the key torch's (reentrant); where no rule"
        " finds it wrong it is kept (DEFAULT): a default that works is a correct choice",
        "transformers/modeling_utils.py (4.57.6: gradient_checkpointing_enable; 5.24.0:"
        " _activation_checkpointing_enable; 4.36.2: `{}`), torch/utils/checkpoint.py (2.13)",
        documents=True,
    ),
    Rule(
        "R1",
        "partially frozen model + reentrant -> non-reentrant: reentrant blocks whose inputs need no"
        " grad give their weights no gradients. Required where no input-grads hook can serve the"
        " stack (nothing trainable upstream and the input embeddings do not feed it, or the"
        " encoder's output comes by keyword); a recommendation where the input embeddings feed it,"
        " as R2's hook then makes reentrant exact and a user's reentrant is kept. Under ZeRO-3 only"
        " where the deepspeed plugin publishes that non-reentrant recompute of partitioned frozen"
        " parameters works (its R3 gate)",
        "transformers#21381, Axolotl A1, DeepSpeed #8148",
    ),
    Rule(
        "R2",
        "reentrant kept and a checkpointed layer trains -> input-grads hook on the embedding output"
        " and on inputs_embeds",
        "torch.utils.checkpoint docs, X2, peft#137",
    ),
    Rule(
        "R5",
        "checkpointing enabled but the first grad-enabled forward runs with the layers in eval mode"
        " -> the layers checkpoint anyway, their forward still runs in the user's mode",
        "transformers/modeling_layers.py (GradientCheckpointingLayer checks self.training),"
        " ColossalAI C1",
    ),
    Rule(
        "R6",
        "checkpointing enabled -> config.use_cache=False on every config that has it, except on"
        " transformers 5.x models whose layers run in transformers' own model code, which turns"
        " the cache off itself in a checkpointed training forward (warning once): there the"
        " config is left as it is, and switched off only where the first training forward runs"
        " in eval mode (R5), where transformers keeps the cache on. 4.x's own switch logs in every"
        " forward, breaking a compiled graph that the config's switch leaves whole",
        "4.35.2 models/llama/modeling_llama.py LlamaModel.forward; 4.57.6 utils/generic.py"
        " check_model_inputs; 5.24.0 utils/generic.py merge_with_config_defaults,"
        " modeling_layers.py; Axolotl A5",
    ),
    Rule(
        "X6",
        "Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3-Omni text models, given no attention mask and"
        " no cache (checkpointing and R6 turn it off), read the multimodal rope's temporal row as"
        " packed sequences, one per image, and change every gradient; gcpatch hands such a"
        " forward of a checkpointing model an attention mask of ones, the causal mask a cached"
        " forward gets (a packing collator's 2-D position_ids are left as given)",
        "transformers#44158 (fixed in 5.3.0); 4.57.6 models/qwen3_vl/modeling_qwen3_vl.py"
        " Qwen3VLTextModel.forward, masking_utils.py find_packed_sequence_indices",
        mrope_mask.RELEASES,
        documents=True,  # a patch point acts on the forward's call; no knob is voted
    ),
)

INFO = PluginInfo(
    name="transformers",
    framework="transformers",
    versions=">=4.35",
    rules=RULES,
    proven=">=4.35.2,<=5.25.0",
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    v4 = lambda m: not hasattr(m.PreTrainedModel, _V5_CHOKE)  # noqa: E731
    v5 = lambda m: hasattr(m.PreTrainedModel, _V5_CHOKE)  # noqa: E731
    return [
        PatchPoint(
            "transformers.modeling_utils",
            "PreTrainedModel.gradient_checkpointing_enable",
            _enable_v4,
            applies=v4,
            why="X1: the 4.x entry point",
        ),
        PatchPoint(
            "transformers.modeling_utils",
            "PreTrainedModel.gradient_checkpointing_disable",
            functools.partial(_disable, "gradient_checkpointing_disable"),
            applies=v4,
            why="undo gcpatch's hooks with the user's disable",
        ),
        PatchPoint(
            "transformers.modeling_utils",
            f"PreTrainedModel.{_V5_CHOKE}",
            _enable_v5,
            applies=v5,
            why="X1: the 5.x choke point of both enable names",
        ),
        PatchPoint(
            "transformers.modeling_utils",
            "PreTrainedModel._activation_checkpointing_disable",
            functools.partial(_disable, "activation_checkpointing_disable"),
            applies=v5,
            why="undo gcpatch's hooks with the user's disable",
        ),
        PatchPoint(
            "transformers.modeling_utils",
            "PreTrainedModel.enable_input_require_grads",
            _enable_input_require_grads,
            why="X2: one input-grads hook per embedding however often it is called",
        ),
        PatchPoint(
            "transformers.modeling_utils",
            "PreTrainedModel.disable_input_require_grads",
            _disable_input_require_grads,
            why="X2: gcpatch's own hook back where a decision still needs one",
        ),
        PatchPoint(
            "transformers.trainer",
            "Trainer.train",
            _trainer_train,
            why="X3: the Trainer's re-enable goes through the same decision",
        ),
        PatchPoint(
            "transformers.training_args",
            "TrainingArguments.__post_init__",
            _training_args_post_init,
            why="remember the user's own checkpoint kwargs before a trainer adds to them",
        ),
        *(
            PatchPoint(
                module,
                f"{name}.forward",
                mrope_mask.masked,
                applies=mrope_mask.applies,
                why="X6: a mask of ones where no cache would read images as packed sequences",
            )
            for module, name in mrope_mask.MODELS
        ),
        PatchPoint(
            "transformers.configuration_utils",
            "PretrainedConfig.to_dict",
            apply.config_as_the_user,
            why="R6: a serialised config carries the user's use_cache",
        ),
        PatchPoint(
            "transformers.modeling_utils",
            "PreTrainedModel.save_pretrained",
            apply.saving_as_the_user,
            why="R6: what save_pretrained writes carries the user's use_cache",
        ),
    ]


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage == Stage.CONFIG:
        return _config_votes(facts)
    if facts.stage == Stage.ENABLE:
        return _enable_votes(facts)
    if facts.stage == Stage.FIRST_FORWARD:
        return _first_forward_votes(facts)
    return []


def _config_votes(facts: Facts) -> list[Vote]:
    """R1 at a config's enable: a config that freezes part of the model."""
    votes: list[Vote] = []
    if facts.partially_frozen and not _zero3_needs_reentrant(facts):
        votes.append(
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "R1",
                "the config freezes part of the model: reentrant "
                "would drop the gradients of layers whose inputs need none",
                avoids=WRONG_GRADIENTS,
                short="partly frozen: layers would get no gradients",
            )
        )
    return votes


def _enable_votes(facts: Facts) -> list[Vote]:
    """R1 (layers whose inputs need no gradient), R2 (the input-grads hook), R6 (the cache off)."""
    votes = _starved_votes(facts)
    if facts.trainable_in_checkpointed_layers:
        votes.append(
            Vote(
                INPUT_GRADS_HOOK,
                True,
                REQUIRED,
                "R2",
                "checkpointed layers train: under reentrant their first input must require grad"
                " (frozen embeddings, inputs_embeds; X2)",
                avoids=WRONG_GRADIENTS,
                short="checkpointed layers train",
            )
        )
    if not _drops_cache_itself(facts):
        votes.extend(
            _cache_off(
                facts,
                "transformers 4.x turns it off in every training forward with a logger call,"
                " a graph break under torch.compile"
                if _own_runners(facts)
                else "the forward that runs the checkpointed layers is not transformers' own,"
                " which turns the cache off in training",
            )
        )
    return votes


def _starved_votes(facts: Facts) -> list[Vote]:
    """R1 at the enable: checkpointed stacks whose inputs need no gradient, served by the
    input-grads hook under reentrant (recommended) or not (required)."""
    votes: list[Vote] = []
    starved = _stacks_without_input_grads(facts)
    hooked = _stacks_without_input_grads(facts, served_by_hook=True) if not starved else ""
    custom = (
        ""
        if not facts.checkpoint_function
        else (
            f"; the layers call {facts.checkpoint_function}, not torch's checkpoint, which may"
            " run reentrant whatever it is asked (offloading checkpointers): gcpatch also puts"
            " the input-grads hook (R2) in place; without it, those blocks' weights get no"
            " gradients (by hand: enable_input_require_grads)"
        )
    )
    if hooked and not _zero3_needs_reentrant(facts):
        votes.append(
            Vote(
                USE_REENTRANT,
                False,
                RECOMMENDED,
                "R1",
                hooked
                + "; under reentrant the input-grads hook on the input embeddings' output (R2)"
                " gives them one, so an explicit reentrant is kept; non-reentrant needs no"
                " hook" + custom,
                short=_starved_short(facts, hooked=True),
            )
        )
    if starved and not _zero3_needs_reentrant(facts):
        starved += custom
        votes.append(
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "R1",
                starved,
                avoids=WRONG_GRADIENTS,
                short=_starved_short(facts),
            )
        )
    return votes


def _first_forward_votes(facts: Facts) -> list[Vote]:
    """R5 (layers left in eval mode at the first training forward) and R6 where it waited."""
    votes: list[Vote] = []
    if not (facts.grad_enabled and facts.layers_in_eval_mode):
        return votes
    votes.append(
        Vote(
            EVAL_MODE_FIX,
            True,
            REQUIRED,
            "R5",
            f"{facts.layers_in_eval_mode} of {facts.checkpointed_layers} checkpointed layers"
            " are in eval mode at the first training forward: checkpointing would silently do"
            " nothing",
            avoids=NO_MEMORY_SAVED,
            short="else no memory saved",
            unmet=(
                "R5: checkpointing is off in eval mode and this model family's layers cannot be"
                " switched without changing their forward; call model.train() before training"
            ),
        )
    )
    if _drops_cache_itself(facts):  # else R6 voted at the enable
        votes.extend(
            _cache_off(
                facts,
                "the model is in eval mode, where transformers keeps the cache on: it would"
                " hold every checkpointed layer's keys and values",
                on_only=True,
            )
        )
    return votes


def _drops_cache_itself(facts: Facts) -> bool:
    """Whether switching the config off is left to transformers: 5.x, where every checkpointed
    stack runs in a forward of its own model code, which turns the KV cache off where it
    checkpoints in training (5.24.0 utils/generic.py `merge_with_config_defaults`,
    modeling_layers.py GradientCheckpointingLayer), warning once per process. R6 switching it
    up front there costs a compiled job's first step 1.6x (dynamo traces the decoder frame twice;
    benchmarks/COMPILE.md) and leaves the graph breaks as they are. 4.x turns it off too (4.35.2
    per model, 4.57.6 utils/generic.py `check_model_inputs`), but with a logger call in every
    forward, which breaks a compiled graph where R6's switch removes the break (benchmarks/
    COMPILE.md: 3 breaks against 0): there R6 stands. Remote code and a user's own runner may
    not turn it off at all."""
    return facts.major("transformers") >= 5 and _own_runners(facts)


def _own_runners(facts: Facts) -> bool:
    """Every checkpointed stack runs in a forward of transformers' own model code."""
    return bool(facts.stacks) and all(
        s.get("runner_forward_from", "").startswith("transformers.models.") for s in facts.stacks
    )


def _cache_off(facts: Facts, why: str, on_only: bool = False) -> list[Vote]:
    """R6's vote where some config has `use_cache` (`on_only`: where one has it on)."""
    cached = [
        where
        for where, value in facts.use_cache_configs.items()
        if value is not None and (value or not on_only)
    ]
    if not cached and (facts.use_cache is None or (on_only and not facts.use_cache)):
        return []
    configs = f" (configs: {', '.join(cached)})" if len(cached) > 1 else ""
    return [
        Vote(
            USE_CACHE_OFF,
            True,
            REQUIRED,
            "R6",
            f"no KV cache under checkpointing: {why}{configs}",
            short="no KV cache under checkpointing",
        )
    ]


def _starved_short(facts: Facts, hooked: bool = False) -> str:
    """R1's reason in a few words, for the one-line log."""
    if any(s.encoder_states_by_keyword for s in facts.stacks):
        return "decoder takes the encoder's output by keyword"
    blocks = sum(
        s.blocks for s in facts.stacks if s.trainable_in_blocks and not s.inputs_can_require_grad
    )
    if not blocks:
        return "partly frozen: layers would get no gradients"
    if hooked:
        return f"frozen upstream of {blocks} blocks: reentrant needs the input-grads hook"
    return f"frozen upstream, {blocks} blocks would lose gradients"


def _zero3_needs_reentrant(facts: Facts) -> bool:
    """R1 stands back under ZeRO-3 unless the DeepSpeed plugin says this release recomputes
    partitioned frozen parameters non-reentrant (its R3 gate, published as a framework fact): a
    required non-reentrant would outrank R3's reentrant + hook there and crash the run."""
    return facts.zero3 and facts.framework_facts.get(ZERO3_NONREENTRANT_RECOMPUTE) is not True


def _stacks_without_input_grads(facts: Facts, served_by_hook: bool = False) -> str:
    """R1's condition, per checkpointed stack: its blocks train but nothing upstream of it does,
    so under reentrant its first input needs no grad and the blocks get none (transformers#21381).
    Parameters frozen elsewhere (Whisper's fixed position embeddings next to a trainable conv
    stem, a frozen head) do not starve a stack. A stack fed by the model's input embeddings is
    served under reentrant by the input-grads hook R2 puts on their output (and on inputs_embeds):
    those stacks are named only with `served_by_hook`, where R1 is a recommendation and a user's
    explicit reentrant is kept. Without stack facts, any freezing counts (never served)."""
    if not facts.stacks:
        if served_by_hook or not facts.partially_frozen:
            return ""
        return (
            f"{facts.frozen_params} frozen and {facts.trainable_params} trainable parameters: "
            "reentrant would drop the gradients of layers whose inputs need none"
        )
    keyword = [s for s in facts.stacks if s.encoder_states_by_keyword]
    if keyword and facts.trainable_params:
        if served_by_hook:
            return ""
        names = ", ".join(s.stack for s in keyword)
        return (
            f"{names} gets the encoder's output as a keyword argument, which a reentrant checkpoint"
            " does not see: the encoder's gradients through it are lost or its graph is run twice"
        )
    starved = [
        s
        for s in facts.stacks
        if s.trainable_in_blocks
        and not s.inputs_can_require_grad
        and bool(s.fed_by_input_embeddings) is served_by_hook
    ]
    if not starved:
        return ""
    names = ", ".join(f"{s['stack']} ({s['blocks']} blocks)" for s in starved)
    return (
        f"{facts.frozen_params} frozen and {facts.trainable_params} trainable parameters; the"
        f" blocks of {names} train but nothing upstream of them does: reentrant would drop the"
        " gradients of layers whose inputs need none"
    )


def _enable_v4(wrapped: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    # gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None), and on 5.17-5.22
    # (..., every_n_layers=1, offload=False): every other argument of the user's call is passed
    # through unchanged, on the call and on every replay (re-decision, Trainer re-enable).
    rest = dict(kwargs)
    asked = args[0] if args else rest.pop("gradient_checkpointing_kwargs", None)
    more = args[1:]

    def replay(target: Any, chosen: Any) -> Any:
        return target.gradient_checkpointing_enable(chosen, *more, **rest)

    return run_enable(
        _call(
            model,
            "gradient_checkpointing_enable",
            asked,
            "gradient_checkpointing_kwargs",
            lambda chosen: wrapped(chosen, *more, **rest),
            replay,
            v5=False,
        )
    )


def _enable_v5(wrapped: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    # _activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1,
    # offload=False)
    names = ("activation_checkpointing_kwargs", "every_n_layers", "offload")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    asked = bound.pop("activation_checkpointing_kwargs", None)

    def replay(target: Any, chosen: Any) -> Any:
        return target.activation_checkpointing_enable(chosen, **bound)

    api = _public_name_called()
    kwarg = (
        "gradient_checkpointing_kwargs"
        if api == "gradient_checkpointing_enable"
        else "activation_checkpointing_kwargs"
    )
    invoke = lambda chosen: wrapped(chosen, **bound)  # noqa: E731
    return run_enable(_call(model, api, asked, kwarg, invoke, replay, v5=True))


def _public_name_called() -> str:
    """Which of 5.x's two public names the user called: both reach the choke point, and wrapping
    them would trip `_is_overridden` (X1), so it is read from the calling frames."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in (
            "gradient_checkpointing_enable",
            "activation_checkpointing_enable",
        ) and frame.f_code.co_filename.endswith("modeling_utils.py"):
            outer = frame.f_back
            # the deprecated alias calls activation_checkpointing_enable: the outermost one is the
            # user's
            if outer is not None and outer.f_code.co_name == "gradient_checkpointing_enable":
                return "gradient_checkpointing_enable"
            return name
        frame = frame.f_back
    return "activation_checkpointing_enable"


def _call(
    model: Any, api: str, asked: Any, kwarg_name: str, invoke: Any, replay: Any, v5: bool
) -> EnableCall:
    trainer = context.asker().trainer
    trainer_name = (
        f"{type(trainer).__module__}.{type(trainer).__name__}" if trainer is not None else ""
    )
    if trainer is not None:
        source = Source.TRAINER
        asked, asked_from = _attributed(
            asked, getattr(trainer, "args", None), type(trainer).__name__
        )
    else:
        source = Source.CALL
        asked_from = f"{type(model).__name__}.{api}({kwarg_name}=...)" if asked else "nothing"
    return EnableCall(
        model=model,
        api=api,
        source=source,
        asked_kwargs=asked,
        asked_from=asked_from,
        invoke=invoke,
        replay=replay,
        trainer=trainer_name,
        keeps_ask="X3",
        **_framework_default(asked, v5),
    )


def _framework_default(asked: Any, v5: bool) -> dict[str, Any]:
    """What the framework runs with when the ask names no use_reentrant (X5): its enable's own
    kwargs where nothing was asked (4.38-4.57 `{"use_reentrant": True}`, every 5.x
    `{"use_reentrant": False}`; 4.35-4.37 `{}`, torch's default), else torch's default for kwargs
    that name none (torch/utils/checkpoint.py 2.13: `use_reentrant = True` when not passed, with a
    warning). The release decides, not the entry point: 5.0-5.22 still enable through
    `gradient_checkpointing_enable` (the 4.x patch point) and already default to non-reentrant
    (modeling_utils.py 5.0.0, 5.2.0, 5.22.2: `gradient_checkpointing_kwargs = {"use_reentrant":
    False}`)."""
    version = installed_version("transformers") or ("5" if v5 else "4")
    if asked is None:
        try:
            reentrant = Version(version).major < 5
        except InvalidVersion:
            reentrant = not v5
        return {"default_use_reentrant": reentrant, "default_from": f"transformers {version}"}
    if isinstance(asked, dict) and USE_REENTRANT not in asked:
        return {"default_use_reentrant": True, "default_from": "torch"}
    return {}


def _attributed(asked: Any, args: Any, trainer: str) -> tuple[Any, str]:
    """Only the user's own use_reentrant is an ask: one a trainer wrote into TrainingArguments
    after the user built them (TRL's T1 default, its T2 override) is that framework's vote."""
    field = (
        "activation_checkpointing_kwargs"
        if hasattr(args, "activation_checkpointing_kwargs")
        else "gradient_checkpointing_kwargs"
    )
    if not asked:
        named = "names no use_reentrant" if getattr(args, field, None) else "unset"
        return asked, f"nothing (TrainingArguments.{field} {named})"
    user = getattr(args, _USER_KWARGS, None)
    if user is not None and "use_reentrant" in asked and "use_reentrant" not in user:
        rest = {k: v for k, v in asked.items() if k != "use_reentrant"}
        return (
            rest or None,
            (
                f"nothing (use_reentrant={asked['use_reentrant']} in TrainingArguments.{field} "
                f"was set by {trainer}, not by the user)"
            ),
        )
    return asked, f"TrainingArguments.{field}"


def _disable(api: str, wrapped: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    """The user's off is final: gcpatch takes back what it changed for the enable (hooks, the
    eval-mode fix, R6's use_cache) so the model is what it would be without gcpatch."""
    run_disable(model, api)
    return wrapped(*args, **kwargs)


def _enable_input_require_grads(wrapped: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    """transformers 5.23 adds a hook on every call and keeps only the last handle, so a second
    enable (the Trainer's, TRL's own call after it: trl#480) runs the hook twice or more; the
    earlier ones, and gcpatch's own on the same embedding, go first: one hook per embedding."""
    apply.dedupe_input_grads_hooks(model)
    return wrapped(*args, **kwargs)


def _disable_input_require_grads(wrapped: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    apply.rehook_embeddings(model)
    return result


def _trainer_train(wrapped: Any, trainer: Any, args: tuple, kwargs: dict) -> Any:
    with context.asking(trainer=trainer):
        return wrapped(*args, **kwargs)


def _training_args_post_init(wrapped: Any, training_args: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    user = (
        getattr(training_args, "activation_checkpointing_kwargs", None)
        or getattr(training_args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    object.__setattr__(
        training_args, _USER_KWARGS, copy.deepcopy(dict(user)) if isinstance(user, dict) else {}
    )
    return result
