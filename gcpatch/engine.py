"""The running engine: one plugin host and one patcher per process.

Started by the activation watcher when a framework is first imported; everything heavy
(wrapt, pluggy, entry points) is imported from here on, never earlier.
"""
from __future__ import annotations

from gcpatch import crash_notes, record, settings
from gcpatch.manager import PluginHost
from gcpatch.patching import Patcher

_host: PluginHost | None = None
_patcher: Patcher | None = None


def start() -> PluginHost:
    """Load the plugins and register their patch points. Idempotent."""
    global _host, _patcher
    if _host is not None:
        return _host
    cfg = settings.read()
    record.configure_logging(cfg.log_level)
    host = PluginHost.from_entry_points(blocked=cfg.blocked_plugins, strict=cfg.strict)
    patcher = Patcher(strict=cfg.strict)
    _host, _patcher = host, patcher
    for status in host.active():
        for point in status.patch_points:
            patcher.register(point, status.name)
    crash_notes.register()
    return host


def stop() -> None:
    """Restore every patched original; a later `start()` loads everything afresh."""
    global _host, _patcher
    if _patcher is not None:
        _patcher.uninstall_all()
    crash_notes.uninstall()
    _host, _patcher = None, None


def host() -> PluginHost:
    return _host if _host is not None else start()


def running() -> PluginHost | None:
    """The plugin host if the engine is started; never starts it."""
    return _host


def patcher() -> Patcher | None:
    return _patcher


def reinstate() -> list[str]:
    """Wrap again any patch point another tool rebound since the last decision (see Patcher)."""
    return _patcher.reinstate() if _patcher is not None else []
