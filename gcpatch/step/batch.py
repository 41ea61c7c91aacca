"""The batch of a training forward: its size, its shape, and its first rows as new leaves (what
gcpatch's own passes at the first step run on, so they never need the memory of the whole batch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

# The inputs that name the batch's rows, in the order they are looked for.
_INPUTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features")
# Per-call tensors whose first dimension is not the batch even when its length happens to match.
NOT_BATCHED = frozenset({"cache_position"})


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


def first_tokens(torch: Any, value: Any, full: int, tokens: int, name: str = "") -> Any:
    """Every tensor of a (sliced) batch cut to its first `tokens` of `full` tokens: each dimension
    after the rows whose length is `full` (a mask of rows x 1 x tokens x tokens in both), a
    1-dimensional cache_position too, and inputs_embeds in its token dimension only."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 1:
            return value[:tokens] if name in NOT_BATCHED and value.shape[0] == full else value
        dims = [1] if name == "inputs_embeds" else range(1, value.dim())
        index = [slice(None)] * value.dim()
        for dim in dims:
            if value.shape[dim] == full:
                index[dim] = slice(0, tokens)
        part = value[tuple(index)].detach().clone()
        return (
            part.requires_grad_(True) if value.requires_grad and part.is_floating_point() else part
        )
    if isinstance(value, dict):
        return {k: first_tokens(torch, v, full, tokens, k) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(first_tokens(torch, v, full, tokens, name) for v in value)
    if isinstance(value, list):
        return [first_tokens(torch, v, full, tokens, name) for v in value]
    return value


def first_rows(torch: Any, value: Any, batch: int, rows: int, name: str = "") -> Any:
    """The first `rows` rows of every tensor whose first dimension is the batch, as new leaves
    (the user's graph upstream of the model is never reached), keeping requires_grad."""
    if isinstance(value, torch.Tensor):
        if name in NOT_BATCHED or value.dim() == 0 or value.shape[0] != batch:
            return value
        part = value[:rows].detach().clone()
        return (
            part.requires_grad_(True) if value.requires_grad and part.is_floating_point() else part
        )
    if isinstance(value, dict):
        return {k: first_rows(torch, v, batch, rows, k) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(first_rows(torch, v, batch, rows, name) for v in value)
    if isinstance(value, list):
        return [first_rows(torch, v, batch, rows, name) for v in value]
    return value
