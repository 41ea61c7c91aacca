"""A lever's name is written once: in its own file (gcpatch/step/levers/) and in the glossary
(docs/BUDGET.md); everything else asks the registry. The one other place a name may stand is the
GCPATCH_BUDGET_LEVERS value that asks for it (gcpatch/settings.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

from gcpatch.step import levers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SETTING_VALUES = {"whole": "gcpatch/settings.py"}


def _sources():
    for folder in ("gcpatch", "plugins"):
        yield from sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("lever", levers.every(), ids=lambda lever: lever.name)
def test_a_levers_name_is_written_only_in_its_own_file_and_the_glossary(lever):
    quoted = re.compile(rf"""["']{re.escape(lever.name)}["']""")
    own = Path(type(lever).__module__.replace(".", "/") + ".py")
    found = {
        str(path.relative_to(ROOT))
        for path in _sources()
        if quoted.search(path.read_text(encoding="utf-8"))
    }
    allowed = {str(own), SETTING_VALUES.get(lever.name, str(own))}
    assert found <= allowed, found - allowed
    assert str(own) in found
    glossary = (ROOT / "docs" / "BUDGET.md").read_text(encoding="utf-8")
    assert f"`{lever.name}`" in glossary.split("## Glossary", 1)[-1]
