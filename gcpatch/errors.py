"""The one exception gcpatch raises into a host, and only in strict mode."""

from __future__ import annotations


class GcpatchError(RuntimeError):
    """A set-up gcpatch refuses in strict mode; the message names the rule and the fix."""

    def __init__(self, message: str, rule: str | None = None, fix: str | None = None) -> None:
        self.rule = rule
        self.fix = fix
        text = message
        if rule:
            text = f"[{rule}] {text}"
        if fix:
            text = f"{text} Fix: {fix}"
        super().__init__(text)
