"""DeepSpeed ZeRO-3: frozen (PEFT) parameters partitioned by ZeRO-3 change shape between forward
and recompute, so non-reentrant checkpointing raises `CheckpointError: Recomputed values ...
different metadata` on releases without the fix (trl#2514). There reentrant + the input-grads
hook is the only correct choice (R3, TRL T2, Axolotl A3); fixed releases need no override.
"""

from __future__ import annotations

import logging

from packaging.version import InvalidVersion, Version

from gcpatch.plugin import (
    CRASH,
    INPUT_GRADS_HOOK,
    REQUIRED,
    USE_REENTRANT,
    ZERO3_NONREENTRANT_RECOMPUTE,
    Facts,
    PluginInfo,
    Rule,
    Stage,
    Vote,
    hookimpl,
    installed_version,
)

# The first release whose runtime/zero/partitioned_param_coordinator.py skips frozen params
# during checkpoint recompute (`in_checkpoint_recompute`, absent from 0.19.2; DeepSpeed PR #8148).
FIRST_FIXED = Version("0.19.3")
log = logging.getLogger("gcpatch")

RULES = (
    Rule(
        "R3",
        f"ZeRO-3 + frozen or PEFT parameters on DeepSpeed < {FIRST_FIXED} -> reentrant +"
        " input-grads hook, even over the user's False (non-reentrant raises CheckpointError on"
        " recompute)",
        "deepspeed/runtime/zero/partitioned_param_coordinator.py (in_checkpoint_recompute),"
        " trl#2514, TRL T2, Axolotl A3",
        f"deepspeed<{FIRST_FIXED}",
    ),
)

INFO = PluginInfo(
    name="deepspeed",
    framework="deepspeed",
    versions=">=0.9",
    rules=RULES,
    proven=">=0.18.9,<=0.19.8",
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list:
    return []  # ZeRO-3 is a fact (facts.py), read at every decision


@hookimpl
def gcpatch_facts(facts: Facts) -> dict:
    """The release gate of R3, for the rules that must stand back where non-reentrant would crash
    (R1 under ZeRO-3): published, not copied, so it lives here only."""
    version = _version(facts)
    if not facts.zero3 or version is None:
        return {}
    return {ZERO3_NONREENTRANT_RECOMPUTE: not _lacks_fix(version)}


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if (
        facts.stage not in (Stage.ENABLE, Stage.CONFIG)
        or not facts.zero3
        or not (facts.peft or facts.frozen_params)
    ):
        return []
    version = _version(facts)
    if not _lacks_fix(version):
        return []
    why = (
        f"ZeRO-3 with frozen parameters on DeepSpeed {version} (< {FIRST_FIXED}): "
        "non-reentrant recompute raises CheckpointError"
    )
    return [
        Vote(
            USE_REENTRANT,
            True,
            REQUIRED,
            "R3",
            why,
            avoids=CRASH,
            short=f"ZeRO-3 + frozen params, DeepSpeed {version}: non-reentrant crashes",
        ),
        Vote(
            INPUT_GRADS_HOOK,
            True,
            REQUIRED,
            "R3",
            "reentrant kept for ZeRO-3: the first input must need grad",
            avoids=CRASH,
        ),
    ]


def _version(facts: Facts) -> str | None:
    return facts.versions.get("deepspeed") or installed_version(
        "deepspeed"
    )  # a config is decided before the import


def _lacks_fix(version: str | None) -> bool:
    """An unreadable version counts as lacking the fix: R3's reentrant + hook is correct on fixed
    releases too, while non-reentrant crashes on the others."""
    try:
        return version is not None and Version(version) < FIRST_FIXED
    except InvalidVersion:
        log.warning(
            "gcpatch: DeepSpeed version %r is not a PEP 440 version; R3 assumes it lacks the "
            "recompute fix of %s",
            version,
            FIRST_FIXED,
        )
        return True
