"""Figures that stay true: every timing docs/CI.md prints is a row of its timings table, with the
seconds, the commit and the machine it was measured on (the machine one of its machines table), and
every timing the README prints is one of those rows, spelled the same: one cannot change without
the other. A duration anywhere else in the two documents fails here, unless it is a setting (a
limit, an interval) listed below with what it sets."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_links import prose  # the one reader of a page's prose (tests/docs, rootdir-relative)

ROOT = Path(__file__).resolve().parents[2]
README, CI = ROOT / "README.md", ROOT / "docs" / "CI.md"
TIMINGS, MACHINES = "## Timings", "### Machines"
TIMINGS_HEADER = ["figure", "seconds", "commit", "machine", "conditions"]
MACHINES_HEADER = ["machine", "what"]
COMMIT = re.compile(r"[0-9a-f]{7,40}")
SECONDS = re.compile(r"\d+(?:-\d+)?")
# A figure in the README: `what` [words, no backtick or bracket] 1234 s (at <commit> on `<machine>`)
README_FIGURE = re.compile(
    r"`(?P<figure>[^`]+)`[^`()\[\]]*?\s(?P<seconds>\d+(?:-\d+)?) s "
    r"\(at (?P<commit>[0-9a-f]{7,40}) on `(?P<machine>[^`]+)`\)"
)
# A duration as prose spells it: 12 s, 3.5 min, 50-60 s, 90 minutes, 4 hours, a 2-minute run, an hour
DURATION = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?"
    r"(?:\s?(?:s|secs?|seconds?|min|minutes?|h|hours?)\b|-(?:second|minute|hour)s?\b)"
    r"|\ban? (?:hour|minute)\b|\bhalf an hour\b",
    re.IGNORECASE,
)
# Durations the documents may print without a commit: settings, not measurements (the phrase, and
# what it sets)
SETTINGS = {
    "its limit is 90 minutes": "CI's own limit on a run",
    "GCPATCH_CI_PROGRESS_S` (60 s)": ".ci/run's progress interval, its default",
    "at most 30 minutes": "the target for `bash .ci/run` quiet",
    "at most 60 minutes": "the target for `bash .ci/run` beside a second run",
    "at most 60 s": "the target for `bash .ci/run quick`",
}


def table_after(lines: list[str], heading: str, header: list[str]) -> tuple[list[dict], set[int]]:
    """The rows of the first table under `heading` (as dicts by the header's names) and the indexes
    of its lines."""
    assert heading in lines, f"docs/CI.md has no '{heading}' section"
    at = lines.index(heading) + 1
    while not lines[at].startswith("|"):
        at += 1
    cells = [c.strip() for c in lines[at].strip().strip("|").split("|")]
    assert cells == header, f"'{heading}': the table's header is {cells}, not {header}"
    rows, taken = [], {at, at + 1}
    for i in range(at + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        assert len(cells) == len(header), f"docs/CI.md line {lines[i]!r}: {len(header)} cells"
        rows.append(dict(zip(header, cells)))
        taken.add(i)
    return rows, taken


def ci_tables() -> tuple[list[dict], set[str], set[int], list[str]]:
    lines = prose(CI.read_text(encoding="utf-8"))
    timings, taken = table_after(lines, TIMINGS, TIMINGS_HEADER)
    machines, machine_lines = table_after(lines, MACHINES, MACHINES_HEADER)
    return timings, {m["machine"].strip("`") for m in machines}, taken | machine_lines, lines


def test_every_timing_row_names_its_seconds_commit_and_a_machine():
    timings, machines, _, _ = ci_tables()
    assert timings, "docs/CI.md's timings table is empty"
    figures = [row["figure"] for row in timings]
    assert len(set(figures)) == len(figures), f"a figure twice in the timings table: {figures}"
    for row in timings:
        assert SECONDS.fullmatch(row["seconds"]), row
        assert COMMIT.fullmatch(row["commit"].strip("`")), row
        assert row["machine"].strip("`") in machines, (row, sorted(machines))
        assert row["conditions"], row


def _unlisted_durations(lines: list[str], skip: set[int]) -> list[str]:
    found = []
    for i, line in enumerate(lines):
        if i in skip:
            continue
        text = line
        for phrase in SETTINGS:
            text = text.replace(phrase, "")
        found += [f"{m.group(0)!r} in: {line.strip()}" for m in DURATION.finditer(text)]
    return found


def test_docs_ci_prints_no_timing_outside_its_table():
    """A measured figure belongs in the timings table (its commit and machine); the prose names
    its row."""
    _, _, taken, lines = ci_tables()
    found = _unlisted_durations(lines, taken)
    assert not found, (
        "docs/CI.md prints a duration outside its timings table: put the figure there with its "
        "commit and machine (or, for a setting, add its phrase to SETTINGS here):\n"
        + "\n".join(found)
    )


def test_every_readme_figure_is_a_row_of_the_ci_table():
    timings, _, _, _ = ci_tables()
    rows = {row["figure"].strip("`"): row for row in timings}
    text = README.read_text(encoding="utf-8")
    figures = list(README_FIGURE.finditer(text))
    named = {m.group("figure") for m in figures}
    assert {"bash .ci/run", "bash .ci/run quick"} <= named, (
        "the README prints how long `bash .ci/run` and `bash .ci/run quick` take, each as "
        "`command` N s (at COMMIT on `MACHINE`)"
    )
    for m in figures:
        row = rows.get(m.group("figure"))
        assert row is not None, f"README's `{m.group('figure')}` is no row of docs/CI.md's timings"
        ours = (m.group("seconds"), m.group("commit"), m.group("machine"))
        theirs = (row["seconds"], row["commit"].strip("`"), row["machine"].strip("`"))
        assert ours == theirs, (
            f"README's `{m.group('figure')}` says {ours}, docs/CI.md's row {theirs}"
        )
    found = _unlisted_durations(prose(README_FIGURE.sub("", text)), set())
    assert not found, (
        "the README prints a duration that is not a figure of docs/CI.md's timings table:\n"
        + "\n".join(found)
    )


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
    )


def test_every_timing_commit_is_in_this_history():
    """The commit a figure was measured on is one this checkout descends from (a typo, or a
    commit of another branch, fails)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git checkout here")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: the figures' commits may be outside it")
    timings, _, _, _ = ci_tables()
    for commit in sorted({row["commit"].strip("`") for row in timings}):
        assert _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, (
            f"docs/CI.md's timings name {commit}, which is not in this checkout's history"
        )
