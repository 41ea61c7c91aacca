"""The one exception gcpatch raises into a host, and only in strict mode."""

from __future__ import annotations


class GcpatchError(RuntimeError):
    """A set-up gcpatch refuses in strict mode; the message names the rule and the fix."""

    def __init__(self, message: str, rule: str | None = None, fix: str | None = None) -> None:
        self.rule = rule
        self.fix = fix
        text = message.strip()
        if rule:
            if text.startswith(f"{rule} "):  # "CK1 requires ...": the rule is named once, in front
                text = text[len(rule) + 1 :]
            text = f"[{rule}] {text}"
        if fix:
            text = f"{text.rstrip('.;')}. Fix: {fix.rstrip('.')}."
        super().__init__(text)
