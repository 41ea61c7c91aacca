"""Upstream canaries: the shape of every patch point gcpatch relies on, checked on the installed
release. When a new transformers / peft / trl release moves one, the failure names the point and
the release, before any user meets a silently unpatched call.

Each canary is one function of the installed frameworks' objects, so the last test can show that
a canary fails on a deliberately changed signature (without any framework installed).
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata
from typing import Any, Callable

import pytest
from packaging.version import Version


def installed(dist: str) -> Version | None:
    try:
        return Version(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None


class CanaryFailure(AssertionError):
    pass


def expect_params(point: str, release: str, func: Any, names: tuple[str, ...]) -> None:
    """`func` takes `names` (in this order, after self) among its parameters."""
    try:
        params = [p for p in inspect.signature(func).parameters if p != "self"]
    except (TypeError, ValueError) as exc:
        raise CanaryFailure(f"canary {point} on {release}: no signature ({exc})") from exc
    found = [p for p in params if p in names]
    if found != list(names):
        raise CanaryFailure(
            f"canary {point} on {release}: expected parameters {list(names)}, found {params}"
        )


def expect_source(point: str, release: str, obj: Any, needle: str) -> None:
    """`obj`'s source contains `needle` (what the patch point dispatches to)."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise CanaryFailure(f"canary {point} on {release}: no source ({exc})") from exc
    if needle not in source:
        raise CanaryFailure(f"canary {point} on {release}: no longer calls {needle!r}")


def expect_attr(point: str, release: str, owner: Any, name: str) -> Any:
    # classes: the attribute itself, not a descriptor's result; modules: getattr, as lazy modules
    # (trl, transformers) resolve their exports in __getattr__
    value = (
        getattr(owner, name, None)
        if inspect.ismodule(owner)
        else inspect.getattr_static(owner, name, None)
    )
    if value is None:
        raise CanaryFailure(
            f"canary {point} on {release}: {getattr(owner, '__name__', owner)}.{name} is gone"
        )
    return getattr(owner, name)


# --- transformers -------------------------------------------------------------------------------

TF = installed("transformers")
CHOKE = "_activation_checkpointing_enable"


def tf_release() -> str:
    return f"transformers {TF}"


def canary_enable_entry(pretrained: Any, release: str, version: Version) -> None:
    """X1: the entry point gcpatch wraps and the arguments it passes through (the choke point from
    5.23; the public method before, with every_n_layers/offload from 5.17)."""
    if version >= Version("5.23"):
        point = f"PreTrainedModel.{CHOKE}"
        expect_params(
            point,
            release,
            expect_attr(point, release, pretrained, CHOKE),
            ("activation_checkpointing_kwargs", "every_n_layers", "offload"),
        )
        for public in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
            expect_source(
                f"PreTrainedModel.{public}",
                release,
                getattr(pretrained, public),
                "activation_checkpointing_enable(",
            )
        expect_source(point, release, getattr(pretrained, CHOKE), "_set_gradient_checkpointing(")
        return
    point = "PreTrainedModel.gradient_checkpointing_enable"
    if inspect.getattr_static(pretrained, CHOKE, None) is not None:
        raise CanaryFailure(
            f"canary {point} on {release}: {CHOKE} exists before 5.23; gcpatch's X1 assumes it does not"
        )
    names = ("gradient_checkpointing_kwargs",) + (
        ("every_n_layers", "offload") if version >= Version("5.17") else ()
    )
    func = expect_attr(point, release, pretrained, "gradient_checkpointing_enable")
    expect_params(point, release, func, names)
    expect_source(point, release, func, "_set_gradient_checkpointing(")


def canary_disable(pretrained: Any, release: str, version: Version) -> None:
    name = (
        "_activation_checkpointing_disable"
        if version >= Version("5.23")
        else "gradient_checkpointing_disable"
    )
    expect_attr(f"PreTrainedModel.{name}", release, pretrained, name)


def canary_set_gradient_checkpointing(pretrained: Any, release: str, version: Version) -> None:
    """What the entry point dispatches to (facts.py reads the flags it sets on each module)."""
    point = "PreTrainedModel._set_gradient_checkpointing"
    expect_params(
        point,
        release,
        expect_attr(point, release, pretrained, "_set_gradient_checkpointing"),
        ("enable", "gradient_checkpointing_func"),
    )


def canary_trainer_call(trainer_module: Any, release: str, version: Version) -> None:
    """X3: the Trainer re-enables through the model's public enable call, inside Trainer.train."""
    expect_attr("Trainer.train", release, trainer_module.Trainer, "train")
    needle = (
        "checkpointing_enable("
        if version >= Version("5.23")
        else "self.model.gradient_checkpointing_enable("
    )
    expect_source("Trainer (re-enable call)", release, trainer_module, needle)


def canary_training_args(training_args: Any, release: str, version: Version) -> None:
    expect_attr("TrainingArguments.__post_init__", release, training_args, "__post_init__")
    fields = getattr(training_args, "__dataclass_fields__", {})
    if not {"gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"} & set(fields):
        raise CanaryFailure(
            f"canary TrainingArguments.gradient_checkpointing_kwargs on {release}: field is gone"
        )


TF_CANARIES: list[tuple[str, Callable[[], Any], Callable[..., None]]] = [
    (
        "enable entry point",
        lambda: importlib.import_module("transformers.modeling_utils").PreTrainedModel,
        canary_enable_entry,
    ),
    (
        "disable",
        lambda: importlib.import_module("transformers.modeling_utils").PreTrainedModel,
        canary_disable,
    ),
    (
        "_set_gradient_checkpointing",
        lambda: importlib.import_module("transformers.modeling_utils").PreTrainedModel,
        canary_set_gradient_checkpointing,
    ),
    (
        "Trainer's call",
        lambda: importlib.import_module("transformers.trainer"),
        canary_trainer_call,
    ),
    (
        "TrainingArguments",
        lambda: importlib.import_module("transformers.training_args").TrainingArguments,
        canary_training_args,
    ),
]


@pytest.mark.skipif(TF is None, reason="transformers not installed")
@pytest.mark.parametrize("name, target, check", TF_CANARIES, ids=[c[0] for c in TF_CANARIES])
def test_transformers_patch_point_shape(name, target, check):
    check(target(), tf_release(), TF)


# --- peft ---------------------------------------------------------------------------------------


def outside_plugin_range(plugin: str, version: Version | None) -> str:
    """'' when the installed framework is in the range the gcpatch plugin declares, else why not:
    outside it the plugin is skipped (and says so), so its patch points are not relied on."""
    if version is None:
        return f"{plugin} not installed"
    spec = importlib.import_module(f"gcpatch_plugins.{plugin}").INFO.versions
    from packaging.specifiers import SpecifierSet

    return (
        ""
        if version in SpecifierSet(spec)
        else f"{plugin} {version} is outside the {plugin} plugin's range {spec}"
    )


PEFT = installed("peft")
PEFT_SKIP = outside_plugin_range("peft", PEFT)
KBIT_EXPORTS = ("peft", "peft.utils", "peft.utils.other")


@pytest.mark.skipif(bool(PEFT_SKIP), reason=PEFT_SKIP)
@pytest.mark.parametrize("module", KBIT_EXPORTS)
def test_peft_kbit_preparation_under_each_exported_name(module):
    """P3: prepare_model_for_kbit_training is patched under every name peft exports it as, and it
    still re-enables checkpointing through the model's enable call."""
    release = f"peft {PEFT}"
    point = f"{module}.prepare_model_for_kbit_training"
    func = expect_attr(
        point, release, importlib.import_module(module), "prepare_model_for_kbit_training"
    )
    expect_params(
        point, release, func, ("use_gradient_checkpointing", "gradient_checkpointing_kwargs")
    )
    expect_source(point, release, func, "gradient_checkpointing_enable(")


@pytest.mark.skipif(bool(PEFT_SKIP), reason=PEFT_SKIP)
def test_peft_model_init_wraps_the_base_model():
    """P4: PeftModel.__init__ is where gcpatch decides again; get_base_model gives the model back."""
    release = f"peft {PEFT}"
    peft_model = importlib.import_module("peft.peft_model").PeftModel
    expect_params("PeftModel.__init__", release, peft_model.__init__, ("model", "peft_config"))
    expect_attr("PeftModel.get_base_model", release, peft_model, "get_base_model")


# --- trl ----------------------------------------------------------------------------------------

TRL = installed("trl")
TRL_SKIP = outside_plugin_range("trl", TRL) or ("" if TF else "transformers not installed")


@pytest.mark.skipif(bool(TRL_SKIP), reason=TRL_SKIP)
def test_trl_trainer_init_ends_in_the_transformers_trainer():
    """T1/X3: TRL's SFTTrainer is a transformers Trainer whose train() is the one gcpatch wraps,
    and SFTConfig is a TrainingArguments (so the user's own kwargs are remembered)."""
    release = f"trl {TRL}"
    trl = importlib.import_module("trl")
    transformers = importlib.import_module("transformers")
    sft = expect_attr("trl.SFTTrainer", release, trl, "SFTTrainer")
    if not issubclass(sft, transformers.Trainer):
        raise CanaryFailure(f"canary trl.SFTTrainer on {release}: no longer a transformers.Trainer")
    if "train" in vars(sft):
        expect_source("trl.SFTTrainer.train", release, sft.train, "super().train(")
    config = expect_attr("trl.SFTConfig", release, trl, "SFTConfig")
    if not issubclass(config, transformers.TrainingArguments):
        raise CanaryFailure(f"canary trl.SFTConfig on {release}: no longer a TrainingArguments")


# --- the canaries themselves --------------------------------------------------------------------


def test_a_canary_fails_on_a_changed_signature_naming_the_point_and_the_release():
    """A release that renames the enable call's kwargs argument must fail the canary, loudly."""

    class Renamed:  # what a future 4.x-line PreTrainedModel with a renamed argument would look like
        def gradient_checkpointing_enable(self, checkpoint_kwargs=None):
            self._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=None)

    class Unchanged:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=None)

    canary_enable_entry(Unchanged, "transformers 4.99.0", Version("4.99.0"))  # passes
    with pytest.raises(CanaryFailure) as info:
        canary_enable_entry(Renamed, "transformers 4.99.0", Version("4.99.0"))
    message = str(info.value)
    assert "PreTrainedModel.gradient_checkpointing_enable" in message
    assert "transformers 4.99.0" in message
    assert "checkpoint_kwargs" in message and "gradient_checkpointing_kwargs" in message

    # 5.17+: dropping every_n_layers from the public method fails too (X1 passes it through)
    with pytest.raises(CanaryFailure, match=r"on transformers 5\.18\.0: expected parameters"):
        canary_enable_entry(Unchanged, "transformers 5.18.0", Version("5.18.0"))
