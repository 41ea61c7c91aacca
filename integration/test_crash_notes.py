"""Crash explanations: each known checkpointing crash, reproduced by an unchanged user script,
plain and under GCPATCH=1. Under gcpatch the same exception (type, message, the frames it was
raised through; gcpatch's wrapper adds only its own frame) carries one note naming the likely
cause, the rule, what gcpatch decided and the fix; it is recorded and `gcpatch explain` shows it."""

from __future__ import annotations

import pytest
from _asserts import assert_explained, assert_installed_gcpatch_ran, assert_plain
from _run import V5, Spec

SCRIPT = "crash_families.py"
# family -> (gcpatch's variables, expected exception type, words of its message, rule named, what
# gcpatch decided)
CASES = {
    "recompute": (
        {"GCPATCH_MODE": "fix"},
        "torch.utils.checkpoint.CheckpointError",
        "A different number of tensors was saved",
        "R5",
        "applied use_reentrant=False",
    ),
    # the hidden states reach the checkpoint by keyword, which CK1 would pass positionally; with the
    # torch plugin blocked no call-site rule sees it, and the set-up crashes as it would plainly
    "no_grad": (
        {"GCPATCH_MODE": "warn", "GCPATCH_DISABLE_PLUGINS": "torch"},
        "builtins.RuntimeError",
        "element 0 of tensors does not require grad",
        "CK1",
        "applied use_reentrant=True",
    ),
    "twice": (
        {"GCPATCH_MODE": "fix"},
        "builtins.RuntimeError",
        "Trying to backward through the graph a second time",
        "R6",
        # the framework's default kept (no rule finds it wrong): 5.x non-reentrant, 4.x reentrant
        f"applied use_reentrant={not V5}",
    ),
}
FAMILY_IDS = {
    "recompute": "recompute_mismatch",
    "no_grad": "loss_without_grad",
    "twice": "backward_twice",
    "ddp": "ddp_ready_twice",
}
RUNS = [
    Spec(SCRIPT, ("--family", f), env=tuple(sorted(env.items()))) for f, (env, *_) in CASES.items()
] + [Spec(SCRIPT, ("--family", "ddp"), env=(("GCPATCH_MODE", "warn"),), launcher="torchrun2")]


def assert_explained_crash(
    run, plain, family: str, error_type: str, words: str, rule: str, decided: str
) -> None:
    assert_installed_gcpatch_ran(run)
    assert_plain(plain)
    for r in (run.result, plain.result):
        assert r["error_type"] == error_type, r
        assert words in r["message"], r["message"]
    assert run.result["message"] == plain.result["message"]
    assert plain.result["notes"] == []
    # the same frames: gcpatch's wrappers of torch.autograd.backward (crash notes, the CK6 patch point) are the only ones added
    ours = ("crash_notes.py:", "reentrant_grads.py:", "patching.py:")
    assert [f for f in run.result["frames"] if not f.startswith(ours)] == plain.result["frames"]
    notes = run.result["notes"]
    assert len(notes) == 1, notes
    note = notes[0]
    assert note.startswith(f"gcpatch [{FAMILY_IDS[family]}]:"), note
    for part in ("likely cause:", "rule:", "gcpatch decided:", "fix:", rule, decided):
        assert part in note, (part, note)
    crash = [e for e in run.records() if e.get("stage") == "crash"]
    assert len(crash) == len(run.results), crash  # one per rank
    assert crash[0]["family"] == FAMILY_IDS[family] and words in crash[0]["error"]
    assert_explained(run, f"crash explained [{FAMILY_IDS[family]}]", "gcpatch decided:", rule)
    assert "crash explained" not in run.stderr  # the script caught it: the note, no ERROR line


@pytest.mark.parametrize("family", sorted(CASES))
def test_crash_is_explained_on_the_unchanged_exception(script_runs, family):
    env, error_type, words, rule, decided = CASES[family]
    run = script_runs.get(SCRIPT, "--family", family, gcpatch=True, env=env)
    plain = script_runs.get(SCRIPT, "--family", family, gcpatch=False)
    assert_explained_crash(run, plain, family, error_type, words, rule, decided)


@pytest.mark.distributed
def test_ddp_mark_ready_twice_is_explained_on_every_rank(script_runs):
    """warn mode keeps reentrant under DDP(find_unused_parameters=True): R4 would have fixed it."""
    env = {"GCPATCH_MODE": "warn"}
    run = script_runs.get(
        SCRIPT, "--family", "ddp", gcpatch=True, env=env, launcher="torchrun2", exit_ok=False
    )
    plain = script_runs.get(
        SCRIPT, "--family", "ddp", gcpatch=False, launcher="torchrun2", exit_ok=False
    )
    assert [r["rank"] for r in run.results] == [0, 1]
    assert_explained_crash(
        run,
        plain,
        "ddp",
        "builtins.RuntimeError",
        "Expected to mark a variable ready only once",
        "R4",
        "warn mode keeps the user's value",
    )
    assert run.results[1]["notes"] == run.results[0]["notes"]
