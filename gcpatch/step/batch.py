"""The batch of a training forward: its size, its shape, and its first rows as new leaves (what
gcpatch's own passes at the first step run on, so they never need the memory of the whole batch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

# The inputs that name the batch's rows, in the order they are looked for.
_INPUTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features")
# Per-call tensors whose first dimension is not the batch even when its length happens to match.
NOT_BATCHED = frozenset({"cache_position"})
# Per-call tensors whose rows are their second dimension where they have three: multimodal RoPE's
# position_ids, sections x rows x tokens (3 or 4 sections: Qwen2-VL's get_rope_index in
# transformers/models/qwen2_vl/modeling_qwen2_vl.py, the text positions first where 4).
SECTIONED = frozenset({"position_ids"})


def tensors(torch: Any, value: Any) -> Iterator[Any]:
    """Every tensor in `value`, through mappings, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(torch, item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(torch, item)


def main_input(torch: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The tensor that names the batch: a model input by its usual name, else the first tensor
    argument with a dimension."""
    for name in _INPUTS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value
    return None


def batch_size(torch: Any, args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    value = main_input(torch, args, kwargs)
    return None if value is None else int(value.shape[0])


def shape(torch: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple[int, int] | None:
    """(rows, tokens) of the batch; tokens 1 where the main input is not a token sequence (pixel
    values, audio features: their second dimension is not a length the budget follows)."""
    value = main_input(torch, args, kwargs)
    if value is None:
        return None
    return int(value.shape[0]), _tokens(torch, value, kwargs) or 1


def _tokens(torch: Any, value: Any, kwargs: Mapping[str, Any]) -> int | None:
    """The token count of a token sequence: input_ids (integers, rows x tokens) or inputs_embeds
    (rows x tokens x hidden), by keyword or as the first positional tensor."""
    if value is kwargs.get("inputs_embeds"):
        return int(value.shape[1]) if value.dim() == 3 else None
    integer = not value.is_floating_point() and not value.is_complex()
    return int(value.shape[1]) if value.dim() == 2 and integer else None


def first_rows(torch: Any, value: Any, batch: int, rows: int, name: str = "") -> Any:
    """The first `rows` rows of every tensor whose first dimension is the batch, as new leaves
    (the user's graph upstream of the model is never reached), keeping requires_grad."""

    def cut(tensor: Any, key: str) -> Any:
        if key in SECTIONED and tensor.dim() == 3 and tensor.shape[1] == batch:
            return leaf(tensor, tensor[:, :rows])
        if key in NOT_BATCHED or tensor.dim() == 0 or tensor.shape[0] != batch:
            return tensor
        return leaf(tensor, tensor[:rows])

    return _each(torch, value, cut, name)


def leaf(tensor: Any, part: Any) -> Any:
    """`part` of `tensor` as a new leaf, requiring grad where the tensor did."""
    part = part.detach().clone()
    return part.requires_grad_(True) if tensor.requires_grad and part.is_floating_point() else part


def _each(torch: Any, value: Any, cut: Any, name: str) -> Any:
    """`cut(tensor, name)` for each tensor in nested dicts (under its key), tuples and lists."""
    if isinstance(value, torch.Tensor):
        return cut(value, name)
    if isinstance(value, dict):
        return {k: _each(torch, v, cut, k) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_each(torch, v, cut, name) for v in value)
    if isinstance(value, list):
        return [_each(torch, v, cut, name) for v in value]
    return value
