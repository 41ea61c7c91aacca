"""The public plugin API: everything a gcpatch plugin imports, and nothing else is promised
(docs/PLUGINS.md says how a plugin is written and what each word means; examples/gcpatch-acme).

A plugin implements, with `@hookimpl`, `gcpatch_plugin_info`, `gcpatch_patch_points`,
`gcpatch_vote` and optionally `gcpatch_call_vote` and `gcpatch_facts`. The words a vote uses: the
knobs USE_REENTRANT, INPUT_GRADS_HOOK, USE_CACHE_OFF, EVAL_MODE_FIX, RUN_INLINE,
LIFT_BOUND_TENSORS, GRAD_INPUT, TUPLE_OUTPUTS; the strengths REQUIRED and RECOMMENDED; the
failures a required vote avoids, WRONG_GRADIENTS, CRASH, NO_MEMORY_SAVED; the framework fact
ZERO3_NONREENTRANT_RECOMPUTE. `BUILTIN_ONLY` names the internals built-in plugins still reach:
they are not part of the API and may change in any release.
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
    "gcpatch.call.checkpoint_call": "torch: the checkpoint-call decision itself (CK1-CK5)",
    "gcpatch.call.reentrant_grads": "torch: gradients taken through reentrant checkpoints (CK6)",
    "gcpatch.agreement": "ddp: the rank agreement at DDP construction (R4)",
    "gcpatch.verify": "the pytest plugin: the verify fixture",
}
