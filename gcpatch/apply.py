"""Applying a decision to a model, and undoing it.

The checkpoint arguments themselves go through the framework's own enable call; what is
applied here is what that call cannot do: the input-grads hooks (R2, X2), `use_cache` (R6), and
checkpointing that takes effect on a model left in eval mode (R5). Every change is kept in a
per-model state so enabling twice leaves one hook and disabling leaves the model as it was.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from gcpatch.facts import checkpoint_layers, is_checkpoint_layer
from gcpatch.schema import INPUT_GRADS_HOOK, USE_CACHE_OFF, USE_REENTRANT, Decision


def _grad_enabled() -> bool:
    # torch is imported by the host long before a model exists; importing it here would make
    # the engine's start (at `import transformers`) load torch eagerly (benchmarks/RESULTS.md).
    return sys.modules["torch"].is_grad_enabled()


def _is_tensor(value: Any) -> bool:
    return isinstance(value, sys.modules["torch"].Tensor)


@dataclass
class ModelState:
    """What gcpatch changed on one model, and the user's last explicit model-level ask."""

    ask: dict[str, Any] | None = None
    ask_from: str = ""
    replay: Callable[[Any, Any], Any] | None = None  # re-runs the public enable on a model (re-decisions)
    context: dict[str, Any] = field(default_factory=dict)  # wrap-time facts (DDP)
    trainer: str = ""
    input_hooks: list[Any] = field(default_factory=list)
    first_forward: Any = None
    eval_fixed: list[tuple[Any, Any]] = field(default_factory=list)
    mode_sync: Any = None  # R5's pre-hook: layers checkpoint only in grad-enabled forwards
    last: dict[str, Any] | None = None


_states: weakref.WeakKeyDictionary[Any, ModelState] = weakref.WeakKeyDictionary()


def has_state(model: Any) -> bool:
    return model in _states


def state_of(model: Any) -> ModelState:
    state = _states.get(model)
    if state is None:
        state = _states[model] = ModelState()
    return state


def apply(model: Any, decision: Decision, on_first_forward: Callable[[Any], None]) -> dict[str, Any]:
    """Apply what the enable call itself did not, and return what was applied."""
    state = state_of(model)
    applied: dict[str, Any] = {"use_reentrant": decision.values.get(USE_REENTRANT)}
    _remove_input_hooks(state)
    if decision.values.get(USE_REENTRANT) and decision.values.get(INPUT_GRADS_HOOK):
        _install_input_hooks(model, state)
        applied[INPUT_GRADS_HOOK] = True
    config = getattr(model, "config", None)
    if decision.values.get(USE_CACHE_OFF) and config is not None:
        applied[USE_CACHE_OFF] = "use_cache True -> False" if config.use_cache else "use_cache already False"
        config.use_cache = False
    if checkpoint_layers(model):
        _arm_first_forward(model, state, on_first_forward)
    return applied


def reset(model: Any) -> None:
    """Undo the eval-mode fix and the pending first-forward check (before a re-enable or a
    disable): the layers get back the user's mode and the framework's own function."""
    state = _states.get(model)
    if state is None:
        return
    for layer, func in state.eval_fixed:
        layer.training = _user_mode(layer)
        if isinstance(layer._gradient_checkpointing_func, _ModePreservingCheckpoint):
            layer._gradient_checkpointing_func = func
    state.eval_fixed.clear()
    if state.mode_sync is not None:
        state.mode_sync.remove()
        state.mode_sync = None
    if state.first_forward is not None:
        state.first_forward.remove()
        state.first_forward = None


def remove_all(model: Any) -> None:
    """The user disabled checkpointing: take back everything, and re-decide nothing later."""
    reset(model)
    state = _states.get(model)
    if state is not None:
        _remove_input_hooks(state)
        state.replay = None


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
        if isinstance(func, _ModePreservingCheckpoint):
            continue
        state.eval_fixed.append((layer, func))
        layer._gradient_checkpointing_func = _ModePreservingCheckpoint(func, layer)
        layer.training = True
        fixed += 1
    if fixed and state.mode_sync is None:
        layers = [weakref.ref(layer) for layer, _ in state.eval_fixed]
        state.mode_sync = model.register_forward_pre_hook(lambda module, args: _sync_modes(layers))
    return fixed


def _sync_modes(layers: list[weakref.ref]) -> None:
    grad = _grad_enabled()
    for ref in layers:
        layer = ref()
        if layer is not None:
            layer.training = grad or _user_mode(layer)


# Reads of `self.training` that do not change what a legacy model computes: the checkpoint
# decision itself, the SDPA causal-mask shortcut, which eager mode takes either way
# (transformers 4.51 modeling_attn_mask_utils._ignore_causal_mask_sdpa: `is_training or not is_tracing`),
# and the legacy-cache conversion of transformers 4.43-4.44 (`LlamaModel.forward` and its copies:
# `use_cache and not isinstance(past_key_values, Cache) and not self.training`): it follows
# `if self.gradient_checkpointing and self.training and use_cache: use_cache = False`, so with the
# flag R5 sets, `use_cache` is already off there (the cache a checkpointed forward drops in train
# mode too; R6 turns it off anyway) and the logits and gradients are those of the user's mode.
_NEUTRAL_TRAINING_READS = ("gradient_checkpointing", "is_training=self.training",
                           "not isinstance(past_key_values, Cache) and not self.training")


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
        except (OSError, TypeError):
            return False
    reads = [line for src in sources for line in src.splitlines() if "self.training" in line]
    return all(any(mark in line for mark in _NEUTRAL_TRAINING_READS) for line in reads)


class _ModePreservingCheckpoint:
    """The layer's checkpoint function, running the checkpointed body in the user's mode."""

    def __init__(self, func: Callable[..., Any], layer: Any) -> None:
        self.func = func
        self.layer = weakref.ref(layer)

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
    """A one-shot pre-hook: R5 is decided at the first forward that builds a graph, then the hook
    is gone (no per-step cost after the first step)."""
    if state.first_forward is not None:
        return
    model_ref = weakref.ref(model)

    def pre_hook(module: Any, args: Any) -> None:
        if not _grad_enabled():
            return
        if state.first_forward is not None:
            state.first_forward.remove()
            state.first_forward = None
        target = model_ref()
        if target is not None:
            callback(target)

    state.first_forward = model.register_forward_pre_hook(pre_hook)


def _install_input_hooks(model: Any, state: ModelState) -> None:
    """R2/X2: reentrant checkpointing gives no gradients to a block none of whose inputs needs
    one. Make the first checkpointed input require grad, whether it comes from the embedding
    (frozen embeddings) or straight from the caller (`inputs_embeds`, which transformers' own
    `enable_input_require_grads` never sees)."""
    try:
        embeddings = model.get_input_embeddings()
    except Exception:  # noqa: BLE001
        embeddings = None
    if embeddings is not None and hasattr(embeddings, "register_forward_hook"):
        state.input_hooks.append(embeddings.register_forward_hook(_output_requires_grad))
    modules = [model]
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        modules.append(base)
    for module in modules:
        state.input_hooks.append(module.register_forward_pre_hook(_inputs_embeds_require_grad, with_kwargs=True))


def _remove_input_hooks(state: ModelState) -> None:
    for handle in state.input_hooks:
        handle.remove()
    state.input_hooks.clear()


def _output_requires_grad(module: Any, args: Any, output: Any) -> None:
    if _grad_enabled() and _is_tensor(output) and output.is_floating_point():
        if not output.requires_grad:
            output.requires_grad_(True)


def _inputs_embeds_require_grad(module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
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
