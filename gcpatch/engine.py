"""The running engine: one patcher per process, and one plugin host once it is needed.

Armed by the activation watcher when a framework is first imported: the built-in plugins' patch
points are registered by name (BUILTIN_POINTS) and wrapped as their modules are imported; nothing
else loads. The plugin host (pluggy, the entry-point scan, every plugin) and the crash notes start
at the first call through one of those points (an enable, a checkpoint call, a wrap), or when
asked (`gcpatch doctor`), so a process that never checkpoints (a DataLoader worker, a tokenizer
script) pays for the arming only (benchmarks/IMPORT_COST.md).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from gcpatch import lifetime, mrope_mask, settings
from gcpatch.patching import Patcher

if TYPE_CHECKING:
    from gcpatch.manager import PluginHost


def _v4(module: Any) -> bool:
    return not hasattr(module.PreTrainedModel, "_activation_checkpointing_enable")


def _v5(module: Any) -> bool:  # 5.23's choke point of both enable names
    return hasattr(module.PreTrainedModel, "_activation_checkpointing_enable")


# The built-in plugins' patch points: (plugin, module, target, copies, applies or None). Pinned to
# the plugins' own declarations (gcpatch_patch_points: the same points, the same `applies` on the
# installed release) by tests/process/test_patch_points.py, with LOAD_TIME_POINTS below; a
# third-party plugin's points are registered when the plugins load.
_TF = "transformers.modeling_utils"
BUILTIN_POINTS: tuple[tuple[str, str, str, bool, Callable[[Any], bool] | None], ...] = (
    ("torch", "torch.utils.checkpoint", "checkpoint", True, None),
    ("transformers", _TF, "PreTrainedModel.gradient_checkpointing_enable", False, _v4),
    ("transformers", _TF, "PreTrainedModel.gradient_checkpointing_disable", False, _v4),
    ("transformers", _TF, "PreTrainedModel._activation_checkpointing_enable", False, _v5),
    ("transformers", _TF, "PreTrainedModel._activation_checkpointing_disable", False, _v5),
    ("transformers", _TF, "PreTrainedModel.enable_input_require_grads", False, None),
    ("transformers", _TF, "PreTrainedModel.disable_input_require_grads", False, None),
    ("transformers", "transformers.trainer", "Trainer.train", False, None),
    ("transformers", "transformers.training_args", "TrainingArguments.__post_init__", False, None),
    ("transformers", "transformers.configuration_utils", "PretrainedConfig.to_dict", False, None),
    ("transformers", _TF, "PreTrainedModel.save_pretrained", False, None),
    *(
        ("transformers", module, f"{name}.forward", False, mrope_mask.applies)
        for module, name in mrope_mask.MODELS
    ),
    ("peft", "peft.utils.other", "prepare_model_for_kbit_training", True, None),
    ("peft", "peft.peft_model", "PeftModel.__init__", False, None),
    ("peft", "transformers.integrations.peft", "PeftAdapterMixin.add_adapter", False, None),
    ("ddp", "torch.nn.parallel.distributed", "DistributedDataParallel.__init__", False, None),
    ("axolotl", "axolotl.utils.config", "validate_config", True, None),
    ("colossalai", "colossalai.booster.booster", "Booster.boost", False, None),
    ("fsdp", "torch.distributed.fsdp", "fully_shard", True, None),
    (
        "fsdp",
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "FullyShardedDataParallel.__init__",
        False,
        None,
    ),
    (
        "fsdp",
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "apply_activation_checkpointing",
        True,
        None,
    ),
)
# Points no call through which needs the plugins before a checkpoint call loaded them (CK6 looks at
# a gradient call only once a reentrant checkpoint ran): registered when the plugins load, so a
# process that never checkpoints keeps torch.autograd's own functions.
LOAD_TIME_POINTS = frozenset({("torch.autograd", "grad"), ("torch.autograd", "backward")})

# Points that act only on what a decision left (R6's use_cache in what is saved, X6's mask): a call
# through one does not load the plugins (a script that only reads a config pays nothing).
QUIET_POINTS = frozenset(
    {
        ("transformers.configuration_utils", "PretrainedConfig.to_dict"),
        ("transformers.modeling_utils", "PreTrainedModel.save_pretrained"),
        # X6 acts only on a model whose checkpointing an enable (which loads them) switched on
        *((module, f"{name}.forward") for module, name in mrope_mask.MODELS),
    }
)

_host: PluginHost | None = None
_patcher: Patcher | None = None
_loading = threading.RLock()
_starting = False


def arm() -> Patcher:
    """Register the built-in patch points by name. Idempotent; loads no plugin."""
    global _patcher
    if _patcher is None:
        cfg = settings.read()
        patcher = Patcher(strict=cfg.strict, on_first_call=start)
        _patcher = patcher
        for plugin, module, target, copies, applies in BUILTIN_POINTS:
            if plugin not in cfg.blocked_plugins:
                patcher.arm(
                    module,
                    target,
                    plugin,
                    copies,
                    applies,
                    wakes=(module, target) not in QUIET_POINTS,
                )
    return _patcher


def start() -> PluginHost | None:
    """Load the plugins and bind their patch points. Idempotent. None only for a call the
    loading itself makes (it runs as called)."""
    global _host, _starting
    if _host is not None:
        return _host
    with _loading:
        if _host is not None or _starting:
            return _host
        _starting = True
        try:
            _host = _load()
        finally:
            _starting = False
    return _host


def _load() -> PluginHost:
    from gcpatch import crash_notes, record
    from gcpatch.manager import PluginHost

    cfg = settings.read()
    record.configure_logging(cfg.log_level)
    patcher = arm()
    host = PluginHost.from_entry_points(blocked=cfg.blocked_plugins, strict=cfg.strict)
    for status in host.active():
        for point in status.patch_points:
            patcher.register(point, status.name)
    patcher.settle()
    crash_notes.register()
    return host


def stop() -> None:
    """Restore every patched original and end the activation's state (gcpatch/lifetime.py): a
    later `start()` loads everything afresh, as a fresh process would."""
    global _host, _patcher
    if _patcher is not None:
        _patcher.uninstall_all()
    _host, _patcher = None, None
    lifetime.reset_all()


def host() -> PluginHost:
    return _host if _host is not None else start()


def running() -> PluginHost | None:
    """The plugin host if the plugins are loaded; never loads them."""
    return _host


def patcher() -> Patcher | None:
    return _patcher


def reinstate() -> list[str]:
    """Wrap again any patch point another tool rebound since the last decision (see Patcher)."""
    return _patcher.reinstate() if _patcher is not None else []
