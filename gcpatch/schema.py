"""The values that flow through one decision: rules, patch points, facts, votes, decisions.

Plain frozen dataclasses (their methods written once, in gcpatch/value_class.py), so a record is
a faithful copy of what was decided and every rank can compare its decisions with the others' as
data.
"""

from __future__ import annotations

from dataclasses import asdict, field, fields
from enum import Enum
from typing import Any, Callable, Mapping

from gcpatch.value_class import Value, value_class


class _Word(str, Enum):
    """A word of the record's vocabulary: compares, hashes and prints as its string, so
    records stay plain JSON and a plugin may still pass the string."""

    __str__ = str.__str__
    __format__ = str.__format__


class Stage(_Word):
    """When a decision is taken."""

    CONFIG = "config"  # from a framework's config, before any model exists (Axolotl)
    ENABLE = "enable"  # at the framework's enable call (or a re-decision after a wrap)
    FIRST_FORWARD = "first_forward"  # at the first forward that builds a graph (R5)
    CALL = "call"  # at one torch.utils.checkpoint call no enable-time decision covers
    DISABLE = "disable"  # the user switched checkpointing off: what gcpatch gave back


class Source(_Word):
    """Who asked, where it is one of these; a framework enabling on the user's behalf is named
    by its own string (e.g. "peft.prepare_model_for_kbit_training")."""

    CALL = "call"  # the user's code
    TRAINER = "trainer"  # a Trainer re-enabling from its arguments (X3)


class Strength(_Word):
    """How strongly a vote holds, strongest first."""

    REQUIRED = "required"
    USER = "user"
    RECOMMENDED = "recommended"
    DEFAULT = "default"


class Failure(_Word):
    """What a required vote avoids; a conflict between required votes goes to the worse failure:
    silent wrong gradients outrank a loud crash, which outranks lost memory."""

    WRONG_GRADIENTS = "wrong_gradients"
    CRASH = "crash"
    NO_MEMORY_SAVED = "no_memory_saved"


class Knob(_Word):
    """What a vote can be about."""

    USE_REENTRANT = "use_reentrant"
    INPUT_GRADS_HOOK = "input_grads_hook"
    USE_CACHE_OFF = "use_cache_off"
    EVAL_MODE_FIX = "eval_mode_fix"
    # a checkpoint call nested in another runs its function directly (CK2)
    RUN_INLINE = "run_inline"
    # a partial's bound graph tensors become checkpoint inputs (CK5)
    LIFT_BOUND_TENSORS = "lift_bound_tensors"
    # a reentrant call none of whose inputs requires grad gets one that does, reentrant kept (CK1)
    GRAD_INPUT = "grad_input"
    # a reentrant call's result passes through the checkpoint as a flat tuple, rebuilt after (CK7)
    TUPLE_OUTPUTS = "tuple_outputs"


REQUIRED, USER, RECOMMENDED, DEFAULT = (
    Strength.REQUIRED,
    Strength.USER,
    Strength.RECOMMENDED,
    Strength.DEFAULT,
)
STRENGTH_ORDER = {REQUIRED: 3, USER: 2, RECOMMENDED: 1, DEFAULT: 0}
WRONG_GRADIENTS, CRASH, NO_MEMORY_SAVED = (
    Failure.WRONG_GRADIENTS,
    Failure.CRASH,
    Failure.NO_MEMORY_SAVED,
)
FAILURE_ORDER = {WRONG_GRADIENTS: 3, CRASH: 2, NO_MEMORY_SAVED: 1, "": 0}
USE_REENTRANT, INPUT_GRADS_HOOK, USE_CACHE_OFF = (
    Knob.USE_REENTRANT,
    Knob.INPUT_GRADS_HOOK,
    Knob.USE_CACHE_OFF,
)
EVAL_MODE_FIX, RUN_INLINE, LIFT_BOUND_TENSORS = (
    Knob.EVAL_MODE_FIX,
    Knob.RUN_INLINE,
    Knob.LIFT_BOUND_TENSORS,
)
GRAD_INPUT, TUPLE_OUTPUTS = Knob.GRAD_INPUT, Knob.TUPLE_OUTPUTS
KNOBS = tuple(Knob)

# Framework facts one plugin publishes (gcpatch_facts) for other plugins' rules to read.
# True: non-reentrant recompute of ZeRO-3-partitioned frozen parameters works on this DeepSpeed;
# False: it raises CheckpointError (the deepspeed plugin owns the release gate, R3). Absent:
# unknown.
ZERO3_NONREENTRANT_RECOMPUTE = "zero3_nonreentrant_recompute"


@value_class()
class Rule(Value):
    """One row of the rule table: its id is what records and docs/RULES.md cite, its source is
    where the truth lives."""

    id: str
    summary: str
    source: str
    versions: str = "all"
    # True: the row documents upstream behaviour or a patch point (X1, P3, ...) and never decides
    # a knob; a vote citing it is refused like an undeclared one
    documents: bool = False


@value_class()
class PatchPoint(Value):
    """Where a plugin hooks in: `module` is watched, `target` ("Class.method") is wrapped.

    `wrapper` has wrapt's signature (wrapped, instance, args, kwargs). `applies` is asked with
    the imported module and says whether this version has the target (X1: the API changed).
    `copies` covers re-exports imported before the patch (P3: peft's aliases).
    """

    module: str
    target: str
    wrapper: Callable[..., Any]
    applies: Callable[[Any], bool] = lambda module: True
    why: str = ""
    copies: bool = False  # also replace `from x import f` copies already bound in other modules
    guarded: bool = False  # the wrapper fails open by itself: no per-call guard layer (hot paths)


@value_class()
class PluginInfo(Value):
    """What a plugin declares before any of its patches is installed."""

    name: str
    framework: str  # the distribution whose version is checked, e.g. "transformers"
    # a PEP 440 specifier, e.g. ">=4.41,<6": outside it the plugin cannot work and is skipped
    versions: str
    rules: tuple[Rule, ...] = ()
    # the releases gcpatch's tests prove (matrix/RESULTS.md, the tox envs outside CI); inside
    # `versions` but outside this, the plugin still runs (fail-open) and says once
    # "untested <framework> <version>"
    proven: str = ""


@value_class()
class Stack(Value):
    """One stack of checkpointed blocks, as R1 reads it (gcpatch/facts.py `stack_facts`). Read its
    fields by name; `stack["blocks"]` and `stack.get("blocks")` also work, for plugins written when
    a stack was a dict."""

    stack: str  # where the blocks sit, e.g. "model.layers"
    runner: str  # the class whose forward runs the loop
    blocks: int
    block_class: str
    trainable_in_blocks: int  # trainable parameters inside the blocks
    trainable_upstream: int  # trainable parameters on the way to the stack
    inputs_can_require_grad: bool  # under reentrant the stack's first input requires grad
    # the model's input embeddings sit upstream: an input-grads hook on their output (R2, X2, P1)
    # makes the stack's first input require grad under reentrant
    fed_by_input_embeddings: bool = False
    blocks_in_eval_mode: int = 0
    # a decoder stack that takes the encoder's output by keyword (reentrant does not see it)
    encoder_states_by_keyword: bool = False
    # the module that defines the runner's forward (whose code decides what a forward caches)
    runner_forward_from: str = ""

    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@value_class()
class Facts(Value):
    """Everything a rule may look at, gathered once per decision.

    Only rank-independent facts live here (model layout, launcher environment, versions):
    a decision that differed between DDP ranks would deadlock.
    """

    stage: str  # "enable" | "first_forward"
    api: str  # the entry point the call came through
    source: str  # "call" (the user's code) | "trainer" (Trainer re-enabling, X3)
    model_class: str
    asked_use_reentrant: bool | None
    asked_from: str
    asked_kwargs: Mapping[str, Any]
    trainable_params: int
    frozen_params: int
    embeddings_trainable: bool | None
    checkpointed_layers: int
    trainable_in_checkpointed_layers: bool
    main_input_name: str
    layers_in_eval_mode: int
    checkpoint_layer_api: bool  # layers are transformers' GradientCheckpointingLayer
    use_cache: bool | None
    peft: bool
    kbit: bool
    zero3: bool
    world_size: int
    distributed: str  # "none" | "ddp" (multi-process launcher seen)
    versions: Mapping[str, str | None]
    grad_enabled: bool = True
    find_unused_parameters: bool = False  # DDP(find_unused_parameters=True) wraps this model
    trainer: str = ""  # "module.Class" of the Trainer running this call, if any
    # every config with use_cache, by where it sits (config, config.text_config, decoder.config): R6
    use_cache_configs: Mapping[str, Any] = field(default_factory=dict)
    # per checkpointed stack: blocks, whether they train, whether anything upstream trains (R1)
    stacks: tuple[Stack, ...] = ()
    # a checkpoint function other than torch's that the layers will call ("": torch's)
    checkpoint_function: str = ""
    # where the checkpoint call sits around a checkpointed layer (facts.checkpoint_site): "loop" |
    # "layer_call" | "layer_forward" | "" (no layer); what a reentrant recompute runs again depends
    # on it (F2)
    checkpoint_site: str = ""
    # FSDP wrapping the model: "fsdp1" | "fsdp2" (wrapped, or wrapping now), "accelerate:fsdpN"
    # (launcher), ""
    fsdp: str = ""
    # FSDP's own activation checkpointing: "checkpoint_wrapper: N modules (impl)", "accelerate:
    # planned", ""
    fsdp_checkpointing: str = ""
    # what plugins know about their frameworks for other plugins' rules (gcpatch_facts), by name
    framework_facts: Mapping[str, Any] = field(default_factory=dict)
    # what the framework's own enable runs with when the ask names no use_reentrant (None: not
    # known), and whose default it is ("transformers 4.57.6"): kept where no rule finds it wrong
    default_use_reentrant: bool | None = None
    default_from: str = ""

    @property
    def partially_frozen(self) -> bool:
        return self.trainable_params > 0 and self.frozen_params > 0

    def major(self, dist: str) -> int:
        """The major release of `dist` as found (`versions`); 0 where it is absent or unreadable,
        which a rule reads as the oldest release."""
        head = (self.versions.get(dist) or "").split(".", 1)[0]
        return int(head) if head.isdigit() else 0

    def to_dict(self) -> dict[str, Any]:
        # Not asdict(): it deep-copies, and the user's checkpoint kwargs may hold anything.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["asked_kwargs"] = {k: _plain(v) for k, v in self.asked_kwargs.items()}
        data["versions"] = dict(self.versions)
        data["use_cache_configs"] = dict(self.use_cache_configs)
        data["stacks"] = [
            stack.to_dict() if isinstance(stack, Stack) else dict(stack) for stack in self.stacks
        ]
        data["framework_facts"] = {k: _plain(v) for k, v in self.framework_facts.items()}
        data["partially_frozen"] = self.partially_frozen
        return data


@value_class()
class CallFacts(Value):
    """The facts of one `torch.utils.checkpoint.checkpoint` call that no enable-time decision
    covers. Exact and cheap: read from the call's own arguments at call time, so the decision
    for one pattern of facts holds for every call that shows it (and is cached by it)."""

    asked_use_reentrant: bool | None  # None: not passed, torch's default (reentrant on torch 2.x)
    grad_enabled: bool
    inputs_require_grad: bool  # a positional tensor input requires grad (what reentrant looks at)
    # the function holds trainable parameters or grad-requiring tensors (modules, bound methods, a
    # partial's arguments, closures, default arguments); None: cannot be known
    trainable_inside: bool | None
    context_fn: bool  # selective checkpointing or another context_fn was given
    nested: bool  # called while another checkpoint's function runs (its forward or recompute)
    # grad-requiring tensors with a graph of their own that reach the function other than as its
    # positional inputs; `liftable`: all of them are arguments of the partial itself (CK5)
    bound_graph_tensors: int = 0
    bound_graph_liftable: bool = False
    # grad-requiring tensors with a graph inside list, tuple, dict or dataclass positional arguments
    # (reentrant passes such an argument to its recompute as it is, graph and all: CK5)
    container_graph_tensors: int = 0
    # what the function's first result showed reentrant could not track (CK7): "" nothing,
    # "rebuildable" (tensors in dicts, lists, ModelOutput) or "opaque" (in other objects)
    outputs_untracked: str = ""
    # the rule of the enable-time decision covering the call's module ("": none covers it; CK4)
    enable_decision: str = ""
    torch_version: str = ""
    stage: str = "call"

    @property
    def reentrant(self) -> bool:
        return self.asked_use_reentrant is not False

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["reentrant"] = self.reentrant
        return data


@value_class()
class Vote(Value):
    """One rule's opinion on one knob."""

    knob: str
    value: Any
    strength: str
    rule: str
    reason: str
    plugin: str = ""
    avoids: str = ""  # for required votes: the failure it prevents
    unmet: str = ""  # what the user is told when it wins but cannot be applied to this model
    kept_cost: str = ""  # a recommendation's cost, told when the user's explicit ask overrules it
    short: str = ""  # the reason in a few words, for the one-line log (the record keeps `reason`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@value_class(frozen=False)
class Decision(Value):
    """The resolved outcome of one call, with every vote that took part."""

    mode: str
    values: dict[str, Any]
    winners: dict[str, Vote]
    overruled: list[Vote] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def rules(self) -> list[str]:
        seen: list[str] = []
        for vote in self.winners.values():
            if vote.rule not in seen:
                seen.append(vote.rule)
        return seen

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "values": dict(self.values),
            "rules": self.rules,
            "winners": {k: v.to_dict() for k, v in self.winners.items()},
            "overruled": [v.to_dict() for v in self.overruled],
            "conflicts": list(self.conflicts),
            "warnings": list(self.warnings),
        }


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
