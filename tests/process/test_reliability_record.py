"""The record writer cannot hurt the host: GCPATCH_RECORD at an existing file, a directory that
cannot be written, a planted symlink (to a file, dangling), a FIFO, a directory in the file's
place, a non-ASCII path, a line truncated by a killed rank. The job trains in every case, each
failure is one line with the path and the reason, no file outside the record is touched, and
what gcpatch creates is private (0700 directory, 0600 file). `gcpatch explain` reads damaged
records: it skips and counts bad lines and names missing fields."""

from __future__ import annotations

import json
import os
import stat

import pytest
from testkit.faultkit import FAULTS, run, tally
from testkit.harness import parse_results
from testkit.subproc import requires_transformers

from gcpatch import cli, record

VICTIM_TEXT = "the user's own file\n"


def _hazards(base):
    """(case, GCPATCH_RECORD, check) where check(result) -> (clear, lost)."""
    cases = []

    def add(name, path, check):
        cases.append((name, str(path), check))

    def one_line_naming(path, reason):
        return lambda r: (
            len(r["lines"]) == 1 and str(path) in r["lines"][0] and reason in r["lines"][0]
        )

    existing = base / "a-file"
    existing.write_text(VICTIM_TEXT)
    # said once at start-up, on stderr, by the settings (the parent test counts that line)
    add(
        "record path is an existing file",
        existing,
        lambda r: (True, existing.read_text() != VICTIM_TEXT),
    )

    if os.geteuid() == 0:  # root writes through chmod: a place no one can create a directory in
        readonly = "/proc/1/gcpatch-records"
    else:
        readonly = base / "read-only"
        readonly.mkdir()
        readonly.chmod(0o555)
    add(
        "directory cannot be written",
        readonly,
        lambda r: (one_line_naming(readonly, "cannot write")(r), False),
    )

    linked = base / "linked"
    linked.mkdir()
    victim = base / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    (linked / "gcpatch-rank0.jsonl").symlink_to(victim)
    add(
        "rank file is a symlink to another file",
        linked,
        lambda r: (one_line_naming(linked, "symbolic link")(r), victim.read_text() != VICTIM_TEXT),
    )

    dangling = base / "dangling"
    dangling.mkdir()
    (dangling / "gcpatch-rank0.jsonl").symlink_to(base / "created-through-link.txt")
    add(
        "rank file is a dangling symlink",
        dangling,
        lambda r: (
            one_line_naming(dangling, "symbolic link")(r),
            (base / "created-through-link.txt").exists(),
        ),
    )

    isdir = base / "isdir"
    (isdir / "gcpatch-rank0.jsonl").mkdir(parents=True)
    add(
        "rank file is a directory",
        isdir,
        lambda r: (one_line_naming(isdir, "cannot write")(r), False),
    )

    fresh = base / "fresh" / "records"
    add(
        "directory created by gcpatch",
        fresh,
        lambda r: (
            r["lines"] == []
            and stat.S_IMODE(fresh.stat().st_mode) == 0o700
            and stat.S_IMODE((fresh / "gcpatch-rank0.jsonl").stat().st_mode) == 0o600,
            len(record.read(str(fresh))) != 1,
        ),
    )

    unicode = base / "récords-日本"
    add(
        "non-ASCII directory",
        unicode,
        lambda r: (r["lines"] == [], len(record.read(str(unicode))) != 1),
    )

    truncated = base / "truncated"
    truncated.mkdir()
    (truncated / "gcpatch-rank0.jsonl").write_text(
        '{"rank": 0, "stage": "enable", "time": 1}\n{"rank": 0, "sta'
    )
    add(
        "previous line truncated by a killed rank",
        truncated,
        lambda r: (
            r["lines"] == [] and len(record.scan(str(truncated)).damaged) == 1,
            len(record.read(str(truncated))) != 2,
        ),
    )

    fifo = base / "fifo"  # last: a writer that blocks on it hangs the job here
    fifo.mkdir()
    os.mkfifo(fifo / "gcpatch-rank0.jsonl")
    add(
        "rank file is a FIFO (no reader)",
        fifo,
        lambda r: (one_line_naming(fifo, "cannot write")(r), False),
    )
    return cases


@requires_transformers
def test_record_hazards_never_stop_the_job_nor_touch_foreign_files(tmp_path):
    cases = _hazards(tmp_path)
    arg = json.dumps([[name, path] for name, path, _ in cases])
    proc = run(
        f"import runpy, sys; sys.argv = ['x', {arg!r}]; "
        f"runpy.run_path({str(FAULTS / 'record_hazards.py')!r}, run_name='__main__')",
        tmp_path,
        timeout=120,
        GCPATCH="1",
    )
    results = {entry["case"]: entry for entry in parse_results(proc.stdout or "")}
    problems = []
    for name, _path, check in cases:
        got = results.get(name)
        if got is None:  # the process died or hung in this case
            tally("record hazards", name, False, False, True)
            problems.append((name, "no result", proc.returncode, proc.stderr[-1500:]))
            continue
        survived = got["error"] is None and got["missing_grads"] == 0
        clear, lost = check(got)
        tally("record hazards", name, survived, clear, lost)
        if not (survived and clear and not lost):
            problems.append((name, got))
    assert problems == []
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    existing = str(tmp_path / "a-file")
    said = f"GCPATCH_RECORD={existing!r} is a file, not a directory; nothing is recorded"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]


def _entry(rank=0, **drop):
    entry = {
        "time": 1.0,
        "pid": 1,
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
        "facts": {},
    }
    for key in drop:
        entry.pop(key)
    return entry


def test_explain_skips_and_counts_damaged_lines_and_names_missing_fields(tmp_path, capsys):
    lines = [
        json.dumps(_entry(0)),
        json.dumps(_entry(0, asked=None, decision=None)),
        '{"rank": 1, "stage": "ena',
        "[1, 2]",
        json.dumps(_entry(1)),
    ]
    (tmp_path / "gcpatch-rank0.jsonl").write_text("\n".join(lines[:4]) + "\n")
    (tmp_path / "gcpatch-rank1.jsonl").write_bytes(
        b"\xff\xfe not utf-8\n" + lines[4].encode() + b"\n"
    )
    code = cli.main(["explain", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0
    assert (
        out.count("gcpatch: M: use_reentrant True -> False (R1: frozen)") == 2
    )  # both intact records explained
    assert "incomplete record, missing asked, decision" in out
    assert (
        "skipped 3 damaged line(s)" in err
        and "gcpatch-rank0.jsonl:3" in err
        and "gcpatch-rank1.jsonl:1" in err
    )
    tally(
        "explain",
        "truncated, missing keys, non-record JSON, non-UTF-8",
        True,
        "missing asked, decision" in out and "skipped 3" in err,
        False,
    )


def test_read_survives_unreadable_entries(tmp_path):
    (tmp_path / "gcpatch-rank0.jsonl").write_text('{"rank": "zero", "time": null}\n{"rank": 1}\n')
    assert [e["rank"] for e in record.read(str(tmp_path))] == ["zero", 1]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
def test_chmod_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    assert record._write({"rank": 0}, str(ro)) is False


def test_explain_reads_checkpoint_call_records(tmp_path, capsys):
    entry = _entry(0, model=None, api=None, source=None)
    entry.update(stage="call", site="train.py:42")
    (tmp_path / "gcpatch-rank0.jsonl").write_text(json.dumps(entry) + "\n")
    assert cli.main(["explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint call at train.py:42" in out and "incomplete" not in out
