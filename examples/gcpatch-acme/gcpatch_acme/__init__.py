"""gcpatch-acme: an example third-party gcpatch plugin with one rule of its own (ACME1)."""

from __future__ import annotations

from gcpatch.plugin import (
    REQUIRED,
    USE_REENTRANT,
    WRONG_GRADIENTS,
    Facts,
    PatchPoint,
    PluginInfo,
    Rule,
    Stage,
    Vote,
    hookimpl,
)

RULES = (
    Rule(
        "ACME1",
        "Acme model classes keep state the reentrant recompute does not restore -> non-reentrant",
        "the Acme modelling team's own finding (an example rule)",
    ),
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    # The version range is checked against the installed `torch` before any hook below runs.
    return PluginInfo(name="acme", framework="torch", versions=">=2.0", rules=RULES)


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return []


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage == Stage.ENABLE and facts.model_class.startswith("Acme"):
        return [
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "ACME1",
                f"{facts.model_class} keeps buffer state the reentrant recompute would not restore",
                avoids=WRONG_GRADIENTS,
            )
        ]
    return []
