"""The benchmark (benchmarks/run.py) runs end to end on its smallest setting, so that
it cannot rot. It writes into a temporary directory: the committed results are left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run.py"


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.slow,  # out of CI's tf525-unit: docs/CI.md
    pytest.mark.skipif(not _installed("transformers"), reason="transformers not installed"),
    pytest.mark.skipif(not _installed("torch"), reason="torch not installed"),
    pytest.mark.skipif(
        not _installed("gcpatch"), reason="gcpatch is not installed in this environment"
    ),
]


def test_benchmark_smoke(tmp_path):
    committed = ROOT / "benchmarks" / "RESULTS.md"
    before = committed.read_bytes() if committed.exists() else None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"

    results = (tmp_path / "RESULTS.md").read_text()
    assert "Smoke run" in results
    targets = results.split("## Targets")[1].split("###")[0]
    rows = [line for line in targets.splitlines() if line.startswith("| ") and "---" not in line][
        1:
    ]
    assert len(rows) >= 8, targets
    assert all(" met " in row or "**missed**" in row or "(no target)" in row for row in rows), (
        targets
    )
    assert "nan" not in targets.lower()

    data = json.loads((tmp_path / "results.json").read_text())
    cases = {c["setup"]: c for c in data["raw"]["cases"]["cases"]}
    assert set(cases) == {"full", "full_reentrant", "lora", "lora_embeds", "eval"}
    assert all(c["variants"]["gcpatch"]["correct"] for c in cases.values())
    # the eval-mode case: plainly checkpointing does nothing there; gcpatch makes it take effect
    ev = cases["eval"]["variants"]
    assert ev["plain"]["packed"] > 2 * ev["gcpatch"]["packed"]
    assert ev["gcpatch"]["packed"] == ev["hand-train-NR"]["packed"]

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in results or "skipped: matplotlib" in results
    else:
        assert (tmp_path / "results.png").stat().st_size > 0
    # the committed results are not touched by a smoke run
    assert (committed.read_bytes() if committed.exists() else None) == before
