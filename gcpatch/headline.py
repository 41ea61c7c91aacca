"""The one short line a decision gets on the console: what changed and the rule behind it,
e.g. `gcpatch: LlamaForCausalLM: use_reentrant True -> False (R1: frozen upstream, 2 blocks
would lose gradients)`. The asked value, the facts and every vote stay in the record
(`gcpatch explain -v`) and in the DEBUG line (`detail`)."""

from __future__ import annotations

import os
from typing import Any

LIMIT = 120  # characters of the first line: one terminal row
# R6's use_cache=False comes with every enable: it is in the record and the DEBUG line, not here.
_KNOB_WORDS = {
    "input_grads_hook": "input-grads hook",
    "run_inline": "runs inline",
    "lift_bound_tensors": "bound tensors passed as inputs",
    "grad_input": "an input that requires grad, reentrant kept",
    "tuple_outputs": "result passed through as a tuple",
}


def line(entry: dict[str, Any]) -> str:
    """The short line for one record (a decision, a checkpoint call site or a failure)."""
    if "failed_open" in entry:
        return shorten(
            f"gcpatch: {entry.get('stage', '?')} failed open, the framework's own behaviour is kept"
            f" ({entry['failed_open']})"
        )
    if entry.get("stage") == "call":
        head = f"gcpatch: checkpoint call at {_site(entry.get('site', '?'))}: "
    else:
        # one word: "DDP(find_unused_parameters=True) (R4)" -> DDP, "wrapped by
        # PeftModelForCausalLM" -> the wrapper
        source = (str(entry.get("source") or "call").split("(", 1)[0].split() or ["call"])[-1]
        head = f"gcpatch: {_model(entry)}" + (f" ({source})" if source != "call" else "") + ": "
    parts = _parts(entry)
    if not parts:
        return shorten(head + "left as asked")
    # the rule id stays on the line: a long first part gives up its reason's words first, then
    # words before its rule (room kept for "+N more" where more parts follow)
    reserve = len(" +9 more") if len(parts) > 1 else 0
    for room in (40, 24, 0):
        if len(head) + len(parts[0]) + reserve <= LIMIT:
            break
        parts = _parts(entry, room)
    if len(head) + len(parts[0]) + reserve > LIMIT:
        parts[0] = _keep_rule(parts[0], LIMIT - len(head) - reserve)
    # The first part keeps its reason; the rest name their rule only, and drop out if the line is
    # full.
    text = head + parts[0]
    for index, part in enumerate(parts[1:], 1):
        room = LIMIT - (len(" +9 more") if index < len(parts) - 1 else 0)
        if len(text) + 2 + len(part) > room:
            return shorten(text, LIMIT - len(" +9 more")) + f" +{len(parts) - index} more"
        text += "; " + part
    return shorten(text)


def _model(entry: dict[str, Any]) -> str:
    """The model's name in a line: a config names the model's path, of which the last part is
    kept; the second model of its class and on are numbered."""
    model = str(entry.get("model", "?")).rstrip("/").rsplit("/", 1)[-1]
    if isinstance(entry.get("instance"), int) and entry["instance"] > 1:
        model += f" #{entry['instance']}"
    return model


def _parts(entry: dict[str, Any], room: int = 60) -> list[str]:
    """The words for each knob that took effect, use_reentrant first."""
    applied = entry.get("applied") or {}
    winners = (entry.get("decision") or {}).get("winners") or {}
    parts: list[str] = []
    if "use_reentrant" in applied:
        parts.append(
            _reentrant(entry, applied["use_reentrant"], winners.get("use_reentrant"), room)
        )
    hook = (
        winners.get("input_grads_hook") if isinstance(winners.get("input_grads_hook"), dict) else {}
    )
    if applied.get("input_grads_hook") and _kept_through_hook(entry):
        # R1 recommended non-reentrant, the user's reentrant is kept: the hook is what makes it
        # exact
        parts[0] += (
            f", exact through the input-grads hook ({hook.get('rule', 'R2')}: frozen upstream)"
        )
        applied = {k: v for k, v in applied.items() if k != "input_grads_hook"}
    for knob, value in applied.items():
        vote = winners.get(knob) if isinstance(winners.get(knob), dict) else {}
        rule = vote.get("rule", "?")
        if knob == "eval_mode_fix":
            parts.append(
                f"{value} eval-mode layers checkpoint anyway {_why(rule, vote, room)}"
                if value
                else f"eval-mode layers cannot be switched, call model.train() ({rule})"
            )
        elif knob in _KNOB_WORDS and value:
            parts.append(
                f"{_KNOB_WORDS[knob]} {_why(rule, vote, room)}"
                if not parts
                else f"{_KNOB_WORDS[knob]} ({rule})"
            )
    return parts


def _reentrant(entry: dict[str, Any], value: Any, vote: Any, room: int = 60) -> str:
    vote = vote if isinstance(vote, dict) else {}
    asked = (entry.get("asked") or {}).get("use_reentrant")
    rule = vote.get("rule", "?")
    if rule == "USER":
        kept = (
            " (X3: earlier ask kept)"
            if "(X3)" in str((entry.get("asked") or {}).get("from"))
            else ""
        )
        return f"use_reentrant={value} as asked{kept}"
    reason = _why(rule, vote, room)[1:-1]
    if asked == value:
        return f"use_reentrant={value} as asked ({rule} agrees)"
    facts = entry.get("facts") if isinstance(entry.get("facts"), dict) else {}
    if asked is None and facts.get("default_use_reentrant") is value:
        # nothing changed: the framework's own default stands, and a rule may agree with it (X5)
        owner = facts.get("default_from") or "the framework"
        agrees = "no rule applies" if rule == "DEFAULT" else f"{rule} agrees"
        return f"use_reentrant={value}, {owner}'s default ({agrees})"
    if asked is None and isinstance(facts.get("default_use_reentrant"), bool):
        was = f"{facts['default_use_reentrant']} (default)"
    else:
        was = "unset" if asked is None else str(asked)
    return f"use_reentrant {was} -> {value} ({reason})"


def _kept_through_hook(entry: dict[str, Any]) -> bool:
    """The user's reentrant won over a recommendation for non-reentrant that only the hook answers
    (R1)."""
    decision = entry.get("decision") or {}
    won = (decision.get("winners") or {}).get("use_reentrant") or {}
    return (
        won.get("rule") == "USER"
        and won.get("value") is True
        and any(
            v.get("knob") == "use_reentrant"
            and v.get("strength") == "recommended"
            and v.get("rule") == "R1"
            for v in decision.get("overruled") or []
        )
    )


def _keep_rule(part: str, room: int) -> str:
    """`part` within `room`, its closing `(rule ...)` kept whole and the words before it cut."""
    text, sep, rule = part.rpartition(" (")
    if not sep or len(rule) + 6 > room:
        return shorten(part, room, " ...")
    left = room - len(rule) - 2
    if len(text) > left and " " not in text[: left - 3]:
        return "..." + sep + rule  # not even its first word fits: the rule alone
    return shorten(text, left, " ...") + sep + rule


def _why(rule: str, vote: dict[str, Any], room: int) -> str:
    """`(R1: short reason)` within `room` characters of reason, or `(R1)`."""
    short = _short(vote, room) if room else ""
    return f"({rule}: {short})" if short else f"({rule})"


def _short(vote: dict[str, Any], room: int = 60) -> str:
    """A vote's short reason, or the first clause of its reason where the plugin gave none;
    within `room` at a word, or none where its first word alone is longer."""
    reason = vote.get("short")
    if not isinstance(reason, str) or not reason:
        reason = vote.get("reason")
        if not isinstance(reason, str):
            return ""
        for mark in (": ", "; ", " ("):
            reason = reason.split(mark, 1)[0]
    if len(reason) > room and " " not in reason[: room - 3]:
        return ""
    return shorten(reason, room, " ...")


def _site(site: str) -> str:
    path, _, lineno = str(site).rpartition(":")
    return f"{os.path.basename(path)}:{lineno}" if path else str(site)


# What ends a line cut short: where the rest is.
MORE = " ... (gcpatch explain -v)"
INDENT = "    "  # a wrapped message's continuation lines


def shorten(text: str, limit: int | None = None, more: str = MORE) -> str:
    """`text` within `limit` characters (default LIMIT), cut at a word (never inside one), ending
    with `more` (where the rest is)."""
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
    limit = LIMIT if limit is None else limit
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


def warnings(entry: dict[str, Any]) -> list[str]:
    """The decision's warnings, each in one short line: a rule over the user's ask (fix mode), the
    user's ask over a rule (warn mode), required rules that disagree; the full texts stay in the
    record and at DEBUG."""
    decision = entry.get("decision") or {}
    winners = decision.get("winners") or {}
    who = _model(entry) if entry.get("model") else _site(entry.get("site", "?"))
    out: list[str] = []
    overruled = False
    for text in decision.get("warnings") or []:
        if "; the user asked " in str(text):
            overruled = True
            continue
        out.append(shorten(f"gcpatch: {who}: warning: {text}"))
    if overruled:
        for vote in decision.get("overruled") or []:
            won = winners.get(vote.get("knob"))
            if not isinstance(won, dict):
                continue
            if vote.get("strength") == "user" and won.get("strength") == "required":
                out.append(
                    shorten(
                        f"gcpatch: {who}: {won.get('rule')} overrules {_whose(vote)}"
                        f" {vote.get('knob')}={vote.get('value')} (GCPATCH_MODE=warn keeps it)"
                    )
                )
            elif vote.get("strength") == "required" and won.get("strength") == "user":
                out.append(
                    shorten(
                        f"gcpatch: {who}: warn mode keeps {won.get('knob')}={won.get('value')} over"
                        f" {vote.get('rule')} ({_short(vote)})"
                    )
                )
    for text in decision.get("conflicts") or []:
        rules = sorted(
            {
                v.get("rule", "?")
                for v in decision.get("overruled") or []
                if v.get("strength") == "required"
            }
        )
        knob = str(text).split(":", 1)[0].rsplit(" ", 1)[-1]
        won = winners.get(knob) if isinstance(winners.get(knob), dict) else {}
        out.append(
            shorten(
                f"gcpatch: {who}: required rules disagree on {knob}; {won.get('rule', '?')} wins"
                f" over {', '.join(rules) or '?'} (gcpatch explain -v)"
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
    asked, what was applied, which rule and its full reason."""
    if "failed_open" in entry:
        return (
            f"gcpatch: rank {entry.get('rank')} {entry.get('stage')}: failed open, original"
            f" behaviour ({entry['failed_open']})"
        )
    if entry.get("stage") == "call":
        applied = ", ".join(f"{k}={v}" for k, v in entry["applied"].items()) or "left as called"
        why = "; ".join(entry["why"].values())
        return f"gcpatch: rank {entry['rank']} checkpoint call at {entry['site']}: {applied}" + (
            f" | {why}" if why else ""
        )
    asked = entry["asked"]
    ask = "nothing" if asked["use_reentrant"] is None else f"use_reentrant={asked['use_reentrant']}"
    applied = ", ".join(f"{k}={v}" for k, v in entry["applied"].items()) or "nothing"
    why = "; ".join(f"{knob}: {reason}" for knob, reason in entry["why"].items())
    head = (
        f"gcpatch: rank {entry['rank']} {entry['model']}.{entry['api']} ({entry['source']},"
        f" {entry['stage']})"
    )
    return f"{head}: asked {ask} [{asked['from']}] -> applied {applied} | {why}"
