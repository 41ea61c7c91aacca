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
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit.faultkit import FAULTS, run, tally
from testkit.harness import child_env, messages, parse_results
from testkit.subproc import requires_transformers

from gcpatch import nofollow, record
from gcpatch.commands import cli, explain

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
            len(explain.read(str(fresh))) != 1,
        ),
    )

    unicode = base / "récords-日本"
    add(
        "non-ASCII directory",
        unicode,
        lambda r: (r["lines"] == [], len(explain.read(str(unicode))) != 1),
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
            r["lines"] == [] and len(explain.scan(str(truncated)).damaged) == 1,
            len(explain.read(str(truncated))) != 2,
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
    assert [e["rank"] for e in explain.read(str(tmp_path))] == ["zero", 1]


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


# The record guard against another user's links (ATTACKER_UID: numeric, nothing is added to the
# machine's user database). gcpatch runs as a second, unprivileged user (VICTIM_UID) where that
# user can reach this venv's interpreter, else as root, which follows links as freely. Planting
# another user's link needs root: elsewhere these are skipped.
VICTIM_UID, ATTACKER_UID = 4243, 4242
GUARDED = """
import json, os, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
def enable():
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)).train()
    m.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 8))
    m(input_ids=ids, labels=ids).loss.backward()
enable()
if os.environ.get("SWAP_AT"):  # let the test swap the record directory between two decisions
    open(os.environ["SWAP_AT"] + ".ready", "w").close()
    while not os.path.exists(os.environ["SWAP_AT"] + ".swapped"):
        time.sleep(0.05)
    enable()
print("RESULT " + json.dumps({"uid": os.getuid()}))
"""


def _reachable_by_others(path: str) -> bool:
    """Whether a user who is neither the owner nor in its group can run `path`."""
    parts = Path(os.path.realpath(path)).parents
    return os.stat(path).st_mode & 0o001 and all(os.stat(p).st_mode & 0o001 for p in parts)


def _as_victim(base, **env):
    if os.geteuid() != 0:
        pytest.skip("planting another user's symbolic link needs root")
    home = base / "home"
    home.mkdir()
    unprivileged = _reachable_by_others(sys.executable) and _reachable_by_others(os.getcwd())
    who = {"user": VICTIM_UID, "group": VICTIM_UID, "extra_groups": []} if unprivileged else {}
    if unprivileged:
        os.chown(home, VICTIM_UID, VICTIM_UID)
    return subprocess.Popen(
        [sys.executable, "-c", GUARDED],
        cwd=home,
        env=child_env(quiet=True, GCPATCH="1", HOME=str(home), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **who,
    )


def _shared(path):
    path.mkdir(parents=True)
    path.chmod(0o777)
    return path


def test_another_users_link_is_not_followed_through_dotdot(tmp_path):
    """`shared/blink/../arec`, blink another user's link into their tree: the text drops `blink/..`,
    the kernel follows the link. Before, the record was created inside the other user's tree."""
    tmp_path.chmod(0o755)
    shared, theirs = _shared(tmp_path / "shared"), _shared(tmp_path / "theirs")
    (theirs / "inner").mkdir()
    blink = shared / "blink"
    blink.symlink_to(theirs / "inner")
    os.lchown(blink, ATTACKER_UID, ATTACKER_UID)
    proc = _as_victim(tmp_path, GCPATCH_RECORD=f"{shared}/blink/../arec")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and json.loads(out.split("RESULT ", 1)[1])["uid"] in (VICTIM_UID, 0)
    assert sorted(p.name for p in theirs.iterdir()) == ["inner"]  # nothing written in their tree
    said = [line for line in messages(err) if "cannot write the record" in line]
    assert len(said) == 1 and f"{blink} is a symbolic link owned by another user" in said[0], err


def test_a_directory_swapped_for_a_link_between_two_decisions_is_not_followed(tmp_path):
    tmp_path.chmod(0o755)
    shared, theirs = _shared(tmp_path / "shared"), _shared(tmp_path / "theirs")
    record = shared / "rec"
    swap = tmp_path / "swap"
    proc = _as_victim(tmp_path, GCPATCH_RECORD=str(record), SWAP_AT=str(swap))
    deadline = time.monotonic() + 240
    while not Path(f"{swap}.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    assert [p.name for p in record.iterdir()] == ["gcpatch-rank0.jsonl"]  # the first decision
    record.rename(shared / "rec.before")
    record.symlink_to(theirs)  # another user's link where the directory was
    os.lchown(record, ATTACKER_UID, ATTACKER_UID)
    Path(f"{swap}.swapped").touch()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert list(theirs.iterdir()) == []  # the second decision was not written through the link
    said = [line for line in messages(err) if "cannot write the record" in line]
    assert len(said) == 1 and "owned by another user" in said[0], err


def _explain_proc(path, tmp_path, **env):
    """`gcpatch explain path` in a fresh interpreter whose stdout is UTF-8."""
    from testkit.harness import run_python

    return run_python(
        f"from gcpatch.commands.cli import main; raise SystemExit(main(['explain', {str(path)!r}]))",
        tmp_path,
        PYTHONIOENCODING="utf-8",
        **env,
    )


def _decision(**fields):
    entry = _entry()
    entry.update(fields)
    return json.dumps(entry)


@pytest.mark.parametrize(
    "name, lines",
    [
        # a call site whose path was not valid UTF-8: JSON keeps it as a lone surrogate
        (
            "non-UTF-8 path",
            [json.dumps({**json.loads(_decision()), "stage": "call", "site": "/d/\udcff.py:3"})],
        ),
        ("details not a list", ['{"stage": "verify", "line": "gcpatch: rank 0 x", "details": 5}']),
        ("a time no clock shows", [_decision(pid=1, time=1e300), _decision(pid=2, time=2.0)]),
        ("nested past the parser's depth", ["[" * 100000 + "]" * 100000, _decision()]),
    ],
)
def test_explain_reads_hostile_records_without_a_traceback(tmp_path, name, lines):
    record_dir = tmp_path / "rec"
    record_dir.mkdir()
    (record_dir / "gcpatch-rank0.jsonl").write_text("\n".join(lines) + "\n", errors="surrogatepass")
    proc = _explain_proc(record_dir, tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (name, proc.stderr)
    assert proc.stdout.strip(), (name, proc.stdout)
    tally("explain hostile records", name, True, True, False)


@pytest.mark.parametrize("verbose", [False, True])
def test_explain_reads_fields_of_the_wrong_type_and_names_what_it_skips(tmp_path, verbose):
    """Valid JSON of the wrong type in a field (tests/unit/test_explain_fuzz.py found these): a
    winner that is `true`, overruled votes that are a number, a record without `source` under -v.
    Each is shown (the field read as absent, or said missing); a JSON object with no stage is
    skipped, counted and named. Before, each of the three stopped `gcpatch explain` with a traceback."""
    decision = _entry()["decision"]
    lines = [
        _decision(decision={**decision, "winners": {"use_reentrant": True}}),
        _decision(decision={**decision, "overruled": 5}),
        json.dumps(_entry(source=None)),
        json.dumps({"rank": 0, "pid": 1, "time": 2.0}),
    ]
    record_dir = tmp_path / "rec"
    record_dir.mkdir()
    (record_dir / "gcpatch-rank0.jsonl").write_text("\n".join(lines) + "\n")
    from testkit.harness import run_python

    argv = ["explain", str(record_dir)] + (["-v"] if verbose else [])
    proc = run_python(
        f"from gcpatch.commands.cli import main; raise SystemExit(main({argv!r}))", tmp_path
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    for said in (
        "gcpatch: M: use_reentrant True -> False (?)",  # the winner read as absent
        "gcpatch: rank 0 enable: incomplete record, missing decision.overruled",
        "gcpatch: M: use_reentrant True -> False (R1: frozen)",  # no source: the line as ever
    ):
        assert said in proc.stdout.splitlines(), proc.stdout
    assert "skipped 1 damaged line(s)" in proc.stderr, proc.stderr
    assert "gcpatch-rank0.jsonl:4: a JSON object without a stage" in proc.stderr, proc.stderr


def test_explain_shows_the_damage_of_a_record_whose_only_line_is_truncated(tmp_path):
    record_dir = tmp_path / "rec"
    record_dir.mkdir()
    (record_dir / "gcpatch-rank0.jsonl").write_text(_decision()[:40])
    proc = _explain_proc(record_dir, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "not a gcpatch record" not in proc.stderr
    assert "skipped every line" in proc.stderr and "gcpatch-rank0.jsonl:1" in proc.stderr


def test_explain_groups_concurrent_runs_by_run(tmp_path):
    """Four runs writing into one directory at once interleave their lines: one header a run."""
    record_dir = tmp_path / "rec"
    record_dir.mkdir()
    lines = [_decision(pid=100 + i % 4, time=10.0 + i) for i in range(40)]
    (record_dir / "gcpatch-rank0.jsonl").write_text("\n".join(lines) + "\n")
    proc = _explain_proc(record_dir, tmp_path)
    assert proc.returncode == 0, proc.stderr
    headers = [line for line in proc.stdout.splitlines() if line.startswith("-- run: pid")]
    assert len(headers) == 4, proc.stdout


def test_a_rank_that_loses_the_race_to_create_the_record_directory_still_writes(
    tmp_path, monkeypatch, caplog
):
    """Every rank of a job creates the missing record directory as its first decision is written:
    where another rank made it between this one's open and its mkdir (FileExistsError), the entry
    is written all the same. Before, that rank's first decision was lost with a 'cannot write'
    line (torchrun, 2 ranks: one rank recorded one decision, the other two)."""
    record_dir = tmp_path / "shared" / "rec"
    real_mkdir = os.mkdir

    def another_rank_first(path, mode=0o777, *, dir_fd=None):
        real_mkdir(path, mode, dir_fd=dir_fd)  # the other rank wins the race ...
        real_mkdir(path, mode, dir_fd=dir_fd)  # ... and this one's mkdir meets its directory

    if not nofollow.supported():
        pytest.skip("this platform has no directory-relative open")
    monkeypatch.setattr(
        nofollow, "supported", lambda: True
    )  # os.mkdir below is not in supports_dir_fd
    monkeypatch.setattr(os, "mkdir", another_rank_first)
    entry = {"time": 1.0, "pid": os.getpid(), "rank": 1, "stage": "enable"}
    with caplog.at_level("ERROR"):
        assert record._write(entry, str(record_dir))
    monkeypatch.undo()
    assert not [r for r in caplog.records if "cannot write the record" in r.getMessage()]
    lines = (record_dir / "gcpatch-rank1.jsonl").read_text().splitlines()
    assert [json.loads(line)["stage"] for line in lines] == ["enable"]
