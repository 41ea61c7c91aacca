"""A typed facade over pluggy, so the core never calls `pm.hook.*` itself.

Loads plugins from the entry-point group, applies the block list (GCPATCH_DISABLE_PLUGINS),
checks each plugin's declared framework range before its patches exist, and isolates one
plugin's failure from the others (design card: a plugin error fails open).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib import metadata

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from gcpatch import hookspecs
from gcpatch.errors import GcpatchError
from gcpatch.schema import Facts, PatchPoint, PluginInfo, Vote

log = logging.getLogger("gcpatch")


@dataclass
class PluginStatus:
    """What `gcpatch doctor` says of one plugin."""

    name: str
    state: str  # "active" | "skipped" | "blocked" | "failed"
    why: str = ""
    info: PluginInfo | None = None
    framework_version: str | None = None
    patch_points: list[PatchPoint] = field(default_factory=list)
    untested: bool = False  # inside the supported range, outside the range the version matrix proves


class PluginHost:
    def __init__(self, strict: bool = False) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs.PluginSpec)
        self._strict = strict
        self.statuses: list[PluginStatus] = []

    @classmethod
    def from_entry_points(cls, blocked: frozenset[str] = frozenset(), strict: bool = False) -> PluginHost:
        host = cls(strict=strict)
        for ep in sorted(_entry_points(hookspecs.ENTRY_POINT_GROUP), key=_builtin_first):
            if ep.name in blocked:
                host.statuses.append(PluginStatus(ep.name, "blocked", "named in GCPATCH_DISABLE_PLUGINS"))
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001
                host._failed(ep.name, f"could not be loaded from {ep.value}", exc)
                continue
            host.add(plugin, ep.name)
        return host

    def add(self, plugin: object, name: str) -> PluginStatus:
        """Register one plugin object (module or instance) and check its framework version."""
        try:
            self._pm.register(plugin, name=name)
            info = self._call_one(name, "gcpatch_plugin_info")
            if not isinstance(info, PluginInfo):
                raise TypeError(f"gcpatch_plugin_info returned {type(info).__name__}, not PluginInfo")
        except Exception as exc:  # noqa: BLE001
            self._unregister(name)
            return self._failed(name, "failed in gcpatch_plugin_info", exc)
        status = PluginStatus(name, "active", info=info)
        installed = _installed_version(info.framework)
        status.framework_version = installed
        if installed is None:
            status.state, status.why = "skipped", f"{info.framework} is not installed"
            log.debug("gcpatch: plugin %s skipped: %s", name, status.why)
        elif not _in_range(installed, info.versions):
            status.state = "skipped"
            status.why = f"{info.framework} {installed} is outside the supported range {info.versions}"
            log.error("gcpatch: plugin %s skipped: %s", name, status.why)
        elif info.proven and not _in_range(installed, info.proven):
            status.untested = True
            _say_untested(info.framework, installed, info.proven)
        if status.state != "active":
            self._unregister(name)
            self.statuses.append(status)
            return status
        try:
            status.patch_points = list(self._call_one(name, "gcpatch_patch_points") or [])
        except Exception as exc:  # noqa: BLE001
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
        """Every active plugin's votes, in plugin order. A plugin that raises stops the decision
        (the caller falls back to the host's own behaviour): a partial vote could be wrong."""
        votes: list[Vote] = []
        for status in self.active():
            try:
                result = self._call_one(status.name, "gcpatch_vote", facts=facts) or []
            except Exception as exc:
                raise PluginFailure(status.name, "gcpatch_vote", exc) from exc
            votes.extend(_stamped(v, status.name) for v in result)
        return votes

    def _call_one(self, name: str, hook: str, **kwargs):  # noqa: ANN202
        for impl in getattr(self._pm.hook, hook).get_hookimpls():
            if impl.plugin_name == name:
                return impl.function(**kwargs)
        return None

    def _unregister(self, name: str) -> None:
        if self._pm.get_plugin(name) is not None:
            self._pm.unregister(name=name)

    def _failed(self, name: str, what: str, exc: BaseException) -> PluginStatus:
        status = PluginStatus(name, "failed", f"{what}: {type(exc).__name__}: {exc}")
        self.statuses.append(status)
        if self._strict:
            raise GcpatchError(f"plugin {name!r} {status.why}", rule=f"plugin:{name}",
                               fix=f"fix the plugin or block it with GCPATCH_DISABLE_PLUGINS={name}") from exc
        log.error("gcpatch: plugin %s disabled, %s", name, status.why)
        return status


class PluginFailure(Exception):
    """A plugin raised while voting; carries which one, for the one log line."""

    def __init__(self, plugin: str, hook: str, exc: BaseException) -> None:
        self.plugin, self.hook, self.exc = plugin, hook, exc
        super().__init__(f"plugin {plugin!r} raised in {hook}: {type(exc).__name__}: {exc}")


def _stamped(vote: Vote, plugin: str) -> Vote:
    if vote.plugin:
        return vote
    from dataclasses import replace

    return replace(vote, plugin=plugin)


def _builtin_first(ep: metadata.EntryPoint) -> tuple[int, str]:
    # Built-ins vote first so that ties between equal votes go to them (RULES.md §3).
    return (0 if ep.value.startswith("gcpatch_plugins.") else 1, ep.name)


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    """`entry_points(group=...)` is Python >= 3.10; 3.9 returns a dict of groups."""
    found = metadata.entry_points()
    if hasattr(found, "select"):
        return list(found.select(group=group))
    return list(found.get(group, ()))  # type: ignore[union-attr]


_untested_said: set[tuple[str, str]] = set()


def _say_untested(framework: str, version: str, proven: str) -> None:
    """Once per process and release: the plugin runs, but no matrix cell proves this release."""
    if (framework, version) in _untested_said:
        return
    _untested_said.add((framework, version))
    log.warning("gcpatch: untested %s %s (the version matrix proves %s); gcpatch keeps working where it can "
                "and falls back to %s's own behaviour where it cannot", framework, version, proven, framework)


def _installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _in_range(version: str, spec: str) -> bool:
    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return False
