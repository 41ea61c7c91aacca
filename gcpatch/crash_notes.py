"""Crash explanations: the known checkpointing failures, explained on the exception itself.

Each of these surfaces in a backward pass, far from its cause: a recompute that differs from
the forward (`CheckpointError`), DDP's "mark a variable ready only once", "element 0 of tensors
does not require grad", and a backward through a freed graph. While gcpatch is active,
`torch.autograd.backward` (which `Tensor.backward` and reentrant checkpointing call) and
`torch.autograd.grad` are wrapped by one plain function each: when one of these is raised, an
exception note (PEP 678) names the likely
cause, the rule that covers it, what gcpatch decided in this process and the fix; the note is
recorded for `gcpatch explain`. The exception object, its type, message and the frames it
was raised through are the same: it is re-raised as is (the wrapper adds its own frame).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from gcpatch import context, headline, lifetime, record, settings
from gcpatch.ranks import rank
from gcpatch.schema import Stage

log = logging.getLogger("gcpatch")
_MARK = "_gcpatch_explained"


class Family:
    """One family of crashes gcpatch can explain. A slotted class, not a named tuple: what a first
    enable loads is paid by every checkpointing process (docs/LAYOUT.md)."""

    __slots__ = ("id", "markers", "title", "cause", "rules", "fix")

    def __init__(
        self,
        id: str,  # noqa: A002 (the family's id, as the note prints it)
        markers: tuple[str, ...],  # in the exception's type name or message
        title: str,
        cause: str,
        rules: str,
        fix: str,
    ) -> None:
        self.id, self.markers, self.title = id, markers, title
        self.cause, self.rules, self.fix = cause, rules, fix


FAMILIES = (
    Family(
        "recompute_mismatch",
        (
            "CheckpointError",
            "Recomputed values for the following tensors have different metadata",
            "A different number of tensors was saved",
        ),
        "a checkpointed block computed something else when it was recomputed in the backward",
        "non-reentrant checkpointing checks that the recompute saves the tensors the forward saved;"
        " it does not when the layers' train/eval mode changed between forward and backward"
        " (dropout saves a mask only in training), when DeepSpeed ZeRO-3 gathers parameters"
        " differently for the recompute (non-reentrant on DeepSpeed < 0.19.3, DeepSpeed #8148),"
        " when the block writes a KV cache, or when the block computes the same values by other"
        " operations the second time (a cache built on its first call, a data-dependent branch,"
        " MoE routing: torchtitan#1117, pytorch#155171, transformers#34928)",
        "R3 (ZeRO-3 + frozen/PEFT parameters on DeepSpeed < 0.19.3 -> reentrant + input-grads"
        " hook), R5 (eval mode at the first training forward), R6 (use_cache off under"
        " checkpointing)",
        "keep the model in one mode from forward to backward (no model.eval()/train() in between);"
        " under ZeRO-3 upgrade DeepSpeed to >= 0.19.3 or use use_reentrant=True (GCPATCH_MODE=fix"
        " applies R3); a block that saves other tensors on its recompute runs exactly under"
        " use_reentrant=True, which does not compare them (with an input that requires grad:"
        " gcpatch's CK1 and R2 give it one)",
    ),
    Family(
        "ddp_ready_twice",
        ("Expected to mark a variable ready only once",),
        "DDP saw a parameter's gradient twice in one backward",
        "reentrant checkpointing runs each checkpointed block's backward as a separate backward"
        " pass; with DDP(find_unused_parameters=True) (or a parameter shared between blocks) the"
        " recompute fires the parameter's DDP hook a second time (trl#4782, accelerate#2017)",
        "R4 (multi-process DDP with find_unused_parameters=True + reentrant -> non-reentrant)",
        "use_reentrant=False (gcpatch's R4 applies it in fix mode when DDP wraps the model), or "
        "find_unused_parameters=False (ddp_find_unused_parameters=False in TrainingArguments), or "
        "DDP(static_graph=True)",
    ),
    Family(
        "loss_without_grad",
        ("element 0 of tensors does not require grad and does not have a grad_fn",),
        "the loss has no graph to backpropagate",
        "with reentrant checkpointing a checkpointed block whose inputs need no gradient returns an"
        " output without one (frozen embeddings, inputs_embeds, adapters inside frozen layers,"
        " hidden states passed by keyword); if nothing trainable comes after the blocks the loss"
        " has no grad_fn. Also: every parameter frozen, or the forward ran under torch.no_grad()",
        "CK1 (a reentrant call none of whose positional inputs requires grad -> non-reentrant), R1"
        " (partially frozen + reentrant -> non-reentrant), R2/X2/P1 (input-grads hook under"
        " reentrant)",
        "use_reentrant=False, or model.enable_input_require_grads() before training; check that a"
        " parameter requires grad and that the forward is not under torch.no_grad()",
    ),
    Family(
        "backward_twice",
        ("Trying to backward through the graph a second time",),
        "a graph was backpropagated twice",
        "under reentrant checkpointing, a tensor with a graph that reaches a checkpointed function"
        " other than as a positional input (a keyword such as hidden_states=..., a closure, a"
        " default argument) is backpropagated inside each checkpoint's own backward, once per block"
        " that uses it; also a tensor computed with grad in one step and used again in the next"
        " (inputs_embeds or an embedding output computed once outside the loop, a KV cache carried"
        " across steps), or backward() run twice on one loss",
        "CK1/CK5 (a tensor bound into a reentrant checkpoint: passed positionally, or"
        " non-reentrant), R6 (use_cache off under checkpointing), R1/R4 (non-reentrant)",
        "use_reentrant=False, or pass the tensor to the checkpointed layer positionally"
        " (GCPATCH_MODE=fix applies CK1/CK5); recompute per step what is reused across steps;"
        " use_cache=False; retain_graph=True only if a second backward is intended",
    ),
    Family(
        "reentrant_grad",
        ("torch.utils.checkpoint is incompatible with .grad()",),
        "reentrant checkpointing cannot serve torch.autograd.grad or backward(inputs=...)",
        "reentrant checkpointing runs each block's backward as a separate backward that accumulates"
        " into .grad; torch refuses it inside torch.autograd.grad() or backward(inputs=...). Known"
        " only at backward time: nothing in the forward shows how the gradients will be taken",
        "CK1 (non-reentrant where the evidence shows reentrant cannot serve)",
        "use_reentrant=False (gradient_checkpointing_kwargs={'use_reentrant': False}), or take"
        " gradients with loss.backward()",
    ),
)

_installed: list[tuple[Any, Any, Any]] = []  # (module, original, wrapper)


def register() -> None:
    """Wrap torch.autograd.backward when torch.autograd is imported (now, if it already is)."""
    from gcpatch import import_hooks

    import_hooks.when_imported("torch.autograd", _install)


def _install(module: Any) -> None:
    if _installed:
        return
    for name in _ENTRIES:
        original = getattr(module, name)
        if getattr(original, _MARK, False):
            continue
        wrapper = _explaining(original)
        setattr(module, name, wrapper)
        _installed.append((module, name, original, wrapper))


# The autograd entries a checkpointing failure surfaces through: backward (Tensor.backward,
# reentrant
# checkpointing's own) and grad (torch.autograd.grad, which reentrant checkpointing refuses).
_ENTRIES = ("backward", "grad")


def _explaining(original: Any) -> Any:
    @functools.wraps(original)
    def entry(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            if not context.in_own_pass():  # gcpatch's own pass says its failure itself
                explain(exc)
            raise

    setattr(entry, _MARK, True)
    return entry


@lifetime.activation
def uninstall() -> None:
    """Put torch.autograd's entries back, by identity (someone who wrapped over us keeps theirs)."""
    while _installed:
        module, name, original, wrapper = _installed.pop()
        if getattr(module, name) is wrapper:
            setattr(module, name, original)


def family_of(exc: BaseException) -> Family | None:
    text = f"{type(exc).__name__}: {exc}"
    return next((f for f in FAMILIES if any(marker in text for marker in f.markers)), None)


def explain(exc: BaseException) -> str | None:
    """Add gcpatch's note to a known checkpointing failure (once); returns the note. Never
    raises."""
    try:
        if getattr(exc, _MARK, False):
            return None
        family = family_of(exc)
        if family is None:
            return None
        setattr(exc, _MARK, True)
        decided = decisions()
        lines = [
            f"likely cause: {family.cause}",
            f"rule: {family.rules}",
            *(f"gcpatch decided: {text}" for text in decided),
            *_exact_instead(family, exc),
            f"fix: {family.fix}",
        ]
        note = f"gcpatch [{family.id}]: {family.title}\n" + "\n".join(
            headline.wrap(f"  {line}") for line in lines
        )
        message = (
            headline.shorten(str(exc).strip().splitlines()[0], 200, " ...")
            if str(exc).strip()
            else ""
        )
        line = (
            f"gcpatch: rank {rank()} crash explained [{family.id}]: {type(exc).__name__}: {message}"
        )
        if hasattr(exc, "add_note"):
            # The note is what the user sees if the exception propagates; a program that expects
            # and catches it (torch's own tests catch CheckpointError) sees no ERROR line.
            exc.add_note(note)
            log.debug("%s (gcpatch's note is on the exception)", headline.wrap(line))
        else:  # Python < 3.11 has no exception notes: the log line is the only carrier
            log.warning("%s\n%s", headline.wrap(line), note)
        record.event(
            {
                "stage": "crash",
                "family": family.id,
                "error": f"{type(exc).__name__}: {message}",
                "line": line,
                "details": lines,
            },
            settings.read().record_dir,
        )
        return note
    except Exception as inner:  # noqa: BLE001 (the user's exception must propagate untouched)
        log.error(
            "gcpatch: could not explain %s (%s: %s)",
            type(exc).__name__,
            type(inner).__name__,
            inner,
        )
        return None


def _exact_instead(family: Family, exc: BaseException) -> list[str]:
    """Which other choice is exact where the one in force raised: a recompute that saves a
    different number of tensors is refused by non-reentrant checkpointing only."""
    if family.id != "recompute_mismatch" or "A different number of tensors" not in str(exc):
        return []
    chose = [
        e
        for e in record.history()
        if (e.get("applied") or {}).get("use_reentrant") is False and e.get("stage") != "disable"
    ]
    by = ""
    if chose:
        last = chose[-1]
        won = ((last.get("decision") or {}).get("winners") or {}).get("use_reentrant") or {}
        why = f"{won.get('rule', '?')}: {won.get('short')}" if won.get("short") else won.get("rule")
        what = last.get("model") or last.get("site", "the call")
        by = f" (gcpatch ran {what} non-reentrant by {why or 'no rule'})"
    return [
        "exact instead: use_reentrant=True: reentrant recomputes without comparing what is saved,"
        f" so this block runs exactly under it{by}; pass gradient_checkpointing_kwargs="
        "{'use_reentrant': True} (or use_reentrant=True at the call)"
    ]


def decisions() -> list[str]:
    """What gcpatch decided in this process: the last decision per model and per checkpoint call
    site (by file name and line), and verify's findings."""
    last: dict[str, dict[str, Any]] = {}
    verified: list[str] = []
    for entry in record.history():
        if entry.get("stage") in (Stage.ENABLE, Stage.FIRST_FORWARD, Stage.CONFIG):
            last[f"{entry.get('model', '?')}.{entry.get('api', '?')}"] = entry
        elif entry.get("stage") == "call":  # a checkpoint call site's own decision (CK1-CK7)
            site = str(entry.get("site", "?"))
            path, _, line = site.rpartition(":")
            last[f"the checkpoint call at {os.path.basename(path)}:{line}" if path else site] = (
                entry
            )
        elif entry.get("stage") == "verify":
            verified.append(entry["line"].split(" verify ", 1)[-1])
    if not last:
        return ["no checkpointing decision in this process (no enable call went through gcpatch)"]
    out = []
    for where, entry in last.items():
        decision = entry.get("decision", {})
        mode = decision.get("mode", "?")
        applied = ", ".join(f"{k}={v}" for k, v in entry.get("applied", {}).items())
        rules = ", ".join(entry.get("rules") or [])
        if applied:
            text = f"{where}: applied {applied}" + (f" by {rules}" if rules else "")
        else:
            text = f"{where}: left as made"
        text += f" ({mode} mode)"
        warnings = decision.get("warnings", []) + decision.get("conflicts", [])
        out.append(text + "".join(f"; warning: {w}" for w in warnings))
    return out + [f"verify: {text}" for text in verified]
