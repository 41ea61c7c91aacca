"""What a user sees on the console, under every launcher available on CPU, with no logging
set-up of their own: each decision's short line (under 120 characters: what changed and the rule,
gcpatch/headline.py), said once per job however many ranks run (gcpatch/console.py), while the
record keeps every rank. Launchers: a plain script, the Trainer, TRL's SFTTrainer, torchrun (2
ranks, gloo), accelerate launch (2 CPU processes), the deepspeed launcher (one CPU rank) and the
Axolotl CLI (its own test module, test_axolotl.py, where Axolotl is installed)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
from _run import (
    DECISION_LINE,
    SCRIPTS,
    V5,
    Run,
    Spec,
    child_env,
    free_port,
    harness_run,
    outside_plugin_range,
)

LIMIT = 120


def _run(tmp_path: Path, name: str, argv: list[str], **env: str) -> Run:
    workdir = tmp_path / name
    workdir.mkdir()
    record_dir = workdir / "gcpatch-record"
    start = time.monotonic()
    proc = harness_run(
        argv, workdir, child_env(GCPATCH="1", GCPATCH_RECORD=str(record_dir), **env), 600, warm=True
    )
    return Run(
        Spec(name), proc.returncode, proc.stdout, proc.stderr, record_dir, time.monotonic() - start
    )


def console_lines(run: Run) -> list[str]:
    """The decision lines the user saw: stdout and stderr (a launcher may merge them)."""
    return [
        line for line in (run.stdout + "\n" + run.stderr).splitlines() if DECISION_LINE.match(line)
    ]


def assert_each_decision_said_once(run: Run, ranks: int) -> list[str]:
    """Every rank recorded its decisions; the console shows each distinct line exactly once, short."""
    assert run.returncode == 0, run.describe()
    by_rank = run.records_by_rank()
    assert sorted(by_rank) == list(range(ranks)), (sorted(by_rank), run.describe())
    decided = [
        [r for r in entries if r.get("stage") in ("enable", "first_forward", "config", "call")]
        for entries in by_rank.values()
    ]
    assert all(decided), run.describe()
    assert len({len(d) for d in decided}) == 1, [
        len(d) for d in decided
    ]  # every rank decided as often
    lines = console_lines(run)
    assert lines, run.describe()
    assert len(lines) == len(set(lines)), "\n".join(lines)  # once per job, not once per rank
    assert all(len(line) <= LIMIT for line in lines), "\n".join(lines)
    assert "rank 1" not in run.stderr, run.stderr[-3000:]  # no other rank spoke (no line differs)
    return lines


def test_plain_script_shows_one_short_line(tmp_path):
    run = _run(tmp_path, "plain", [sys.executable, str(SCRIPTS / "frozen_llama.py")])
    lines = assert_each_decision_said_once(run, 1)
    assert lines == [
        "gcpatch: LlamaForCausalLM: use_reentrant=True as asked, exact through the input-grads hook "
        "(R2: frozen upstream)"
    ], run.stderr
    # the asked value, the facts and every vote are in the record and in `explain -v`, not on the console
    rec = [r for r in run.records() if r.get("stage") == "enable"][-1]
    assert rec["asked"]["use_reentrant"] is True and rec["facts"]["frozen_params"] > 0
    assert (
        "frozen and" not in run.stderr
    )  # the long reason (R1's overruled recommendation) is not printed
    short = run.explain(verbose=False).stdout
    assert short.splitlines() == lines, short
    assert (
        "overruled: R1 (recommended) wanted use_reentrant=False" in run.explain().stdout
    )  # -v: every vote


def test_trainer_shows_its_line(tmp_path):
    run = _run(tmp_path, "trainer", [sys.executable, str(SCRIPTS / "frozen_llama_trainer.py")])
    lines = assert_each_decision_said_once(run, 1)
    # 5.x: the framework's non-reentrant default, R1 agreeing; 4.x: its reentrant default changed
    said = (
        "'s default (R1 agrees)"
        if V5
        else " (trainer): use_reentrant True (default) -> False (R1: "
    )
    assert any(said in line for line in lines), run.stderr


def test_trl_sft_trainer_shows_its_lines(tmp_path):
    if outside_plugin_range("trl") or importlib.util.find_spec("peft") is None:
        pytest.skip(outside_plugin_range("trl") or "peft not installed")
    run = _run(tmp_path, "trl", [sys.executable, str(SCRIPTS / "trl_peft.py"), "--trainer", "sft"])
    lines = assert_each_decision_said_once(run, 1)
    assert any("use_reentrant" in line for line in lines), run.stderr


@pytest.mark.distributed
def test_torchrun_two_ranks_print_each_line_once_and_record_both(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(SCRIPTS / "ddp_unused.py"),
        "--frozen",
        "yes",
    ]
    run = _run(tmp_path, "torchrun", argv)
    lines = assert_each_decision_said_once(run, 2)
    # rank 1 decided the same (its record says so) and compared its lines with rank 0's: no warning
    ranks = run.records_by_rank()
    assert [r.get("applied") for r in ranks[0] if "applied" in r] == [
        r.get("applied") for r in ranks[1] if "applied" in r
    ]
    assert all(
        any(str(r.get("source")).startswith("DDP") for r in entries) for entries in ranks.values()
    )  # R4's re-decision
    # the user's reentrant, exact through the hook, stands until DDP(find_unused_parameters=True) wraps the
    # model: the rule acting there is R4, and its line credits it (not R1 a second time)
    # the user asked for reentrant: R4 over that ask, its reason and how to keep the ask on one
    # line (wrapped into a second row where one row cannot hold them)
    assert len(lines) == 2 and lines[1].startswith(
        "gcpatch: LlamaForCausalLM (DDP): R4 overrules your use_reentrant=True -> False ("
    ), "\n".join(lines)
    whole = " ".join(m for m in run.messages() if m.startswith(lines[1]))
    assert "processes would crash" in whole and "GCPATCH_MODE=warn keeps it" in whole, whole
    assert "decided differently" not in run.stderr


@pytest.mark.distributed
def test_torchrun_redecision_at_ddp_wrap_is_said_once(tmp_path):
    """All parameters train: the user's reentrant stands until DDP(find_unused_parameters=True) wraps
    the model, where R4 changes it: two lines, each once, the second naming DDP."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(SCRIPTS / "ddp_unused.py"),
        "--frozen",
        "no",
    ]
    run = _run(tmp_path, "torchrun-r4", argv)
    lines = assert_each_decision_said_once(run, 2)
    assert any(
        line.startswith("gcpatch: LlamaForCausalLM (DDP): R4 overrules your use_reentrant=True")
        for line in lines
    ), "\n".join(lines)


@pytest.mark.distributed
def test_torchrun_plain_would_print_every_line_per_rank(tmp_path):
    """The same run with GCPATCH_LOG=debug (every rank says everything): twice the lines, which is
    what the once-per-job default removes."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(SCRIPTS / "ddp_unused.py"),
        "--frozen",
        "yes",
    ]
    run = _run(tmp_path, "torchrun-debug", argv, GCPATCH_LOG="debug")
    assert run.returncode == 0, run.describe()
    lines = console_lines(run)
    assert len(lines) == 2 * len(set(lines)), "\n".join(lines)


@pytest.mark.distributed
def test_accelerate_launch_two_processes(tmp_path):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate not installed")
    # --multi_gpu on a machine without GPUs: accelerate starts the processes through torch.distributed.run
    # (its --cpu multi-process path needs mpirun); the script itself runs gloo on CPU
    argv = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
        str(SCRIPTS / "ddp_unused.py"),
        "--frozen",
        "yes",
    ]
    run = _run(tmp_path, "accelerate", argv, CUDA_VISIBLE_DEVICES="")
    assert_each_decision_said_once(run, 2)


def test_deepspeed_launcher(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed (tox env ds0193)")
    if outside_plugin_range("peft"):
        pytest.skip(outside_plugin_range("peft"))
    argv = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "1",
        "--no_local_rank",
        "--master_port",
        str(free_port()),
        str(SCRIPTS / "zero3_lora.py"),
        "--reentrant",
        "true",
    ]
    # the launcher's ranks JIT-build DeepSpeed's shared-memory comm op on CPU: in a directory of this
    # test's own, so a build lock another job left behind in ~/.cache/torch_extensions cannot hang it
    run = _run(
        tmp_path,
        "deepspeed",
        argv,
        DS_ACCELERATOR="cpu",
        DS_BUILD_OPS="0",
        CUDA_VISIBLE_DEVICES="",
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"),
        PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    )
    lines = assert_each_decision_said_once(run, 1)
    assert any("use_reentrant" in line for line in lines), run.describe()
