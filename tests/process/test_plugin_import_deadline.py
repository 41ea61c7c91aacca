"""A third-party plugin whose import hangs, registered through the real entry-point group: its
import is waited for no longer than its hooks are (GCPATCH_PLUGIN_TIMEOUT_S, gcpatch/deadline.py),
the job goes on without it with one line naming it, an import that finishes later registers
nothing, strict mode names it in a GcpatchError, and `gcpatch doctor` lists it as not imported.

The plugin sleeps far longer than any subprocess timeout here (SLEEP_AT_IMPORT, 600 s), so a job
that waited for its import fails by that timeout; no assertion reads a clock.
"""

from __future__ import annotations

import sys

import pytest
from testkit.harness import child_env, messages, result_of, run, run_python

pytest.importorskip("torch")

PLUGIN = """
import os, time
from gcpatch.plugin import PatchPoint, PluginInfo, hookimpl

VOTED = []  # every hook call and patched call this plugin saw
time.sleep(float(os.environ.get("SLEEP_AT_IMPORT", "600")))
IMPORTED = True


@hookimpl
def gcpatch_plugin_info():
    return PluginInfo(name="sleepy", framework="torch", versions=">=1")


@hookimpl
def gcpatch_patch_points():
    return [PatchPoint("sleepy_target", "work", _wrapper, why="the test's own target")]


@hookimpl
def gcpatch_vote(facts):
    VOTED.append("vote")
    return []


@hookimpl
def gcpatch_call_vote(facts):
    VOTED.append("call_vote")
    return []


def _wrapper(wrapped, instance, args, kwargs):
    VOTED.append("wrapper")
    return wrapped(*args, **kwargs)
"""

TARGET = """
def work(x):
    return x + 1
"""

# A tiny checkpointed step; which threads gcpatch started for plugin imports (threading.settrace
# sees every thread start), and, with WAIT_FOR_IMPORT=1, a second step once the import finished.
JOB = """
import json, os, sys, threading, time, torch
import torch.utils.checkpoint

started = []

def seen(frame, event, arg):
    started.append(threading.current_thread().name)
    sys.settrace(None)

threading.settrace(seen)

def step(reentrant):
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x * 2, use_reentrant=reentrant).sum().backward()
    return x.grad is not None

ok = step(False)
late = None
if os.environ.get("WAIT_FOR_IMPORT") == "1":  # the import finishes in its thread, after the deadline
    for _ in range(1200):
        if getattr(sys.modules.get("sleepy_plugin"), "IMPORTED", False):
            break
        time.sleep(0.1)
    import sleepy_target  # the plugin's patch point: wrapped only if the plugin were registered

    ok = ok and step(True)  # another ask: a new decision, which asks every active plugin
    late = {"imported": sys.modules["sleepy_plugin"].IMPORTED, "work": sleepy_target.work(1),
            "voted": sys.modules["sleepy_plugin"].VOTED}
if os.environ.get("REACTIVATE") == "1":  # a new activation while the import still runs
    import gcpatch
    gcpatch.deactivate()
    os.environ["GCPATCH_PLUGIN_TIMEOUT_S"] = "600"  # waiting again would outlast the test's timeout
    print("-- re-activated --", file=sys.stderr, flush=True)
    gcpatch.activate()
    ok = ok and step(True)
threads = [name for name in started if name.startswith("gcpatch-plugin")]
print("RESULT " + json.dumps({"grad": ok, "threads": threads, "late": late}))
"""

TIMEOUT_S = 180  # generous against a 1 s deadline; far short of the plugin's 600 s sleep


@pytest.fixture
def plugin_path(tmp_path):
    site = tmp_path / "site"
    info = site / "sleepy_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "sleepy_plugin.py").write_text(PLUGIN)
    (site / "sleepy_target.py").write_text(TARGET)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sleepy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[gcpatch.plugins]\nsleepy = sleepy_plugin\n")
    return str(site)


def _job(tmp_path, plugin_path, **env):
    env = {"GCPATCH": "1", "GCPATCH_PLUGIN_TIMEOUT_S": "1", "PYTHONPATH": plugin_path, **env}
    proc = run_python(JOB, tmp_path, timeout=TIMEOUT_S, **env)
    assert proc.returncode is not None, "the job waited for the plugin's import: " + str(proc)
    return proc, [line for line in messages(proc.stderr) if "sleepy" in line]


def test_a_hung_import_is_not_waited_for_and_said_in_one_line(tmp_path, plugin_path):
    proc, lines = _job(tmp_path, plugin_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = result_of(proc)
    assert result["grad"] is True
    assert result["threads"] == ["gcpatch-plugin-import"]  # one third-party plugin, one thread
    assert len(lines) == 1, lines
    assert "plugin sleepy did not import within 1 s; the job goes on without it" in lines[0]
    assert "Traceback" not in proc.stderr


def test_an_import_finishing_after_the_deadline_registers_nothing(tmp_path, plugin_path):
    """The import completes in its thread 3 s in, after the 1 s deadline: the plugin stays off
    for the activation: no hook of it is asked, its patch point is never wrapped."""
    proc, lines = _job(tmp_path, plugin_path, SLEEP_AT_IMPORT="3", WAIT_FOR_IMPORT="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = result_of(proc)
    assert result["grad"] is True
    assert result["late"] == {"imported": True, "work": 2, "voted": []}, result
    assert len(lines) == 1 and "did not import within 1 s" in lines[0], lines


def test_a_new_activation_does_not_wait_for_an_import_still_running(tmp_path, plugin_path):
    """Importing the module again would block on its module lock (Lib/importlib/_bootstrap.py
    `_find_and_load`) until the first import ends: the second host sees it still initializing
    in sys.modules and goes on at once, although its deadline is now 600 s."""
    proc, lines = _job(tmp_path, plugin_path, REACTIVATE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result_of(proc)["grad"] is True
    after = [
        line for line in lines if line in messages(proc.stderr.split("-- re-activated --")[-1])
    ]
    assert len(lines) == 2 and len(after) == 1, lines
    assert "plugin sleepy is still being imported" in after[0] and "goes on without it" in after[0]


def test_strict_mode_names_the_plugin_that_did_not_import(tmp_path, plugin_path):
    proc, _ = _job(tmp_path, plugin_path, GCPATCH_MODE="strict")
    assert proc.returncode != 0
    assert "GcpatchError: [plugin:sleepy] plugin 'sleepy' did not import within 1 s" in proc.stderr


def test_only_built_in_plugins_start_no_thread(tmp_path):
    """Built-in plugins (gcpatch_plugins.*) are imported directly: no thread at start-up."""
    proc = run_python(JOB, tmp_path, timeout=TIMEOUT_S, GCPATCH="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from importlib.metadata import entry_points

    third_party = [
        ep
        for ep in entry_points(group="gcpatch.plugins")
        if not ep.value.startswith("gcpatch_plugins.")
    ]
    assert result_of(proc)["threads"] == ["gcpatch-plugin-import"] * len(third_party)


def test_doctor_lists_the_plugin_as_not_imported(tmp_path, plugin_path):
    env = child_env(quiet=True, GCPATCH="1", GCPATCH_PLUGIN_TIMEOUT_S="1", PYTHONPATH=plugin_path)
    proc = run([sys.executable, "-m", "gcpatch", "doctor", "--no-import"], tmp_path, env, TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert "sleepy: failed - did not import within 1 s\n" in out, out
    assert (
        "waits that long for it (GCPATCH_PLUGIN_TIMEOUT_S); GCPATCH_DISABLE_PLUGINS=sleepy" in out
    )
