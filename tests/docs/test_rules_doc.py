"""docs/RULES.md is generated from the plugins' rule tables (`gcpatch rules --markdown`): this
test fails when a rule changes and the document was not regenerated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "RULES.md"


def test_rules_document_is_up_to_date():
    proc = subprocess.run(
        [sys.executable, "-m", "gcpatch", "rules", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert DOC.read_text() == proc.stdout, (
        "docs/RULES.md is stale: run `gcpatch rules --markdown > docs/RULES.md`"
    )
    for rule_id in ("R1", "R3", "R4", "P1", "CK1", "CK4"):
        assert f"| {rule_id} |" in proc.stdout
