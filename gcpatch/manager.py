"""A typed facade over pluggy, so the core never calls `pm.hook.*` itself.

Loads plugins from the entry-point group, applies the block list (GCPATCH_DISABLE_PLUGINS),
checks each plugin's declared framework range before its patches exist, and isolates one
plugin's failure from the others (a plugin error fails open).
"""

from __future__ import annotations

import logging
import sys
import time
import types
from dataclasses import replace
from importlib import metadata
from typing import Any, Mapping

import pluggy

from gcpatch import (
    console,
    deadline,
    hookspecs,
    import_hooks,
    plugin_scan,
    release_range,
    settings,
)
from gcpatch.errors import GcpatchError
from gcpatch.facts import installed_version
from gcpatch.schema import (
    EVAL_MODE_FIX,
    FAILURE_ORDER,
    GRAD_INPUT,
    INPUT_GRADS_HOOK,
    KNOBS,
    LIFT_BOUND_TENSORS,
    STRENGTH_ORDER,
    TUPLE_OUTPUTS,
    USE_CACHE_OFF,
    USE_REENTRANT,
    USER,
    CallFacts,
    Facts,
    PatchPoint,
    PluginInfo,
    Vote,
)

log = logging.getLogger("gcpatch")


class PluginStatus:
    """What `gcpatch doctor` says of one plugin."""

    __slots__ = ("name", "state", "why", "info", "framework_version", "patch_points", "untested")

    def __init__(
        self, name: str, state: str, why: str = "", info: PluginInfo | None = None
    ) -> None:
        self.name = name
        self.state = state  # "active" | "skipped" | "blocked" | "failed"
        self.why = why
        self.info = info
        self.framework_version: str | None = None
        self.patch_points: list[PatchPoint] = []
        # inside the supported range, outside the range gcpatch's tests prove
        self.untested = False

    def __repr__(self) -> str:
        return f"PluginStatus({self.name!r}, {self.state!r}, {self.why!r})"


class PluginHost:
    def __init__(self, strict: bool = False) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs.PluginSpec)
        self._strict = strict
        self._reported: set[tuple[str, str]] = set()
        self.statuses: list[PluginStatus] = []
        self._failed_votes: set[tuple[str, str, str]] = set()  # vote failures already warned about
        self._builtin: set[str] = set()  # plugins of gcpatch_plugins: run without a deadline
        self._slow: set[tuple[str, str]] = set()  # (plugin, hook) already said to be slow

    @classmethod
    def from_entry_points(
        cls, blocked: frozenset[str] = frozenset(), strict: bool = False
    ) -> PluginHost:
        host = cls(strict=strict)
        found, listed = plugin_scan.scan()
        unknown = sorted(blocked - {ep.name for ep in found})
        if unknown:
            log.warning(
                "gcpatch: GCPATCH_DISABLE_PLUGINS names no installed plugin: %s (installed: %s); "
                "nothing else is blocked",
                ", ".join(unknown),
                ", ".join(sorted(ep.name for ep in found)),
            )
        for ep in sorted(found, key=_builtin_first):
            if ep.name in blocked:
                host.statuses.append(
                    PluginStatus(ep.name, "blocked", "named in GCPATCH_DISABLE_PLUGINS")
                )
                continue
            try:
                plugin = _loaded(ep)
            except PluginNotImported as exc:  # fail open: this plugin only, one line
                host._not_imported(ep.name, exc)
                continue
            except Exception as exc:  # noqa: BLE001 (fail open: this plugin only, one line)
                host._failed(ep.name, f"could not be loaded from {ep.value}", exc)
                continue
            host.add(plugin, ep.name, listed)
        return host

    def _not_imported(self, name: str, exc: PluginNotImported) -> None:
        """A plugin whose import was not waited for to its end: failed for this host, which never
        registers it (a later activation's host tries again); strict mode raises instead."""
        self.statuses.append(PluginStatus(name, "failed", exc.why))
        if self._strict:
            raise GcpatchError(
                f"plugin {name!r} {exc.why}",
                rule=f"plugin:{name}",
                fix=f"fix the plugin's import or block it with GCPATCH_DISABLE_PLUGINS={name}",
            ) from exc
        log.error(
            "gcpatch: plugin %s %s; the job goes on without it (GCPATCH_PLUGIN_TIMEOUT_S sets the"
            " wait, GCPATCH_DISABLE_PLUGINS=%s blocks it)",
            name,
            exc.why,
            name,
        )

    def add(
        self,
        plugin: object,
        name: str,
        listed: dict[str, plugin_scan.Listed] | None = None,
    ) -> PluginStatus:
        """Register one plugin object (module or instance) and check its framework version;
        `listed`: the distributions on sys.path by normalized name, where the entry-point scan has
        listed them already (else metadata is searched for the framework)."""
        if getattr(plugin, "__name__", "").startswith("gcpatch_plugins."):
            self._builtin.add(name)
        try:
            self._pm.register(_hooks_of(plugin), name=name)
            info = self._call_one(name, "gcpatch_plugin_info")
            if not isinstance(info, PluginInfo):
                raise TypeError(
                    f"gcpatch_plugin_info returned {type(info).__name__}, not PluginInfo"
                )
        except Exception as exc:  # noqa: BLE001 (fail open: this plugin only, one line)
            self._unregister(name)
            return self._failed(name, "failed in gcpatch_plugin_info", exc)
        status = PluginStatus(name, "active", info=info)
        installed = (
            plugin_scan.version(info.framework, listed)
            if listed is not None
            else installed_version(info.framework)
        )
        status.framework_version = installed
        if installed is None:
            status.state, status.why = "skipped", f"{info.framework} is not installed"
            log.debug("gcpatch: plugin %s skipped: %s", name, status.why)
        elif not release_range.contains(info.versions, installed):
            status.state = "skipped"
            status.why = (
                f"{info.framework} {installed} is outside the supported range {info.versions}"
            )
            _say_once(logging.ERROR, f"gcpatch: plugin {name} skipped: {status.why}")
        elif info.proven and not release_range.contains(info.proven, installed):
            status.untested = True
            _say_untested(info.framework, installed, info.proven)
        if status.state != "active":
            self._unregister(name)
            self.statuses.append(status)
            return status
        try:
            points = self._call_one(name, "gcpatch_patch_points") or []
            if not isinstance(points, (list, tuple)) or not all(
                isinstance(p, PatchPoint) for p in points
            ):
                raise TypeError(
                    f"gcpatch_patch_points returned {_describe(points)}, not a list of PatchPoint"
                )
            status.patch_points = list(points)
        except Exception as exc:  # noqa: BLE001 (fail open: this plugin only, one line)
            self._unregister(name)
            return self._failed(name, "failed in gcpatch_patch_points", exc)
        self.statuses.append(status)
        return status

    def active(self) -> list[PluginStatus]:
        return [s for s in self.statuses if s.state == "active"]

    def rules(self) -> list[tuple[str, object]]:
        """(plugin name, Rule) for every active plugin's rule table."""
        return [(s.name, rule) for s in self.active() for rule in (s.info.rules if s.info else ())]

    def votes(self, facts: Facts) -> list[Vote]:
        """Every active plugin's votes, in plugin order. A plugin that raises or returns
        something that is not a list of valid votes is dropped from this decision, with one
        warning naming it: the other plugins' rules (the built-in ones included) still decide.
        A partial vote could be wrong, so none of that plugin's votes count. Strict mode
        raises instead (`PluginFailure`, turned into a GcpatchError by the pipeline)."""
        return self._gather("gcpatch_vote", facts)

    def with_framework_facts(self, facts: Facts) -> Facts:
        """`facts` with every active plugin's `gcpatch_facts` merged into `framework_facts`.
        A plugin that raises or answers something other than a mapping of names is left out of
        this decision with one warning (strict: `PluginFailure`); a name two plugins give keeps
        the first plugin's value, with a warning."""
        merged: dict[str, Any] = dict(facts.framework_facts)
        for status in self.active():
            try:
                found = self._call_one(status.name, "gcpatch_facts", facts=facts)
                if found is None:
                    continue
                if not isinstance(found, Mapping) or not all(isinstance(k, str) for k in found):
                    raise TypeError(
                        f"gcpatch_facts returned {_describe(found)}, not a mapping of names"
                    )
            except Exception as exc:  # noqa: BLE001 (fail open: this plugin, this decision)
                if self._strict:
                    raise PluginFailure(status.name, "gcpatch_facts", exc) from exc
                self._dropped(status.name, "gcpatch_facts", exc)
                continue
            for name, value in found.items():
                if name in merged and merged[name] != value:
                    log.warning(
                        "gcpatch: plugin %s gives fact %r=%r, already %r from another plugin; the"
                        " first stands",
                        status.name,
                        name,
                        value,
                        merged[name],
                    )
                    continue
                merged[name] = value
        return replace(facts, framework_facts=merged) if merged != facts.framework_facts else facts

    def call_votes(self, facts: CallFacts) -> list[Vote]:
        """Every active plugin's votes on one checkpoint call's facts (`gcpatch_call_vote`),
        isolated per plugin as `votes` is."""
        return self._gather("gcpatch_call_vote", facts)

    def _gather(self, hook: str, facts: object) -> list[Vote]:
        votes: list[Vote] = []
        for status in self.active():
            try:
                result = _checked_votes(self._call_one(status.name, hook, facts=facts))
            except Exception as exc:  # noqa: BLE001 (fail open: this plugin, this decision)
                if self._strict:
                    raise PluginFailure(status.name, hook, exc) from exc
                self._dropped(status.name, hook, exc)
                continue
            declared = (
                {rule.id for rule in status.info.rules if not rule.documents}
                if status.info
                else set()
            )
            for vote in result:
                if vote.rule not in declared:
                    self._undeclared(status.name, vote.rule)
                    continue
                votes.append(_stamped(vote, status.name))
        return votes

    def _dropped(self, name: str, hook: str, exc: BaseException) -> None:
        if isinstance(exc, PluginHung):  # said once, as the plugin was switched off
            return
        key = (name, hook, f"{type(exc).__name__}: {exc}")
        first = key not in self._failed_votes
        self._failed_votes.add(key)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "gcpatch: plugin %s dropped from this decision, its %s failed (%s: %s); "
            "the other plugins' rules, the built-in ones included, still decide",
            name,
            hook,
            type(exc).__name__,
            exc,
        )

    def _undeclared(self, plugin: str, rule: str) -> None:
        """A vote whose rule is not in its plugin's table cannot be explained: it is dropped."""
        text = (
            f"plugin {plugin!r} voted with rule {rule!r}, which its rule table does not declare as"
            " a voting rule"
        )
        if self._strict:
            raise GcpatchError(
                text, rule=f"plugin:{plugin}", fix=f"declare {rule} in gcpatch_plugin_info's rules"
            )
        if (plugin, rule) not in self._reported:
            self._reported.add((plugin, rule))
            log.warning("gcpatch: %s; the vote is ignored", text)

    def _call_one(self, name: str, hook: str, **kwargs):  # noqa: ANN202
        """One plugin's hook. Whatever it raises (SystemExit from an argparse at its import, say)
        comes back as an Exception naming it; only a KeyboardInterrupt passes. A built-in plugin
        runs in the caller's thread; another runs under a deadline (GCPATCH_PLUGIN_TIMEOUT_S): a
        hook that does not return by then is left behind, and its plugin is off for the process.
        One that is slower than HOOK_SLOW_S is said once."""
        impl = next(
            (i for i in getattr(self._pm.hook, hook).get_hookimpls() if i.plugin_name == name),
            None,
        )
        if impl is None:
            return None
        start = time.perf_counter()
        if name in self._builtin:
            result = plugin_code(impl.function, **kwargs)
        else:
            result = self._with_deadline(name, hook, impl.function, kwargs)
        spent = time.perf_counter() - start
        if spent > HOOK_SLOW_S and (name, hook) not in self._slow:
            self._slow.add((name, hook))
            log.warning(
                "gcpatch: plugin %s took %.1f s in %s (more than %g s); every decision waits for"
                " it (GCPATCH_DISABLE_PLUGINS=%s blocks it)",
                name,
                spent,
                hook,
                HOOK_SLOW_S,
                name,
            )
        return result

    def _with_deadline(self, name: str, hook: str, function: Any, kwargs: dict) -> Any:
        limit = settings.read().plugin_timeout_s
        outcome = deadline.run(function, kwargs, limit)
        if outcome.timed_out:
            self._off(
                name, f"its {hook} did not return within {limit:g} s (GCPATCH_PLUGIN_TIMEOUT_S)"
            )
            raise PluginHung(f"{hook} did not return within {limit:g} s; it is left running")
        if outcome.error is not None:
            raise _as_exception(outcome.error)
        return outcome.value

    def _off(self, name: str, why: str) -> None:
        """A plugin that cannot be waited for: off for the rest of the process, said once."""
        for status in self.statuses:
            if status.name == name and status.state == "active":
                status.state, status.why = "failed", why
                log.error("gcpatch: plugin %s disabled for this process: %s", name, why)
        self._unregister(name)

    def _unregister(self, name: str) -> None:
        if self._pm.get_plugin(name) is not None:
            self._pm.unregister(name=name)

    def _failed(self, name: str, what: str, exc: BaseException) -> PluginStatus:
        status = PluginStatus(name, "failed", f"{what}: {type(exc).__name__}: {exc}")
        self.statuses.append(status)
        if self._strict:
            raise GcpatchError(
                f"plugin {name!r} {status.why}",
                rule=f"plugin:{name}",
                fix=f"fix the plugin or block it with GCPATCH_DISABLE_PLUGINS={name}",
            ) from exc
        log.error("gcpatch: plugin %s disabled, %s", name, status.why)
        return status


# A hook slower than this is said once (it slows every decision it takes part in).
HOOK_SLOW_S = 1.0


class PluginRaised(Exception):
    """A plugin's code raised something that is not an Exception (SystemExit, a custom
    BaseException): carried as one, so the plugin fails open like any other."""


class PluginHung(Exception):
    """A plugin's hook did not return within GCPATCH_PLUGIN_TIMEOUT_S."""


class PluginNotImported(Exception):
    """A third-party plugin whose import was not waited for to its end; `why` says how."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# Python's import locks (Lib/importlib/_bootstrap.py): an import holds its module's lock while the
# module runs, and a second import of a module still initializing waits on that lock. So: (1) a
# third-party plugin is imported in a thread the caller waits for no longer than the deadline:
# were the caller holding a lock that import needs (the engine started inside another module's
# import), the wait still ends at the deadline; (2) gcpatch never imports a plugin module whose
# import has not ended: this host drops the plugin, a later host (a re-activation) finds the module
# still initializing in sys.modules and skips it at once, or, once that import ended, gets it from
# sys.modules. Only the user's own import of that module waits on its lock, as it would wait for
# the hanging module without gcpatch.
def _loaded(ep: metadata.EntryPoint) -> object:
    """The object `ep` names. A built-in plugin (gcpatch_plugins.*) is imported in the caller's
    thread, no thread started; a third-party one under its hooks' deadline
    (GCPATCH_PLUGIN_TIMEOUT_S, gcpatch/deadline.py). Past it PluginNotImported; what the import
    gives later is dropped in its thread, so none of that plugin is registered."""
    if ep.value.startswith("gcpatch_plugins."):
        return plugin_code(ep.load)
    if _still_importing(ep.module):
        raise PluginNotImported(
            "is still being imported (an import started earlier in this process has not ended)"
        )
    limit = settings.read().plugin_timeout_s
    outcome = deadline.run(
        ep.load,
        {},
        limit,
        what=f"the import of plugin {ep.name}",
        thread_name="gcpatch-plugin-import",
    )
    if outcome.timed_out:
        raise PluginNotImported(f"did not import within {limit:g} s")
    if outcome.error is not None:
        raise _as_exception(outcome.error)
    return outcome.value


def _still_importing(module: str) -> bool:
    """Whether `module`, or a package above it, is in sys.modules and still initializing: an
    import of it has not ended (the test `_find_and_load` makes before waiting on its lock)."""
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        found = sys.modules.get(".".join(parts[:end]))
        if getattr(getattr(found, "__spec__", None), "_initializing", False):
            return True
    return False


def plugin_code(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Call plugin code; a BaseException other than KeyboardInterrupt comes back as an Exception
    (a plugin must never end the host's job, however it fails)."""
    try:
        return function(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except Exception:
        raise
    except BaseException as exc:  # noqa: BLE001 (SystemExit & co. from a plugin: carried, not lost)
        raise _as_exception(exc) from exc


def _as_exception(exc: BaseException) -> Exception:
    if isinstance(exc, Exception):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    return PluginRaised(f"{type(exc).__name__}: {exc}")


class PluginFailure(Exception):
    """A plugin raised while voting; carries which one, for the one log line."""

    def __init__(self, plugin: str, hook: str, exc: BaseException) -> None:
        self.plugin, self.hook, self.exc = plugin, hook, exc
        super().__init__(f"plugin {plugin!r} raised in {hook}: {type(exc).__name__}: {exc}")


def builtin_infos() -> list[tuple[str, PluginInfo]]:
    """(entry-point name, PluginInfo) of every built-in plugin, whether its framework is installed
    or not: what the generated rules document lists."""
    found = []
    for ep in sorted(_entry_points(hookspecs.ENTRY_POINT_GROUP), key=_builtin_first):
        if ep.value.startswith("gcpatch_plugins."):
            found.append((ep.name, ep.load().gcpatch_plugin_info()))
    return found


# The knobs whose value is a switch: a string "False" there would be read as True.
_VALUE_TYPES = {
    USE_REENTRANT: bool,
    INPUT_GRADS_HOOK: bool,
    USE_CACHE_OFF: bool,
    EVAL_MODE_FIX: bool,
    LIFT_BOUND_TENSORS: bool,
    GRAD_INPUT: bool,
    TUPLE_OUTPUTS: bool,
}


def _describe(value: object) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return f"a {type(value).__name__}"


def _checked_votes(result: object) -> list[Vote]:
    """A plugin's answer, or TypeError/ValueError saying what is wrong with it."""
    if result is None:
        return []
    if not isinstance(result, (list, tuple)):
        raise TypeError(f"returned {type(result).__name__}, not a list of Vote")
    for vote in result:
        if not isinstance(vote, Vote):
            raise TypeError(f"returned a {type(vote).__name__} among its votes, not a Vote")
        if vote.knob not in KNOBS:
            raise ValueError(f"voted on an unknown knob {vote.knob!r} (known: {', '.join(KNOBS)})")
        if vote.strength not in STRENGTH_ORDER or vote.strength == USER:
            raise ValueError(
                f"voted with strength {vote.strength!r} (a plugin's votes are required, "
                "recommended or default; 'user' is the user's own ask)"
            )
        if not isinstance(
            vote.value, _VALUE_TYPES.get(vote.knob, (bool, int, float, str, type(None)))
        ):
            raise TypeError(
                f"voted {vote.knob}={vote.value!r}, a {type(vote.value).__name__}, not a bool"
            )
        if not isinstance(vote.rule, str) or not vote.rule or not isinstance(vote.reason, str):
            raise TypeError(f"returned a vote without a rule id or reason ({vote.rule!r})")
        if vote.avoids not in FAILURE_ORDER:
            raise ValueError(
                f"vote {vote.rule} avoids {vote.avoids!r} (known:"
                f" {', '.join(k for k in FAILURE_ORDER if k)})"
            )
    return list(result)


def _stamped(vote: Vote, plugin: str) -> Vote:
    if vote.plugin:
        return vote
    return replace(vote, plugin=plugin)


class _ModuleHooks:
    """A plugin module's hook implementations, as pluggy registers them. pluggy reads every name
    `dir()` gives of what it registers through inspect.getattr_static: about 0.15 ms for each
    plugin module (its imports included) at the first enable of every process."""

    def __init__(self, module: types.ModuleType) -> None:
        marker = hookspecs.PROJECT + "_impl"
        self.__name__ = module.__name__
        self.__dict__.update(
            (name, value)
            for name, value in vars(module).items()
            if isinstance(value, (types.FunctionType, types.MethodType))
            and getattr(value, marker, None) is not None
        )

    def __dir__(self) -> list[str]:
        return [name for name in self.__dict__ if name != "__name__"]

    def __repr__(self) -> str:
        return f"<plugin module {self.__name__}>"


def _hooks_of(plugin: object) -> object:
    """What pluggy registers: a module's hooks alone (`_ModuleHooks`); anything else (a plugin
    instance) as it is."""
    return _ModuleHooks(plugin) if isinstance(plugin, types.ModuleType) else plugin


def _builtin_first(ep: metadata.EntryPoint) -> tuple[int, str]:
    # Built-ins load and log first; the resolver's outcome does not depend on this order.
    return (0 if ep.value.startswith("gcpatch_plugins.") else 1, ep.name)


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    """`entry_points(group=...)` is Python >= 3.10; 3.9 returns a dict of groups."""
    found = metadata.entry_points()
    if hasattr(found, "select"):
        return list(found.select(group=group))
    return list(found.get(group, ()))  # type: ignore[union-attr]


# What this process already said about plugin ranges: an installed release does not change while a
# process runs, so a re-activation does not say it again.
_said: set[str] = set()


def _say_once(level: int, text: str) -> None:
    """Once per process (a restarted engine loads the plugins again) and once per job, as the
    decision lines (gcpatch/console.py): every rank, and the launcher, load the same plugins."""
    if text in _said:
        return
    _said.add(text)
    log.log(level if console.speaker() else logging.DEBUG, "%s", text)


def _say_untested(framework: str, version: str, proven: str) -> None:
    """The plugin runs, but no matrix cell proves this release: one line per job, said only once
    the framework is imported (a script that never imports it hears nothing of it), with the way
    to check the user's own job."""
    text = (
        f"gcpatch: untested {framework} {version} (proven {proven}); check your job with"
        " GCPATCH_VERIFY=1"
    )
    import_hooks.when_imported(
        framework.replace("-", "_"), lambda _module: _say_once(logging.WARNING, text)
    )
