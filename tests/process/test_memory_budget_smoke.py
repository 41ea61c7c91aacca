"""The memory-budget benchmark (benchmarks/memory_budget.py) runs end to end on its quick
setting, so that it cannot rot. It writes into a temporary directory: the committed table is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version
from test_benchmark_smoke import _installed
from test_benchmark_smoke import pytestmark as _installed_marks

pytestmark = _installed_marks + [
    pytest.mark.skipif(
        _installed("transformers") and Version(metadata.version("transformers")) < Version("4.52"),
        reason="a per-layer plan needs transformers' GradientCheckpointingLayer (4.52+)",
    )
]

ROOT = Path(__file__).resolve().parents[2]


def test_memory_budget_benchmark_quick(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH")}
    env.update(HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "memory_budget.py"),
            "--quick",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    raw = json.loads((tmp_path / "memory_budget.json").read_text())
    rows = raw["configs"][0]["budgets"]
    assert (
        rows["1.0"]["gcpatch_checkpointed"] == 0
    )  # the whole no-checkpointing step fits: nothing recomputed
    half = rows["0.5"]
    # fewer whole layers than all meet 0.5: no plan runs every layer whole
    assert 0 < half["gcpatch_checkpointed"] and half["gcpatch_modes"] != ["whole"] * 4, half
    assert half["bytes"]["gcpatch"] <= 0.5 * 1.05 * half["bytes"]["plain"]
    assert "| 4 | 32 | 0.5 |" in (tmp_path / "MEMORY_BUDGET.md").read_text()
