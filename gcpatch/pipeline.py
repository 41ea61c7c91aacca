"""One decision, start to end: facts -> votes -> resolve -> apply -> record.

Plugins call `run_enable` from their patch points with an `EnableCall` that knows how to run
the framework's own enable, and `redecide` when a model is wrapped after checkpointing was
enabled (PEFT, DDP): config-time, enable-time and wrap-time decisions are this one path.
Anything that fails inside gcpatch runs the call as the user made it and logs one line;
strict mode raises a GcpatchError instead.
"""
from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gcpatch import apply, checkpoint_call, engine, record, resolve, settings, verify
from gcpatch import facts as facts_mod
from gcpatch.errors import GcpatchError
from gcpatch.manager import PluginFailure
from gcpatch.schema import EVAL_MODE_FIX, USE_REENTRANT

log = logging.getLogger("gcpatch")
_inside = contextvars.ContextVar("gcpatch_inside_decision", default=False)
_source_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("gcpatch_source", default=None)
_caller: contextvars.ContextVar[str | None] = contextvars.ContextVar("gcpatch_caller", default=None)


class called_by:
    """Label the enable calls a framework makes on the user's behalf (peft's kbit preparation)
    so the record says who asked for what."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._token: contextvars.Token | None = None

    def __enter__(self) -> None:
        self._token = _caller.set(self.name)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _caller.reset(self._token)


@dataclass
class EnableCall:
    """A framework's enable call, as the patch point saw it."""

    model: Any
    api: str
    source: str  # "call": the user's code; "trainer": a Trainer re-enabling (X3); a framework's name
    asked_kwargs: Mapping[str, Any] | None  # the checkpoint kwargs asked for, None when none were
    asked_from: str
    invoke: Callable[[Mapping[str, Any] | None], Any]  # runs the original with these kwargs
    replay: Callable[[Any, Mapping[str, Any] | None], Any] | None = None  # re-enables a model later
    trainer: str = ""


def run_enable(call: EnableCall) -> Any:
    if _inside.get():
        return call.invoke(call.asked_kwargs)  # an enable nested in ours: the outer decision stands
    cfg = settings.read()
    engine.reinstate()  # a tool that rebound a patch point since the last decision is wrapped again
    state = apply.state_of(call.model)
    source = _source_override.get() or _caller.get() or call.source
    asked, asked_from = _effective_ask(call, state)
    try:
        facts = facts_mod.gather(call.model, stage="enable", api=call.api, source=source,
                                 asked_kwargs=asked, asked_from=asked_from, context=state.context,
                                 trainer=call.trainer or state.trainer)
        votes = resolve.stance_votes(facts) + engine.host().votes(facts)
        decision = resolve.resolve(votes, cfg.mode)
    except GcpatchError:
        raise
    except Exception as exc:
        _failed_open("enable", exc, cfg)
        return call.invoke(call.asked_kwargs)
    chosen = dict(asked or {})
    chosen[USE_REENTRANT] = decision.values[USE_REENTRANT]
    apply.reset(call.model)
    token = _inside.set(True)
    try:
        result = call.invoke(chosen)
    finally:
        _inside.reset(token)
    try:
        applied = apply.apply(call.model, decision, run_first_forward)
    except Exception as exc:
        apply.remove_all(call.model)
        _failed_open("apply", exc, cfg)
        return call.invoke(call.asked_kwargs)
    checkpoint_call.cover(call.model)  # its layers' checkpoint calls follow this decision (CK4)
    if call.asked_kwargs is not None and USE_REENTRANT in call.asked_kwargs and source != "trainer":
        state.ask, state.ask_from = dict(call.asked_kwargs), call.asked_from
    state.replay = call.replay or state.replay
    state.trainer = call.trainer or state.trainer
    entry = record.decision(facts, decision, applied, cfg.record_dir, quiet=_same_as_last(state, facts, decision))
    state.last = entry
    if cfg.verify:
        verify.arm(call.model)
    return result


def run_disable(model: Any) -> dict[str, str]:
    """The user switched checkpointing off: take back what gcpatch added for the enable. Returns
    the configs whose `use_cache` was given back (R6)."""
    restored = apply.remove_all(model)
    checkpoint_call.uncover(model)
    return restored


def run_config(facts: Any, write: Callable[[Any], dict[str, Any]]) -> Any:
    """A decision taken from a framework's config before any model exists (Axolotl): the same
    votes and resolver; `write` puts the outcome into the config and says what it changed.
    Returns the decision, or None when gcpatch failed open (the config is left as it was)."""
    cfg = settings.read()
    try:
        decision = resolve.resolve(resolve.stance_votes(facts) + engine.host().votes(facts), cfg.mode)
        applied = write(decision)
    except GcpatchError:
        raise
    except Exception as exc:
        _failed_open("config", exc, cfg)
        return None
    record.decision(facts, decision, applied, cfg.record_dir)
    return decision


def redecide(model: Any, source: str, **context: Any) -> bool:
    """Decide again for a model whose set-up changed after checkpointing was enabled (wrapped by
    PEFT, by DDP): the same path as the user's enable, with what is known now."""
    state = apply._states.get(model)
    if state is None or state.replay is None or not _checkpointing_on(model):
        return False
    state.context.update(context)
    token = _source_override.set(source)
    try:
        state.replay(model, state.ask)
    finally:
        _source_override.reset(token)
    return True


def redecide_within(root: Any, source: str, **context: Any) -> None:
    """`redecide` for every model gcpatch decided for inside `root` (a DDP or booster wrapper)."""
    for module in root.modules():
        if apply.has_state(module):
            redecide(module, source, **context)


def run_first_forward(model: Any) -> None:
    """R5, decided when the first forward that builds a graph runs (the mode the user trains in
    is known only then)."""
    cfg = settings.read()
    state = apply.state_of(model)
    last = state.last or {}
    try:
        facts = facts_mod.gather(model, stage="first_forward", api=last.get("api", "?"),
                                 source=last.get("source", "call"), asked_kwargs=state.ask,
                                 asked_from=state.ask_from or "nothing", context=state.context,
                                 trainer=state.trainer)
        decision = resolve.resolve(engine.host().votes(facts), cfg.mode)
        if not decision.winners and not decision.warnings:
            return
        applied: dict[str, Any] = {}
        if decision.values.get(EVAL_MODE_FIX):
            fixed = apply.fix_eval_mode(model)
            applied[EVAL_MODE_FIX] = fixed
            if not fixed:
                decision.warnings.append(
                    "R5: checkpointing is off in eval mode and this model family's layers cannot be "
                    "switched without changing their forward; call model.train() before training")
        record.decision(facts, decision, applied, cfg.record_dir)
    except GcpatchError:
        raise
    except Exception as exc:
        apply.reset(model)
        _failed_open("first_forward", exc, cfg)


def _effective_ask(call: EnableCall, state: apply.ModelState) -> tuple[Mapping[str, Any] | None, str]:
    """A re-enable that names no use_reentrant (the Trainer's from TrainingArguments, TRL's
    disable_gradient_checkpointing on exit, peft's kbit preparation) would reset the user's
    earlier choice (the last writer wins, transformers#26221): that earlier ask stands (X3)."""
    redecided = _source_override.get()
    if redecided and state.ask is not None:
        return state.ask, f"{state.ask_from} (decided again: {redecided})"
    caller = _caller.get()
    if caller and call.source == "call":
        call.asked_from = f"{caller}(gradient_checkpointing_kwargs=...)" if call.asked_kwargs else f"nothing ({caller})"
    silent = call.asked_kwargs is None or USE_REENTRANT not in call.asked_kwargs
    if silent and state.ask is not None:
        merged = {**(call.asked_kwargs or {}), USE_REENTRANT: state.ask[USE_REENTRANT]}
        return merged, f"{state.ask_from}, kept over a re-enable that names none (X3)"
    return call.asked_kwargs, call.asked_from


def _checkpointing_on(model: Any) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in facts_mod.checkpoint_layers(model))


def _same_as_last(state: apply.ModelState, facts: Any, decision: Any) -> bool:
    last = state.last
    return (bool(last) and last["decision"]["values"] == decision.values
            and last["decision"]["rules"] == decision.rules and last["asked"]["from"] == facts.asked_from)


def _failed_open(stage: str, exc: BaseException, cfg: settings.Settings) -> None:
    text = str(exc) if isinstance(exc, PluginFailure) else f"{type(exc).__name__}: {exc}"
    if cfg.strict:
        rule = f"plugin:{exc.plugin}" if isinstance(exc, PluginFailure) else f"gcpatch:{stage}"
        raise GcpatchError(f"gcpatch failed in {stage}: {text}", rule=rule,
                           fix="report it, or set GCPATCH_MODE=fix to fall back to the framework's behaviour") from exc
    log.error("gcpatch: %s failed, the framework's own behaviour is kept (%s)", stage, text)
    record.failure(stage, text, cfg.record_dir)
