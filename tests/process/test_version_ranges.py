"""Plugin ranges against the installed release, with a stub framework (no torch, no transformers:
this file runs on every Python gcpatch claims).

A plugin declares the range it can work in (`versions`: outside it, skipped) and the range its
tests prove (`proven`: outside it the plugin still runs, fail-open, and gcpatch says once per job,
once the framework is imported, "untested <framework> <version>"); `gcpatch doctor` shows both
against the installed version.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from testkit.harness import result_of, run_python

PLUGIN = """
from gcpatch.hookspecs import hookimpl
from gcpatch.schema import PatchPoint, PluginInfo

INFO = PluginInfo(name="stub", framework="stubfw", versions=">=1,<3", proven=">=1.0,<=1.5")


@hookimpl
def gcpatch_plugin_info():
    return INFO


@hookimpl
def gcpatch_patch_points():
    return [PatchPoint("stubfw", "Model.enable", _enable, why="the stub's enable call")]


@hookimpl
def gcpatch_vote(facts):
    return []


def _enable(wrapped, instance, args, kwargs):
    instance.seen_by_gcpatch = True
    return wrapped(*args, **kwargs)
"""


def stub_site(root: Path, version: str) -> Path:
    """A directory for PYTHONPATH holding the stub framework `stubfw` at `version` and a plugin
    registered in gcpatch's entry-point group, as an installed distribution would be."""
    site = root / f"site-{version}"
    (site / "stubfw").mkdir(parents=True)
    (site / "stubfw" / "__init__.py").write_text(
        "class Model:\n    def enable(self):\n        return 'enabled'\n"
    )
    info = site / f"stubfw-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: stubfw\nVersion: {version}\n")
    (site / "stub_gcpatch.py").write_text(PLUGIN)
    plugin_info = site / "stub_gcpatch-0.1.dist-info"
    plugin_info.mkdir()
    (plugin_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: stub-gcpatch\nVersion: 0.1\n"
    )
    (plugin_info / "entry_points.txt").write_text("[gcpatch.plugins]\nstub = stub_gcpatch\n")
    return site


LOAD_TWICE = """
import json
import gcpatch.engine as engine
host = engine.start()
status = next(s for s in host.statuses if s.name == "stub")
import stubfw
m = stubfw.Model()
out = m.enable()
engine.stop(); engine.start()  # a second start in the same process says nothing new
print("RESULT " + json.dumps({"state": status.state, "untested": status.untested, "why": status.why,
                              "patched": getattr(m, "seen_by_gcpatch", False), "out": out}))
"""


@pytest.mark.parametrize(
    "version, state, untested",
    [
        ("1.2", "active", False),  # proven
        ("2.0", "active", True),  # supported, not proven: runs, says so once
        ("3.1", "skipped", False),  # outside what the plugin can work with
    ],
)
def test_plugin_range_proven_untested_and_unsupported(tmp_path, version, state, untested):
    site = stub_site(tmp_path, version)
    proc = run_python(
        LOAD_TWICE, tmp_path, PYTHONPATH=str(site), GCPATCH_DISABLE_PLUGINS=_builtins()
    )
    result = result_of(proc)
    assert result["state"] == state, proc.stderr
    assert result["untested"] is untested
    assert result["patched"] is (state == "active")
    assert result["out"] == "enabled"  # the framework's own result, whatever gcpatch did
    said = proc.stderr.count(f"untested stubfw {version}")
    assert said == (1 if untested else 0), proc.stderr
    if state == "skipped":
        assert "stubfw 3.1 is outside the supported range >=1,<3" in proc.stderr


NEVER_IMPORTED = """
import json
import gcpatch.engine as engine
host = engine.start()
status = next(s for s in host.statuses if s.name == "stub")
print("RESULT " + json.dumps({"untested": status.untested}), flush=True)
"""


def test_an_untested_release_is_said_only_once_its_framework_is_imported(tmp_path):
    """The plugins load at the first checkpointing call, whatever the script imports: a script
    that never imports the framework hears nothing of its release; one that does hears one short
    line naming the way to check the job (GCPATCH_VERIFY=1)."""
    site = stub_site(tmp_path, "2.0")
    env = {"PYTHONPATH": str(site), "GCPATCH_DISABLE_PLUGINS": _builtins()}
    silent = run_python(NEVER_IMPORTED, tmp_path, **env)
    assert result_of(silent) == {"untested": True}
    assert "untested" not in silent.stderr, silent.stderr
    said = run_python(LOAD_TWICE, tmp_path, **env)
    lines = [line for line in said.stderr.splitlines() if "untested stubfw 2.0" in line]
    assert lines == [
        "gcpatch: untested stubfw 2.0 (proven >=1.0,<=1.5); check your job with GCPATCH_VERIFY=1"
    ], said.stderr


@pytest.mark.parametrize("rank, said", [("0", 1), ("1", 0)])
def test_an_unsupported_release_is_said_once_per_job(tmp_path, rank, said):
    """Every rank loads the same plugins: local rank 0 says the skip, the others keep it at DEBUG."""
    site = stub_site(tmp_path, "3.1")
    proc = run_python(
        LOAD_TWICE,
        tmp_path,
        PYTHONPATH=str(site),
        GCPATCH_DISABLE_PLUGINS=_builtins(),
        LOCAL_RANK=rank,
    )
    assert result_of(proc)["state"] == "skipped"
    assert proc.stderr.count("stubfw 3.1 is outside the supported range >=1,<3") == said, (
        proc.stderr
    )


def test_doctor_shows_proven_range_against_the_installed_version(tmp_path):
    site = stub_site(tmp_path, "2.0")
    proc = run_python(
        "from gcpatch.commands.cli import main; raise SystemExit(main(['doctor']))",
        tmp_path,
        PYTHONPATH=str(site),
        GCPATCH_DISABLE_PLUGINS=_builtins(),
    )
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.strip().startswith("stub:"))
    assert (
        line.strip()
        == "stub: active stubfw 2.0 (supports >=1,<3) proven >=1.0,<=1.5: UNTESTED release"
    ), line
    assert "stubfw.Model.enable: live" in proc.stdout
    assert proc.stderr.count("untested stubfw 2.0") == 1


def test_doctor_without_any_framework_runs(tmp_path):
    """The engine starts and doctor prints on every claimed Python, frameworks or not."""
    proc = run_python(
        "from gcpatch.commands.cli import main; raise SystemExit(main(['doctor', '--no-import']))",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "plugins" in proc.stdout and "Traceback" not in proc.stderr


def _builtins() -> str:
    """The built-in plugins stay out of these runs: only the stub's lines are read."""
    return "transformers,peft,trl,deepspeed,ddp,axolotl,colossalai,torch"


def test_stub_site_is_a_real_distribution(tmp_path):
    site = stub_site(tmp_path, "1.2")
    proc = run_python(
        textwrap.dedent("""
        import json
        from importlib import metadata
        eps = [ep.name for ep in metadata.distribution("stub-gcpatch").entry_points]
        print("RESULT " + json.dumps([metadata.version("stubfw"), eps]))
    """),
        tmp_path,
        PYTHONPATH=str(site),
    )
    assert result_of(proc) == ["1.2", ["stub"]]


def test_installed_version_reads_what_importlib_metadata_reads_for_every_installed_distribution():
    """The dist-info folder name stands in for METADATA's Version (the first enable's plugin checks):
    the same answer for every distribution here, wheels and anything else."""
    from importlib import metadata

    from gcpatch.facts import installed_version

    names = {d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"]}
    assert len(names) > 3
    assert {n: installed_version(n) for n in names} == {n: metadata.version(n) for n in names}
    assert installed_version("no-such-distribution-gcpatch-test") is None


def test_installed_version_of_a_wheel_reads_no_metadata(tmp_path, monkeypatch):
    """A wheel's `name-version.dist-info` answers without METADATA being read (parsing it costs
    milliseconds per plugin at every process's first enable); a folder that does not follow the
    wheel spec's `name-version` is read from METADATA."""
    from importlib import metadata

    from gcpatch.facts import installed_version

    site = stub_site(tmp_path, "1.2")
    legacy = site / "legacy_fw-0.3-py3.9.dist-info"  # not `name-version`: the folder cannot say
    legacy.mkdir()
    (legacy / "METADATA").write_text("Metadata-Version: 2.1\nName: legacy-fw\nVersion: 0.3\n")
    monkeypatch.syspath_prepend(str(site))
    read: list[str] = []
    original = metadata.PathDistribution.read_text

    def counting(self, filename):
        read.append(f"{self._path.name}/{filename}")
        return original(self, filename)

    monkeypatch.setattr(metadata.PathDistribution, "read_text", counting)
    assert installed_version("stubfw") == "1.2"
    assert read == []
    assert installed_version("legacy-fw") == "0.3"
    assert "legacy_fw-0.3-py3.9.dist-info/METADATA" in read
