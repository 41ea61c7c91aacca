"""The first rows of a batch, as gcpatch's measuring pass runs them (gcpatch/step/batch.py): each
tensor cut where its rows are. Multimodal RoPE's position_ids hold the rows in their second
dimension (sections x rows x tokens); a batch of as many rows as sections once had its sections
cut instead."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gcpatch.step import batch  # noqa: E402

TOKENS = 5


def _batch(rows: int, sections: int) -> dict:
    positions = torch.arange(sections * rows * TOKENS).view(sections, rows, TOKENS)
    return {
        "input_ids": torch.arange(rows * TOKENS).view(rows, TOKENS),
        "position_ids": positions,
        "cache_position": torch.arange(TOKENS),
    }


@pytest.mark.parametrize("sections", [3, 4])
@pytest.mark.parametrize("rows", [2, 3, 4])
def test_multimodal_position_ids_are_cut_in_their_rows(rows, sections):
    full = _batch(rows, sections)
    cut = batch.first_rows(torch, full, rows, 1)
    assert torch.equal(cut["input_ids"], full["input_ids"][:1])
    assert torch.equal(cut["position_ids"], full["position_ids"][:, :1])
    assert cut["cache_position"] is full["cache_position"]


def test_position_ids_of_rows_and_tokens_are_cut_in_their_first_dimension():
    positions = torch.arange(3 * TOKENS).view(3, TOKENS)
    cut = batch.first_rows(torch, {"position_ids": positions}, 3, 2)
    assert torch.equal(cut["position_ids"], positions[:2])
