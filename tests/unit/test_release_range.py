"""gcpatch/release_range.py answers as packaging.specifiers does (pre-releases in range) on every
release and range of a grid: the built-in plugins' own ranges, and the edges PEP 440 gives rules for
(pre-, post- and dev-releases of the bound itself, local builds, epochs, release prefixes)."""

from __future__ import annotations

import itertools

import pytest
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from gcpatch import release_range
from gcpatch.manager import builtin_infos

pytestmark = pytest.mark.unit

RELEASES = [
    "2.13.0",
    "2.13.0+cpu",
    "2.13",
    "2.13.1",
    "2.13.0rc1",
    "2.13.0.dev20260101",
    "2.13.0.post1",
    "2.12.9",
    "2.130.0",
    "3.0.0a1",
    "3",
    "3.0.0",
    "3.0.0.post1",
    "3.0.0+local",
    "1!2.13.0",
    "4.35.2",
    "4.35",
    "5.0.0rc0",
    "5.24.0",
    "5.24.0.dev0",
    "6.0",
    "0.19.3",
    "0.19.3.post2",
    "0.5.1",
    "not a version",
]
BOUNDS = ["2.13", "2.13.0", "3", "3.0.0a1", "3.0.0.post1", "4.35", "5.24.0", "0.19.3", "1!2.13"]
CLAUSES = [
    f"{op}{bound}" for op, bound in itertools.product((">=", "<=", ">", "<", "==", "!="), BOUNDS)
] + [
    "==2.13.*",
    "!=2.13.*",
    "==3.*",
    "==2.*",
    "== 2.13.* ",
    "~=2.13",
    "===2.13.0",
    "==2.13.0+cpu",
    ">=banana",
    "",
]


def packaging_says(spec: str, version: str) -> bool:
    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return False


def ranges() -> list[str]:
    plugins = [r for _, info in builtin_infos() for r in (info.versions, info.proven) if r]
    pairs = [f"{a},{b}" for a, b in itertools.combinations(CLAUSES[:20], 2)]
    return sorted(set(CLAUSES + plugins + pairs))


def test_every_release_and_range_of_the_grid_agrees_with_packaging():
    cases = [(spec, version) for spec in ranges() for version in RELEASES]
    wrong = [c for c in cases if release_range.contains(*c) != packaging_says(*c)]
    assert len(cases) > 5000 and wrong == []


def test_the_built_in_plugins_ranges_are_read_without_packaging_specifiers():
    """Every range a built-in plugin declares is plain comparisons and release prefixes."""
    for _, info in builtin_infos():
        for spec in filter(None, (info.versions, info.proven)):
            for clause in spec.split(","):
                assert release_range._clause(clause.strip(), Version("2.13.0")) is not None, spec
