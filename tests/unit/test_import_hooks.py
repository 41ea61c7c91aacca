"""gcpatch/import_hooks.py: a hook runs once its module's code has run (at once where the module is
already imported), and the module keeps its own loader, during its import and after."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from gcpatch import import_hooks

pytestmark = pytest.mark.unit


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh importable package `hooked_pkg` with one submodule that records its own loader."""
    root = tmp_path / "hooked_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text(
        textwrap.dedent(
            """
            LOADER_DURING_IMPORT = type(__loader__).__name__
            SPEC_LOADER_DURING_IMPORT = type(__spec__.loader).__name__
            READY = True
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hooked_pkg.mod"
    for name in ("hooked_pkg.mod", "hooked_pkg"):
        sys.modules.pop(name, None)
    importlib.invalidate_caches()


def test_a_hook_runs_after_the_module_code_with_its_own_loader(package):
    seen = []
    import_hooks.when_imported(package, lambda m: seen.append((m.__name__, m.READY)))
    assert seen == []
    module = importlib.import_module(package)
    assert seen == [(package, True)]
    assert module.LOADER_DURING_IMPORT == "SourceFileLoader"
    assert module.SPEC_LOADER_DURING_IMPORT == "SourceFileLoader"
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert type(module.__spec__.loader).__name__ == "SourceFileLoader"
    importlib.import_module(package)  # a second import runs nothing again
    assert seen == [(package, True)]


def test_a_hook_for_an_imported_module_runs_at_once(package):
    module = importlib.import_module(package)
    seen = []
    import_hooks.when_imported(package, seen.append)
    assert seen == [module]


def test_the_finder_takes_no_part_in_other_imports(package):
    import_hooks.when_imported(package, lambda m: None)
    finder = next(f for f in sys.meta_path if isinstance(f, import_hooks._Finder))
    assert finder.find_spec("json") is None
    importlib.import_module(package)
