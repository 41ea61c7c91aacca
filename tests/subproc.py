"""Shared helpers: every behaviour that depends on interpreter start-up or import order is
proved in a fresh subprocess, as a user would meet it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def run_python(code: str, cwd: Path, args: list[str] | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *(args or []), "-c", textwrap.dedent(code)],
        cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=300,
    )


def result_of(proc: subprocess.CompletedProcess) -> dict:
    """The script's `RESULT {json}` line."""
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"no RESULT line\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")


def transformers_major() -> int | None:
    from importlib import metadata

    try:
        return int(metadata.version("transformers").split(".")[0])
    except metadata.PackageNotFoundError:
        return None


def transformers_version():
    """The installed transformers release (packaging Version), or None."""
    from importlib import metadata

    from packaging.version import Version

    try:
        return Version(metadata.version("transformers"))
    except metadata.PackageNotFoundError:
        return None


requires_transformers = pytest.mark.skipif(transformers_major() is None, reason="transformers not installed")
