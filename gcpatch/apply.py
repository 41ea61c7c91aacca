"""Applying a decision to a model, and undoing it.

The checkpoint arguments themselves go through the framework's own enable call; what is
applied here is what that call cannot do: the input-grads hooks (R2, X2), `use_cache` (R6), and
checkpointing that takes effect on a model left in eval mode (R5). Every change is kept in a
per-model state so enabling twice leaves one hook and disabling leaves the model as it was.
"""

from __future__ import annotations

import copy
import logging
import sys
import weakref
from typing import Any, Callable

from gcpatch import lifetime
from gcpatch.facts import (
    checkpoint_function,
    checkpoint_layers,
    checkpoint_stacks,
    input_embeddings,
    is_checkpoint_layer,
    passes_kv_cache,
    use_cache_configs,
)
from gcpatch.schema import INPUT_GRADS_HOOK, USE_CACHE_OFF, USE_REENTRANT, Decision

log = logging.getLogger("gcpatch")


def _grad_enabled() -> bool:
    # torch is imported by the host long before a model exists; importing it here would make
    # the engine's start (at `import transformers`) load torch eagerly (benchmarks/RESULTS.md).
    return sys.modules["torch"].is_grad_enabled()


def _is_tensor(value: Any) -> bool:
    return isinstance(value, sys.modules["torch"].Tensor)


class ModelState:
    """What gcpatch installed on one model, so that a re-enable replaces it and a disable
    takes all of it back (what the user asked lives in gcpatch.context)."""

    __slots__ = (
        "input_hooks",
        "embeddings_hook_wanted",
        "first_forward",
        "eval_fixed",
        "mode_sync",
        "cache_off",
    )

    def __init__(self) -> None:
        self.input_hooks: list[Any] = []
        # R2/X2 asked for a hook on the embedding output (transformers' or ours)
        self.embeddings_hook_wanted = False
        # R5's one-shot pre-hooks: the model's and one per stack runner
        self.first_forward: list[Any] = []
        self.eval_fixed: list[tuple[Any, Any]] = []
        # R5's pre-hooks: layers checkpoint only in grad-enabled forwards
        self.mode_sync: list[Any] = []
        self.cache_off: dict[int, tuple[Any, str, Any]] = {}  # R6: config -> (config, where, old)


_states: weakref.WeakKeyDictionary[Any, ModelState] = weakref.WeakKeyDictionary()


@lifetime.activation
def forget() -> None:
    """Every model gcpatch changed given back (hooks removed, use_cache restored), and forgotten."""
    try:
        for model in list(_states.keys()):
            try:
                remove_all(model)
            except Exception as exc:  # noqa: BLE001 (fail open: the other models still given back)
                log.error(
                    "gcpatch: could not give %s back (%s: %s)",
                    type(model).__name__,
                    type(exc).__name__,
                    exc,
                )
    finally:
        _states.clear()


def state_of(model: Any) -> ModelState:
    state = _states.get(model)
    if state is None:
        state = _states[model] = ModelState()
    return state


def input_hooks_installed(model: Any) -> int:
    """How many input-grads hooks gcpatch has on `model` now."""
    state = _states.get(model)
    return len(state.input_hooks) if state is not None else 0


def apply(
    model: Any, decision: Decision, on_first_forward: Callable[[Any], None]
) -> dict[str, Any]:
    """Apply what the enable call itself did not, and return what was applied."""
    state = state_of(model)
    applied: dict[str, Any] = {"use_reentrant": decision.values.get(USE_REENTRANT)}
    _remove_input_hooks(state)
    # Under a custom checkpoint function (an offloader that may run reentrant whatever it is
    # asked) the hook is put in place either way: harmless under non-reentrant, and what keeps a
    # reentrant-only function's layers getting gradients.
    if decision.values.get(INPUT_GRADS_HOOK) and (
        decision.values.get(USE_REENTRANT) or checkpoint_function()
    ):
        if decision.mode == "strict":
            # strict changes nothing on its own: a layer's checkpoint call whose input would need
            # the hook raises instead (CK1 naming this rule, gcpatch/call/checkpoint_call.py)
            applied["withheld"] = "input_grads_hook (strict mode)"
        else:
            _install_input_hooks(model, state)
            applied[INPUT_GRADS_HOOK] = True
    if decision.values.get(USE_CACHE_OFF):
        applied.update(use_cache_off(model))
    stacks = checkpoint_stacks(model)
    if stacks:
        applied["checkpointed_stacks"] = {
            name: (
                f"{sum(1 for m in layers if getattr(m, 'gradient_checkpointing', False))} of"
                f" {len(layers)} {type(layers[0]).__name__}"
            )
            for name, _, layers in stacks
        }
        _arm_first_forward(model, state, on_first_forward)
    return applied


def use_cache_off(model: Any) -> dict[str, Any]:
    """R6 applied (at the enable, or at the first training forward in eval mode): what the
    record's `applied` gets."""
    applied: dict[str, Any] = {}
    per_config = _use_cache_off(model, state_of(model))
    if per_config:
        applied[USE_CACHE_OFF] = per_config.get("config") or "; ".join(
            f"{where}: {change}" for where, change in per_config.items()
        )
        if set(per_config) != {"config"}:
            applied["use_cache_per_config"] = per_config
    return applied


def _use_cache_off(model: Any, state: ModelState) -> dict[str, str]:
    """R6 on every config transformers reads `use_cache` from (the top config, `text_config` and
    other sub-configs, a decoder stack's own copy): one left on makes that part build a KV cache
    the checkpointed layers then drop. What was switched off is remembered for the disable."""
    changes: dict[str, str] = {}
    for where, config in use_cache_configs(model).items():
        value = getattr(config, "use_cache", None)
        if value is None:
            continue
        if value:
            state.cache_off.setdefault(id(config), (config, where, value))
            config.use_cache = False
            changes[where] = "use_cache True -> False"
        else:
            changes[where] = "use_cache already False"
    return changes


def _restore_use_cache(state: ModelState) -> dict[str, str]:
    """Give back what R6 switched off: the user's disable leaves the configs as they were."""
    restored = {}
    for config, where, old in state.cache_off.values():
        if getattr(config, "use_cache", None) is False:
            config.use_cache = old
            restored[where] = f"use_cache False -> {old}"
    state.cache_off.clear()
    return restored


def _switched() -> list[tuple[Any, Any]]:
    """Every config R6 holds switched off now, with the user's own value."""
    return [
        (config, old)
        for state in list(_states.values())
        for config, _, old in state.cache_off.values()
        if getattr(config, "use_cache", None) is False
    ]


def config_as_the_user(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """`PretrainedConfig.to_dict` (wrapt's protocol): what a config serialises (config.json,
    `to_json_string`, a tracker's copy) carries the user's `use_cache`, not R6's training value."""
    out = wrapped(*args, **kwargs)
    if isinstance(out, dict) and out.get("use_cache") is False:
        for config, old in _switched():
            if config is instance:
                out["use_cache"] = old
    return out


def saving_as_the_user(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """`save_pretrained` (wrapt's protocol) runs with the user's `use_cache` on every config R6
    switched off, and R6's value back afterwards: transformers 4.x moves a non-default `use_cache`
    from config.json into generation_config.json (and sets the config's to None) as it saves."""
    switched = _switched()
    for config, old in switched:
        config.use_cache = old
    try:
        return wrapped(*args, **kwargs)
    finally:
        for config, old in switched:
            if getattr(config, "use_cache", None) == old:
                config.use_cache = False


def reset(model: Any) -> None:
    """Undo the eval-mode fix and the pending first-forward check (before a re-enable or a
    disable): the layers get back the user's mode and the framework's own function."""
    state = _states.get(model)
    if state is None:
        return
    for layer, func in state.eval_fixed:
        layer.training = _user_mode(layer)
        if isinstance(layer._gradient_checkpointing_func, ModePreservingCheckpoint):
            layer._gradient_checkpointing_func = func
    state.eval_fixed.clear()
    _remove_handles(state.mode_sync)
    _remove_handles(state.first_forward)


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def remove_all(model: Any) -> dict[str, str]:
    """The user disabled checkpointing: take back everything gcpatch changed for the enable
    (hooks, the eval-mode fix, `use_cache`). Returns the configs whose `use_cache` was given back.
    """
    reset(model)
    state = _states.get(model)
    if state is None:
        return {}
    _remove_input_hooks(state)
    return _restore_use_cache(state)


def fix_eval_mode(model: Any) -> int:
    """R5: let checkpointing take effect on layers left in eval mode, without changing what
    their forward computes. The layer's own `training` flag (which transformers reads to decide
    whether to checkpoint) is set, and the checkpointed body runs with the user's mode again,
    so dropout and every other train/eval switch stay as the user left them. The flag is set only
    for forwards that build a graph: under no_grad (generate, evaluation) the layers are back in
    the user's mode, else transformers' checkpoint branch would drop the KV cache."""
    state = state_of(model)
    fixed = 0
    for layer in checkpoint_layers(model):
        if not (getattr(layer, "gradient_checkpointing", False) and not layer.training):
            continue
        if not (is_checkpoint_layer(layer) or _reads_training_only_to_checkpoint(layer)):
            continue
        func = layer._gradient_checkpointing_func
        if isinstance(func, ModePreservingCheckpoint):
            continue
        state.eval_fixed.append((layer, func))
        layer._gradient_checkpointing_func = ModePreservingCheckpoint(func, layer)
        layer.training = True
        fixed += 1
    if fixed and not state.mode_sync:
        sync = _ModeSync([layer for layer, _ in state.eval_fixed])
        for runner in _runners(model):
            state.mode_sync.append(runner.register_forward_pre_hook(sync, with_kwargs=True))
    return fixed


def _runners(model: Any) -> list[Any]:
    """The modules whose forward runs the loop over the checkpointed blocks (one per stack). R5's
    hooks sit there, not on the model: PEFT tuners (`self.model.forward(...)` in peft <= 0.13),
    ColossalAI's boosted wrappers and a user calling `model.forward` bypass the model's own
    hooks, but every path into the blocks goes through the loop that calls them."""
    runners: list[Any] = []
    for _, owner, _ in checkpoint_stacks(model):  # walked once per decision (facts.one_walk)
        if all(owner is not r for r in runners):
            runners.append(owner)
    return runners or [model]


def _asks_for_cache(kwargs: dict[str, Any]) -> bool:
    # A forward that asks for a KV cache (use_cache=True, a cache to extend): checkpointed layers
    # would drop it (GradientCheckpointingLayer sets use_cache=False), where the user's eval-mode
    # layers keep it. Such a forward keeps the user's mode: never an empty cache for a full one.
    return kwargs.get("use_cache") is True or passes_kv_cache(kwargs)


class _ModeSync:
    """R5's pre-hook on a stack's runner: the fixed layers checkpoint only in forwards that build a
    graph. A module-level class so a model carrying it copies and pickles: a copy (or a loaded
    pickle) finds its own fixed layers under the runner it runs on, at its first forward."""

    def __init__(self, layers: list[Any] | None = None) -> None:
        self.layers = None if layers is None else [weakref.ref(layer) for layer in layers]

    def __call__(self, module: Any, args: Any, kwargs: dict[str, Any] | None = None) -> None:
        if kwargs is None:
            return  # taken out mid-call: no kwargs
        if _compiling():
            return  # the modes the last eager forward left stand: a traced flag write recompiles
        if self.layers is None:
            self.layers = [
                weakref.ref(m)
                for m in module.modules()
                if isinstance(
                    getattr(m, "_gradient_checkpointing_func", None), ModePreservingCheckpoint
                )
            ]
        grad = _grad_enabled() and not _asks_for_cache(kwargs)
        for ref in self.layers:
            layer = ref()
            if layer is not None:
                layer.training = grad or _user_mode(layer)

    def __deepcopy__(self, memo: dict) -> _ModeSync:
        return _ModeSync()

    def __reduce__(self) -> Any:
        return _ModeSync, ()


# Reads of `self.training` that do not change what a legacy model computes: the checkpoint
# decision itself, the SDPA causal-mask shortcut, which eager mode takes either way
# (transformers 4.51 modeling_attn_mask_utils._ignore_causal_mask_sdpa: `is_training or not
# is_tracing`),
# and the legacy-cache conversion of transformers 4.43-4.44 (`LlamaModel.forward` and its copies:
# `use_cache and not isinstance(past_key_values, Cache) and not self.training`): it follows
# `if self.gradient_checkpointing and self.training and use_cache: use_cache = False`, so with the
# flag R5 sets, `use_cache` is already off there (the cache a checkpointed forward drops in train
# mode too; R6 turns it off anyway) and the logits and gradients are those of the user's mode.
_NEUTRAL_TRAINING_READS = (
    "gradient_checkpointing",
    "is_training=self.training",
    "not isinstance(past_key_values, Cache) and not self.training",
)


def _reads_training_only_to_checkpoint(module: Any) -> bool:
    """R5 on model families that predate GradientCheckpointingLayer (transformers < 4.52, and
    ColossalAI's shardformer forwards): the loop owner's `training` flag decides checkpointing.
    It is safe to set only if nothing else it computes reads that flag; otherwise R5 warns."""
    import functools
    import inspect

    sources = []
    forward = getattr(module.forward, "__func__", module.forward)
    while isinstance(forward, functools.partial):
        forward = getattr(forward.func, "__func__", forward.func)
    for obj in (type(module), forward):
        try:
            sources.append(inspect.getsource(obj))
        except (OSError, TypeError) as exc:
            log.debug(
                "gcpatch: R5: no source for %r (%s); the eval-mode fix is declined there", obj, exc
            )
            return False
    reads = [line for src in sources for line in src.splitlines() if "self.training" in line]
    return all(any(mark in line for mark in _NEUTRAL_TRAINING_READS) for line in reads)


class ModePreservingCheckpoint:
    """The layer's checkpoint function, running the checkpointed body in the user's mode. A copy
    of the layer gets one bound to the copy; a pickle names the layer (pickle's memo resolves it).
    """

    def __init__(self, func: Callable[..., Any], layer: Any) -> None:
        self.func = func
        self.layer = weakref.ref(layer)

    def __deepcopy__(self, memo: dict) -> ModePreservingCheckpoint:
        layer = self.layer()
        return ModePreservingCheckpoint(copy.deepcopy(self.func, memo), memo.get(id(layer), layer))

    def __reduce__(self) -> Any:
        return ModePreservingCheckpoint, (self.func, self.layer())

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        layer = self.layer()
        mode = _user_mode(layer) if layer is not None else True

        def body(*inner_args: Any, **inner_kwargs: Any) -> Any:
            if layer is None:
                return function(*inner_args, **inner_kwargs)
            flag = layer.training
            layer.training = mode
            try:
                return function(*inner_args, **inner_kwargs)
            finally:
                layer.training = flag

        return self.func(body, *args, **kwargs)


def _user_mode(layer: Any) -> bool:
    # The layer's own flag is the one R5 sets; its children still carry the user's mode.
    child = next(iter(layer.children()), None)
    return bool(child.training) if child is not None else False


def _arm_first_forward(model: Any, state: ModelState, callback: Callable[[Any], None]) -> None:
    """One-shot pre-hooks on the model and on the modules that run the checkpointed blocks
    (`_runners`): R5 is decided at the first forward that builds a graph, whichever path reaches
    the blocks, then the hooks are gone (no per-step cost after the first step). The model's own
    hook comes first where its `__call__` is the path: a head that reads `config.use_cache` before
    its stacks run and hands them `use_cache=True` (transformers 5.2.0's
    T5ForConditionalGeneration.forward, BART's and Whisper's) would otherwise keep its stacks out
    of R5 and R6 on that forward, as if the user had asked for the cache."""
    if state.first_forward:
        return
    hook = _FirstForward(_Armed(model, callback, state.first_forward))
    for owner in [model, *(r for r in _runners(model) if r is not model)]:
        state.first_forward.append(owner.register_forward_pre_hook(hook, with_kwargs=True))


class _Armed:
    """What the first-forward hooks of one model share: the model, the decision to run, the
    handles to remove once it ran. A deep copy of the model gets its own (bound to the copy,
    without handles: each copied hook removes itself); a pickle names the model (pickle's memo
    resolves it) and the callback by its qualified name."""

    def __init__(
        self, model: Any, callback: Callable[[Any], None], handles: list[Any] | None = None
    ) -> None:
        self.model = weakref.ref(model) if model is not None else None
        self.callback = callback
        self.handles = handles if handles is not None else []
        self.done = False

    def fire(self) -> Any:
        """The model to decide for, once; None after that."""
        if self.done:
            return None
        self.done = True
        _remove_handles(self.handles)
        return self.model() if self.model is not None else None

    def __deepcopy__(self, memo: dict) -> _Armed:
        model = self.model() if self.model is not None else None
        copied = _Armed(memo.get(id(model)), self.callback)
        copied.done = self.done
        return copied

    def __reduce__(self) -> Any:
        return _Armed, (self.model() if self.model is not None else None, self.callback)


class _FirstForward:
    """R5's one-shot pre-hook (see `_arm_first_forward`): module-level, so a model carrying it
    copies and pickles."""

    def __init__(self, armed: _Armed) -> None:
        self.armed = armed

    def __call__(self, module: Any, args: Any, kwargs: dict[str, Any] | None = None) -> None:
        if kwargs is None:
            return  # taken out mid-call (the other runner's fired): no kwargs
        if _compiling():
            # Deciding is eager work (facts, votes, records): inside a traced region it would
            # break the graph. The decision waits for an eager forward; the layers checkpoint as
            # enabled meanwhile.
            return
        if not _grad_enabled() or _asks_for_cache(kwargs):
            return
        _remove_hook(module, self)  # a copied hook has no handle
        target = self.armed.fire()
        if target is not None:
            self.armed.callback(target)

    def __deepcopy__(self, memo: dict) -> _FirstForward:
        return _FirstForward(copy.deepcopy(self.armed, memo))

    def __reduce__(self) -> Any:
        return _FirstForward, (self.armed,)


def _remove_hook(module: Any, hook: Any) -> None:
    for key, value in list(module._forward_pre_hooks.items()):
        if value is hook:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)


def _compiling() -> bool:
    compiler = getattr(sys.modules["torch"], "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _install_input_hooks(model: Any, state: ModelState) -> None:
    """R2/X2: reentrant checkpointing gives no gradients to a block none of whose inputs needs
    one. Make the first checkpointed input require grad, whether it comes from the embedding
    (frozen embeddings) or straight from the caller (`inputs_embeds`, which transformers' own
    `enable_input_require_grads` never sees). Where transformers' own hook already sits on the
    embedding, it is the one: one input-grads hook per embedding (`dedupe_input_grads_hooks`)."""
    state.embeddings_hook_wanted = True
    _hook_embeddings(model, state)
    modules = [model]
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        modules.append(base)
    for module in modules:
        state.input_hooks.append(
            module.register_forward_pre_hook(_inputs_embeds_require_grad, with_kwargs=True)
        )


def _hook_embeddings(model: Any, state: ModelState) -> None:
    embeddings = input_embeddings(model)
    if embeddings is None or _transformers_hooks(embeddings):
        return
    if any(getattr(h, "gcpatch_embeddings", False) for h in state.input_hooks):
        return
    handle = embeddings.register_forward_hook(_output_requires_grad)
    handle.gcpatch_embeddings = True
    state.input_hooks.append(handle)


# transformers' `enable_input_require_grads` hook (5.x: make_inputs_require_grads; 4.x:
# make_inputs_require_grad), also installed by peft and TRL through that method.
_TRANSFORMERS_HOOKS = (
    "enable_input_require_grads.<locals>.make_inputs_require_grads",
    "enable_input_require_grads.<locals>.make_inputs_require_grad",
)


def _transformers_hooks(embeddings: Any) -> list[int]:
    hooks = getattr(embeddings, "_forward_hooks", None) or {}
    return [
        key
        for key, fn in hooks.items()
        if getattr(fn, "__qualname__", "").endswith(_TRANSFORMERS_HOOKS)
    ]


def input_grads_hooked(model: Any) -> bool:
    """Whether transformers' own input-grads hook (`enable_input_require_grads`) sits on the
    model's input embeddings."""
    embeddings = input_embeddings(model)
    return embeddings is not None and bool(_transformers_hooks(embeddings))


def dedupe_input_grads_hooks(model: Any) -> int:
    """Before transformers' `enable_input_require_grads` adds its hook (transformers 5.23 adds one
    on every call and drops the handle of the last; TRL enables again after the Trainer's enable,
    trl#480): take away the earlier ones, and gcpatch's own on the same embedding, so the call
    leaves exactly one. Returns how many were removed."""
    removed = 0
    for module in model.modules():
        # looked up on the class: `hasattr` on a module goes through nn.Module.__getattr__, which
        # raises for every layer of the tree (half of this walk's time)
        embeddings = (
            input_embeddings(module) if hasattr(type(module), "get_input_embeddings") else None
        )
        if embeddings is None:
            continue
        for key in _transformers_hooks(embeddings):
            for table in (
                "_forward_hooks",
                "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called",
            ):
                getattr(embeddings, table, {}).pop(key, None)
            removed += 1
        state = _states.get(module)
        if state is not None:
            for handle in [h for h in state.input_hooks if getattr(h, "gcpatch_embeddings", False)]:
                handle.remove()
                state.input_hooks.remove(handle)
                removed += 1
    return removed


def rehook_embeddings(model: Any) -> None:
    """transformers' hook was taken away (`disable_input_require_grads`) while a decision still
    wants one (R2): gcpatch's own goes back."""
    for module in model.modules():
        state = _states.get(module)
        if state is not None and state.embeddings_hook_wanted:
            _hook_embeddings(module, state)


def _remove_input_hooks(state: ModelState) -> None:
    for handle in state.input_hooks:
        handle.remove()
    state.input_hooks.clear()
    state.embeddings_hook_wanted = False


def _output_requires_grad(module: Any, args: Any, output: Any) -> None:
    if _grad_enabled() and _is_tensor(output) and output.is_floating_point():
        if not output.requires_grad:
            output.requires_grad_(True)


def _inputs_embeds_require_grad(
    module: Any, args: Any, kwargs: dict[str, Any] | None = None
) -> Any:
    if kwargs is None:
        return None  # taken out mid-call: no kwargs
    embeds = kwargs.get("inputs_embeds")
    if (
        _is_tensor(embeds)
        and _grad_enabled()
        and embeds.is_floating_point()
        and not embeds.requires_grad
    ):
        # A new leaf sharing storage: the caller's tensor keeps its own requires_grad flag.
        kwargs["inputs_embeds"] = embeds.detach().requires_grad_(True)
        return args, kwargs
    return None
