"""The version matrix's one table of release pairs (matrix/releases.csv) is complete, tox's CI slice
uses the same pairs, the committed results table is what the runner renders from its results,
and the transformers plugin's proven range spans the table. Framework-free."""

from __future__ import annotations

import ast
import configparser
import csv
import importlib.util
import json
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
ROWS = list(csv.DictReader((ROOT / "matrix" / "releases.csv").open()))


def runner():
    spec = importlib.util.spec_from_file_location("matrix_run", ROOT / "matrix" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_minor_from_the_oldest_to_the_newest_has_one_row():
    versions = [Version(r["transformers"]) for r in ROWS]
    assert versions == sorted(versions)
    minors = [(v.major, v.minor) for v in versions]
    expected = [(4, m) for m in range(35, 58)] + [(5, m) for m in range(0, 26)]
    assert minors == expected
    for row in ROWS:
        assert row["peft"] and row["trl"] and row["accelerate"] and row["source"], row
        assert row["status"] in ("supported", "unsupported", "candidate"), row


def test_tox_ci_slice_uses_the_table_pairs():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    deps = tox["testenv"]["deps"].splitlines()
    by_version = {r["transformers"]: r for r in ROWS}
    # an env's release is its first factor (tf524-unit and tf524-it run the same release)
    envs = sorted(
        {
            e.strip().split("-")[0]
            for e in tox["tox"]["env_list"].split(",")
            if e.strip().startswith("tf")
        }
    )
    pinned = set()
    for env in envs:
        pins = {}
        for line in deps:
            factors, _, req = line.partition(":")
            if req and env in [f.strip() for f in factors.split(",")] and "==" in req:
                name, _, version = req.strip().partition("==")
                pins[name] = version
        row = by_version[pins["transformers"]]
        assert pins == {k: row[k] for k in ("transformers", "peft", "trl", "accelerate")}, env
        pinned.add(pins["transformers"])
    oldest = next(r for r in ROWS if r["status"] != "unsupported")["transformers"]
    # CI: the oldest, 4.57, 5.2 (5.x through the 4.x entry point) and the newest
    assert pinned == {oldest, "4.57.6", "5.2.0", ROWS[-1]["transformers"]}


def test_committed_results_table_is_the_rendered_results():
    module = runner()
    results = json.loads((ROOT / "matrix" / "results.json").read_text())
    table = (ROOT / "matrix" / "RESULTS.md").read_text()
    assert table == module.render(results), (
        "RESULTS.md is stale: run `python matrix/run.py --render`"
    )
    for row in ROWS:
        assert f"| {row['transformers']} |" in table


def test_a_failing_rule_is_reported_as_fail_not_dropped(tmp_path):
    """The runner's summary of pytest's JUnit XML: a failing test makes its column fail, a skipped
    one carries its reason, a column without tests is 'no test collected'."""
    module = runner()
    junit = tmp_path / "j.xml"
    junit.write_text(
        "<testsuites><testsuite>"
        '<testcase classname="integration.test_frozen_gradients" name="a"><failure message="wrong 9"/></testcase>'
        '<testcase classname="integration.test_frozen_gradients" name="b"/>'
        '<testcase classname="integration.test_enable_arguments" name="c">'
        '<skipped message="transformers 4.57.6 has no every_n_layers"/></testcase>'
        "</testsuite></testsuites>"
    )
    out = module.summarise(junit, ["R1 frozen", "X1 args", "P4 LoRA"])
    assert out["R1 frozen"]["state"] == "fail" and out["R1 frozen"]["n"] == 1
    assert out["X1 args"] == {
        "state": "skip",
        "detail": "transformers 4.57.6 has no every_n_layers",
    }
    assert out["P4 LoRA"]["state"] == "fail" and out["P4 LoRA"]["detail"] == "no test collected"


def _proven(plugin: str) -> SpecifierSet:
    """The `proven` range a built-in plugin's PluginInfo declares, read from its source."""
    source = (ROOT / "plugins" / f"{plugin}.py").read_text()
    call = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "PluginInfo"
    )
    return SpecifierSet(next(k.value.value for k in call.keywords if k.arg == "proven"))


def test_transformers_plugin_proven_range_spans_the_table():
    proven = _proven("transformers")
    supported = [r["transformers"] for r in ROWS if r["status"] != "unsupported"]
    assert supported[0] in proven and supported[-1] in proven
    newest = Version(supported[-1])
    assert (
        "4.35.1" not in proven and f"{newest.major}.{newest.minor}.{newest.micro + 1}" not in proven
    )


def _tox_pins(section: str, package: str) -> list[str]:
    """The releases of `package` that a tox.ini section's deps pin (`factor: package==X`)."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    return [
        req.strip().partition("==")[2]
        for line in tox[section]["deps"].splitlines()
        for _, _, req in [line.partition(":")]
        if req.strip().startswith(f"{package}==")
    ]


def test_torch_plugins_proven_range_spans_the_torch_releases_tox_runs():
    """2.13 (the table's torch, every env of CI) and the releases tox's torch envs pin
    (torch214-unit ... torch215-it, docs/CI.md), each a minor with its patch releases; none before
    or after."""
    pins = _tox_pins("testenv:torch{214,215}-{unit,it}", "torch")
    releases = sorted({r["torch"] for r in ROWS} | set(pins), key=Version)
    assert len(pins) == 2 and releases[0] == "2.13.0", releases
    lowest, highest = Version(releases[0]), Version(releases[-1])
    for plugin in ("torch_checkpoint", "ddp", "fsdp"):
        proven = _proven(plugin)
        assert all(release in proven for release in releases), (plugin, proven)
        assert f"{highest.major}.{highest.minor}.9" in proven, (plugin, proven)
        assert f"{lowest.major}.{lowest.minor - 1}.9" not in proven, (plugin, proven)
        assert f"{highest.major}.{highest.minor + 1}.0" not in proven, (plugin, proven)


def test_deepspeed_plugin_proven_range_is_the_releases_tox_runs():
    """From the oldest DeepSpeed a tox env pins to the newest (ds0189 ... ds0198, docs/CI.md): a
    release outside them says `untested` rather than claiming a proof nobody ran."""
    pins = sorted(Version(pin) for pin in _tox_pins("testenv", "deepspeed"))
    assert len(pins) >= 2, pins
    proven = _proven("deepspeed")
    assert all(str(pin) in proven for pin in pins), (pins, proven)
    lowest, highest = pins[0], pins[-1]
    assert f"{lowest.major}.{lowest.minor}.{lowest.micro - 1}" not in proven, proven
    assert f"{highest.major}.{highest.minor}.{highest.micro + 1}" not in proven, proven


def test_the_table_names_the_gcpatch_commit_each_release_proved():
    module = runner()
    cell = {
        "transformers": "4.99.0",
        "peft": "p",
        "trl": "t",
        "python": "3.11",
        "torch": "2.13.0",
        "wall_s": 1.0,
        "rules": {
            "R1 frozen": {"state": "pass", "n": 2, "skipped": [], "code": "abc1234"},
            "P4 LoRA": {"state": "pass", "n": 1, "skipped": [], "code": "abc1234"},
            "R5 eval": {"state": "pass", "n": 1, "skipped": []},
        },
    }
    assert module._codes(cell) == "abc1234 (2), - (1)"
    assert module.code_version().split("-")[0]  # a commit, read from this checkout


def test_tox_core_files_are_the_matrix_core_columns():
    """CI's tf457/tf4352 run the matrix's core columns: the same test files as `matrix/run.py`'s CORE."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    module = runner()
    core = [f for name, _, files in module.RULES if name in module.CORE for f in files]
    assert tox["core"]["files"].split() == core


def test_tox_framework_free_envs_run_the_matrix_framework_free_files():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    command = tox["testenv:py{39,310,312,313}"]["commands"]
    files = [word for word in command.split() if word.startswith("tests/")]
    assert files == runner().FRAMEWORK_FREE


def test_the_weekly_newest_release_check_reads_the_index_answer():
    """`python3.11 matrix/run.py --newest` (docs/CI.md: run weekly) reads pip's answer; what it
    cannot read is no release (it then says the index did not answer)."""
    module = runner()
    assert module.newest_listed("transformers (5.25.0)\nAvailable versions: 5.25.0, 5.24.0\n") == (
        "5.25.0"
    )
    assert module.newest_listed("") is None
    assert module.newest_listed("ERROR: No matching distribution found") is None
