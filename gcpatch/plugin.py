"""The public plugin API: everything a gcpatch plugin imports, and nothing else is promised.

A plugin is a module registered under the entry-point group `gcpatch.plugins` (see
examples/gcpatch-acme and docs/PLUGINS.md). It implements, with `@hookimpl`:

- `gcpatch_plugin_info() -> PluginInfo`: its name, the framework distribution and the PEP 440
  range it supports, and its table of `Rule`s (a vote may cite only a declared rule);
- `gcpatch_patch_points() -> list[PatchPoint]`: where its framework decides (wrapped lazily, at
  the module's import, restored on `gcpatch.deactivate()`);
- `gcpatch_vote(facts: Facts) -> list[Vote]`: its rules' votes on one decision, from `facts` alone
  (so every rank decides the same); optionally `gcpatch_call_vote(facts: CallFacts)` for one
  `torch.utils.checkpoint` call and `gcpatch_facts(facts)` to publish what other plugins' rules
  read (`facts.framework_facts`).

A patch point hands the framework's enable to the pipeline as an `EnableCall` (`run_enable`),
its disable to `run_disable`, a config decided before any model exists to `run_config` (facts
from `for_config`), and a wrap after the enable to `redecide` / `redecide_within`.

The words a vote uses: the knobs USE_REENTRANT, INPUT_GRADS_HOOK, USE_CACHE_OFF, EVAL_MODE_FIX,
RUN_INLINE, LIFT_BOUND_TENSORS (a checkpoint call's bound graph tensors passed as its inputs),
GRAD_INPUT (one more input that requires grad, reentrant kept), TUPLE_OUTPUTS (the result through
the checkpoint as a flat tuple); the strengths REQUIRED (a correctness fix) and RECOMMENDED (a
default the user's ask overrides); what a required vote avoids, WRONG_GRADIENTS, CRASH,
NO_MEMORY_SAVED (a conflict goes to the worse failure). ZERO3_NONREENTRANT_RECOMPUTE is the
framework fact the deepspeed plugin publishes (True: this DeepSpeed recomputes ZeRO-3 frozen
parameters under non-reentrant checkpointing) for other plugins' rules to read.

The same words as enums: `Knob`, `Strength`, `Failure`, `Stage` (when a decision is taken:
CONFIG, ENABLE, FIRST_FORWARD, CALL), `Source`; they compare equal to their strings, so
`facts.stage == Stage.ENABLE` reads what a record says. `facts.stacks` holds a `Stack` per
checkpointed stack.

`BUILTIN_ONLY` names the internals built-in plugins still reach where this API cannot serve
them; they are not part of it and may change in any release.
"""

from __future__ import annotations

from gcpatch.context import EnableCall, asking
from gcpatch.errors import GcpatchError
from gcpatch.facts import for_config, installed_version
from gcpatch.hookspecs import hookimpl
from gcpatch.pipeline import redecide, redecide_within, run_config, run_disable, run_enable
from gcpatch.schema import (
    CRASH,
    EVAL_MODE_FIX,
    GRAD_INPUT,
    INPUT_GRADS_HOOK,
    LIFT_BOUND_TENSORS,
    NO_MEMORY_SAVED,
    RECOMMENDED,
    REQUIRED,
    RUN_INLINE,
    TUPLE_OUTPUTS,
    USE_CACHE_OFF,
    USE_REENTRANT,
    WRONG_GRADIENTS,
    ZERO3_NONREENTRANT_RECOMPUTE,
    CallFacts,
    Decision,
    Facts,
    Failure,
    Knob,
    PatchPoint,
    PluginInfo,
    Rule,
    Source,
    Stack,
    Stage,
    Strength,
    Vote,
)

__all__ = [
    "CRASH",
    "EVAL_MODE_FIX",
    "GRAD_INPUT",
    "INPUT_GRADS_HOOK",
    "LIFT_BOUND_TENSORS",
    "NO_MEMORY_SAVED",
    "RECOMMENDED",
    "REQUIRED",
    "RUN_INLINE",
    "TUPLE_OUTPUTS",
    "USE_CACHE_OFF",
    "USE_REENTRANT",
    "WRONG_GRADIENTS",
    "ZERO3_NONREENTRANT_RECOMPUTE",
    "CallFacts",
    "Decision",
    "EnableCall",
    "Facts",
    "Failure",
    "GcpatchError",
    "Knob",
    "PatchPoint",
    "PluginInfo",
    "Rule",
    "Source",
    "Stack",
    "Stage",
    "Strength",
    "Vote",
    "asking",
    "for_config",
    "hookimpl",
    "installed_version",
    "redecide",
    "redecide_within",
    "run_config",
    "run_disable",
    "run_enable",
]

# The internals built-in plugins import beyond this API, and why the API does not carry them
# (tests/unit/test_plugin_api.py holds every module under plugins/ to this list).
BUILTIN_ONLY = {
    "gcpatch.apply": (
        "transformers: its input-grads hooks re-applied after an upstream rebuild (R2)"
    ),
    "gcpatch.context": "transformers: the Trainer whose train() is running (X3)",
    "gcpatch.mrope_mask": "transformers: the Qwen3 multimodal text models' mask of ones (X6)",
    "gcpatch.checkpoint_call": "torch: the checkpoint-call decision itself (CK1-CK5)",
    "gcpatch.reentrant_grads": "torch: gradients asked for through reentrant checkpoints (CK6)",
    "gcpatch.agreement": "ddp: the rank agreement at DDP construction (R4)",
    "gcpatch.verify": "the pytest plugin: the verify fixture",
}
