"""The first enable's plugin scan lists what importlib.metadata lists, only cheaper."""

from __future__ import annotations

import re
import sys
from importlib import metadata

import pytest

from gcpatch import hookspecs, plugin_scan

GROUP = hookspecs.ENTRY_POINT_GROUP


def _dist_info(root, name, version, group_line=""):
    folder = root / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"  # escaped, as wheels are
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if group_line:
        (folder / "entry_points.txt").write_text(f"[{GROUP}]\n{group_line}\n")
    return folder


@pytest.mark.skipif(sys.version_info < (3, 10), reason="entry_points(group=) is Python >= 3.10")
def test_the_scan_lists_what_importlib_metadata_lists(monkeypatch):
    monkeypatch.setenv("GCPATCH_LOCAL_PLUGINS", "1")  # the whole of sys.path, as metadata reads it
    found, listed = plugin_scan.scan()
    assert sorted((ep.name, ep.value) for ep in found) == sorted(
        (ep.name, ep.value) for ep in metadata.entry_points(group=GROUP)
    )
    assert "transformers" in {ep.name for ep in found}
    names = {plugin_scan.normalized(d.metadata["Name"]) for d in metadata.distributions()}
    assert set(listed) == names
    assert {n: plugin_scan.version(n, listed) for n in names} == {
        n: metadata.version(n) for n in names
    }
    assert plugin_scan.version("no-such-distribution-gcpatch-test", listed) is None


def test_the_first_of_duplicates_on_sys_path_is_kept(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    _dist_info(first, "Stub.Plugin_fw", "2.0", "stub = stub_first:plugin")
    _dist_info(second, "stub-plugin-fw", "1.0", "stub = stub_second:plugin")
    _dist_info(second, "other_fw", "0.3")
    monkeypatch.setattr(sys, "path", [str(first), str(second), *sys.path])
    monkeypatch.setenv("GCPATCH_LOCAL_PLUGINS", "1")
    found, listed = plugin_scan.scan()
    assert [ep.value for ep in found if ep.name == "stub"] == ["stub_first:plugin"]
    assert plugin_scan.version("stub_plugin.fw", listed) == "2.0"
    assert plugin_scan.version("other-fw", listed) == "0.3"
    assert metadata.version("stub-plugin-fw") == "2.0"  # what importlib.metadata says too


class _Bundled(metadata.Distribution):
    """A distribution that exists only through a finder's `find_distributions` (no folder on
    sys.path), as a zipapp or a bundler serves one."""

    def __init__(self, files: dict[str, str]) -> None:
        self._files = files

    def read_text(self, filename):
        return self._files.get(filename)

    def locate_file(self, path):
        return path


class _BundleFinder:
    def __init__(self, dists):
        self.dists = dists

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=None):
        return iter(self.dists)


class _BrokenFinder(_BundleFinder):
    def find_distributions(self, context=None):
        raise RuntimeError("index unreadable")


@pytest.mark.skipif(sys.version_info < (3, 10), reason="entry_points(group=) is Python >= 3.10")
def test_a_finder_of_its_own_on_sys_meta_path_is_listed_as_importlib_metadata_lists_it(
    monkeypatch, caplog
):
    bundled = _Bundled(
        {
            "METADATA": "Metadata-Version: 2.1\nName: bundled_fw\nVersion: 4.2\n",
            "entry_points.txt": f"[{GROUP}]\nbundled = bundled_plugin:plugin\n",
        }
    )
    finders = [_BrokenFinder([]), _BundleFinder([bundled])]
    monkeypatch.setattr(sys, "meta_path", [*finders, *sys.meta_path])
    monkeypatch.setenv("GCPATCH_LOCAL_PLUGINS", "1")
    found, listed = plugin_scan.scan()
    assert ("bundled", "bundled_plugin:plugin") in {(ep.name, ep.value) for ep in found}
    assert plugin_scan.version("bundled-fw", listed) == "4.2"
    assert "transformers" in {ep.name for ep in found}  # sys.path's are still listed
    # what importlib.metadata lists, where the broken finder is left out (metadata would raise)
    monkeypatch.setattr(sys, "meta_path", [finders[1], *sys.meta_path[2:]])
    assert sorted((ep.name, ep.value) for ep in found) == sorted(
        (ep.name, ep.value) for ep in metadata.entry_points(group=GROUP)
    )
    assert metadata.version("bundled-fw") == "4.2"
    said = [r.getMessage() for r in caplog.records if "failed to list" in r.getMessage()]
    assert len(said) == 1 and "index unreadable" in said[0], said
