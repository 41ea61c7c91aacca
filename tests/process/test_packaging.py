"""What a newcomer installs: constraints.txt keeps torch to its CPU build on Linux (PyPI's Linux
torch is the CUDA build, version without a local label), and the sdist ships no tests whose
data it would leave behind."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _torch_allows(version: str, system: str) -> bool:
    env = {"platform_system": system, "sys_platform": system.lower(), "python_version": "3.11"}
    pins = [
        Requirement(line)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return all(
        Version(version) in req.specifier
        for req in pins
        if req.name == "torch" and (req.marker is None or req.marker.evaluate(env))
    )


def test_constraints_keep_linux_to_the_cpu_build():
    assert _torch_allows("2.13.0+cpu", "Linux")
    assert not _torch_allows(
        "2.13.0", "Linux"
    )  # PyPI's Linux wheel: CUDA libraries as dependencies
    assert not _torch_allows("2.13.0+cu130", "Linux")
    assert _torch_allows("2.13.0", "Darwin") and _torch_allows(
        "2.13.0", "Windows"
    )  # PyPI's CPU builds there


def test_every_tox_env_installs_through_the_constraints():
    assert "PIP_CONSTRAINT = {tox_root}{/}constraints.txt" in (ROOT / "tox.ini").read_text()


def test_the_sdist_ships_the_package_and_no_tests(tmp_path):
    pytest.importorskip("hatchling")
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (sdist,) = tmp_path.glob("gcpatch-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {
        "gcpatch/plugin.py",
        "plugins/transformers.py",
        "_gcpatch_startup.py",
        "startup/gcpatch.pth",
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "constraints.txt",
    } <= names
    assert not any(name.startswith(("tests/", "integration/")) for name in names)
