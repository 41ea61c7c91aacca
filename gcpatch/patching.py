"""Installing and removing patch points: lazily on import, exactly once, restored by identity.

A point is installed when its module is imported, or at once if it already is
(gcpatch/import_hooks.py), so the order of `import gcpatch` and `import transformers` does not
matter. A function or method is replaced by a plain function (wrapt's wrapper protocol inside);
wrapt's proxy stands only for what a function cannot (a builtin, a callable object), and wrapt is
imported only then.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import types
from typing import TYPE_CHECKING, Any, Callable

from gcpatch import import_hooks
from gcpatch.call.caller import call_from, user_frame
from gcpatch.errors import GcpatchError

if TYPE_CHECKING:  # not imported at run time: arming (at the first framework import) stays cheap
    from gcpatch.schema import PatchPoint

log = logging.getLogger("gcpatch")


class Installed:
    """One installed point. A plain class, not a dataclass: generating a dataclass's methods
    costs about a millisecond at the first framework import of every process."""

    __slots__ = (
        "point",
        "plugin",
        "owner",
        "attr",
        "original",
        "wrapper",
        "inherited",
        "copies",
        "replaced",
        "deferred",
    )

    def __init__(
        self,
        point: Any,  # the plugin's PatchPoint; an _ArmedPoint until its plugin is loaded
        plugin: str,
        owner: Any,
        attr: str,
        original: Any,
        wrapper: Any,
        inherited: bool,
        copies: list[_Binding],
        deferred: _Deferred | None = None,  # armed by name: bound when the plugin loads
    ) -> None:
        self.point = point
        self.plugin = plugin
        self.owner = owner
        self.attr = attr
        self.original = original
        self.wrapper = wrapper
        self.inherited = inherited
        self.copies = copies
        self.replaced: list[tuple[Any, str, Any, Any]] = []  # (owner, name, theirs, our wrapper)
        self.deferred = deferred


class Patcher:
    """Owns every installed patch point of the process.

    A point is either registered with its plugin's `PatchPoint` (the plugin is loaded), or armed by
    name before any plugin is loaded (`arm`): then its wrapper calls a `_Deferred` whose first call
    asks `on_first_call` to load the plugins, which register their points and so bind it. `settle`
    puts back what no loaded plugin claimed."""

    def __init__(
        self, strict: bool = False, on_first_call: Callable[[], Any] | None = None
    ) -> None:
        self.installed: dict[tuple[str, str], Installed] = {}
        self.not_applicable: dict[tuple[str, str], str] = {}
        self._registered: set[tuple[str, str]] = set()
        self._points: dict[tuple[str, str], tuple[PatchPoint, str]] = {}
        self._armed: set[tuple[str, str]] = set()
        self._settled = False
        self._stopped = False
        self._strict = strict
        self._on_first_call = on_first_call

    def arm(
        self,
        module: str,
        target: str,
        plugin: str,
        copies: bool = False,
        applies: Callable[[Any], bool] | None = None,
        wakes: bool = True,
    ) -> None:
        """Wrap `module.target` when `module` is imported, before its plugin is loaded. A call
        through it loads the plugins, unless `wakes` is False: such a point acts only on what a
        decision left, and runs as called until something else loaded them. `applies` is the
        plugin's own test of the release (X1), asked at the import."""
        key = (module, target)
        if key in self._armed or key in self._registered:
            return
        self._armed.add(key)
        imported = (
            module in sys.modules
        )  # else the hook runs as it loads: nothing else holds it yet
        import_hooks.when_imported(
            module,
            lambda loaded: self._install_armed(
                loaded, key, plugin, copies, applies, wakes, imported
            ),
        )

    def register(self, point: PatchPoint, plugin: str) -> None:
        """Install `point` when its module is imported (now, if it already is); a point armed by
        name gets the plugin's wrapper."""
        key = (point.module, point.target)
        if key in self._registered:
            return
        self._registered.add(key)
        self._points[key] = (point, plugin)
        item = self.installed.get(key)
        if item is not None and item.deferred is not None:
            self._bind(key, item, point, plugin)
        elif key not in self._armed:
            imported = point.module in sys.modules
            import_hooks.when_imported(
                point.module, lambda module: self._install(module, point, plugin, imported)
            )

    def settle(self) -> None:
        """The plugins are loaded: every armed point no active plugin registered (blocked, out
        of its version range, failed) is put back, and later imports arm nothing more."""
        self._settled = True
        for key, item in list(self.installed.items()):
            if item.deferred is not None and item.deferred.call is None:
                item.deferred.call = _passthrough
                self._restore(item)
                del self.installed[key]

    def _install(self, module: Any, point: PatchPoint, plugin: str, imported: bool = True) -> None:
        key = (point.module, point.target)
        if self._stopped or key in self.installed:
            return
        try:
            if not point.applies(module):
                self.not_applicable[key] = "not in this version"
                return
            owner, attr = _resolve(module, point.target)
            inherited = attr not in vars(owner)
            original = getattr(owner, attr) if inherited else vars(owner)[attr]
            if getattr(original, "_self_gcpatch", False):
                return  # already ours (the start-up line ran twice)
            guard = point.wrapper if point.guarded else _fail_open(point, plugin, self._strict)
            wrapper = _wrap(owner, original, guard)
            setattr(owner, attr, wrapper)
            copies = _copies(module, original, wrapper, imported) if point.copies else []
            self.installed[key] = Installed(
                point, plugin, owner, attr, original, wrapper, inherited, copies
            )
        except Exception as exc:
            if self._strict:
                raise GcpatchError(
                    f"could not patch {point.module}.{point.target}: {exc}", rule=f"plugin:{plugin}"
                ) from exc
            log.error(
                "gcpatch: %s.%s left unpatched (%s: %s)",
                point.module,
                point.target,
                type(exc).__name__,
                exc,
            )

    def _install_armed(
        self,
        module: Any,
        key: tuple[str, str],
        plugin: str,
        copies: bool,
        applies: Callable[[Any], bool] | None,
        wakes: bool,
        imported: bool = True,
    ) -> None:
        if key in self._points:
            point, plugin = self._points[key]
            self._install(module, point, plugin, imported)
            return
        if self._stopped or self._settled or key in self.installed:
            return
        try:
            if applies is not None and not applies(module):
                self.not_applicable[key] = "not in this version"
                return
            owner, attr = _resolve(module, key[1])
            inherited = attr not in vars(owner)
            original = getattr(owner, attr) if inherited else vars(owner)[attr]
            if getattr(original, "_self_gcpatch", False):
                return  # already ours (the start-up line ran twice)
            deferred = _Deferred(self, wakes)
            wrapper = _wrap(owner, original, deferred)
            setattr(owner, attr, wrapper)
            bindings = _copies(module, original, wrapper, imported) if copies else []
            self.installed[key] = Installed(
                _ArmedPoint(key[0], key[1], copies),
                plugin,
                owner,
                attr,
                original,
                wrapper,
                inherited,
                bindings,
                deferred=deferred,
            )
        except Exception as exc:
            if self._strict:
                raise GcpatchError(
                    f"could not patch {key[0]}.{key[1]}: {exc}", rule=f"plugin:{plugin}"
                ) from exc
            log.error(
                "gcpatch: %s.%s left unpatched (%s: %s)", key[0], key[1], type(exc).__name__, exc
            )

    def _bind(self, key: tuple[str, str], item: Installed, point: PatchPoint, plugin: str) -> None:
        deferred = item.deferred
        try:
            applies = point.applies(sys.modules[point.module])
        except Exception as exc:
            if self._strict:
                raise GcpatchError(
                    f"could not patch {point.module}.{point.target}: {exc}", rule=f"plugin:{plugin}"
                ) from exc
            log.error(
                "gcpatch: %s.%s left unpatched (%s: %s)",
                point.module,
                point.target,
                type(exc).__name__,
                exc,
            )
            applies = False
        if not applies:
            self.not_applicable[key] = "not in this version"
            deferred.call = _passthrough
            self._restore(item)
            del self.installed[key]
            return
        deferred.call = point.wrapper if point.guarded else _fail_open(point, plugin, self._strict)
        item.point, item.plugin = point, plugin

    def first_call(self, deferred: _Deferred) -> Callable[..., Any]:
        """An armed point is called before the plugins are loaded: load them (once, whichever
        point is called first), and return what that point runs now."""
        if self._on_first_call is not None and not self._stopped:
            try:
                self._on_first_call()
            except GcpatchError:
                raise
            except Exception as exc:
                if self._strict:
                    raise GcpatchError(
                        f"gcpatch's plugins could not be loaded: {type(exc).__name__}: {exc}",
                        rule="gcpatch:engine",
                    ) from exc
                log.error(
                    "gcpatch: plugins not loaded, frameworks run unpatched (%s: %s)",
                    type(exc).__name__,
                    exc,
                )
                self.uninstall_all()
        # None while the plugins are still loading (a call made by the loading itself): as called
        return deferred.call or _passthrough

    def reinstate(self) -> list[str]:
        """Wrap again where another tool rebound one of gcpatch's patch points (a monkeypatch that
        assigns the name, Axolotl's exec of peft's source): the replacement then runs inside
        gcpatch's wrapper and its decisions still happen. Each replacement is reported once;
        returns what was found this time."""
        found = []
        for item in list(self.installed.values()):
            places = [(item.owner, item.attr)] + [
                (b.owner, b.name) for b in item.copies if b.index is None
            ]
            for owner, name in places:
                current = vars(owner).get(name)
                if (
                    current is None
                    or getattr(current, "_self_gcpatch", False)
                    or _runs(current, item.wrapper)
                ):
                    continue
                wrapper = _wrap(owner, current, item.wrapper._self_wrapper)
                setattr(owner, name, wrapper)
                item.replaced.append((owner, name, current, wrapper))
                # its re-exports
                aliases = _replace_copies(current, wrapper) if item.point.copies else ()
                for alias in aliases:
                    item.replaced.append((alias.owner, alias.name, current, wrapper))
                where = getattr(owner, "__name__", repr(owner))
                text = (
                    f"{where}.{name} was rebound by another tool to {_describe(current)}; gcpatch"
                    f" now wraps the replacement ({item.point.why or item.point.target})"
                )
                found.append(text)
                log.warning("gcpatch: %s", text)
        return found

    def uninstall_all(self) -> None:
        """Put every original back, by identity, where our wrapper still stands."""
        self._stopped = True
        for item in self.installed.values():
            if item.deferred is not None and item.deferred.call is None:
                item.deferred.call = _passthrough
            self._restore(item)
        self.installed.clear()

    @staticmethod
    def _restore(item: Installed) -> None:
        for owner, name, replacement, wrapper in item.replaced:
            if vars(owner).get(name) is wrapper:
                setattr(owner, name, replacement)
        for binding in item.copies:
            binding.restore(item.original, item.wrapper)
        if vars(item.owner).get(item.attr) is not item.wrapper:
            return  # someone wrapped over us: leave their object alone
        if item.inherited:
            delattr(item.owner, item.attr)
        else:
            setattr(item.owner, item.attr, item.original)


class _ArmedPoint:
    """What is known of a point armed by name, until its plugin's PatchPoint replaces it."""

    def __init__(self, module: str, target: str, copies: bool) -> None:
        self.module, self.target, self.copies, self.why = module, target, copies, ""


class _Deferred:
    """The wrapper (wrapt's protocol) of a point armed before the plugins are loaded: its first
    call loads them; from then on it runs the plugin's wrapper (`call`), or the original where no
    plugin claimed the point. One attribute read per call on top of the plugin's own wrapper."""

    __slots__ = ("call", "_patcher", "_wakes")

    def __init__(self, patcher: Patcher, wakes: bool = True) -> None:
        self.call: Callable[..., Any] | None = None
        self._patcher = patcher
        self._wakes = wakes

    def __call__(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        call = self.call
        if call is None:
            call = self._patcher.first_call(self) if self._wakes else _passthrough
        return call(wrapped, instance, args, kwargs)


def _passthrough(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return wrapped(*args, **kwargs)


def _wrap(owner: Any, original: Any, guard: Callable[..., Any]) -> Any:
    """What stands in `owner` for `original`, calling `guard` (wrapt's wrapper protocol)."""
    if isinstance(original, types.FunctionType):
        if isinstance(owner, type):
            return _method_wrapper(original, guard)
        return _function_wrapper(original, guard)
    return _proxy_class()(original, guard)


def _function_wrapper(
    original: Callable[..., Any], guard: Callable[..., Any]
) -> Callable[..., Any]:
    """A plain function standing for a module's function. torch.compile inlines a Python function,
    where a wrapt proxy is opaque to it: a graph break at every call (each checkpointed layer). A
    function copies as itself and pickles by its qualified name."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return guard(original, None, args, kwargs)

    return _stands_for(wrapper, original, guard)


def _method_wrapper(original: Callable[..., Any], guard: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function standing for a class's method: bound like the method it replaces, it gives
    `guard` the bound original and the instance, as wrapt does (also when the method is called
    through the class with the instance first, or through `super()`)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not args:
            return guard(original, None, args, kwargs)  # the original says what is missing
        instance = args[0]
        return guard(original.__get__(instance, type(instance)), instance, args[1:], kwargs)

    return _stands_for(wrapper, original, guard)


def _stands_for(
    wrapper: Callable[..., Any], original: Callable[..., Any], guard: Callable[..., Any]
) -> Callable[..., Any]:
    functools.update_wrapper(
        wrapper, original
    )  # name, module, qualname, doc, attributes, __wrapped__ (signatures read through it)
    wrapper._self_gcpatch = True
    wrapper._self_wrapper = guard
    return wrapper


# The one code object of every plain-function wrapper: torch.compile may be told to run its
# fresh frames eagerly (gcpatch.call.checkpoint_call), which leaves inlining it into a traced frame
# as it is.
FUNCTION_WRAPPER_CODE = _function_wrapper(len, _passthrough).__code__
# The frames between a patched function's caller and its plugin's wrapper: the wrapper, and the
# guard of a point armed before the plugins load (torch's checkpoint and its copies).
GUARD_CODES = (FUNCTION_WRAPPER_CODE, _Deferred.__call__.__code__)


def _runs(current: Any, wrapper: Any) -> bool:
    """`current` is gcpatch's wrapper, or a function that wraps it (functools.wraps' `__wrapped__`,
    as gcpatch's own crash notes do around torch.autograd.backward): gcpatch still runs inside it.
    """
    for _ in range(8):
        if current is wrapper:
            return True
        current = (
            getattr(current, "__wrapped__", None)
            if not getattr(current, "_self_gcpatch", False)
            else None
        )
        if current is None:
            return False
    return False


@functools.lru_cache(maxsize=None)
def _proxy_class() -> type:
    """wrapt's proxy for what no plain function can stand for (a builtin, a callable object),
    built at its first use: wrapt is not imported before."""
    import wrapt

    class _GcpatchWrapper(wrapt.FunctionWrapper):
        """Copies and pickles as the callable it stands for: it is its own copy, and a pickle names
        the original's qualified name (where gcpatch was removed or the name rebound, it pickles
        as what it wraps)."""

        _self_gcpatch = True

        def __copy__(self) -> Any:
            return self

        def __deepcopy__(self, memo: dict) -> Any:
            return self

        def __reduce_ex__(self, protocol: int) -> Any:
            module = sys.modules.get(getattr(self, "__module__", None) or "")
            name = getattr(self, "__qualname__", "")
            try:
                standing = _lookup(module, name) if module is not None and name else None
            except AttributeError:
                standing = None
            if standing is self:
                return name  # pickle's global reference, as for the function itself
            # Not where the original lives (gcpatch was removed, or another tool rebound the name):
            # pickled as what it wraps. copy.copy returns a function itself.
            return copy.copy, (self.__wrapped__,)

        def __reduce__(self) -> Any:
            return self.__reduce_ex__(2)

    return _GcpatchWrapper


def _lookup(module: Any, qualname: str) -> Any:
    owner = module
    for part in qualname.split("."):
        owner = getattr(owner, part)
    return owner


def _copies(module: Any, original: Any, wrapper: Any, imported: bool) -> list[_Binding]:
    """`_replace_copies` where other modules may hold the original: its module was imported before
    the point was registered. A point installed as its module loads (the start-up path: armed
    before the first framework import) runs before any importer gets the name back, so only the
    module's own functions can hold it (default arguments); scanning every loaded module there cost
    tens of ms at every `import torch`."""
    return _replace_copies(original, wrapper, None if imported else [module])


def _replace_copies(
    original: Any, wrapper: Any, modules: list[Any] | None = None
) -> list[_Binding]:
    """Point every module-level name bound to `original` at `wrapper` (P3: modules imported
    before the patch hold their own reference), every module-level `functools.partial` of it (a
    project's `ckpt = partial(checkpoint, use_reentrant=True)` built before `import gcpatch`) at a
    partial of the wrapper with the same arguments, and every default argument captured from it in
    those modules' functions and classes (transformers' `_set_gradient_checkpointing(...,
    gradient_checkpointing_func=checkpoint)`). Later imports get the wrapper anyway."""
    replaced: list[_Binding] = []
    for module in list(sys.modules.values()) if modules is None else modules:
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        names = [
            name
            for name, value in list(namespace.items())
            if value is original or (type(value) is functools.partial and value.func is original)
        ]
        if not names:
            continue
        for name in names:
            value = namespace[name]
            if value is original:
                setattr(module, name, wrapper)
                replaced.append(_Binding(module, name))
            else:
                rebound = functools.partial(wrapper, *value.args, **value.keywords)
                setattr(module, name, rebound)
                replaced.append(_Binding(module, name, previous=(value, rebound)))
        replaced.extend(_replace_defaults(module, original, wrapper))
    return replaced


class _Binding:
    """One place that held the original: a module attribute (or a partial of it there), or a
    function's default argument."""

    def __init__(
        self, owner: Any, name: str, index: int | None = None, previous: tuple | None = None
    ) -> None:
        self.owner, self.name, self.index, self.previous = owner, name, index, previous

    def restore(self, original: Any, wrapper: Any) -> None:
        if self.previous is not None:
            old, rebound = self.previous
            if vars(self.owner).get(self.name) is rebound:
                setattr(self.owner, self.name, old)
        elif self.index is None:
            if vars(self.owner).get(self.name) is wrapper:
                setattr(self.owner, self.name, original)
        elif self.name == "__kwdefaults__":
            defaults = self.owner.__kwdefaults__ or {}
            key = list(defaults)[self.index]
            if defaults.get(key) is wrapper:
                defaults[key] = original
        else:
            defaults = list(self.owner.__defaults__ or ())
            if self.index < len(defaults) and defaults[self.index] is wrapper:
                defaults[self.index] = original
                self.owner.__defaults__ = tuple(defaults)


def _replace_defaults(module: Any, original: Any, wrapper: Any) -> list[_Binding]:
    replaced: list[_Binding] = []
    for function in _functions_of(module):
        defaults = function.__defaults__
        if defaults and any(d is original for d in defaults):
            function.__defaults__ = tuple(wrapper if d is original else d for d in defaults)
            replaced.extend(
                _Binding(function, "__defaults__", i)
                for i, d in enumerate(defaults)
                if d is original
            )
        kwdefaults = function.__kwdefaults__
        if kwdefaults:
            for i, (key, value) in enumerate(list(kwdefaults.items())):
                if value is original:
                    kwdefaults[key] = wrapper
                    replaced.append(_Binding(function, "__kwdefaults__", i))
    return replaced


def _functions_of(module: Any) -> list[Any]:
    """The plain functions defined in `module`, at module level and one class level down."""
    found = []
    name = module.__name__
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == name:
            for member in list(vars(value).values()):
                member = getattr(member, "__func__", member)  # staticmethod, classmethod
                if isinstance(member, types.FunctionType):
                    found.append(member)
        elif isinstance(value, types.FunctionType) and value.__module__ == name:
            found.append(value)
    return found


def _describe(obj: Any) -> str:
    code = getattr(obj, "__code__", None)
    where = f" from {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    name = getattr(obj, "__qualname__", type(obj).__name__)
    return f"{getattr(obj, '__module__', '?')}.{name}{where}"


def _resolve(module: Any, target: str) -> tuple[Any, str]:
    owner = module
    *path, attr = target.split(".")
    for name in path:
        owner = getattr(owner, name)
    return owner, attr


class _Original:
    """The wrapped callable, remembering whether it was reached: an exception raised after that
    is the host's own and propagates; one raised before is gcpatch's and fails open."""

    def __init__(self, wrapped: Any, caller: Any = None) -> None:
        self.wrapped = wrapped
        self.__wrapped__ = wrapped  # so inspect.signature() gives plugins the real signature
        self.caller = caller  # the user's frame: the framework's warnings name it, not gcpatch
        self.called = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.called = True
        return call_from(self.caller, self.wrapped, args, kwargs)


def _fail_open(point: PatchPoint, plugin: str, strict: bool):  # noqa: ANN202
    # one ERROR line per patch point; later failures at DEBUG (a hot path)
    reported: list[bool] = []

    def wrapper(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202 (wrapt's protocol)
        original = _Original(wrapped, user_frame())
        try:
            return point.wrapper(original, instance, args, kwargs)
        except GcpatchError as exc:  # strict mode: its traceback starts at this, the user's call
            raise exc.with_traceback(None) from exc.__cause__
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 (a plugin's SystemExit must not end the job)
            if original.called:  # the host's own exception: it propagates as it is
                raise
            if strict:
                raise GcpatchError(
                    f"{point.target} failed inside gcpatch: {type(exc).__name__}: {exc}",
                    rule=f"plugin:{plugin}",
                ) from exc
            first = not reported
            reported[:] = [True]
            log.log(
                logging.ERROR if first else logging.DEBUG,
                "gcpatch: plugin %s failed in %s, running it unpatched (%s: %s)%s",
                plugin,
                point.target,
                type(exc).__name__,
                exc,
                "; later failures here are logged at DEBUG only" if first else "",
            )
            return wrapped(*args, **kwargs)

    return wrapper
