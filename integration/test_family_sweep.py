"""A sample of the family sweep (docs/FAMILY_SWEEP.md, every causal-LM family transformers registers:
`python integration/_family_sweep.py --write`): families outside docs/FAMILIES.md's hand-built table,
built through the Auto classes from their own default configs shrunk, as a user's script reaches
them. Multi-head latent attention with experts (DeepSeek-V3), a linear-attention hybrid
(Qwen3-Next), a state-space model (Mamba), GPT-J's partial rotary. With gcpatch every set-up gets the
no-checkpointing gradients and eval mode checkpoints; the plain run shows the failures. (Falcon-H1,
the Mamba hybrid, is left out: on transformers 4.57 its tiny config's forward takes over 24 GiB.)
Three of them, and GPT-OSS, also train under GCPATCH_MEMORY_BUDGET=0.5 (`--budget`): GPT-OSS's experts
write into their grouped matmul's output, which keeping the matmuls cannot run over (the budget
once failed open there, every layer checkpointed whole); the lever is left out and the plan made.
"""

from __future__ import annotations

import pytest
from _family_sweep import CASES, exact
from _run import Spec

SCRIPT = "family_sweep.py"
SAMPLE = ("deepseek_v3", "qwen3_next", "mamba", "gptj")
BUDGET_ARGS = ("--budget", "deepseek_v3", "qwen3_next", "mamba", "gpt_oss")
BUDGET = 0.5
TOLERANCE = 0.05  # of a plan fitted at the first step's shape (docs/BUDGET.md)
BUDGET_ENV = {"GCPATCH_MEMORY_BUDGET": str(BUDGET)}
RUNS = [Spec(SCRIPT, SAMPLE), Spec(SCRIPT, BUDGET_ARGS, env=tuple(BUDGET_ENV.items()))]


def family(script_runs, name: str, gcpatch: bool) -> dict:
    fam = script_runs.get(SCRIPT, *SAMPLE, gcpatch=gcpatch).result["families"][name]
    if fam.get("unregistered"):
        pytest.skip(f"{name}: no causal LM of this type in the installed transformers")
    assert "unbuilt" not in fam, fam
    return fam


@pytest.mark.parametrize("name", SAMPLE)
def test_every_set_up_gets_the_no_checkpointing_gradients(script_runs, name):
    fam, plain = family(script_runs, name, True), family(script_runs, name, False)
    for case in CASES:
        if "unrun" in fam[case]:
            # PEFT refuses LoRA on Mamba's out_proj, with or without gcpatch
            assert case == "lora" and "unrun" in plain[case], (case, fam[case], plain[case])
            continue
        assert exact(fam[case]) and fam[case]["with_grad"] > 0, (case, fam[case])


@pytest.mark.parametrize("name", SAMPLE)
def test_the_plain_run_loses_gradients_that_gcpatch_keeps(script_runs, name):
    """The input path transformers' own input hook misses (R2): the sample can fail."""
    plain = family(script_runs, name, False)["frozen/inputs_embeds"]
    assert plain["wrong"] > 0, plain


@pytest.mark.parametrize("name", SAMPLE)
def test_eval_mode_checkpoints(script_runs, name):
    assert 0.9 <= family(script_runs, name, True)["eval"] <= 1.1
    assert family(script_runs, name, False)["eval"] > 1.1  # plain: eval mode skips it


@pytest.mark.parametrize("name", BUDGET_ARGS[1:])
def test_under_a_budget_every_step_is_exact_and_holds_it(script_runs, name):
    """The first step checkpoints every layer while gcpatch measures; the later ones run the plan:
    they hold more than that floor (fewer layers recompute) and at most the budget."""
    run = script_runs.get(SCRIPT, *BUDGET_ARGS, gcpatch=True, env=BUDGET_ENV)
    fam = run.result["families"][name]
    if fam.get("unregistered"):
        pytest.skip(f"{name}: no causal LM of this type in the installed transformers")
    case = fam["budget"]
    assert case["error"] is None and case["wrong"] == [0, 0, 0], case
    floor, *later = case["held_fraction"]
    assert all(floor < held <= BUDGET * (1 + TOLERANCE) for held in later), case
    planned = [e for e in run.records() if e.get("stage") == "budget" and e["budget"].get("plan")]
    registered = [f for f in run.result["families"].values() if not f.get("unregistered")]
    assert len(planned) == len(registered), [e.get("line") for e in run.records()]
