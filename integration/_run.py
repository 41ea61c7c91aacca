"""Running the user scripts under integration/scripts/ as a user would: an interpreter of this
venv (`sys.executable`; started warm where it can, tests/kit/testkit/warm_starts.py), cwd a temporary
directory (so the INSTALLED gcpatch is the one that runs, never the checkout), HF_HUB_OFFLINE=1,
and either GCPATCH=0 (the plain run) or GCPATCH=1 with GCPATCH_RECORD=<dir>. Nothing here
imports gcpatch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.version import Version
from testkit.harness import child_env, free_port, parse_results, torchrun_argv
from testkit.harness import run as harness_run
from testkit.warm_starts import summary as warm_starts_summary  # noqa: F401 - conftest reads it here

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# A decision's short line on the console (gcpatch/headline.py)
DECISION_LINE = re.compile(
    r"gcpatch: (checkpoint call at \S+|[\w.-]+( \([\w.-]+\))?): "
    r"(use_reentrant|\d+ eval-mode|eval-mode|input-grads|runs inline|bound tensors|left as asked"
    r"|an input that requires grad|result passed through|[A-Z]+\d+ overrules your"
    r"|warn mode (keeps|leaves))"
)
LINE_LIMIT = 120  # gcpatch/headline.py LIMIT: one terminal row
CUT_WORD = re.compile(r"[A-Za-z]\.\.\.(?=[\s)]|$)")  # "needs t...": a word cut where it stood
BLUNT = Path(__file__).resolve().parent / "blunt"  # sitecustomize.py: the force-non-reentrant patch
TIMEOUT_S = 300
# the scripts whose runs take longer than TIMEOUT_S (none now; a test module may add its own)
SCRIPT_TIMEOUT_S: dict[str, int] = {}
# torch 2.13's gloo may abort a rank as the interpreter exits when the job never destroyed its process
# group (std::terminate from a gloo worker thread during finalization; pytorch/pytorch#179291). The
# Trainer scripts leave that to the interpreter as most user scripts do, and FSDP2's runs hit it too:
# measured plain and with gcpatch alike, a few runs in a hundred, always after every rank's RESULT.
TEARDOWN_ABORT = "terminate called without an active exception"

TRANSFORMERS = Version(metadata.version("transformers"))
V5 = TRANSFORMERS.major >= 5
PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def reentrant(value: object) -> object:
    """The use_reentrant a checkpointed layer runs with. 'unset' (the Trainer of 4.35-4.4x passes
    `gradient_checkpointing_kwargs={}`, so the layers get no keyword) is torch's own default: True on
    torch 2.13 (torch/utils/checkpoint.py: `if use_reentrant is None: warn; use_reentrant = True`)."""
    return True if value == "unset" else value


def plugin_range(plugin: str) -> str:
    """The framework range a built-in plugin declares (`versions=` of its PluginInfo), read from its
    source so that this process never imports (and so never activates) gcpatch."""
    import ast

    for node in ast.walk(ast.parse((PLUGINS / f"{plugin}.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "PluginInfo":
            return next(k.value.value for k in node.keywords if k.arg == "versions")
    raise LookupError(f"no PluginInfo in plugins/{plugin}.py")


def outside_plugin_range(plugin: str, dist: str | None = None) -> str:
    """Why the rules of `plugin` do not apply on the installed release ('' when they do): below its
    declared range gcpatch skips the plugin, so its integration tests are skipped with this reason."""
    from packaging.specifiers import SpecifierSet

    dist = dist or plugin
    try:
        installed = Version(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return f"{dist} not installed"
    spec = plugin_range(plugin)
    return (
        ""
        if installed in SpecifierSet(spec)
        else f"{dist} {installed} is outside the {plugin} plugin's range {spec}: gcpatch skips the plugin there"
    )


# How a script is started: a plain interpreter, `torch.distributed.run --nproc_per_node=2` (gloo,
# one RESULT line per rank), or one DeepSpeed process on CPU (the env torchrun would give it).
LAUNCHERS = ("python", "torchrun2", "deepspeed1")


@dataclass(frozen=True)
class Spec:
    """One script invocation: which script, which variant arguments, plain or with gcpatch, extra
    environment (e.g. GCPATCH_MODE) and launcher."""

    script: str
    args: tuple[str, ...] = ()
    gcpatch: bool = True
    env: tuple[tuple[str, str], ...] = ()
    launcher: str = "python"
    blunt: bool = (
        False  # GCPATCH=0 with the force-non-reentrant patch (integration/blunt) on PYTHONPATH
    )

    def plain(self) -> "Spec":
        """The same run with GCPATCH=0: gcpatch's own variables (GCPATCH_MODE, ...) are dropped, so
        every gcpatch mode of one script shares one plain run."""
        env = tuple((k, v) for k, v in self.env if not k.startswith("GCPATCH"))
        return Spec(self.script, self.args, False, env, self.launcher)

    def forced_non_reentrant(self) -> "Spec":
        """The plain run with the blunt fix many scripts carry: every checkpoint call non-reentrant."""
        return Spec(self.script, self.args, False, self.plain().env, self.launcher, blunt=True)

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.env)
        launcher = "" if self.launcher == "python" else f"{self.launcher}: "
        how = "blunt" if self.blunt else ("GCPATCH=1" if self.gcpatch else "GCPATCH=0")
        return f"{launcher}{self.script} {' '.join(self.args)} [{how}{extra}]"


@dataclass
class Run:
    spec: Spec
    returncode: int
    stdout: str
    stderr: str
    record_dir: Path
    wall_s: float = 0.0
    result: dict = field(default_factory=dict)
    # every RESULT line (one per rank under torchrun2, sorted by rank); `result` is rank 0's
    results: list = field(default_factory=list)

    def gcpatch_lines(self) -> list[str]:
        """gcpatch's decisions on stderr, each whole (a long one wraps into indented rows;
        gcpatch/headline.py: `gcpatch: <model>[ (<source>)]: <what changed> (<rule>: <why>)`, or
        `gcpatch: checkpoint call at <file:line>: ...`)."""
        return [line for line in self.messages() if DECISION_LINE.match(line)]

    def messages(self) -> list[str]:
        """stderr with each gcpatch message whole: a long one (a budget's plan, a verification) is
        wrapped at words into indented continuation lines (gcpatch/headline.py `wrap`)."""
        out: list[str] = []
        for line in self.stderr.splitlines():
            if line.startswith("    ") and out and out[-1].startswith("gcpatch: "):
                out[-1] += " " + line[4:]
            else:
                out.append(line)
        return out

    def line_problems(self) -> list[str]:
        """gcpatch's console lines and crash notes that are not whole: longer than the limit, or
        with a word cut short ("needs t..."). Every run the suite reads is checked
        (conftest.ScriptRuns.get); at GCPATCH_LOG=debug the full DEBUG detail lines are exempt, and
        so is a traceback's last line (a strict-mode GcpatchError's whole text)."""
        if ("GCPATCH_LOG", "debug") in self.spec.env:
            return []
        texts = self.stderr.splitlines()
        for result in self.results or [self.result]:
            texts += [line for note in _notes(result) for line in note.splitlines()]
        out, ours = [], False
        for line in texts:
            if line.startswith("gcpatch.errors."):  # a traceback's last line: the exception's text
                ours = False
                continue
            if line.startswith("gcpatch"):
                ours = True
            elif not line.startswith("  "):
                ours = False
            if not ours:
                continue
            if len(line) > LINE_LIMIT:
                out.append(f"longer than {LINE_LIMIT} characters ({len(line)}): {line}")
            if CUT_WORD.search(line):
                out.append(f"a word cut short: {line}")
        return out

    def records(self) -> list[dict]:
        """Every JSONL record gcpatch wrote under GCPATCH_RECORD, in file order."""
        entries = []
        for path in sorted(self.record_dir.glob("*.jsonl")):
            entries.extend(
                json.loads(line) for line in path.read_text().splitlines() if line.strip()
            )
        return entries

    def records_by_rank(self) -> dict[int, list[dict]]:
        """{rank: that rank's JSONL records}, from the file names gcpatch-rank<N>.jsonl."""
        out = {}
        for path in sorted(self.record_dir.glob("gcpatch-rank*.jsonl")):
            rank = int(path.stem[len("gcpatch-rank") :])
            out[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def explain(self, verbose: bool = True) -> subprocess.CompletedProcess:
        """`gcpatch explain` (with -v by default: the detail lines name what was asked and applied)."""
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "gcpatch",
                "explain",
                *(["-v"] if verbose else []),
                str(self.record_dir),
            ],
            cwd=self.record_dir.parent,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )

    def exited_cleanly(self) -> bool:
        """Exit 0, or a distributed run whose every rank printed its RESULT and then lost a rank to
        gloo's teardown abort (TEARDOWN_ABORT, SIGABRT): the figures are complete, the abort came after."""
        if self.returncode == 0:
            return True
        return (
            self.spec.launcher == "torchrun2"
            and len(self.results) == expected_results(self.spec)
            and TEARDOWN_ABORT in self.stderr
            and "exitcode  : -6" in self.stderr
        )

    def describe(self) -> str:
        return f"{self.spec.label()} rc={self.returncode} ({self.wall_s:.1f} s)\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-4000:]}"


def command(spec: Spec) -> tuple[list[str], dict[str, str]]:
    """The command line and the extra environment of one launcher."""
    script = [str(SCRIPTS / spec.script), *spec.args]
    if spec.launcher == "python":
        return [sys.executable, *script], {}
    if spec.launcher == "torchrun2":
        return torchrun_argv(2, *script), {}
    if spec.launcher == "deepspeed1":
        return [sys.executable, *script], dict(
            DS_ACCELERATOR="cpu",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            DS_BUILD_OPS="0",
        )
    raise ValueError(f"unknown launcher {spec.launcher!r}")


PORT_TAKEN = "EADDRINUSE"  # torch's TCPStore could not listen on the rendezvous port


def expected_results(spec: Spec) -> int:
    return 2 if spec.launcher == "torchrun2" else 1


def run_script(spec: Spec, workdir: Path) -> Run:
    """Run one script in `workdir` (a fresh temporary directory) and parse its RESULT line(s).

    The plain run gets GCPATCH=0 *and* a GCPATCH_RECORD directory: nothing may be written there."""
    workdir.mkdir(parents=True, exist_ok=True)
    record_dir = workdir / "gcpatch-record"
    argv, launch_env = command(spec)
    env = child_env(
        GCPATCH_RECORD=str(record_dir),
        **launch_env,
        **{"GCPATCH": "1" if spec.gcpatch else "0", **dict(spec.env)},
    )
    if (
        env.get("GCPATCH") == "unset"
    ):  # a script that switches gcpatch on by an explicit `import gcpatch`
        del env["GCPATCH"]
    if spec.blunt:
        env["PYTHONPATH"] = str(BLUNT)
    limit = SCRIPT_TIMEOUT_S.get(spec.script, TIMEOUT_S)
    start = time.monotonic()
    proc = harness_run(argv, workdir, env, limit, warm=True)
    if (
        spec.launcher != "python"
        and PORT_TAKEN in (proc.stderr or "")
        and not parse_results(proc.stdout or "")
    ):
        # another process bound the rendezvous port between its draw and the run: the run never
        # started, so it runs again on a new one
        argv, launch_env = command(spec)
        env.update(launch_env)
        proc = harness_run(argv, workdir, env, limit, warm=True)
    run = Run(spec, proc.returncode, proc.stdout, proc.stderr, record_dir, time.monotonic() - start)
    results = parse_results(proc.stdout)
    # a distributed run whose ranks crashed may still exit non-zero after printing its RESULT lines
    if len(results) == expected_results(spec) and (
        proc.returncode == 0 or spec.launcher != "python"
    ):
        run.results = sorted(results, key=lambda r: r.get("rank", 0))
        run.result = run.results[0]
    return run


def _notes(value: object) -> list[str]:
    """Every crash note a script's RESULT carries (`notes`, at any depth: one per case)."""
    if isinstance(value, dict):
        found = [str(n) for n in value.get("notes") or [] if isinstance(value.get("notes"), list)]
        return found + [n for k, v in value.items() if k != "notes" for n in _notes(v)]
    if isinstance(value, list):
        return [n for v in value for n in _notes(v)]
    return []
