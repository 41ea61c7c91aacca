"""The first rows of a batch whose images or videos come flattened across its rows, so that the
budget's measuring forwards can run on them (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `pixel_values` holds
every image's patches one after the other and `image_grid_thw` each image's (t, h, w) grid,
transformers' modeling_qwen2_vl.py). The items of the first rows are those whose placeholder tokens
come first in `input_ids`: an item of grid (t, h, w) has t*h*w pixel rows and
t*h*w / spatial_merge_size**2 tokens. Where the counts do not add up, nothing is cut here and the
planner falls back as for any batch whose first row does not run alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# (pixel rows, their grids, the config's placeholder token id, per-item tensors cut alike)
KINDS = (
    ("pixel_values", "image_grid_thw", "image_token_id", ()),
    ("pixel_values_videos", "video_grid_thw", "video_token_id", ("second_per_grid_ts",)),
)


def first_rows(torch: Any, kwargs: Mapping[str, Any], rows: int, config: Any) -> dict[str, Any]:
    """The flattened media of the first `rows` rows, by keyword (None for a medium those rows do
    not have; {} where the batch has none, or where its items cannot be told apart)."""
    ids = kwargs.get("input_ids")
    vision = getattr(config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(merge, int):
        return {}
    out: dict[str, Any] = {}
    for pixels_key, grid_key, token_key, per_item in KINDS:
        pixels, grid = kwargs.get(pixels_key), kwargs.get(grid_key)
        if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
            continue
        items = _items(ids[:rows], pixels, grid, getattr(config, token_key, None), merge)
        if items is None:
            return {}
        # none in these rows: the medium is left out, as a batch without it passes None
        patches = int(grid[:items].prod(-1).sum())
        out[pixels_key] = pixels[:patches] if items else None
        out[grid_key] = grid[:items] if items else None
        for key in per_item:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                out[key] = value[:items] if items else None
    return out


def _items(ids: Any, pixels: Any, grid: Any, token: Any, merge: int) -> int | None:
    """How many leading items the rows' placeholder tokens stand for, or None where they do not
    match a whole number of items (or the pixel rows are not the grids' sum)."""
    if not isinstance(token, int) or grid.dim() != 2 or merge < 1:
        return None
    sizes = grid.prod(-1)
    if int(sizes.sum()) != pixels.shape[0]:
        return None
    wanted = int((ids == token).sum())
    ends = [0] + (sizes // (merge * merge)).cumsum(0).tolist()
    return ends.index(wanted) if wanted in ends else None
