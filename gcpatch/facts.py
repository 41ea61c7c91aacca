"""Gathering the facts of one decision from the model and the launcher's environment.

Only what every rank sees the same: parameter layout, modes, config, versions, WORLD_SIZE.
Nothing rank-local: a decision that differs between ranks deadlocks DDP.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Mapping

from gcpatch.schema import Facts, Stack, Stage

log = logging.getLogger("gcpatch")

VERSIONED = ("torch", "transformers", "accelerate", "peft", "trl", "deepspeed", "bitsandbytes")


# Within one decision the module tree does not change (the framework's enable only sets flags):
# each model is walked once, however many facts and apply steps look at it.
_walk: contextvars.ContextVar[dict[tuple[int, str], Any] | None] = contextvars.ContextVar(
    "gcpatch_walk", default=None
)


@contextmanager
def one_walk() -> Iterator[None]:
    token = _walk.set({})
    try:
        yield
    finally:
        _walk.reset(token)


def _walked(model: Any, what: str, compute: Any) -> Any:
    cache = _walk.get()
    if cache is None:
        return compute()
    key = (id(model), what)
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def named_modules(model: Any) -> list[tuple[str, Any]]:
    return _walked(model, "modules", lambda: list(model.named_modules()))


def checkpoint_layers(model: Any) -> list[Any]:
    """The modules that checkpoint themselves: transformers' GradientCheckpointingLayer, or on
    model families that predate it, every submodule with a `gradient_checkpointing` flag."""
    return _walked(model, "layers", lambda: _checkpoint_layers(model))


def _checkpoint_layers(model: Any) -> list[Any]:
    modules = [m for _, m in named_modules(model)]
    layers = [m for m in modules if is_checkpoint_layer(m)]
    if layers:
        return layers
    return [m for m in modules if m is not model and hasattr(m, "gradient_checkpointing")]


def is_checkpoint_layer(module: Any) -> bool:
    """A transformers GradientCheckpointingLayer (it checkpoints itself), of either layout."""
    return _checkpoint_site_of(type(module)) != "loop"


def checkpoint_site(layers: list[Any]) -> str:
    """Where the checkpoint call sits around a checkpointed layer, which decides what a reentrant
    recompute runs again in backward (F2):
    "loop": the stack's loop checkpoints `layer.__call__` (families before
    GradientCheckpointingLayer):
      the layer's hooks and any wrapper module around it (FSDP1's) run again;
    "layer_call": GradientCheckpointingLayer.__call__ checkpoints `nn.Module.__call__` (transformers
      4.52-5.22): the layer's own hooks (FSDP2's) run again, a wrapper around it does not;
    "layer_forward": the checkpoint wraps `forward` alone (transformers 5.23+): neither;
    "": no checkpointed layer."""
    if not layers:
        return ""
    return _checkpoint_site_of(type(layers[0]))


@functools.lru_cache(maxsize=None)
def _checkpoint_site_of(cls: type) -> str:
    # per class, once: a model has hundreds of modules of a handful of classes
    base = next((c for c in cls.__mro__ if c.__name__ == "GradientCheckpointingLayer"), None)
    if base is None:
        return "loop"
    return "layer_call" if "__call__" in vars(base) else "layer_forward"


_CONTAINERS = ("ModuleList", "Sequential", "ModuleDict")


def checkpoint_stacks(model: Any) -> list[tuple[str, Any, list[Any]]]:
    """The stacks of checkpointed blocks, each as (name, the module whose forward runs the loop
    over them, the blocks). A multi-stack model has several: encoder and decoder, two towers, a
    vision tower and a language model. Blocks are grouped by the container that holds them; on
    families that predate GradientCheckpointingLayer the flagged module runs its own loop."""
    return _walked(model, "stacks", lambda: _checkpoint_stacks(model))


def _checkpoint_stacks(model: Any) -> list[tuple[str, Any, list[Any]]]:
    named = named_modules(model)
    names = {id(m): n for n, m in named}
    modules = dict(named)
    stacks: dict[str, tuple[str, Any, list[Any]]] = {}
    for layer in checkpoint_layers(model):
        name = names.get(id(layer), "")
        if not is_checkpoint_layer(layer):
            # the flagged module runs the loop itself: its blocks are its largest module list
            lists = [
                (n, c)
                for n, c in layer.named_children()
                if type(c).__name__ in _CONTAINERS and len(c)
            ]
            if lists:
                list_name, blocks = max(lists, key=lambda item: len(item[1]))
                key = f"{name}.{list_name}" if name else list_name
                stacks[key] = (key, layer, list(blocks))
            else:
                stacks[name] = (name or type(layer).__name__, layer, [layer])
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        holder = modules.get(parent, model)
        if type(holder).__name__ in _CONTAINERS:
            owner = modules.get(parent.rsplit(".", 1)[0] if "." in parent else "", model)
        else:
            owner = holder
        container = parent
        entry = stacks.setdefault(container, (container, owner, []))
        entry[2].append(layer)
    return list(stacks.values())


def stack_facts(model: Any) -> tuple[Stack, ...]:
    """R1's facts per stack: whether its blocks train, and whether anything upstream of it trains
    (which makes the stack's first input require grad). Upstream is what the model registers
    before the stack on the way from the root down to it, leaving out sibling branches that hold
    a stack of their own (a parallel tower, or a vision tower that only feeds image batches):
    counting those could keep reentrant where a text-only batch loses gradients, so they are not."""
    names = {id(m): n for n, m in named_modules(model)}
    stacks = checkpoint_stacks(model)
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    owners = {id(owner) for _, owner, _ in stacks} | {
        id(layer) for _, _, layers in stacks for layer in layers
    }
    embeddings = input_embeddings(model)
    facts = []
    for name, owner, layers in stacks:
        layer_ids = {id(p) for layer in layers for p in layer.parameters()}
        trainable_inside = sum(
            _numel(p) for layer in layers for p in layer.parameters() if p.requires_grad
        )
        upstream, fed = _upstream(
            model, names.get(id(layers[0]), ""), owners, layer_ids, embeddings
        )
        facts.append(
            Stack(
                stack=name,
                runner=type(owner).__name__,
                blocks=len(layers),
                block_class=type(layers[0]).__name__,
                trainable_in_blocks=trainable_inside,
                trainable_upstream=upstream,
                inputs_can_require_grad=upstream > 0,
                fed_by_input_embeddings=fed,
                blocks_in_eval_mode=sum(1 for layer in layers if not layer.training),
                encoder_states_by_keyword=encoder_decoder and _encoder_states_by_keyword(owner),
                runner_forward_from=str(getattr(type(owner).forward, "__module__", "") or ""),
            )
        )
    return tuple(facts)


def _encoder_states_by_keyword(runner: Any) -> bool:
    """Whether this decoder stack hands the encoder's output to its blocks as a keyword argument.
    A reentrant checkpoint sees only positional tensors: the encoder's graph is then run twice in
    backward ("Trying to backward through the graph a second time") or not at all (transformers
    4.57 WhisperDecoder; GradientCheckpointingLayer's docstring asks for positional inputs)."""
    import inspect
    import re

    try:
        source = inspect.getsource(type(runner).forward)
    except (OSError, TypeError) as exc:
        log.debug(
            "gcpatch: R1: no source for %s.forward (%s); its encoder states are taken as"
            " positional",
            type(runner).__name__,
            exc,
        )
        return False
    for loop in re.finditer(r"for\s+(?:\w+\s*,\s*)?(\w+)\s+in\s+(?:enumerate\()?self\.\w+", source):
        call = re.search(rf"\b{loop.group(1)}\(", source[loop.end() :])
        if call is None:
            continue
        start = loop.end() + call.end()
        depth, end = 1, start
        while depth and end < len(source):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        if re.search(r"\bencoder_hidden_states\s*=", source[start:end]):
            return True
    return False


def _upstream(
    model: Any, path: str, owners: set[int], skip: set[int], embeddings: Any
) -> tuple[int, bool]:
    """Trainable parameter sizes registered before `path` at every level from the root to it, and
    whether the input embeddings are among those modules."""
    total = 0
    fed = False
    module = model
    for part in path.split(".") if path else ():
        for child_name, child in module.named_children():
            if child_name == part:
                break
            if any(id(m) in owners for m in child.modules()):
                continue  # a branch with its own checkpointed stack: not counted as upstream
            total += sum(
                _numel(p) for p in child.parameters() if p.requires_grad and id(p) not in skip
            )
            fed = fed or (embeddings is not None and any(m is embeddings for m in child.modules()))
        module = getattr(module, part, None) if not part.isdigit() else module[int(part)]
        if module is None:
            break
    return total, fed


def input_embeddings(model: Any) -> Any:
    """The model's input embeddings, where it has a module there (R1 reads what feeds the layers,
    R2 hooks its output); None where it has none."""
    try:
        embeddings = model.get_input_embeddings()
    except Exception as exc:  # noqa: BLE001 (many models do not implement it)
        log.debug(
            "gcpatch: %s has no input embeddings (%s: %s)",
            type(model).__name__,
            type(exc).__name__,
            exc,
        )
        return None
    return embeddings if hasattr(embeddings, "register_forward_hook") else None


def checkpoint_function() -> str:
    """The checkpoint function transformers' enable will hand the layers: torch's, or one a tool
    put in its place (Unsloth, Axolotl's offload modes and other offloaders replace
    `transformers.modeling_utils.checkpoint`; many of them only work reentrant). Empty: torch's."""
    module = sys.modules.get("transformers.modeling_utils")
    func = getattr(module, "checkpoint", None)
    for _ in range(8):  # gcpatch's own wrapper, functools.wraps chains
        if getattr(func, "__module__", None) == "torch.utils.checkpoint" or func is None:
            return ""
        inner = getattr(func, "__wrapped__", None)
        if inner is None:
            break
        func = inner
    return (
        f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"
    )


def fsdp_facts(model: Any, context: Mapping[str, Any]) -> dict[str, str]:
    """FSDP around or inside the model, and FSDP's own activation checkpointing: read from the
    modules (FSDP1's wrapper class, FSDP2's FSDPModule, CheckpointWrapper), from the wrap being
    decided now (`context`, the fsdp plugin) and from accelerate's launcher environment (the Trainer
    enables checkpointing before accelerate wraps the model)."""
    kinds, wrappers, impls = [], 0, set()
    if context.get("fsdp"):
        kinds.append(str(context["fsdp"]))
    for module in model.modules():
        names = {cls.__name__ for cls in type(module).__mro__}
        if "FullyShardedDataParallel" in names and "fsdp1" not in kinds:
            kinds.append("fsdp1")
        if "FSDPModule" in names and "fsdp2" not in kinds:
            kinds.append("fsdp2")
        if "CheckpointWrapper" in names:
            wrappers += 1
            impl = getattr(module, "checkpoint_impl", None)
            impls.add(str(getattr(impl, "name", impl)).lower())
    planned = ""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        kinds.append(f"accelerate:fsdp{os.environ.get('FSDP_VERSION', '1')}")
        if os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "").lower() == "true":
            planned = "accelerate FSDP plugin activation_checkpointing (planned)"
    checkpointing = (
        f"checkpoint_wrapper: {wrappers} modules ({', '.join(sorted(impls))})"
        if wrappers
        else planned
    )
    return {"fsdp": ", ".join(kinds), "fsdp_checkpointing": checkpointing}


def _numel(param: Any) -> int:
    """ZeRO-3 partitions parameters in place (numel() is 0 after deepspeed.zero.Init): ds_numel
    holds the real size."""
    return int(getattr(param, "ds_numel", 0) or param.numel())


def use_cache_configs(model: Any) -> dict[str, Any]:
    """Every config reachable from the model that has `use_cache`, by where it sits: the top
    config, its nested sub-configs (`text_config`, towers) and the copies submodules keep (T5's
    decoder stack). Each is a separate switch transformers reads; R6 must reach them all."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    todo: list[tuple[str, Any]] = []
    for name, module in named_modules(model):
        config = module.__dict__.get("config")
        if config is not None and hasattr(config, "to_dict"):
            todo.append((f"{name}.config" if name else "config", config))
    while todo:
        where, config = todo.pop(0)
        nested = []
        if id(config) in seen:
            continue
        seen.add(id(config))
        if "use_cache" in vars(config) or hasattr(type(config), "use_cache"):
            found[where] = config
        for key, value in vars(config).items():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                nested.append((f"{where}.{key}", value))
        todo[:0] = nested  # a sub-config is named from its parent config before a module's copy
    return found


def passes_kv_cache(kwargs: Mapping[str, Any]) -> bool:
    """A forward call extends a KV cache, under either keyword a release takes it by:
    `past_key_values`
    up to transformers 5.23, `cache` from 5.24 (models/*/modeling_*.py:
    `@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`). Runs at every forward: two
    lookups.
    """
    return kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None


def gather(
    model: Any,
    *,
    stage: str,
    api: str,
    source: str,
    asked_kwargs: Mapping[str, Any] | None,
    asked_from: str,
    context: Mapping[str, Any] | None = None,
    trainer: str = "",
    default_use_reentrant: bool | None = None,
    default_from: str = "",
) -> Facts:
    """`context` holds what was learnt when the model was wrapped later (DDP's
    find_unused_parameters); `trainer` names the Trainer class making the call;
    `default_use_reentrant` is what the framework runs with when the ask names none."""
    context = context or {}
    trainable = frozen = 0
    for param in model.parameters():
        if param.requires_grad:
            trainable += _numel(param)
        else:
            frozen += _numel(param)
    layers = checkpoint_layers(model)
    asked = dict(asked_kwargs or {})
    config = getattr(model, "config", None)
    world_size = _int_env("WORLD_SIZE", 1)
    return Facts(
        stage=stage,
        api=api,
        source=source,
        model_class=type(model).__name__,
        asked_use_reentrant=as_bool(asked.get("use_reentrant")),
        asked_from=asked_from,
        asked_kwargs=asked,
        trainable_params=trainable,
        frozen_params=frozen,
        embeddings_trainable=_embeddings_trainable(model),
        checkpointed_layers=len(layers),
        trainable_in_checkpointed_layers=any(
            p.requires_grad for m in layers for p in m.parameters()
        ),
        main_input_name=str(getattr(model, "main_input_name", "input_ids")),
        layers_in_eval_mode=sum(1 for m in layers if not m.training),
        checkpoint_layer_api=bool(layers) and is_checkpoint_layer(layers[0]),
        checkpoint_site=checkpoint_site(layers),
        use_cache=getattr(config, "use_cache", None),
        use_cache_configs={
            where: getattr(cfg, "use_cache", None)
            for where, cfg in use_cache_configs(model).items()
        },
        stacks=stack_facts(model),
        checkpoint_function=checkpoint_function(),
        peft=bool(getattr(model, "_hf_peft_config_loaded", False)) or _has_peft_modules(model),
        kbit=bool(
            getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
        ),
        zero3=_zero3(model),
        world_size=world_size,
        distributed="ddp" if world_size > 1 else "none",
        versions=versions(),
        grad_enabled=_grad_enabled(),
        find_unused_parameters=bool(context.get("find_unused_parameters", False)),
        trainer=trainer,
        default_use_reentrant=default_use_reentrant,
        default_from=default_from,
        **fsdp_facts(model, context),
    )


def for_config(
    *,
    api: str,
    model_class: str,
    asked_kwargs: Mapping[str, Any] | None,
    asked_from: str,
    partially_frozen: bool,
    peft: bool,
    kbit: bool,
    zero3: bool,
    world_size: int,
    trainer: str = "",
) -> Facts:
    """Facts read from a config before the model exists. The parameter counts are not known
    yet: a config that freezes part of the model counts one frozen and one trainable tensor, so
    `partially_frozen` holds; the model-level decision later sees the real counts."""
    asked = dict(asked_kwargs or {})
    return Facts(
        stage=Stage.CONFIG,
        api=api,
        source="config",
        model_class=model_class,
        asked_use_reentrant=as_bool(asked.get("use_reentrant")),
        asked_from=asked_from,
        asked_kwargs=asked,
        trainable_params=1,
        frozen_params=1 if partially_frozen else 0,
        embeddings_trainable=None,
        checkpointed_layers=0,
        trainable_in_checkpointed_layers=True,
        main_input_name="input_ids",
        layers_in_eval_mode=0,
        checkpoint_layer_api=True,
        use_cache=None,
        peft=peft,
        kbit=kbit,
        zero3=zero3,
        world_size=world_size,
        distributed="ddp" if world_size > 1 else "none",
        versions=versions(),
        trainer=trainer,
    )


def versions() -> Mapping[str, str | None]:
    """Versions of the frameworks this process has imported (None: not imported, so not in use).
    Read from `__version__`, not metadata: a metadata scan costs milliseconds per package on the
    first decision (benchmarks/RESULTS.md)."""
    found: dict[str, str | None] = {}
    for dist in VERSIONED:
        module = sys.modules.get(dist)
        version = getattr(module, "__version__", None) if module is not None else None
        found[dist] = str(version) if version is not None else None
    return found


def installed_version(dist: str) -> str | None:
    """The installed version from metadata: for what is not imported yet (doctor, a config). A
    wheel's `name-version.dist-info` folder already says it (the wheel spec), which spares parsing
    its METADATA for each plugin at the first enable of every process; anything else is read from
    METADATA as importlib.metadata does."""
    from importlib import metadata

    try:
        found = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return None
    return version_of(found)


def version_of(dist: Any) -> str | None:
    """A found distribution's version: from its `name-version.dist-info` folder's name where a
    wheel installed it, else from its METADATA."""
    folder = getattr(getattr(dist, "_path", None), "name", "")
    stem = folder[: -len(".dist-info")] if folder.endswith(".dist-info") else ""
    if stem.count("-") == 1:  # `name-version`: both escaped, so one dash
        return stem.split("-")[1]
    return dist.version


def _embeddings_trainable(model: Any) -> bool | None:
    embeddings = input_embeddings(model)
    params = list(embeddings.parameters()) if embeddings is not None else []
    return any(p.requires_grad for p in params) if params else None


def _has_peft_modules(model: Any) -> bool:
    return any(type(m).__module__.startswith("peft.") for _, m in named_modules(model))


def _zero3(model: Any) -> bool:
    # Parameters partitioned by deepspeed.zero.Init carry ds_id; HfDeepSpeedConfig and
    # TrainingArguments(deepspeed=...) register the config with transformers' integration.
    first = next(iter(model.parameters()), None)
    if first is not None and hasattr(first, "ds_id"):
        return True
    integration = sys.modules.get("transformers.integrations.deepspeed")
    check = getattr(integration, "is_deepspeed_zero3_enabled", None)
    try:
        return bool(check()) if check is not None else False
    except Exception as exc:  # noqa: BLE001
        log.warning(
            "gcpatch: R3: cannot tell whether ZeRO-3 is on (is_deepspeed_zero3_enabled raised %s:"
            " %s); taken as off",
            type(exc).__name__,
            exc,
        )
        return False


def _grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch.is_grad_enabled()) if torch is not None else True


def as_bool(value: Any) -> bool | None:
    """An asked flag as the facts hold it: None where nothing was asked."""
    return None if value is None else bool(value)


def _int_env(name: str, default: int) -> int:
    from gcpatch import settings

    meaning = (
        "the number of processes" if name == "WORLD_SIZE" else "this process's rank (records only)"
    )
    return settings.int_env(name, default, meaning)
