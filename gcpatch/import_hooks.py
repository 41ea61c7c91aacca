"""Running a function when a module is imported, or at once if it already is.

wrapt offers this (`wrapt.register_post_import_hook`), but importing wrapt loads every one of its
submodules (about 4 ms under `python -X importtime`) at the first framework import of every process,
most of which never checkpoint. gcpatch arms its patch points there, so it uses this one finder:
it takes part only in the imports of the modules it waits for, and hands each module the loader
that found it before the module's code runs (as wrapt does).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

Hook = Callable[[Any], None]

_hooks: dict[str, list[Hook]] = {}  # module name -> hooks still waiting for its import
_lock = threading.RLock()


def when_imported(name: str, hook: Hook) -> None:
    """Call `hook(module)` once `name` is imported: now if it is already in sys.modules, else
    right after its code has run. A hook's exception propagates into that import, as wrapt's do:
    gcpatch's hooks guard themselves and raise only in strict mode."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(hook)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    hook(module)


def _imported(module: Any) -> None:
    with _lock:
        hooks = _hooks.pop(module.__name__, [])
    for hook in hooks:
        hook(module)


class _Finder:
    """A `sys.meta_path` finder that finds nothing itself: for a module a hook waits for, it asks
    the other finders and wraps the loader they return."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _hooks:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None

    def __repr__(self) -> str:
        return "<gcpatch import hooks>"


class _Loader:
    """The module's own loader, running the hooks after the module's code. The module sees its
    own loader (`__loader__`, `__spec__.loader`) before its code runs."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        _imported(sys.modules.get(module.__name__, module))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
