"""Whether an installed release lies in a plugin's declared range (a PEP 440 specifier set).

packaging.specifiers answers this exactly, but importing it costs about 3 ms (`python -X
importtime`), paid at the first enable of every checkpointing process. The ranges plugins
declare use only comparisons (`>=4.35,<6`) and release prefixes (`==2.13.*`), which
packaging.version answers here with packaging's own rules (pre-releases count as in range, as with
`SpecifierSet(spec, prereleases=True)`); any other clause is handed to packaging.specifiers.
tests/unit/test_release_range.py checks both agree on a grid of releases and ranges.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

_OPERATORS = ("===", "~=", ">=", "<=", "==", "!=", "<", ">")  # longest first


def contains(spec: str, version: str) -> bool:
    """`version` satisfies every clause of `spec`; False where either cannot be read."""
    try:
        candidate = Version(version)
    except InvalidVersion:
        return False
    verdicts = [_clause(clause.strip(), candidate) for clause in spec.split(",")]
    if any(v is None for v in verdicts):
        return _by_packaging(spec, candidate)
    return all(verdicts)


def _clause(clause: str, candidate: Version) -> bool | None:
    """One clause's verdict, or None where it is not a plain comparison or release prefix."""
    if not clause:
        return True
    op = next((o for o in _OPERATORS if clause.startswith(o)), None)
    if op is None or op in ("===", "~="):
        return None
    text = clause[len(op) :].strip()
    if text.endswith(".*"):
        return _release_prefix(op, text[:-2], candidate)
    bound = _plain_bound(text)
    return None if bound is None else _compare(op, bound, candidate)


def _release_prefix(op: str, prefix: str, candidate: Version) -> bool | None:
    """`==X.Y.*` or `!=X.Y.*`; None for any other operator or prefix."""
    if op not in ("==", "!=") or not all(p.isdigit() for p in prefix.split(".")):
        return None
    matched = _prefix(candidate, tuple(int(p) for p in prefix.split(".")))
    return matched if op == "==" else not matched


def _plain_bound(text: str) -> Version | None:
    """A comparison's bound where it is a final public release; None where packaging's rules for
    it are needed (a local version, a pre-, post- or dev-release, an epoch, a legacy version)."""
    if "+" in text:
        return None
    try:
        bound = Version(text)
    except InvalidVersion:
        return None  # packaging says what it is (before 22 it read legacy versions)
    if bound.pre or bound.post is not None or bound.dev is not None or bound.epoch:
        return None
    return bound


def _compare(op: str, bound: Version, candidate: Version) -> bool:
    public = Version(candidate.public)
    if op == "==":
        return public == bound
    if op == "!=":
        return public != bound
    if op == ">=":
        return public >= bound
    if op == "<=":
        return public <= bound
    same_base = Version(candidate.base_version) == bound
    if op == "<":  # not a pre-release of the bound itself
        return candidate < bound and not (candidate.is_prerelease and same_base)
    # ">": not a post-release or a local build of the bound itself
    return (
        candidate > bound
        and not (candidate.is_postrelease and same_base)
        and not (candidate.local is not None and same_base)
    )


def _prefix(candidate: Version, prefix: tuple[int, ...]) -> bool:
    if candidate.epoch != 0:
        return False
    release = candidate.release + (0,) * max(0, len(prefix) - len(candidate.release))
    return release[: len(prefix)] == prefix


def _by_packaging(spec: str, candidate: Version) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return candidate in SpecifierSet(spec, prereleases=True)
    except InvalidSpecifier:
        return False
