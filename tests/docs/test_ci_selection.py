"""What CI leaves to the newest transformers is still run where docs/CI.md says: the memory budget's
integration tests (integration/test_budget_*.py, test_memory_budget*.py, marked `budget` by
integration/conftest.py) run in tf525-it; tf457 runs, from tox.ini's `[budget] files`, only those
marked `budget_all_generations`, and `bash .ci/run -e tf457 -- -m budget` the rest on 4.57. So every
budget file is listed there, and a test that opts into 4.57 is in a file tf457 runs."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTEGRATION = ROOT / "integration"
OPT_IN = re.compile(r"\bmark\.budget_all_generations\b")
SELECTION = '-m "not budget or budget_all_generations"'
REST_ON_457 = "bash .ci/run -e tf457 -- -m budget"


def tox() -> configparser.ConfigParser:
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "tox.ini")
    return config


def tf457_command() -> str:
    commands = tox()["testenv"]["commands"].splitlines()
    [line] = [c.strip() for c in commands if c.strip().startswith("tf457:")]
    return line


def tf457_files() -> set[str]:
    config, files = tox(), set()
    for section in re.findall(r"\{\[(\w+)\]files\}", tf457_command()):
        files |= set(config[section]["files"].split())
    return files


def budget_files() -> set[str]:
    return {
        f"integration/{p.name}"
        for pattern in ("test_budget*.py", "test_memory_budget*.py")
        for p in INTEGRATION.glob(pattern)
    }


def test_tf457_runs_of_the_budget_only_the_tests_that_opt_in():
    command = tf457_command()
    assert SELECTION in command and "{[budget]files}" in command, command


def test_every_budget_file_is_listed_for_tf457():
    """`[budget] files` is every budget file: tf457 finds the tests that opt in there, and
    `-m budget` runs the rest of them on 4.57."""
    listed = set(tox()["budget"]["files"].split())
    assert listed == budget_files(), (
        "tox.ini's [budget] files must list every integration/test_budget*.py and "
        f"test_memory_budget*.py: missing {sorted(budget_files() - listed)}, "
        f"gone {sorted(listed - budget_files())}"
    )


def test_a_test_that_opts_into_every_generation_is_in_a_file_tf457_runs():
    opted = {
        p.relative_to(ROOT).as_posix()
        for folder in (INTEGRATION, ROOT / "tests")
        for p in folder.rglob("test_*.py")
        if OPT_IN.search(p.read_text(encoding="utf-8"))
    }
    outside = opted - tf457_files()
    assert not outside, f"marked budget_all_generations but in no file tf457 runs: {outside}"


def test_docs_ci_names_the_command_that_runs_the_rest_on_4_57():
    text = (ROOT / "docs" / "CI.md").read_text(encoding="utf-8")
    assert REST_ON_457 in text and "budget_all_generations" in text
