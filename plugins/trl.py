"""TRL: its trainers end in the Trainer's enable call, which gcpatch decides; this plugin adds
TRL's own rules. What TRL writes into TrainingArguments (T1's default, T2's override) is taken
as TRL's vote, not as the user's ask (see the transformers plugin). `disable_gradient_checkpointing`
re-enables through the same patched call on exit, so it gets gcpatch's decision back.
"""

from __future__ import annotations

from gcpatch.plugin import (
    CRASH,
    RECOMMENDED,
    REQUIRED,
    USE_REENTRANT,
    Facts,
    PluginInfo,
    Rule,
    Stage,
    Vote,
    hookimpl,
)

_RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "PPOTrainer", "OnlineDPOTrainer")

RULES = (
    Rule(
        "T1",
        "below transformers 5, TRL trainers default to non-reentrant (a recommendation: the user's"
        " value is kept)",
        "trl/trainer/sft_trainer.py (1.16.0: setdefault('use_reentrant', False))",
        "transformers<5",
    ),
    Rule(
        "T2",
        "PEFT + ZeRO-3: TRL forces reentrant; gcpatch applies it only where DeepSpeed lacks the fix"
        " (R3)",
        "trl/trainer/grpo_trainer.py (1.16.0), trl#2514",
        documents=True,
    ),
    Rule(
        "T3",
        "PEFT + checkpointing: TRL calls enable_input_require_grads itself; harmless with either"
        " choice",
        "trl/trainer/sft_trainer.py (1.16.0), transformers#42489",
        documents=True,
    ),
    Rule(
        "T4",
        "reentrant + ddp_find_unused_parameters fails; decided by R4 when DDP is built",
        "trl#4782",
        documents=True,
    ),
    Rule(
        "R4-RL",
        "RL trainer + QLoRA over several processes + reentrant -> non-reentrant",
        "Axolotl A4 (utils/schemas/validation.py), trl#3089",
    ),
)

INFO = PluginInfo(
    name="trl", framework="trl", versions=">=0.12", rules=RULES, proven=">=0.12,<=1.16.0"
)


@hookimpl
def gcpatch_plugin_info() -> PluginInfo:
    return INFO


@hookimpl
def gcpatch_patch_points() -> list:
    return []


@hookimpl
def gcpatch_vote(facts: Facts) -> list[Vote]:
    if facts.stage != Stage.ENABLE or not facts.trainer.startswith("trl."):
        return []
    votes = []
    if facts.major("transformers") < 5:
        votes.append(
            Vote(
                USE_REENTRANT,
                False,
                RECOMMENDED,
                "T1",
                "TRL's default below transformers 5",
                short="TRL's default",
            )
        )
    rl = facts.trainer.rsplit(".", 1)[-1] in _RL_TRAINERS
    if rl and facts.kbit and facts.peft and facts.world_size > 1:
        votes.append(
            Vote(
                USE_REENTRANT,
                False,
                REQUIRED,
                "R4-RL",
                f"{facts.trainer.rsplit('.', 1)[-1]} with QLoRA over {facts.world_size} processes: "
                "reentrant is broken upstream",
                avoids=CRASH,
                short="RL + QLoRA over processes crashes",
            )
        )
    return votes
