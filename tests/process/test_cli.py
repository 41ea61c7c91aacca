"""The `gcpatch` command as a newcomer meets it: `--version`, a reader that stops early (`| head`),
a rule table that is empty for a reason, `explain` on two runs in one directory and on a file
that is not a record, and a record directory behind someone else's symlink."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from gcpatch import record
from gcpatch.commands import cli

GCPATCH = [sys.executable, "-m", "gcpatch"]
ALL_PLUGINS = "torch,transformers,peft,trl,deepspeed,ddp,axolotl,colossalai,fsdp"


def _entry(pid, when, rank=0):
    return {
        "time": when,
        "pid": pid,
        "rank": rank,
        "world_size": 1,
        "stage": "enable",
        "model": "M",
        "api": "enable",
        "source": "call",
        "asked": {"use_reentrant": True, "from": "the user"},
        "applied": {"use_reentrant": False},
        "rules": ["R1"],
        "why": {"use_reentrant": "R1: frozen"},
        "decision": {
            "mode": "fix",
            "values": {"use_reentrant": False},
            "rules": ["R1"],
            "winners": {
                "use_reentrant": {
                    "knob": "use_reentrant",
                    "value": False,
                    "strength": "required",
                    "rule": "R1",
                    "reason": "frozen",
                }
            },
            "overruled": [],
            "conflicts": [],
            "warnings": [],
        },
    }


def _closed_reader(args, cwd, **env):
    """`args` with stdout a pipe whose reader is gone before anything is written (`| head`, at worst)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            args,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env={**os.environ, **env},
            timeout=120,
        )
    finally:
        os.close(write)
    return proc


def test_version():
    out = subprocess.run([*GCPATCH, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"gcpatch {metadata.version('gcpatch')}"


@pytest.mark.parametrize("command", ["rules", "explain"])
def test_a_closed_pipe_ends_quietly(tmp_path, command):
    (tmp_path / "gcpatch-rank0.jsonl").write_text(
        "".join(json.dumps(_entry(1, 1.0 + i)) + "\n" for i in range(500))
    )
    args = [*GCPATCH, command] + ([str(tmp_path)] if command == "explain" else [])
    proc = _closed_reader(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_an_empty_rule_table_says_why(tmp_path):
    proc = subprocess.run(
        [*GCPATCH, "rules"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "GCPATCH_DISABLE_PLUGINS": ALL_PLUGINS},
    )
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[1:] == []  # the header only
    assert (
        "no plugin is active" in proc.stderr
        and "torch: blocked (named in GCPATCH_DISABLE_PLUGINS)" in proc.stderr
    )


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_without_torch_the_rule_table_names_the_missing_framework(tmp_path):
    proc = subprocess.run([*GCPATCH, "rules"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0
    assert "no plugin is active" in proc.stderr and "torch: skipped" in proc.stderr, proc.stderr


def test_explain_separates_two_runs_in_one_directory(tmp_path, capsys):
    lines = [_entry(111, 1000.0), _entry(111, 1001.0), _entry(222, 5000.0)]
    (tmp_path / "gcpatch-rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert cli.main(["explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    headers = [i for i, line in enumerate(out) if line.startswith("-- run: pid ")]
    assert [out[i].split(",")[0] for i in headers] == ["-- run: pid 111", "-- run: pid 222"]
    assert headers[1] - headers[0] == 3  # run 111's two decisions lie between the headers


def test_one_run_needs_no_run_header(tmp_path, capsys):
    (tmp_path / "gcpatch-rank0.jsonl").write_text(json.dumps(_entry(1, 1.0)) + "\n")
    (tmp_path / "gcpatch-rank1.jsonl").write_text(json.dumps(_entry(2, 1.0, rank=1)) + "\n")
    assert cli.main(["explain", str(tmp_path)]) == 0
    assert "-- run" not in capsys.readouterr().out


@pytest.mark.parametrize("text", ["hello\n", '{"not": "a record"}\n'])
def test_explain_refuses_a_file_that_is_not_a_record(tmp_path, capsys, text):
    plain = tmp_path / "notes.txt"
    plain.write_text(text)
    assert cli.main(["explain", str(plain)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "is not a gcpatch record" in err and "damaged" not in err


def test_a_record_directory_behind_another_users_symlink_is_not_followed(tmp_path, monkeypatch):
    target = tmp_path / "theirs"
    target.mkdir()
    link = tmp_path / "shared"
    link.symlink_to(target)
    if os.geteuid() == 0:
        os.lchown(link, 4242, 4242)
    else:  # a link of ours read as another user's
        monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 4242)
    monkeypatch.setattr(record, "_unwritable", {})
    assert record._write({"rank": 0, "stage": "enable"}, str(link / "run")) is False
    assert list(target.iterdir()) == []
    # the one line it logged names the link (read from what it reported: other tests may have set
    # gcpatch's logger to a level caplog does not see)
    [(path, reason)] = record._unwritable.items()
    assert path == str(link / "run" / "gcpatch-rank0.jsonl")
    assert f"{link} is a symbolic link owned by another user" in reason, reason
    assert "which gcpatch never follows" in reason


def test_a_record_directory_behind_our_own_symlink_is_written(tmp_path, monkeypatch):
    target = tmp_path / "ours"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    assert record._write({"rank": 0, "stage": "enable"}, str(tmp_path / "link" / "run")) is True
    assert [p.name for p in (target / "run").iterdir()] == ["gcpatch-rank0.jsonl"]
