"""gcpatch/console.py: who says a decision line, and that it shows on the console whatever the host
configured, printed once. Each case runs in a fresh interpreter (logging is process-wide state)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from testkit.harness import messages

PRELUDE = """
import io, json, logging, os, sys
from gcpatch import console
console.install("info")
log = logging.getLogger("gcpatch")
def say(line, identity="M.enable/enable/call"):
    console.say(line, "detail of " + line, identity)
"""


def run(body: str, **env: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    clean = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RANK", "LOCAL_RANK", "GCPATCH")
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def lines(text: str, word: str = "gcpatch: ") -> list[str]:
    return [line for line in messages(text) if word in line]


def test_no_host_logging_prints_once_on_stderr():
    proc = run(
        "say('gcpatch: M: use_reentrant True -> False (R1: x)'); say('gcpatch: M: use_reentrant True -> False (R1: x)')"
    )
    assert lines(proc.stderr) == ["gcpatch: M: use_reentrant True -> False (R1: x)"], proc.stderr
    assert "detail of" not in proc.stderr  # the details are DEBUG


def test_basic_config_at_info_shows_it_once_through_the_hosts_handler():
    proc = run(
        "logging.basicConfig(level=logging.INFO, format='HOST %(message)s'); say('gcpatch: M: a (R1: x)')"
    )
    assert lines(proc.stderr) == ["HOST gcpatch: M: a (R1: x)"], proc.stderr


def test_host_handler_that_hides_info_gets_ours_and_is_left_as_it_was():
    """Axolotl's set-up: a root console handler whose filter drops other libraries' INFO."""
    proc = run("""
        class WarnOnly(logging.Filter):
            def filter(self, record):
                return record.levelno >= logging.WARNING or record.name.startswith("host")
        handler = logging.StreamHandler(sys.stdout)
        handler.addFilter(WarnOnly())
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.WARNING)
        say('gcpatch: M: a (R1: x)')
        console.warn('gcpatch: M: R1 overrules your use_reentrant=True')
        root = logging.getLogger()
        print(json.dumps([root.level, len(root.handlers), len(handler.filters)]))
    """)
    assert lines(proc.stderr) == ["gcpatch: M: a (R1: x)"], proc.stderr  # ours: the host hides INFO
    assert lines(proc.stdout) == ["gcpatch: M: R1 overrules your use_reentrant=True"], (
        proc.stdout
    )  # the host's
    assert json.loads(proc.stdout.splitlines()[-1]) == [
        30,
        1,
        1,
    ]  # the host's configuration untouched


def test_a_file_only_host_handler_does_not_count_as_the_console(tmp_path):
    proc = run(
        f"logging.basicConfig(level=logging.INFO, filename={str(tmp_path / 'host.log')!r}); say('gcpatch: M: a (R1: x)')"
    )
    assert lines(proc.stderr) == ["gcpatch: M: a (R1: x)"], proc.stderr
    assert (
        "gcpatch: M: a (R1: x)" in (tmp_path / "host.log").read_text()
    )  # and the host's file has it too


def test_dict_config_disabling_existing_loggers_does_not_silence_gcpatch():
    proc = run("""
        import logging.config
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": True})
        say('gcpatch: M: a (R1: x)')
    """)
    assert lines(proc.stderr) == ["gcpatch: M: a (R1: x)"], proc.stderr


@pytest.mark.parametrize(
    "env,said",
    [
        ({"LOCAL_RANK": "0", "RANK": "0"}, True),
        ({"LOCAL_RANK": "1", "RANK": "1"}, False),
        ({"RANK": "3"}, False),
        ({}, True),
    ],
)
def test_only_local_rank_zero_says_it(env, said):
    proc = run("say('gcpatch: M: a (R1: x)')", **env)
    assert bool(lines(proc.stderr)) is said, proc.stderr


def test_another_rank_warns_when_its_line_differs_from_rank_zeros():
    """Through a real c10d store (the process group's, in a job): rank 0 publishes, rank 1 compares
    without waiting, at its decision or later (agreement.py calls `exchange` at DDP construction)."""
    pytest.importorskip("torch")
    proc = run("""
        import torch.distributed as dist
        store = dist.HashStore()
        os.environ.update(RANK="0", LOCAL_RANK="0")
        say("gcpatch: M: use_reentrant True -> False (R1: x)")
        say("gcpatch: M: input-grads hook (R2: y)", identity="M.enable/enable/trainer")
        console.exchange(store)
        console.forget()
        os.environ.update(RANK="1", LOCAL_RANK="1")
        say("gcpatch: M: use_reentrant True -> False (R1: x)")      # the same as rank 0's: quiet
        say("gcpatch: M: use_reentrant=True as asked", identity="M.enable/enable/trainer")  # differs
        say("gcpatch: M: later (R6: z)", identity="M.enable/first_forward/call")  # rank 0 has not said it yet
        console.exchange(store)
    """)
    warned = lines(proc.stderr, "decided differently")
    assert warned == [
        "gcpatch: rank 1 decided differently from rank 0: gcpatch: M: use_reentrant=True as asked "
        "(rank 0: gcpatch: M: input-grads hook (R2: y))"
    ], proc.stderr
    # (a release outside a plugin's range adds its one "plugin ... skipped" line: not a decision)
    said = [line for line in lines(proc.stderr) if not line.startswith("gcpatch: plugin ")]
    assert (
        said
        == [
            "gcpatch: M: use_reentrant True -> False (R1: x)",
            "gcpatch: M: input-grads hook (R2: y)",
        ]
        + warned
    ), proc.stderr


def _entry(**changes):
    winners = {
        "use_reentrant": {"rule": "R1", "reason": "x" * 300 + ": long", "short": "frozen upstream"},
        "input_grads_hook": {"rule": "R2", "reason": "hook"},
        "eval_mode_fix": {"rule": "R5", "reason": "eval"},
    }
    entry = {
        "rank": 0,
        "stage": "enable",
        "model": "M" * 40,
        "api": "enable",
        "source": "call",
        "asked": {"use_reentrant": True, "from": "the user"},
        "applied": {"use_reentrant": False, "input_grads_hook": True, "eval_mode_fix": 2},
        "why": {},
        "decision": {"winners": winners, "overruled": [], "warnings": [], "conflicts": []},
    }
    entry.update(changes)
    return entry


def test_headline_says_what_changed_and_the_rule_within_120_characters():
    from gcpatch import headline

    line = headline.line(_entry())
    assert line.startswith(
        "gcpatch: " + "M" * 40 + ": use_reentrant True -> False (R1: frozen upstream)"
    ), line
    rows = line.split("\n")
    assert len(rows) <= 2 and all(len(row) <= 120 for row in rows), line  # wrapped, never cut
    long_source = headline.line(
        _entry(source="DDP(find_unused_parameters=True) (R4)", model="/a/b/tiny/")
    )
    # one row holds every action once the reasons give way; two rows keep the first change's
    assert headline.unwrap(long_source) == (
        "gcpatch: tiny (DDP): use_reentrant True -> False (R1: frozen upstream); input-grads hook"
        " (R2); 2 eval-mode layers checkpoint anyway (R5)"
    ), long_source
    no_short = _entry()
    no_short["decision"]["winners"]["use_reentrant"].pop("short")
    rows = headline.line(no_short).split("\n")  # a 300-character reason gives way whole
    assert len(rows) <= 2 and all(len(row) <= 120 for row in rows), rows
    said = headline.unwrap("\n".join(rows))
    assert "x" * 20 not in said and said.endswith("eval-mode layers checkpoint anyway (R5)"), said
