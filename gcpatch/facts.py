"""Gathering the facts of one decision from the model and the launcher's environment.

Only what every rank sees the same: parameter layout, modes, config, versions, WORLD_SIZE.
Nothing rank-local (RULES.md §3: a rank-dependent decision deadlocks DDP).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping

from gcpatch.schema import Facts

VERSIONED = ("torch", "transformers", "accelerate", "peft", "trl", "deepspeed", "bitsandbytes")


def checkpoint_layers(model: Any) -> list[Any]:
    """The modules that checkpoint themselves: transformers' GradientCheckpointingLayer, or on
    model families that predate it, every submodule with a `gradient_checkpointing` flag."""
    layers = [m for m in model.modules() if is_checkpoint_layer(m)]
    if layers:
        return layers
    return [m for m in model.modules() if m is not model and hasattr(m, "gradient_checkpointing")]


def is_checkpoint_layer(module: Any) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


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
) -> Facts:
    """`context` holds what was learnt when the model was wrapped later (DDP's
    find_unused_parameters); `trainer` names the Trainer class making the call."""
    context = context or {}
    trainable = frozen = 0
    for param in model.parameters():
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    layers = checkpoint_layers(model)
    asked = dict(asked_kwargs or {})
    config = getattr(model, "config", None)
    world_size = _int_env("WORLD_SIZE", 1)
    return Facts(
        stage=stage,
        api=api,
        source=source,
        model_class=type(model).__name__,
        asked_use_reentrant=_as_bool(asked.get("use_reentrant")),
        asked_from=asked_from,
        asked_kwargs=asked,
        trainable_params=trainable,
        frozen_params=frozen,
        embeddings_trainable=_embeddings_trainable(model),
        checkpointed_layers=len(layers),
        trainable_in_checkpointed_layers=any(p.requires_grad for m in layers for p in m.parameters()),
        main_input_name=str(getattr(model, "main_input_name", "input_ids")),
        layers_in_eval_mode=sum(1 for m in layers if not m.training),
        checkpoint_layer_api=bool(layers) and is_checkpoint_layer(layers[0]),
        use_cache=getattr(config, "use_cache", None),
        peft=bool(getattr(model, "_hf_peft_config_loaded", False)) or _has_peft_modules(model),
        kbit=bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)),
        zero3=_zero3(model),
        world_size=world_size,
        distributed="ddp" if world_size > 1 else "none",
        versions=versions(),
        grad_enabled=_grad_enabled(),
        find_unused_parameters=bool(context.get("find_unused_parameters", False)),
        trainer=trainer,
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
        stage="config", api=api, source="config", model_class=model_class,
        asked_use_reentrant=_as_bool(asked.get("use_reentrant")), asked_from=asked_from, asked_kwargs=asked,
        trainable_params=1, frozen_params=1 if partially_frozen else 0, embeddings_trainable=None,
        checkpointed_layers=0, trainable_in_checkpointed_layers=True, main_input_name="input_ids",
        layers_in_eval_mode=0, checkpoint_layer_api=True, use_cache=None, peft=peft, kbit=kbit,
        zero3=zero3, world_size=world_size, distributed="ddp" if world_size > 1 else "none",
        versions=versions(), trainer=trainer,
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
    """The installed version from metadata: for what is not imported yet (doctor, a config)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def rank() -> int:
    """This process's rank, for the record only: never a decision input."""
    for name in ("RANK", "LOCAL_RANK"):
        if name in os.environ:
            return _int_env(name, 0)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _embeddings_trainable(model: Any) -> bool | None:
    try:
        embeddings = model.get_input_embeddings()
    except Exception:  # noqa: BLE001 (many models do not implement it)
        return None
    params = list(embeddings.parameters()) if embeddings is not None else []
    return any(p.requires_grad for p in params) if params else None


def _has_peft_modules(model: Any) -> bool:
    return any(type(m).__module__.startswith("peft.") for m in model.modules())


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
    except Exception:  # noqa: BLE001
        return False


def _grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch.is_grad_enabled()) if torch is not None else True


def _as_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _int_env(name: str, default: int) -> int:
    from gcpatch import settings

    meaning = "the number of processes" if name == "WORLD_SIZE" else "this process's rank (records only)"
    return settings.int_env(name, default, meaning)
