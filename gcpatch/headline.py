"""The one line a decision gets on the console and in `gcpatch explain`: whose, what changed and
the rule behind it, e.g. `gcpatch: LlamaForCausalLM: use_reentrant True -> False (R1: frozen
upstream)`. Where a rule and the user's ask met, or warn mode left a rule unapplied, that line
says so too, with the consequence and the fix: one line a decision. On the console a line gives
up its reasons' words to fit one row (LIMIT), never its action or its fix, and is wrapped whole
where even that does not fit; `gcpatch explain` prints it whole (`limit=None`). The asked value,
the facts and every vote stay in the record (`gcpatch explain -v`) and the DEBUG line (`detail`).

A record is read as hostile input: a field of the wrong type is read as absent, so nothing here
raises on a record, whatever JSON it holds."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

LIMIT = 120  # characters of a console line: one terminal row
INDENT = "    "  # a wrapped message's continuation lines
# R6's use_cache=False comes with every enable: it is in the record and the DEBUG line, not here.
_KNOB_WORDS = {
    "input_grads_hook": "input-grads hook",
    "run_inline": "runs inline",
    "lift_bound_tensors": "bound tensors passed as inputs",
    "grad_input": "an input that requires grad, reentrant kept",
    "tuple_outputs": "result passed through as a tuple",
}
_LEFT_IN_WARN_MODE = " (warn mode: left as it is)"  # gcpatch/resolve.py `_resolve_knob`
_USER_ASKED = "; the user asked "  # gcpatch/resolve.py: a required rule met the user's ask
# One change's words, most first: with its reason, with the reason's first clause, without a
# reason (its rule id, its action and its fix are in each)
Part = tuple[str, str, str]


def _consequence(avoids: str) -> str:
    """What follows where warn mode keeps the user's value over a required rule: the failure the
    rule avoids (gcpatch/schema.py Failure)."""
    return {
        "wrong_gradients": "gradients will be wrong",
        "crash": "it will crash",
        "no_memory_saved": "no memory will be saved",
    }.get(avoids, "")


def _state_fix(rule: str) -> str:
    """The user's own fix where warn mode leaves a rule on the model's state unapplied: the record
    keeps only the rule's reason (gcpatch/resolve.py `_resolve_knob`); R5's vote says it as its
    `unmet` (plugins/transformers.py)."""
    fix = f"GCPATCH_MODE=fix applies {rule}"
    return f"call model.train() before training, or {fix}" if rule == "R5" else fix


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) and value else default


def _rule(vote: dict[str, Any], default: str = "?") -> str:
    return _text(vote.get("rule"), default)


def line(entry: dict[str, Any], limit: int | None = LIMIT) -> str:
    """The line for one record (a decision, a checkpoint call site or a failure). Within `limit`
    where its actions fit: the other parts' reasons give way first, then the first part's reason
    shortens to its first clause; where that does not fit one row, two rows keep that reason, and
    where two cannot, it goes (its rule id stays): the fewest rows, never cut. `limit=None`
    (`gcpatch explain`): every part with its reason, on one line. Never raises on any record."""
    entry = _dict(entry)
    if "failed_open" in entry:
        text = (
            f"gcpatch: {entry.get('stage', '?')} failed open, the framework's own behaviour is"
            f" kept ({entry['failed_open']})"
        )
        return _fit(text, limit)
    head = _head(entry)
    parts = _parts(entry)
    if not parts:
        return _fit(head + "left as asked", limit)
    whole = head + "; ".join(part[0] for part in parts)
    if limit is None:
        return whole
    rest = [part[2] for part in parts[1:]]
    first = head + "; ".join([parts[0][0], *rest])
    clause = head + "; ".join([parts[0][1], *rest])
    for text in (whole, first, clause):
        if len(text) <= limit:
            return text
    # the first change's reason is worth a second row; where two rows cannot hold it, it goes
    for text in (first, clause):
        if wrap(text, limit).count("\n") < 2:
            return wrap(text, limit)
    bare = head + "; ".join(part[2] for part in parts)
    forms = [wrap(text, limit) for text in (first, clause, bare)]
    return min(forms, key=lambda text: text.count("\n"))


def _fit(text: str, limit: int | None) -> str:
    return text if limit is None else wrap(text, limit)


def _head(entry: dict[str, Any]) -> str:
    """`gcpatch: <who>: `: the call site, or the model and what made the decision."""
    if entry.get("stage") == "call":
        return f"gcpatch: checkpoint call at {_site(entry.get('site', '?'))}: "
    # one word: "DDP(find_unused_parameters=True) (R4)" -> DDP, "wrapped by
    # PeftModelForCausalLM" -> the wrapper
    source = (str(entry.get("source") or "call").split("(", 1)[0].split() or ["call"])[-1]
    return f"gcpatch: {_model(entry)}" + (f" ({source})" if source != "call" else "") + ": "


def _model(entry: dict[str, Any]) -> str:
    """The model's name in a line: a config names the model's path, of which the last part is
    kept; the second model of its class and on are numbered."""
    model = str(entry.get("model", "?")).rstrip("/").rsplit("/", 1)[-1]
    instance = entry.get("instance")
    if isinstance(instance, int) and not isinstance(instance, bool) and instance > 1:
        model += f" #{instance}"
    return model


def _parts(entry: dict[str, Any]) -> list[Part]:
    """The words for each change, use_reentrant first, then what warn mode left unapplied."""
    applied = _dict(entry.get("applied"))
    winners = _dict(_dict(entry.get("decision")).get("winners"))
    parts: list[Part] = []
    reentrant = _reentrant_part(entry)
    if reentrant:
        parts.append(reentrant)
    if applied.get("input_grads_hook") and parts and _kept_through_hook(entry):
        # R1 recommended non-reentrant, the user's reentrant is kept: the hook is what makes it
        # exact
        rule = _rule(_dict(winners.get("input_grads_hook")), "R2")
        words = ", exact through the input-grads hook"
        full, clause, bare = parts[0]
        parts[0] = (
            f"{full}{words} ({rule}: frozen upstream)",
            f"{clause}{words} ({rule}: frozen upstream)",
            f"{bare}{words} ({rule})",
        )
        applied = {k: v for k, v in applied.items() if k != "input_grads_hook"}
    for knob, value in applied.items():
        vote = _dict(winners.get(knob))
        rule = _rule(vote)
        if knob == "eval_mode_fix":
            if value:
                parts.append(_because(f"{value} eval-mode layers checkpoint anyway", rule, vote))
            else:
                said = f"eval-mode layers cannot be switched, call model.train() ({rule})"
                parts.append((said, said, said))
        elif knob in _KNOB_WORDS and value:
            parts.append(_because(_KNOB_WORDS[knob], rule, vote))
    return parts + _left_in_warn_mode(entry)


def _because(action: str, rule: str, vote: dict[str, Any]) -> Part:
    return _words(lambda why: f"{action} ({rule}: {why})" if why else f"{action} ({rule})", vote)


def _words(said: Callable[[str], str], vote: dict[str, Any]) -> Part:
    """A change said with `vote`'s reason, with the reason's first clause, and without."""
    reason = _reason(vote)
    clause = reason
    for mark in (": ", "; ", " (", ", "):
        clause = clause.split(mark, 1)[0]
    return said(reason), said(clause), said("")


def _reentrant_part(entry: dict[str, Any]) -> Part | None:
    """use_reentrant's part: where a required rule and the user's ask met, who won and what
    follows; else what was applied and why."""
    met = _met(entry)
    if met is not None:
        return met
    applied = _dict(entry.get("applied"))
    if "use_reentrant" not in applied:
        return None
    winners = _dict(_dict(entry.get("decision")).get("winners"))
    return _reentrant(entry, applied["use_reentrant"], _dict(winners.get("use_reentrant")))


def _reentrant(entry: dict[str, Any], value: Any, vote: dict[str, Any]) -> Part:
    asked = _dict(entry.get("asked")).get("use_reentrant")
    rule = _rule(vote)
    if rule == "USER":
        if "(X3)" in str(_dict(entry.get("asked")).get("from")):
            kept = f"use_reentrant={value} as asked (X3: earlier ask kept)"
            return kept, kept, f"use_reentrant={value} as asked (X3)"
        return (f"use_reentrant={value} as asked",) * 3
    if asked == value:
        return (f"use_reentrant={value} as asked ({rule} agrees)",) * 3
    facts = _dict(entry.get("facts"))
    default = facts.get("default_use_reentrant")
    if asked is None and isinstance(default, bool) and default is value:
        # nothing changed: the framework's own default stands, and a rule may agree with it (X5)
        owner = facts.get("default_from") or "the framework"
        agrees = "no rule applies" if rule == "DEFAULT" else f"{rule} agrees"
        return (f"use_reentrant={value}, {owner}'s default ({agrees})",) * 3
    if asked is None and isinstance(default, bool):
        was = f"{default} (default)"
    else:
        was = "unset" if asked is None else str(asked)
    return _because(f"use_reentrant {was} -> {value}", rule, vote)


def _clash(entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the losing vote, the winner) where a required rule and the user's ask met on
    use_reentrant (gcpatch/resolve.py `_resolve_knob`: fix mode applies the rule, warn mode keeps
    the ask)."""
    decision = _dict(entry.get("decision"))
    if not any(_USER_ASKED in str(text) for text in _list(decision.get("warnings"))):
        return None
    won = _dict(_dict(decision.get("winners")).get("use_reentrant"))
    for vote in map(_dict, _list(decision.get("overruled"))):
        if vote.get("knob") != "use_reentrant":
            continue
        strengths = (vote.get("strength"), won.get("strength"))
        if strengths in (("user", "required"), ("required", "user")):
            return vote, won
    return None


def _met(entry: dict[str, Any]) -> Part | None:
    """Fix mode over the user's own ask: the rule, the change, how to keep the ask. Warn mode:
    the value kept, over which rule, what follows, the fix. A call that named no use_reentrant
    ran with torch's default, which nobody chose: its change is said as any other."""
    clash = _clash(entry)
    if clash is None:
        return None
    lost, won = clash
    if lost.get("strength") == "user":
        if _whose(lost) != "your":
            return None
        action = (
            f"{_rule(won)} overrules your use_reentrant={lost.get('value')} -> {won.get('value')}"
        )
        keep = "GCPATCH_MODE=warn keeps it"
        return _words(lambda why: f"{action} ({why}; {keep})" if why else f"{action} ({keep})", won)
    action = f"warn mode keeps use_reentrant={won.get('value')} over {_rule(lost)}"
    follows = _consequence(_text(lost.get("avoids")))
    fix = f"{follows}; " if follows else ""
    fix += f"pass use_reentrant={lost.get('value')}"
    return _words(lambda why: f"{action} ({why}): {fix}" if why else f"{action}: {fix}", lost)


def _left_in_warn_mode(entry: dict[str, Any]) -> list[Part]:
    """The rules on the model's state (R5, CK2) that warn mode left unapplied, with what that
    leaves and the fix: said whole, their reason being the consequence."""
    parts: list[Part] = []
    for text in _list(_dict(entry.get("decision")).get("warnings")):
        if isinstance(text, str) and text.endswith(_LEFT_IN_WARN_MODE):
            rule, _, reason = text[: -len(_LEFT_IN_WARN_MODE)].partition(": ")
            said = f"warn mode leaves {rule} unapplied: {reason}; {_state_fix(rule)}"
            parts.append((said, said, said))
    return parts


def _kept_through_hook(entry: dict[str, Any]) -> bool:
    """The user's reentrant won over a recommendation for non-reentrant that only the hook answers
    (R1)."""
    decision = _dict(entry.get("decision"))
    won = _dict(_dict(decision.get("winners")).get("use_reentrant"))
    return (
        won.get("rule") == "USER"
        and won.get("value") is True
        and any(
            v.get("knob") == "use_reentrant"
            and v.get("strength") == "recommended"
            and v.get("rule") == "R1"
            for v in map(_dict, _list(decision.get("overruled")))
        )
    )


def _reason(vote: dict[str, Any]) -> str:
    """A vote's short reason, or the first clause of its reason where the plugin gave none; whole
    (a line that does not fit drops it, never cuts it)."""
    reason = _text(vote.get("short"))
    if not reason:
        reason = _text(vote.get("reason"))
        for mark in (": ", "; ", " ("):
            reason = reason.split(mark, 1)[0]
    return reason


def _site(site: Any) -> str:
    path, _, lineno = str(site).rpartition(":")
    return f"{os.path.basename(path)}:{lineno}" if path else str(site)


def shorten(text: str, limit: int | None = None, more: str = " ...") -> str:
    """`text` within `limit` characters (default LIMIT), cut at a word (never inside one), ending
    with `more`. For a message's excerpt (an exception's first line); a decision's line is never
    cut (`line`)."""
    limit = LIMIT if limit is None else limit
    if len(text) <= limit:
        return text
    room = limit - len(more)
    cut = text.rfind(" ", 0, room + 1)
    # at a word wherever there is one; a single word longer than the room (a path) is cut
    return (text[:cut] if cut > 0 else text[:room]).rstrip(" ,;:(") + more


def wrap(text: str, limit: int | None = None) -> str:
    """A long message (a budget's plan, a verification) as lines of at most `limit` characters
    (default LIMIT), broken at words, the continuation lines indented: nothing of it is cut."""
    limit = max(LIMIT if limit is None else limit, 2 * len(INDENT))  # each row takes a character
    if len(text) <= limit:
        return text
    lines, current = [], ""
    for word in text.split(" "):
        width = limit - (len(INDENT) if lines else 0)
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = ""
        while len(current) + len(word) > limit - len(INDENT):  # a path longer than a line
            room = limit - (len(INDENT) if lines else 0) - len(current) - bool(current)
            lines.append(f"{current} {word[:room]}" if current else word[:room])
            current, word = "", word[room:]
        current = f"{current} {word}" if current else word
    lines.append(current)
    return ("\n" + INDENT).join(lines)


def unwrap(message: str) -> str:
    """The one-line text of a message `wrap` broke into lines."""
    return message.replace("\n" + INDENT, " ")


def level(entry: dict[str, Any]) -> int:
    """The level of the decision's line: WARNING where it tells of a rule over the user's own ask,
    of the user's value kept over a required rule, or of a rule warn mode left unapplied."""
    entry = _dict(entry)
    if _left_in_warn_mode(entry):
        return logging.WARNING
    clash = _clash(entry)
    if clash is None or (clash[0].get("strength") == "user" and _whose(clash[0]) != "your"):
        return logging.INFO
    return logging.WARNING


def warnings(entry: dict[str, Any]) -> list[str]:
    """The decision's warnings its line does not say, each whole: the cost a kept ask pays, a rule
    over the user's ask on another knob than use_reentrant, required rules that disagree (the
    full texts stay in the record and at DEBUG)."""
    entry = _dict(entry)
    decision = _dict(entry.get("decision"))
    winners = _dict(decision.get("winners"))
    who = _model(entry) if entry.get("model") else _site(entry.get("site", "?"))
    out: list[str] = []
    asked = False
    for text in map(str, _list(decision.get("warnings"))):
        if _USER_ASKED in text:
            asked = True
        elif not text.endswith(_LEFT_IN_WARN_MODE):
            out.append(wrap(f"gcpatch: {who}: warning: {text}"))
    for vote in map(_dict, _list(decision.get("overruled")) if asked else []):
        knob = _text(vote.get("knob"), "?")
        won = _dict(winners.get(knob))
        if knob == "use_reentrant" or not won:
            continue  # said by the line (`_met`)
        if vote.get("strength") == "user" and won.get("strength") == "required":
            out.append(
                wrap(
                    f"gcpatch: {who}: {_rule(won)} overrules {_whose(vote)} {knob}="
                    f"{vote.get('value')} -> {won.get('value')} (GCPATCH_MODE=warn keeps it)"
                )
            )
        elif vote.get("strength") == "required" and won.get("strength") == "user":
            out.append(
                wrap(
                    f"gcpatch: {who}: warn mode keeps {knob}={won.get('value')} over {_rule(vote)}"
                    f" ({_reason(vote)}); GCPATCH_MODE=fix applies {knob}={vote.get('value')}"
                )
            )
    return out + _conflicts(decision, who)


def _conflicts(decision: dict[str, Any], who: str) -> list[str]:
    """Required rules that disagree: the winner and the rules it won over, and where each rule's
    reason is told without a record (`gcpatch rules`)."""
    out = []
    winners = _dict(decision.get("winners"))
    for text in _list(decision.get("conflicts")):
        rules = sorted(
            {
                _rule(v)
                for v in map(_dict, _list(decision.get("overruled")))
                if v.get("strength") == "required"
            }
        )
        knob = str(text).split(":", 1)[0].rsplit(" ", 1)[-1]
        won = _dict(winners.get(knob))
        out.append(
            wrap(
                f"gcpatch: {who}: required rules disagree on {knob}; {_rule(won)} wins over"
                f" {', '.join(rules) or '?'} (`gcpatch rules` says what each guards against)"
            )
        )
    return out


def _whose(vote: dict[str, Any]) -> str:
    # A call that named no use_reentrant runs with torch's default: nobody chose it.
    return (
        "torch's default" if str(vote.get("reason", "")).startswith("torch's default") else "your"
    )


def detail(entry: dict[str, Any]) -> str:
    """Everything about one decision on one line (DEBUG, and `gcpatch explain -v`): where, what was
    asked, what was applied, which rule and its full reason. A field a record lacks shows as `?`."""
    entry = _dict(entry)
    if "failed_open" in entry:
        return (
            f"gcpatch: rank {entry.get('rank', '?')} {entry.get('stage', '?')}: failed open,"
            f" original behaviour ({entry['failed_open']})"
        )
    applied = ", ".join(f"{k}={v}" for k, v in _dict(entry.get("applied")).items())
    why = "; ".join(map(str, _dict(entry.get("why")).values()))
    if entry.get("stage") == "call":
        return (
            f"gcpatch: rank {entry.get('rank', '?')} checkpoint call at {entry.get('site', '?')}:"
            f" {applied or 'left as called'}" + (f" | {why}" if why else "")
        )
    asked = _dict(entry.get("asked"))
    ask = asked.get("use_reentrant")
    ask = "nothing" if ask is None else f"use_reentrant={ask}"
    why = "; ".join(f"{knob}: {reason}" for knob, reason in _dict(entry.get("why")).items())
    head = (
        f"gcpatch: rank {entry.get('rank', '?')} {entry.get('model', '?')}.{entry.get('api', '?')}"
        f" ({entry.get('source', '?')}, {entry.get('stage', '?')})"
    )
    return (
        f"{head}: asked {ask} [{asked.get('from', '?')}] -> applied {applied or 'nothing'} | {why}"
    )
