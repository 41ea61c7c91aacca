"""The first rows of a batch whose images come flattened across its rows (gcpatch/step/media.py):
the items whose placeholder tokens come first, their pixel rows and grids; nothing where the
counts do not add up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from gcpatch.step import media  # noqa: E402

IMAGE, VIDEO = 9, 8
CONFIG = SimpleNamespace(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_config=SimpleNamespace(spatial_merge_size=2)
)


def _batch():
    """Row 0: one image of grid (1, 4, 4) (16 pixel rows, 4 tokens); row 1: none; row 2: two
    images of grid (1, 2, 4) (8 pixel rows, 2 tokens each) and one video."""
    ids = torch.zeros(3, 10, dtype=torch.long)
    ids[0, 1:5] = IMAGE
    ids[2, 1:5] = IMAGE
    ids[2, 6:8] = VIDEO
    grid = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 2, 4]])
    return {
        "input_ids": ids,
        "pixel_values": torch.arange(32.0)[:, None].expand(32, 3),
        "image_grid_thw": grid,
        "pixel_values_videos": torch.ones(8, 3),
        "video_grid_thw": torch.tensor([[2, 2, 2]]),
        "second_per_grid_ts": torch.tensor([1.0]),
    }


@pytest.mark.parametrize(("rows", "images", "videos"), [(1, 1, 0), (2, 1, 0), (3, 3, 1)])
def test_the_first_rows_take_the_items_their_tokens_stand_for(rows, images, videos):
    cut = media.first_rows(torch, _batch(), rows, CONFIG)
    assert cut["image_grid_thw"].shape[0] == images
    assert cut["pixel_values"].shape[0] == int(cut["image_grid_thw"].prod(-1).sum())
    assert cut["pixel_values"][:, 0].tolist() == list(range(cut["pixel_values"].shape[0]))
    if videos:
        assert cut["video_grid_thw"].shape[0] == cut["second_per_grid_ts"].shape[0] == videos
        assert cut["pixel_values_videos"].shape[0] == 8 * videos
    else:  # rows without a video pass none, as a batch without one does
        assert [
            cut[k] for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
        ] == [None] * 3


def test_counts_that_do_not_add_up_cut_nothing():
    batch = _batch()
    batch["input_ids"][0, 5] = IMAGE  # five tokens: no whole number of leading images
    assert media.first_rows(torch, batch, 1, CONFIG) == {}
    assert media.first_rows(torch, _batch(), 1, SimpleNamespace(image_token_id=IMAGE)) == {}
    short = {**_batch(), "pixel_values": torch.ones(31, 3)}  # not the grids' pixel rows
    assert media.first_rows(torch, short, 1, CONFIG) == {}
    assert (
        media.first_rows(torch, {"input_ids": torch.zeros(2, 3, dtype=torch.long)}, 1, CONFIG) == {}
    )
