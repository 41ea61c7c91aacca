"""Activation: the start-up line costs nothing when off, loads one small module when on (the
package follows the first framework import), runs twice harmlessly, and reaches child
interpreters."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from testkit.harness import child_env, free_port, result_of, run_python
from testkit.subproc import requires_transformers

HEAVY = ("wrapt", "pluggy", "torch", "transformers", "importlib.metadata")
LIST_MODULES = "import sys, json; print('RESULT ' + json.dumps(sorted(sys.modules)))"


def test_startup_files_are_installed_and_plugins_are_namespaced():
    files = {str(f) for f in metadata.distribution("gcpatch").files}
    assert {"gcpatch.pth", "gcpatch.start", "_gcpatch_startup.py"} <= files
    assert not any(f.startswith("plugins/") for f in files), (
        "plugins/ must be installed as gcpatch_plugins/"
    )
    assert "gcpatch_plugins/transformers.py" in files


def test_unset_imports_no_gcpatch_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        cwd=tmp_path,
        env=child_env(quiet=True),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    assert "import time:" in proc.stderr  # importtime did list the start-up imports
    assert "gcpatch" not in proc.stderr


def test_on_loads_only_the_startup_module_until_a_framework_is_imported(tmp_path):
    modules = set(result_of(run_python(LIST_MODULES, tmp_path, GCPATCH="1")))
    assert "_gcpatch_startup" in modules, "GCPATCH=1 must install the watcher at start-up"
    assert [m for m in modules if m == "gcpatch" or m.startswith("gcpatch.")] == []
    assert [m for m in HEAVY if m in modules] == []
    watching = run_python(
        "import sys, json; print('RESULT ' + json.dumps([repr(f) for f in sys.meta_path]))",
        tmp_path,
        GCPATCH="1",
    )
    assert "<gcpatch framework watcher>" in result_of(watching)


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed in this environment"
)
def test_first_framework_import_starts_gcpatch(tmp_path):
    proc = run_python(
        """
        import json, sys
        import torch.utils.checkpoint as cp
        print("RESULT " + json.dumps({"active": sys.modules["gcpatch"].is_active(),
                                      "patched": getattr(cp.checkpoint, "_self_gcpatch", False),
                                      "watchers": sum("framework watcher" in repr(f) for f in sys.meta_path)}))
    """,
        tmp_path,
        GCPATCH="1",
    )
    assert result_of(proc) == {"active": True, "patched": True, "watchers": 0}, proc.stderr


def test_zero_switches_an_explicit_import_off(tmp_path):
    proc = run_python(
        """
        import gcpatch, sys, json
        print('RESULT ' + json.dumps([gcpatch.is_active(), any('gcpatch' in repr(f) for f in sys.meta_path)]))
    """,
        tmp_path,
        GCPATCH="0",
    )
    assert result_of(proc) == [False, False]


def test_mode_off_patches_nothing(tmp_path):
    modules = set(result_of(run_python(LIST_MODULES, tmp_path, GCPATCH="1", GCPATCH_MODE="off")))
    assert "gcpatch.engine" not in modules
    proc = run_python(
        "import gcpatch, json; print('RESULT ' + json.dumps(gcpatch.is_active()))",
        tmp_path,
        GCPATCH_MODE="off",
    )
    assert result_of(proc) is False


@requires_transformers
def test_startup_line_run_twice_patches_once(tmp_path):
    # A venv whose lib64 links to lib processes gcpatch.pth twice: run every .pth line again.
    proc = run_python(
        """
        import json, site, sys, sysconfig
        site.addsitedir(sysconfig.get_paths()["purelib"])
        from transformers import modeling_utils as mu
        name = next(n for n in ("_activation_checkpointing_enable", "gradient_checkpointing_enable")
                    if n in vars(mu.PreTrainedModel) and hasattr(vars(mu.PreTrainedModel)[n], "__wrapped__"))
        attr = vars(mu.PreTrainedModel)[name]
        print("RESULT " + json.dumps({
            "ours": getattr(attr, "_self_gcpatch", False),
            "wrapped_once": not hasattr(attr.__wrapped__, "__wrapped__"),
            "watchers_left": sum("framework watcher" in repr(f) for f in sys.meta_path),
        }))
    """,
        tmp_path,
        GCPATCH="1",
    )
    assert result_of(proc) == {"ours": True, "wrapped_once": True, "watchers_left": 0}, proc.stderr


def test_child_interpreter_inherits_activation_from_import(tmp_path):
    proc = run_python(
        """
        import gcpatch, json, subprocess, sys
        child = "import sys; print(any(repr(f) == '<gcpatch framework watcher>' for f in sys.meta_path))"
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip()
        print("RESULT " + json.dumps(out))
    """,
        tmp_path,
    )
    assert result_of(proc) == "True"


def _torchrun(folder: Path) -> str:
    """The `torchrun` of this environment; where torch came from a shared base venv (the tox envs)
    there is none next to this interpreter, so the console script pip writes for torch's own
    `torchrun` entry point is written here, pointing at this interpreter, as in a user's venv."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if found is not None:
        return found
    [entry] = [e for e in metadata.entry_points(group="console_scripts") if e.name == "torchrun"]
    script = folder / "torchrun"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {entry.module} import {entry.attr}\n"
        f"sys.exit({entry.attr}())\n"
    )
    script.chmod(0o755)
    return str(script)


def test_torchrun_ranks_see_gcpatch_active(tmp_path):
    """The README's `GCPATCH=1 torchrun ...`: every rank runs gcpatch, no code changed."""
    pytest.importorskip("torch")
    torchrun = _torchrun(tmp_path)
    script = tmp_path / "rank.py"
    # a user's script never imports gcpatch (which would switch it on by itself): its framework
    # import starts gcpatch's engine where the start-up hook armed it, and only there
    script.write_text(
        "import os, sys, torch\n"
        # one write a line (print writes the newline apart: two ranks' lines ran together once)
        "sys.stdout.write(f\"RANK{os.environ['RANK']}:{'gcpatch.engine' in sys.modules}\\n\")\n"
    )
    seen = {}
    for switch in ("1", "0"):
        proc = subprocess.run(
            [torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", str(script)],
            cwd=tmp_path,
            env=child_env(quiet=True, GCPATCH=switch),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen[switch] = sorted(re.findall(r"RANK\d+:(?:True|False)", proc.stdout))
    assert seen == {"1": ["RANK0:True", "RANK1:True"], "0": ["RANK0:False", "RANK1:False"]}


def test_bad_env_values_get_one_clear_line_and_no_traceback(tmp_path):
    proc = run_python(
        "import gcpatch, json; print('RESULT ' + json.dumps(gcpatch.is_active()))",
        tmp_path,
        GCPATCH="1",
        GCPATCH_MODE="sometimes",
    )
    assert proc.returncode == 0
    assert result_of(proc) is True
    assert "Traceback" not in proc.stderr
    assert "GCPATCH_MODE='sometimes'" in proc.stderr and "fix | warn | strict | off" in proc.stderr
    assert proc.stderr.count("GCPATCH_MODE") == 1
