"""Axolotl decides at config time: its validators refuse a config (A1, A4) before any model
exists, and its defaults differ by code path (A2). gcpatch takes the decision on the config,
with the same votes and resolver as at enable time, just before `validate_config` runs, and
writes it into the config; the model-level decisions that follow see the same set-up and agree.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from gcpatch.plugin import (
    CRASH,
    RECOMMENDED,
    REQUIRED,
    USE_REENTRANT,
    Decision,
    Facts,
    PatchPoint,
    PluginInfo,
    Rule,
    Stage,
    Vote,
    for_config,
    hookimpl,
    run_config,
)

log = logging.getLogger("gcpatch")

RULES = (
    Rule(
        "A1",
        "unfrozen_parameters + use_reentrant: true is refused by Axolotl; gcpatch decides it first"
        " by R1 (fix: non-reentrant, recorded; strict: GcpatchError; warn: Axolotl refuses as"
        " before)",
        "axolotl/utils/schemas/validation.py (0.19: check_use_reentrant_mismatch),"
        " transformers#21381",
        documents=True,
    ),
    Rule(
        "A2",
        "standard training without unfrozen_parameters or rl: Axolotl prefers reentrant (a"
        " recommendation)",
        "axolotl/utils/config/__init__.py (0.19: normalize_config)",
    ),
    Rule(
        "A3",
        "QLoRA + ZeRO-3 + use_reentrant: false may raise CheckpointError: decided by R3",
        "axolotl/utils/schemas/validation.py (0.19: warn_qlora_zero3_w_use_reentrant)",
        documents=True,
    ),
    Rule(
        "A4",
        "rl + QLoRA + more than one process + reentrant is refused (broken upstream in TRL) ->"
        " non-reentrant",
        "axolotl/utils/schemas/validation.py (0.19: check_rl_config_gradient_checkpointing)",
    ),
    Rule(
        "A5",
        "checkpointing implies use_cache=False (Axolotl sets it on the model's config itself);"
        " gcpatch's R6 does the same only where transformers' model code would not drop the cache",
        "Axolotl",
        documents=True,
    ),
)

INFO = PluginInfo(
    name="axolotl", framework="axolotl", versions=">=0.10,<1", rules=RULES, proven="==0.19.*"
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list[PatchPoint]:
    return [
        PatchPoint(
            "axolotl.utils.config",
            "validate_config",
            _validate_config,
            copies=True,
            why="A1/A4: decide on the config before Axolotl's validators refuse it",
        )
    ]


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage != Stage.CONFIG or not facts.trainer.startswith("axolotl"):
        return []
    rl = ":rl" in facts.trainer
    votes = []
    if not rl and facts.asked_use_reentrant is None:
        votes.append(
            Vote(
                USE_REENTRANT,
                True,
                RECOMMENDED,
                "A2",
                "Axolotl's default for standard training",
                short="Axolotl's default",
            )
        )
    if rl and facts.kbit and facts.peft and facts.world_size > 1:
        votes.append(
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "A4",
                f"RL with QLoRA over {facts.world_size} processes: reentrant is broken upstream"
                " in TRL",
                avoids=CRASH,
                short="RL + QLoRA over processes crashes",
            )
        )
    return votes


def _validate_config(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    cfg = args[0] if args else kwargs["cfg"]
    capabilities = (args[1] if len(args) > 1 else kwargs.get("capabilities")) or {}
    # Only plain checkpointing: "offload"/"unsloth" install a checkpointer that is not ours to
    # replace.
    if cfg.get("gradient_checkpointing") is True:
        asked = cfg.get("gradient_checkpointing_kwargs")
        facts = for_config(
            api="axolotl config",
            model_class=str(cfg.get("base_model") or "?"),
            asked_kwargs=asked,
            asked_from=(
                "axolotl config gradient_checkpointing_kwargs"
                if asked
                else "nothing (axolotl config)"
            ),
            partially_frozen=bool(cfg.get("unfrozen_parameters"))
            or cfg.get("adapter") in ("lora", "qlora"),
            peft=bool(cfg.get("adapter")),
            kbit=bool(cfg.get("load_in_4bit") or cfg.get("load_in_8bit")),
            zero3=_zero3(cfg.get("deepspeed")),
            world_size=int(capabilities.get("n_gpu") or os.environ.get("WORLD_SIZE", 1)),
            trainer="axolotl" + (f":rl={cfg.get('rl')}" if cfg.get("rl") else ""),
        )
        run_config(facts, lambda decision: _write(cfg, decision))
    return wrapped(*args, **kwargs)


def _write(cfg: Any, decision: Decision) -> dict[str, Any]:
    value = decision.values[USE_REENTRANT]
    before = dict(cfg.get("gradient_checkpointing_kwargs") or {})
    if before.get(USE_REENTRANT) == value:
        return {USE_REENTRANT: value}
    cfg["gradient_checkpointing_kwargs"] = {**before, USE_REENTRANT: value}
    return {
        USE_REENTRANT: value,
        "config": (
            f"gradient_checkpointing_kwargs.use_reentrant {before.get(USE_REENTRANT)} -> {value}"
        ),
    }


def _zero3(deepspeed: Any) -> bool:
    config = deepspeed
    if isinstance(deepspeed, (str, os.PathLike)):
        try:
            with open(deepspeed, encoding="utf-8") as handle:
                config = json.load(handle)
        except (OSError, ValueError) as exc:
            log.warning(
                "gcpatch: cannot read the DeepSpeed config %s (%s: %s); ZeRO-3 rules (R3) are not"
                " applied at config time",
                deepspeed,
                type(exc).__name__,
                exc,
            )
            return False
    return isinstance(config, dict) and (config.get("zero_optimization") or {}).get("stage") == 3
