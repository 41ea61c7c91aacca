"""tox's hook (toxfile.py) shares `.ci/run`'s base torch only with an env that pins the release
the base holds: an env pinning a newer torch (torch214, torch215) installs its own, and no second
torch reaches its path. Runs with the tox that `.ci/run` installs (`.venv-tox`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOX_PYTHON = ROOT / ".venv-tox" / "bin" / "python"

PROBE = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from toxfile import shares_base_torch
site = Path(sys.argv[2])
cases = [
    ["pytest>=7", "torch==2.13.0", "transformers==5.24.0"],
    ["torch == 2.13.0+cpu"],
    ["torch==2.14.1", "pytest>=7"],
    ["pytest>=7"],
]
print(*(shares_base_torch(lines, site) for lines in cases))
"""


@pytest.mark.skipif(not TOX_PYTHON.exists(), reason="no .venv-tox here: `bash .ci/run` makes it")
def test_the_base_torch_is_shared_only_with_an_env_pinning_its_release(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    meta = site / "torch-2.13.0+cpu.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
    out = subprocess.run(
        [str(TOX_PYTHON), "-c", PROBE, str(ROOT), str(site)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["True", "True", "False", "False"]
