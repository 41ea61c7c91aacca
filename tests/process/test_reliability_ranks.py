"""Rank agreement under torchrun + gloo on CPU, 2 and 4 ranks, a fault injected on one rank
(FAULT_RANK=1), R4's set-up: DDP(find_unused_parameters=True) around a model checkpointed with
use_reentrant=True.

- a plugin vote that fails on one rank: dropped there, so every rank still applies R4 and trains
  with gradients equal to the unCheckpointed reference;
- a failure inside gcpatch on one rank (apply), which fails open there only: every rank stops at
  DDP construction with the same GcpatchError naming the ranks and the failure, instead of DDP's
  crash or a hang;
- strict mode, a vote that fails on one rank at the DDP re-decision (the user asked non-reentrant,
  so nothing else raises): every rank raises the same error, no rank is left waiting.
"""

from __future__ import annotations

import pytest
from testkit.faultkit import FAULTS, install_fault_plugin, rank_results, tally, torchrun
from testkit.subproc import requires_transformers

pytestmark = [requires_transformers, pytest.mark.distributed]
HANG_S = 180  # a split that hangs DDP shows as a timeout, never blocks the suite


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_fault_plugin(tmp_path_factory.mktemp("faulty") / "site")


def _launch(site, tmp_path, nproc, hook, **env):
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun(
        FAULTS / "ddp_fault.py",
        nproc,
        tmp_path,
        timeout=HANG_S,
        GCPATCH="1",
        PYTHONPATH=site,
        FAULT_HOOK=hook,
        FAULT_RANK="1",
        RESULT_DIR=str(out),
        **env,
    )
    return proc, rank_results(out)


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_vote_failing_on_one_rank_leaves_every_rank_on_r4(site, tmp_path, nproc):
    proc, ranks = _launch(site, tmp_path, nproc, "vote")
    survived = (
        proc.returncode == 0 and len(ranks) == nproc and all(r["error"] is None for r in ranks)
    )
    same = survived and all(r["use_reentrant"] == ["False"] for r in ranks)
    lost = not survived or any(r["max_grad_err"] is None or r["max_grad_err"] > 1e-5 for r in ranks)
    warned = proc.stderr.count("plugin faulty dropped from this decision")
    tally("ranks", f"{nproc} ranks, vote fault on rank 1", survived, same and warned >= 1, lost)
    assert survived, (proc.returncode, ranks, proc.stderr[-3000:])
    assert same and not lost, ranks
    assert warned >= 1, proc.stderr[-3000:]


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_failure_open_on_one_rank_stops_every_rank_with_one_error(site, tmp_path, nproc):
    proc, ranks = _launch(site, tmp_path, nproc, "apply")
    no_hang = proc.returncode is not None and len(ranks) == nproc
    errors = {r["error"] for r in ranks}
    one_error = len(errors) == 1 and next(iter(errors), "").startswith(
        "GcpatchError: [gcpatch:ranks]"
    )
    text = next(iter(errors), "") or ""
    clear = (
        one_error and "rank(s) 1: use_reentrant=True" in text and "injected fault in apply" in text
    )
    tally("ranks", f"{nproc} ranks, gcpatch fails open on rank 1", no_hang, clear, False)
    assert no_hang, (proc.returncode, ranks, proc.stderr[-3000:])
    assert clear, ranks


def test_strict_error_on_one_rank_is_raised_on_every_rank(site, tmp_path):
    # the user asks non-reentrant, so R4 agrees and only the injected fault can raise
    proc, ranks = _launch(site, tmp_path, 4, "vote_ddp", GCPATCH_MODE="strict", ASK_REENTRANT="0")
    no_hang = proc.returncode is not None and len(ranks) == 4
    errors = {r["error"] for r in ranks}
    text = next(iter(errors), "") or ""
    clear = (
        len(errors) == 1
        and "stopped every rank" in text
        and "rank 1:" in text
        and "injected fault" in text
    )
    tally("ranks", "4 ranks, strict error on rank 1", no_hang, clear, False)
    assert no_hang, (proc.returncode, ranks, proc.stderr[-3000:])
    assert clear, ranks
