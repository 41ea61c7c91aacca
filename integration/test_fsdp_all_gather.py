"""F2: reentrant recompute that encloses FSDP's unshard all-gathers again in backward
(transformers#30404, pytorch#105635), counted on 2 gloo CPU ranks (integration/scripts/fsdp_all_gather.py:
FSDP1 FULL_SHARD, and FSDP2 with forward prefetch, each decoder layer its own unit, a 2-layer Llama).

Where the checkpoint sits depends on the release (transformers/modeling_layers.py):
- before 4.52 ("loop": Llama's loop checkpoints the wrapped layer's `__call__`): plain reentrant makes
  FSDP1 all-gather each unit twice, and FSDP2 run its forward prefetch again;
- 4.52-5.22 ("layer_call": GradientCheckpointingLayer checkpoints `nn.Module.__call__`): FSDP2's hooks
  are inside the checkpoint (prefetch again), FSDP1's wrapper outside (no extra);
- 5.23+ ("layer_forward": only `forward` is checkpointed): no extra under either.
Where plain reentrant costs extra, gcpatch (F2) runs non-reentrant: as many all-gathers as without
checkpointing; an explicit reentrant ask is kept (it is correct) and the record tells the cost. Where it
costs nothing, F2 stays out. Every gradient equals the unsharded no-checkpointing run's in every run.
"""

from __future__ import annotations

import pytest
from _asserts import assert_installed_gcpatch_ran, assert_plain, winner
from _run import TRANSFORMERS, Spec
from packaging.version import Version

pytestmark = pytest.mark.distributed

SCRIPT = "fsdp_all_gather.py"
LAUNCH = "torchrun2"
LAYERS = 2
SITE = (
    "loop"
    if TRANSFORMERS < Version("4.52")
    else "layer_call"
    if TRANSFORMERS < Version("5.23")
    else "layer_forward"
)
# extra backward all-gathers of plain reentrant over no checkpointing, per FSDP, at this release's site
EXTRA = {
    "1": LAYERS if SITE == "loop" else 0,
    "2": LAYERS - 1 if SITE in ("loop", "layer_call") else 0,
}
KINDS = ("1", "2")


def _runs(kind: str) -> list[Spec]:
    """The runs this release's tests read (each costs three interpreters): plain reentrant, plain
    default and no checkpointing always; with gcpatch the default and an explicit reentrant where
    reentrant costs extra, the explicit reentrant alone where it does not."""
    plain = [
        Spec(SCRIPT, ("--fsdp", kind, "--ask", ask), gcpatch=False, launcher=LAUNCH)
        for ask in ("none", "true", "nogc")
    ]
    asks = ("none", "true") if EXTRA[kind] else ("true",)
    return plain + [Spec(SCRIPT, ("--fsdp", kind, "--ask", ask), launcher=LAUNCH) for ask in asks]


RUNS = [spec for kind in KINDS for spec in _runs(kind)]
costly = [
    pytest.param(
        k,
        marks=pytest.mark.skipif(
            not EXTRA[k],
            reason=f"transformers {TRANSFORMERS}: the checkpoint ({SITE}) does not enclose FSDP{k}'s unshard",
        ),
    )
    for k in KINDS
]
free = [
    pytest.param(
        k,
        marks=pytest.mark.skipif(
            bool(EXTRA[k]),
            reason=f"transformers {TRANSFORMERS}: the checkpoint ({SITE}) encloses FSDP{k}'s unshard",
        ),
    )
    for k in KINDS
]


def _run(script_runs, kind, ask, gcpatch):
    run = script_runs.get(
        SCRIPT, "--fsdp", kind, "--ask", ask, gcpatch=gcpatch, launcher=LAUNCH, exit_ok=False
    )
    assert len(run.results) == 2, run.describe()
    assert run.exited_cleanly(), run.describe()
    for r in run.results:
        assert r["wrong"] == 0 and r["trainable"] == 21, r[
            "wrong_names"
        ]  # every gradient exact, every run
        assert r["checkpoint_site"] == SITE
    return run


def _backward(run) -> list[int]:
    return [r["backward_all_gathers"] for r in run.results]


def _last_enable(run) -> dict:
    return [rec for rec in run.records() if rec.get("stage") == "enable"][-1]


@pytest.mark.parametrize("kind", KINDS, ids=["fsdp1", "fsdp2-prefetch"])
def test_plain_reentrant_all_gathers_as_the_checkpoint_site_predicts(script_runs, kind):
    plain = _run(script_runs, kind, "true", False)
    assert_plain(plain)
    without = _backward(_run(script_runs, kind, "nogc", False))
    assert [a - b for a, b in zip(_backward(plain), without)] == [EXTRA[kind]] * 2, (
        _backward(plain),
        without,
    )
    # no kwargs: transformers 4.x runs reentrant (use_reentrant=True, or on 4.35 torch's own default), 5.x not
    default = _run(script_runs, kind, "none", False)
    assert all(
        r["applied_use_reentrant"] in ((True, "unset") if TRANSFORMERS.major < 5 else (False,))
        for r in default.results
    )
    extra = EXTRA[kind] if TRANSFORMERS.major < 5 else 0
    assert [a - b for a, b in zip(_backward(default), without)] == [extra] * 2


@pytest.mark.parametrize("kind", costly, ids=["fsdp1", "fsdp2-prefetch"])
def test_gcpatch_all_gathers_as_without_checkpointing(script_runs, kind):
    run = _run(script_runs, kind, "none", True)
    assert_installed_gcpatch_ran(run)
    assert all(r["applied_use_reentrant"] is False for r in run.results)
    assert _backward(run) == _backward(_run(script_runs, kind, "nogc", False))
    last = _last_enable(run)
    assert winner(last) == "F2" and last["facts"]["fsdp"] == f"fsdp{kind}"
    assert last["facts"]["checkpoint_site"] == SITE


@pytest.mark.parametrize("kind", costly, ids=["fsdp1", "fsdp2-prefetch"])
def test_an_explicit_reentrant_ask_is_kept_and_told_the_cost(script_runs, kind):
    plain = _run(script_runs, kind, "true", False)
    run = _run(script_runs, kind, "true", True)
    assert all(r["applied_use_reentrant"] is True for r in run.results)
    assert _backward(run) == _backward(plain)  # the cost the user chose, nothing else changed
    last = _last_enable(run)
    assert winner(last) == "USER"
    told = [w for w in last["decision"]["warnings"] if w.startswith("F2:")]
    assert told and "is kept" in told[0] and "transformers#30404" in told[0], last["decision"][
        "warnings"
    ]


@pytest.mark.parametrize("kind", free, ids=["fsdp1", "fsdp2-prefetch"])
def test_where_reentrant_costs_nothing_f2_stays_out(script_runs, kind):
    run = _run(script_runs, kind, "true", True)
    assert all(r["applied_use_reentrant"] is True for r in run.results)
    assert _backward(run) == _backward(_run(script_runs, kind, "nogc", False))
    for rec in run.records():
        decision = rec.get("decision", {})
        named = (
            [v["rule"] for v in decision.get("winners", {}).values()]
            + [v["rule"] for v in decision.get("overruled", [])]
            + [w.split(":")[0] for w in decision.get("warnings", [])]
        )
        assert "F2" not in named, rec
