"""The installed `gcpatch.plugins` entry points, and which release of each distribution is
installed: read once, at the first enable of every checkpointing process.

A directory on sys.path is listed with `os.scandir`, and only a distribution whose
entry_points.txt names the group is handed to importlib.metadata: listing, naming and reading every
distribution through importlib.metadata cost about 2.5 ms in a venv of 64 distributions
(benchmarks/IMPORT_COST.md). Anything else on sys.path (a zip, an egg) is listed by
importlib.metadata, and so is what a finder of its own on sys.meta_path lists (a zipapp's, a
bundler's), in meta_path's order. Names are normalized and the first of duplicates is kept, as
importlib.metadata's own `entry_points()` does (Python >= 3.10).

A `*.dist-info` in the directory Python put on sys.path for the script itself (its folder, or the
working directory for `-c`/`-m`) is not loaded unless GCPATCH_LOCAL_PLUGINS=1: a stray folder next
to a training script must not run code inside every job started from there.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from importlib import machinery, metadata
from pathlib import Path
from typing import Any, Iterator, Union

from gcpatch import hookspecs, settings
from gcpatch.facts import version_of

log = logging.getLogger("gcpatch")

GROUP = hookspecs.ENTRY_POINT_GROUP
_GROUP_BYTES = GROUP.encode()
_INFO_SUFFIXES = (".dist-info", ".egg-info")
# A distribution as listed: its folder (a scanned directory's) or importlib.metadata's object.
Listed = Union[str, metadata.Distribution]


def scan() -> tuple[list[metadata.EntryPoint], dict[str, Listed]]:
    """(the group's entry points, every distribution on sys.path by normalized name)."""
    implicit = settings.local_plugins() is False and _implicit_path_entry()
    site_dirs = {os.path.realpath(d) for d in _site_dirs()} if implicit else set()
    skipped = [p for p in sys.path if implicit and _same_dir(p, implicit, site_dirs)]
    found: list[metadata.EntryPoint] = []
    installed: dict[str, Listed] = {}
    for key, dist in _everywhere(skipped):
        if key not in installed:  # the first of duplicates, in importlib.metadata's order
            installed[key] = dist
            found.extend(_group_of(dist))
    local: set[str] = set()
    for entry in skipped:
        for key, dist in _listed(entry):
            installed.setdefault(key, dist)
            local.update(f"{ep.name} ({_dist_name(dist)})" for ep in _group_of(dist))
    if local:
        log.warning(
            "gcpatch: plugins found next to the script in %s not loaded: %s; install them, or set "
            "GCPATCH_LOCAL_PLUGINS=1 to load plugins from there",
            implicit,
            ", ".join(sorted(local)),
        )
    return found, installed


def version(framework: str, installed: dict[str, Listed]) -> str | None:
    """The installed release of `framework` as the scan listed it (None: not installed): a
    wheel's `name-version.dist-info` folder says it (the wheel spec), else its METADATA does."""
    dist = installed.get(normalized(framework))
    if dist is None:
        return None
    return version_of(_as_distribution(dist))


def normalized(name: str) -> str:
    """A distribution's name as importlib.metadata compares it (PEP 503, then '_')."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _everywhere(skipped: list[str]) -> Iterator[tuple[str, Listed]]:
    """Every distribution, in the order importlib.metadata discovers them: each finder on
    sys.meta_path in turn, the path finder's share read from sys.path's directories. A finder of
    its own (a zipapp's or a bundler's) lists its distributions through `find_distributions`."""
    finders = list(sys.meta_path)
    if machinery.PathFinder not in finders:
        finders.append(machinery.PathFinder)
    for finder in finders:
        if finder is machinery.PathFinder:
            for entry in sys.path:
                if entry not in skipped:
                    yield from _listed(entry)
        elif hasattr(finder, "find_distributions"):
            yield from _found_by(finder)


def _found_by(finder: Any) -> Iterator[tuple[str, Listed]]:
    """What a finder other than the path finder lists; a finder that fails is left out, said in
    one line (the scan runs inside every checkpointing job)."""
    try:
        dists = list(finder.find_distributions(metadata.DistributionFinder.Context()))
        listed = [(_dist_key(d), d) for d in dists]
    except Exception as exc:  # noqa: BLE001 (someone else's finder: fail open, said)
        log.warning("gcpatch: %r failed to list its distributions, left out: %r", finder, exc)
        return
    yield from listed


def _listed(entry: str) -> Iterator[tuple[str, Listed]]:
    directory = entry or os.curdir
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory) or directory.lower().endswith(".egg"):
        for dist in metadata.distributions(path=[entry]):
            yield _dist_key(dist), dist
        return
    try:
        names = os.listdir(directory)  # in listing order, as importlib.metadata keeps it
    except OSError:
        return
    for name in names:
        if name.lower().endswith(_INFO_SUFFIXES):  # `name-version.dist-info`, `name.egg-info`
            stem = name[: name.rindex(".")].partition("-")[0]
            yield normalized(stem), os.path.join(directory, name)


def _group_of(dist: Listed) -> list[metadata.EntryPoint]:
    """The distribution's entry points of the group. Only a file that names the group is parsed:
    parsing every installed distribution's entry_points.txt was most of the scan's cost."""
    if isinstance(dist, str):
        try:
            with open(os.path.join(dist, "entry_points.txt"), "rb") as file:
                named = _GROUP_BYTES in file.read()
        except OSError:
            return []
    else:
        named = GROUP in (dist.read_text("entry_points.txt") or "")
    if not named:
        return []
    return [ep for ep in _as_distribution(dist).entry_points if ep.group == GROUP]


def _as_distribution(dist: Listed) -> metadata.Distribution:
    return metadata.PathDistribution(Path(dist)) if isinstance(dist, str) else dist


def _dist_key(dist: metadata.Distribution) -> str:
    """The name its folder gives, without parsing METADATA where the folder gives one."""
    return getattr(dist, "_normalized_name", None) or normalized(_dist_name(dist))


def _dist_name(dist: Listed) -> str:
    return (_as_distribution(dist).metadata["Name"] or "").lower().replace("_", "-")


def _implicit_path_entry() -> str:
    """The directory Python added to sys.path for the script ('' or the script's folder), or ''
    when it added none (-I, -P, PYTHONSAFEPATH)."""
    if getattr(sys.flags, "safe_path", False) or sys.flags.isolated:
        return ""
    script = sys.argv[0] if sys.argv else ""
    if script and script not in ("-c", "-m") and os.path.isfile(script):
        return os.path.dirname(os.path.abspath(script))
    return os.getcwd()


def _same_dir(entry: str, directory: str, site_dirs: set[str]) -> bool:
    """Whether sys.path's `entry` is `directory` and not one of the site directories (real
    paths)."""
    try:
        real = os.path.realpath(entry or os.curdir)
        return real == os.path.realpath(directory) and real not in site_dirs
    except (OSError, ValueError):
        return False


def _site_dirs() -> set[str]:
    import site

    dirs = set(getattr(site, "getsitepackages", lambda: [])())
    dirs.add(getattr(site, "getusersitepackages", lambda: "")())
    dirs.update(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    return dirs
