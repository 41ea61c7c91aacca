"""One decision, start to end: facts -> votes -> resolve -> apply -> record.

Plugins call `run_enable` from their patch points with an `EnableCall` that knows how to run
the framework's own enable. Anything that fails inside gcpatch runs that call as the user made
it and logs one line; strict mode raises a GcpatchError instead (issue #3 item 9).
"""
from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gcpatch import apply, engine, record, resolve, settings
from gcpatch import facts as facts_mod
from gcpatch.errors import GcpatchError
from gcpatch.manager import PluginFailure
from gcpatch.schema import EVAL_MODE_FIX, USE_REENTRANT

log = logging.getLogger("gcpatch")
_inside = contextvars.ContextVar("gcpatch_inside_decision", default=False)


@dataclass
class EnableCall:
    """A framework's enable call, as the patch point saw it."""

    model: Any
    api: str
    source: str  # "call": the user's code; "trainer": a Trainer re-enabling (X3)
    asked_kwargs: Mapping[str, Any] | None  # the checkpoint kwargs passed, None when none were
    asked_from: str
    invoke: Callable[[Mapping[str, Any] | None], Any]  # runs the original with these kwargs


def run_enable(call: EnableCall) -> Any:
    if _inside.get():
        return call.invoke(call.asked_kwargs)  # an enable nested in ours: the outer decision stands
    cfg = settings.read()
    state = apply.state_of(call.model)
    asked, asked_from = _effective_ask(call, state)
    try:
        facts = facts_mod.gather(call.model, stage="enable", api=call.api, source=call.source,
                                 asked_kwargs=asked, asked_from=asked_from)
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
    if call.source == "call" and call.asked_kwargs is not None:
        state.ask, state.ask_from = dict(call.asked_kwargs), call.asked_from
    entry = record.decision(facts, decision, applied, cfg.record_dir, quiet=_same_as_last(state, facts, decision))
    state.last = entry
    return result


def run_first_forward(model: Any) -> None:
    """R5, decided when the first forward that builds a graph runs (the mode the user trains in
    is known only then)."""
    cfg = settings.read()
    state = apply.state_of(model)
    last = state.last or {}
    try:
        facts = facts_mod.gather(model, stage="first_forward", api=last.get("api", "?"),
                                 source=last.get("source", "call"), asked_kwargs=state.ask,
                                 asked_from=state.ask_from or "nothing")
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
    """The Trainer re-enables with TrainingArguments and would erase a model-level choice (the
    last writer wins, transformers#26221); unless TrainingArguments names use_reentrant, the
    user's earlier model-level ask stands (X3)."""
    trainer_silent = call.asked_kwargs is None or USE_REENTRANT not in call.asked_kwargs
    if call.source == "trainer" and trainer_silent and state.ask is not None:
        merged = {**state.ask, **(call.asked_kwargs or {})}
        return merged, f"{state.ask_from}, kept over the Trainer's re-enable (X3)"
    return call.asked_kwargs, call.asked_from


def _same_as_last(state: apply.ModelState, facts: Any, decision: Any) -> bool:
    last = state.last
    return (bool(last) and last["decision"]["values"] == decision.values and last["rules"] == decision.rules
            and last["asked"]["from"] == facts.asked_from)


def _failed_open(stage: str, exc: BaseException, cfg: settings.Settings) -> None:
    text = str(exc) if isinstance(exc, PluginFailure) else f"{type(exc).__name__}: {exc}"
    if cfg.strict:
        rule = f"plugin:{exc.plugin}" if isinstance(exc, PluginFailure) else f"gcpatch:{stage}"
        raise GcpatchError(f"gcpatch failed in {stage}: {text}", rule=rule,
                           fix="report it, or set GCPATCH_MODE=fix to fall back to the framework's behaviour") from exc
    log.error("gcpatch: %s failed, the framework's own behaviour is kept (%s)", stage, text)
    record.failure(stage, text, cfg.record_dir)
