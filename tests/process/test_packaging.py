"""What a newcomer installs: constraints.txt keeps torch to its CPU build on Linux (PyPI's Linux
torch is the CUDA build, version without a local label), and the sdist ships no tests whose
data it would leave behind."""

from __future__ import annotations

import json
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
    # nothing beyond the list in pyproject.toml (and what hatchling adds to every sdist)
    listed = {
        "gcpatch",
        "plugins",
        "_gcpatch_startup.py",
        "LICENSE",
        "README.md",
        "constraints.txt",
    }
    by_hatchling = {"pyproject.toml", "PKG-INFO", ".gitignore"}
    assert {name.split("/", 1)[0] for name in names} == listed | by_hatchling | {"startup"}
    assert {n for n in names if n.startswith("startup/")} == {
        "startup/gcpatch.pth",
        "startup/gcpatch.start",
    }


def test_an_editable_install_runs_the_checkout_and_its_start_up_hook(tmp_path):
    """`pip install -e .`: the three importable names come from the checkout (startup/editable
    links them), and the start-up hook is installed, so GCPATCH=1 reaches every interpreter."""
    pytest.importorskip("hatchling")
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel:editable", "-d", str(dist)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("gcpatch-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + ["--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    proc = subprocess.run(
        [
            str(python),
            "-c",
            "import sys, json, gcpatch, gcpatch_plugins; print(json.dumps("
            "['_gcpatch_startup' in sys.modules, gcpatch.__file__, gcpatch_plugins.__file__]))",
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "GCPATCH": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    started, package, plugins = json.loads(proc.stdout)
    assert started  # the hook ran at start-up, before the script imported anything
    assert Path(package).resolve() == ROOT / "gcpatch" / "__init__.py"
    assert Path(plugins).resolve() == ROOT / "plugins" / "__init__.py"
