"""The short warning lines speak of the user's choice only where the user made one: a checkpoint
call that named no use_reentrant runs with torch's default, and its line says so."""

from __future__ import annotations

import pytest

from gcpatch import headline


def _overruled(reason: str) -> dict:
    return {
        "site": "/x/model.py:12",
        "decision": {
            "warnings": ["CK1 requires use_reentrant=False; the user asked True"],
            "winners": {
                "use_reentrant": {
                    "knob": "use_reentrant",
                    "rule": "CK1",
                    "strength": "required",
                    "value": False,
                }
            },
            "overruled": [
                {
                    "knob": "use_reentrant",
                    "value": True,
                    "strength": "user",
                    "rule": "USER",
                    "reason": reason,
                }
            ],
        },
    }


@pytest.mark.parametrize(
    "reason, said",
    [
        (
            "torch's default, use_reentrant not passed",
            "CK1 overrules torch's default use_reentrant=True",
        ),
        ("asked at the call", "CK1 overrules your use_reentrant=True"),
    ],
)
def test_overrule_line_names_whose_value_it_overrules(reason, said):
    [line] = headline.warnings(_overruled(reason))
    assert said in line, line
    assert ("your" in line) is (reason == "asked at the call")
