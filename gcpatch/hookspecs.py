"""The hooks a gcpatch plugin implements. Built-in and third-party plugins alike register
through the entry-point group `gcpatch.plugins` and implement these with `@hookimpl`.

Config-time, enable-time and wrap-time decisions are one mechanism: a plugin patches the place
where its framework decides, builds the call, and every rule answers `gcpatch_vote`.
"""

from __future__ import annotations

from typing import Any

import pluggy

from gcpatch.schema import CallFacts, Facts, PatchPoint, PluginInfo, Vote

PROJECT = "gcpatch"
ENTRY_POINT_GROUP = "gcpatch.plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PluginSpec:
    @hookspec
    def gcpatch_plugin_info(self) -> PluginInfo:
        """Called once, right after the plugin module is loaded and before anything else.

        Return the plugin's name, the distribution it serves and the PEP 440 range it supports,
        and its rule table. A framework that is absent or outside the range skips the plugin:
        none of its patch points is installed and it never votes.
        """

    @hookspec
    def gcpatch_patch_points(self) -> list[PatchPoint]:
        """Called once, after the version check passed.

        Return the places to wrap. Each is installed lazily when its module is imported (or at
        once if it already is), exactly once, and restored by identity on `gcpatch.deactivate()`.
        """

    @hookspec
    def gcpatch_vote(self, facts: Facts) -> list[Vote]:
        """Called for every decision with the facts gathered for it.

        Return the votes of this plugin's rules that apply to these facts (an empty list when
        none does). Votes must depend on `facts` alone, so that every rank decides the same.
        """

    @hookspec
    def gcpatch_facts(self, facts: Facts) -> dict[str, Any]:
        """Called for every decision, before any plugin votes, with the facts gathered so far.

        Return what this plugin knows about its framework that rules of other plugins need
        (name -> plain value, e.g. whether this DeepSpeed release recomputes ZeRO-3 frozen
        parameters under non-reentrant checkpointing), so that no plugin hard-codes another's
        release gates. Merged into `facts.framework_facts` and recorded. Optional.
        """

    @hookspec
    def gcpatch_call_vote(self, facts: CallFacts) -> list[Vote]:
        """Called for a `torch.utils.checkpoint.checkpoint` call that no enable-time decision
        covers, once per pattern of facts (the outcome is cached by them), never per step.

        Return the votes of this plugin's call-level rules (an empty list when none applies).
        Optional: a plugin without call-level rules does not implement it.
        """
