"""One decision, start to end: context -> facts -> votes -> resolve -> enable -> apply -> record.

Plugins call `run_enable` from their patch points with an `EnableCall` that knows how to run
the framework's own enable, `run_disable` from the disable, and `redecide` when a model is
wrapped after checkpointing was enabled (PEFT, DDP): config-time, enable-time, wrap-time and
disable decisions are this one path. Anything that fails inside gcpatch runs the call as the
user made it and logs one line; strict mode raises a GcpatchError instead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from gcpatch import apply, context, engine, record, resolve, settings
from gcpatch import facts as facts_mod
from gcpatch.call import checkpoint_call
from gcpatch.context import EnableCall
from gcpatch.errors import GcpatchError
from gcpatch.manager import PluginFailure
from gcpatch.schema import (
    EVAL_MODE_FIX,
    INPUT_GRADS_HOOK,
    REQUIRED,
    USE_CACHE_OFF,
    USE_REENTRANT,
    WRONG_GRADIENTS,
    Stage,
    Vote,
)

if TYPE_CHECKING:
    from gcpatch.step.verify import Report

__all__ = ["redecide", "redecide_within", "run_config", "run_disable", "run_enable"]

log = logging.getLogger("gcpatch")


def run_enable(call: EnableCall) -> Any:
    """Decide for the framework's enable `call`, run it with the decided kwargs, apply, record."""
    if context.asker().inside:
        return call.invoke(call.asked_kwargs)  # an enable nested in ours: the outer decision stands
    cfg = settings.read()
    engine.reinstate()  # a tool that rebound a patch point since the last decision is wrapped again
    ctx = context.begin(call)
    with facts_mod.one_walk():
        return _decide_enable(call, ctx, cfg)


def _decide_enable(call: EnableCall, ctx: context.DecisionContext, cfg: settings.Settings) -> Any:
    try:
        facts = _with_framework_facts(
            facts_mod.gather(
                call.model,
                stage=Stage.ENABLE,
                api=call.api,
                source=ctx.source,
                asked_kwargs=ctx.asked,
                asked_from=ctx.asked_from,
                context=ctx.model.wrapped,
                trainer=ctx.trainer,
                default_use_reentrant=call.default_use_reentrant,
                default_from=call.default_from,
            )
        )
        votes = resolve.stance_votes(facts) + engine.host().votes(facts) + ctx.model.evidence
        decision = resolve.resolve(votes, cfg.mode)
    except GcpatchError:
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: the framework's enable as asked)
        _failed_open(Stage.ENABLE, exc, cfg)
        return call.invoke(call.asked_kwargs)
    apply.reset(call.model)
    with context.asking(inside=True):
        result = call.invoke(ctx.chosen(decision.values[USE_REENTRANT]))
    if cfg.strict:  # the framework's enable ran as asked; transformers' own hook is in place now
        try:
            _refuse_unseen_hook(call.model, facts, decision)
        except GcpatchError:
            raise
        except Exception as exc:  # noqa: BLE001 (strict: _failed_open raises GcpatchError)
            _failed_open(Stage.ENABLE, exc, cfg)
    try:
        applied = apply.apply(call.model, decision, run_first_forward)
    except Exception as exc:  # noqa: BLE001 (fail open: undone, enabled again as asked)
        apply.remove_all(call.model)
        _failed_open("apply", exc, cfg)
        # The framework's enable already ran with the decided kwargs: run it again as the user
        # asked, so the model is left exactly as it would be without gcpatch.
        return call.invoke(call.asked_kwargs)
    checkpoint_call.cover(
        call.model, decision
    )  # its layers' checkpoint calls stand on this decision (CK4)
    # verify's own correction says it in its one line (step/verify.py); the decision stays in the
    # record
    quiet = _same_as_last(ctx, facts, decision) or ctx.asker.redecided_by == "verify"
    entry = record.decision(
        facts, decision, applied, cfg.record_dir, quiet=quiet, instance=ctx.model.instance
    )
    ctx.commit(entry)
    if cfg.memory_budget is not None or cfg.verify:
        # loaded only where asked: the first step's work (verify, then the budget's plan)
        from gcpatch.step import first_step

        first_step.arm(call.model, cfg.memory_budget, cfg.verify, correct)
    return result


def run_disable(model: Any, api: str) -> dict[str, str]:
    """The user switched checkpointing off: take back what gcpatch added for the enable, and
    re-decide nothing later. Recorded for every model gcpatch decided for. Returns the configs
    whose `use_cache` was given back (R6)."""
    known = context.known(model)
    if known is None:
        return {}
    known.replay = None
    restored = apply.remove_all(model)
    checkpoint_call.uncover(model)
    record.disable(type(model).__name__, api, restored, settings.read().record_dir, known.instance)
    return restored


def run_config(facts: Any, write: Callable[[Any], dict[str, Any]]) -> Any:
    """A decision taken from a framework's config before any model exists (Axolotl): the same
    votes and resolver; `write` puts the outcome into the config and says what it changed.
    Returns the decision, or None when gcpatch failed open (the config is left as it was)."""
    cfg = settings.read()
    try:
        facts = _with_framework_facts(facts)
        decision = resolve.resolve(
            resolve.stance_votes(facts) + engine.host().votes(facts), cfg.mode
        )
        applied = write(decision)
    except GcpatchError:
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: the config is left as it was)
        _failed_open(Stage.CONFIG, exc, cfg)
        return None
    record.decision(facts, decision, applied, cfg.record_dir)
    return decision


def redecide(model: Any, source: str, **wrapped: Any) -> bool:
    """Decide again for a model whose set-up changed after checkpointing was enabled (wrapped by
    PEFT, by DDP): the same path as the user's enable, with what is known now."""
    known = context.known(model)
    if known is None or not known.enabled or not _checkpointing_on(model):
        return False
    known.wrapped.update(wrapped)
    with context.asking(redecided_by=source):
        known.replay(model, known.ask)
    return True


def redecide_within(root: Any, source: str, **wrapped: Any) -> None:
    """`redecide` for every model gcpatch decided for inside `root` (a DDP or booster wrapper)."""
    for module in context.decided_within(root):
        redecide(module, source, **wrapped)


def correct(model: Any, report: Report, attempt: int) -> str:
    """Fix mode's answer to a verification that found wrong gradients (or a block recomputed twice)
    on the first training forward, before the user's step runs: first non-reentrant, decided again
    with verify's finding as a required vote (VERIFY: evidence outranks the enable-time guess);
    then, as the last resort, checkpointing off for the offending blocks. Returns what changed."""
    known = context.known(model)
    if known is None or not known.enabled:
        return ""
    if attempt == 1:
        if not (_decided_reentrant(known) and report.wrong):
            return ""
        known.evidence = [
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "VERIFY",
                f"the first training step, verified: {'; '.join(report.problems())}",
                plugin="core",
                avoids=WRONG_GRADIENTS,
                short="verify found wrong gradients",
            )
        ]
        redecide(model, "verify")
        return "" if _decided_reentrant(known) else "use_reentrant True -> False"
    layers = [
        m
        for m in facts_mod.checkpoint_layers(model)
        if getattr(m, "gradient_checkpointing", False) is True
    ]
    names = {id(m): n for n, m in model.named_modules()}
    twice = {name for name, runs in report.blocks.items() if runs["backward"] > 1}
    offending = [
        m
        for m in layers
        if names.get(id(m)) in twice
        or any(w.startswith(f"{names.get(id(m))}.") for w in report.wrong)
    ] or layers
    for layer in offending:
        layer.gradient_checkpointing = False
    shown = ", ".join(names.get(id(m), "?") for m in offending[:4]) + (
        " ..." if len(offending) > 4 else ""
    )
    return f"checkpointing off for {len(offending)} of {len(layers)} checkpointed blocks ({shown})"


def _decided_reentrant(known: context.ModelContext) -> bool:
    return bool(((known.last or {}).get("applied") or {}).get(USE_REENTRANT))


def run_first_forward(model: Any) -> None:
    """R5, decided when the first forward that builds a graph runs (the mode the user trains in
    is known only then)."""
    with facts_mod.one_walk():
        _decide_first_forward(model)


def _decide_first_forward(model: Any) -> None:
    cfg = settings.read()
    known = context.of(model)
    last = known.last or {}
    try:
        facts = _with_framework_facts(
            facts_mod.gather(
                model,
                stage=Stage.FIRST_FORWARD,
                api=last.get("api", "?"),
                source=last.get("source", "call"),
                asked_kwargs=known.ask,
                asked_from=known.ask_from or "nothing",
                context=known.wrapped,
                trainer=known.trainer,
            )
        )
        decision = resolve.resolve(engine.host().votes(facts), cfg.mode)  # strict: R5 raises
        if not decision.winners and not decision.warnings:
            return
        applied: dict[str, Any] = {}
        if decision.values.get(EVAL_MODE_FIX):
            fixed = apply.fix_eval_mode(model)
            applied[EVAL_MODE_FIX] = fixed
            if not fixed:
                vote = decision.winners[EVAL_MODE_FIX]
                decision.warnings.append(
                    vote.unmet or f"{vote.rule}: could not be applied to this model"
                )
        if decision.values.get(USE_CACHE_OFF):
            applied.update(apply.use_cache_off(model))
        record.decision(facts, decision, applied, cfg.record_dir, instance=context.instance(model))
    except GcpatchError:
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: the model as the framework left it)
        apply.reset(model)
        _failed_open(Stage.FIRST_FORWARD, exc, cfg)


def _refuse_unseen_hook(model: Any, facts: Any, decision: Any) -> None:
    """Strict mode withholds the input-grads hook (R2, P1, R3; gcpatch/apply.py): through torch's
    checkpoint, the layer call whose input would need it raises (CK1, naming the hook's rule). A
    checkpoint function other than torch's, or the torch plugin not running, hides those calls:
    strict raises here where a stack fed by the input embeddings trains with nothing trainable
    upstream, and no hook of transformers' own (its enable's, or the user's
    enable_input_require_grads) serves it."""
    hook = decision.winners.get(INPUT_GRADS_HOOK) if decision.values.get(INPUT_GRADS_HOOK) else None
    if hook is None:
        return
    if facts.checkpoint_function:  # it may run reentrant whatever it is asked: the hook either way
        unseen = f"the layers call {facts.checkpoint_function}"
    elif decision.values.get(USE_REENTRANT) and not any(
        s.name == "torch" for s in engine.host().active()
    ):
        unseen = "the torch plugin is not running"
    else:
        return
    if any(
        s.trainable_in_blocks and not s.inputs_can_require_grad and s.fed_by_input_embeddings
        for s in facts.stacks
    ) and not apply.input_grads_hooked(model):
        raise resolve.refusal(hook, f" ({unseen}: gcpatch cannot see the checkpoint calls)")


def _with_framework_facts(facts: Any) -> Any:
    """`facts` with what the running plugins know about their frameworks (`gcpatch_facts`: a
    release gate one plugin owns and another plugin's rule reads); gathering stays pure."""
    return engine.host().with_framework_facts(facts)


def _checkpointing_on(model: Any) -> bool:
    return any(
        getattr(m, "gradient_checkpointing", False) for m in facts_mod.checkpoint_layers(model)
    )


def _same_as_last(ctx: context.DecisionContext, facts: Any, decision: Any) -> bool:
    last = ctx.model.last
    return (
        bool(last)
        and last["decision"]["values"] == decision.values
        and last["decision"]["rules"] == decision.rules
        and last["asked"]["from"] == facts.asked_from
    )


def _failed_open(stage: str, exc: BaseException, cfg: settings.Settings) -> None:
    text = str(exc) if isinstance(exc, PluginFailure) else f"{type(exc).__name__}: {exc}"
    if cfg.strict:
        rule = f"plugin:{exc.plugin}" if isinstance(exc, PluginFailure) else f"gcpatch:{stage}"
        raise GcpatchError(
            f"gcpatch failed in {stage}: {text}",
            rule=rule,
            fix="report it, or set GCPATCH_MODE=fix to fall back to the framework's behaviour",
        ) from exc
    log.error("gcpatch: %s failed, the framework's own behaviour is kept (%s)", stage, text)
    record.failure(stage, text, cfg.record_dir)
