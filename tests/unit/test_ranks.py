"""One rank fallback order (gcpatch/ranks.py), read by the record, the console and the crash
notes alike: RANK, else the process group's rank, else LOCAL_RANK, else 0."""

from __future__ import annotations

import sys
import types

import pytest

from gcpatch import console, ranks, record, settings


@pytest.fixture
def launcher(monkeypatch):
    """Set the launcher's variables and, with `group=N`, a process group whose rank is N."""
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def set_up(group=None, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        if group is not None:
            dist = types.SimpleNamespace(
                is_available=lambda: True,
                is_initialized=lambda: True,
                get_rank=lambda: group,
                get_world_size=lambda: 8,
            )
            monkeypatch.setitem(sys.modules, "torch.distributed", dist)
        else:
            monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)

    return set_up


@pytest.mark.parametrize(
    "env, group, rank, local",
    [
        ({}, None, 0, 0),
        ({"RANK": "3", "LOCAL_RANK": "1"}, 5, 3, 1),  # the variables win over the group
        ({"LOCAL_RANK": "2"}, 6, 6, 2),  # no RANK: the group's rank is the global one
        ({"LOCAL_RANK": "2"}, None, 2, 2),  # one node, no group yet: the local rank
        ({}, 4, 4, 4),  # mp.spawn: no variable, only the group
    ],
)
def test_one_fallback_order(launcher, env, group, rank, local):
    launcher(group, **env)
    assert (ranks.rank(), ranks.local_rank()) == (rank, local)
    assert console.speaker() is (local == 0)


def test_the_record_and_the_console_name_the_same_rank(launcher, tmp_path):
    launcher(6, LOCAL_RANK="0")
    entry = record.event({"stage": "verify", "line": "a test line"}, str(tmp_path))
    assert entry["rank"] == ranks.rank() == 6
    assert (tmp_path / "gcpatch-rank6.jsonl").exists()


def test_a_bad_rank_is_read_as_rank_0(launcher, capsys, monkeypatch):
    monkeypatch.setattr(settings, "_reported", set())
    launcher(None, RANK="zero")
    assert ranks.rank() == 0
    assert "RANK='zero' is not an integer" in capsys.readouterr().err
