"""Assertions shared by the integration tests."""

from __future__ import annotations

from _run import Run


def assert_installed_gcpatch_ran(run: Run) -> None:
    """gcpatch was loaded by the start-up hook (the script never imports it), from site-packages."""
    result = run.result
    assert result["env_GCPATCH"] == "1"
    assert result["gcpatch_loaded"], run.describe()
    assert "site-packages" in result["gcpatch_file"], (
        f"not the installed gcpatch: {result['gcpatch_file']}"
    )


def assert_plain(run: Run) -> None:
    """GCPATCH=0: gcpatch never loaded, said nothing, and recorded nothing although
    GCPATCH_RECORD was set."""
    result = run.result
    assert result["env_GCPATCH"] == "0"
    assert not result["gcpatch_loaded"], run.describe()
    assert run.gcpatch_lines() == [], run.describe()
    assert run.records() == []


def enable_records(run: Run, source: str | None = None) -> list[dict]:
    return [
        r
        for r in run.records()
        if r.get("stage") == "enable" and (source is None or r.get("source") == source)
    ]


def assert_explained(run: Run, *needles: str) -> str:
    """`python -m gcpatch explain <dir>` exits 0 and names every needle."""
    proc = run.explain()
    assert proc.returncode == 0, f"explain failed ({proc.returncode})\n{proc.stdout}\n{proc.stderr}"
    for needle in needles:
        assert needle in proc.stdout, f"{needle!r} not in explain output:\n{proc.stdout}"
    return proc.stdout


def final_enable_record(run: Run) -> dict:
    """The last decision gcpatch took for the model (after every wrap and re-enable)."""
    records = enable_records(run)
    assert records, f"no enable record\n{run.describe()}"
    return records[-1]


def winner(record: dict, knob: str = "use_reentrant") -> str:
    return record["decision"]["winners"][knob]["rule"]


def assert_explain_lists_every_decision(run: Run) -> str:
    """`gcpatch explain`: one line per recorded decision, each naming the rule
    that chose use_reentrant, for every rank."""
    records = [r for r in run.records() if r.get("stage") == "enable"]
    out = assert_explained(run)
    lines = [
        line.strip()
        for line in out.splitlines()
        if line.strip().startswith("gcpatch: rank ") and "(" in line and ", enable)" in line
    ]
    assert len(lines) == len(records), f"{len(records)} records, {len(lines)} explain lines:\n{out}"
    for line, rec in zip(lines, records):
        assert f"use_reentrant: {winner(rec)}:" in line, f"{winner(rec)} not named in: {line}"
    return out
