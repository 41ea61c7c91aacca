"""Every family of the model-family table (scripts/families.py builds each tiny model from a config)
trained three SGD steps with checkpointing enabled, each step's gradients against the same model
trained without checkpointing. Under GCPATCH_MEMORY_BUDGET gcpatch probes the first step from
within and plans from the second: a backward refused there ('modified by an inplace operation': a
tensor the forward saved) or a gradient off shows up per family. Ordinary user code: nothing here
imports gcpatch.

usage: budget_families.py [--rows N] [--positions] [FAMILY ...]     prints one line: RESULT {json}
  --rows: the batch's rows (the table's 2 by default); Qwen2-VL's images come flattened across
          them (pixel_values with image_grid_thw)
  FAMILY: the table's, or a VLM beside it whose vision tower merges patches (families.py
          MERGED_VLMS: qwen2_5_vl, qwen3_vl, qwen3_vl_moe)
  --positions: the Qwen VLMs get their multimodal RoPE position_ids (sections x rows x tokens, from
          the model's own get_rope_index) passed in, as a packing collator passes them
"""

from __future__ import annotations

import argparse
import inspect
import traceback

import _common as c
import families as f
import torch

STEPS = 3


def inputs(model, path, positions: bool) -> dict:
    """The family's inputs; a Qwen VLM's with its position_ids under --positions."""
    kwargs = path(model)
    if positions and "image_grid_thw" in kwargs:
        rope_index = model.model.get_rope_index
        taken = inspect.signature(rope_index).parameters  # 5.x added mm_token_type_ids
        names = ("input_ids", "image_grid_thw", "mm_token_type_ids")
        kwargs["position_ids"], _ = rope_index(**{n: kwargs[n] for n in names if n in taken})
    return kwargs


def train(name: str, checkpointing: bool, positions: bool) -> list[dict]:
    """Each step's trainable gradients (the same inputs every step, SGD in between)."""
    model = f.build(name)
    if checkpointing:
        f.enable(model)
    model.train()
    path = f.BUILT[name][2]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    grads = []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        output = model(**inputs(model, path, positions))
        f._first_float(output).float().pow(2).mean().backward()
        grads.append(c.trainable_grads(model))
        optimizer.step()
    return grads


def family(name: str, positions: bool) -> dict:
    reference = train(name, checkpointing=False, positions=positions)
    try:
        got = train(name, checkpointing=True, positions=positions)
    except Exception as exc:  # noqa: BLE001 (reported per family)
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "wrong": None}
    return {"error": None, "wrong": [f.compare(g, r)["wrong"] for g, r in zip(got, reference)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=f.B)
    parser.add_argument("--positions", action="store_true")
    parser.add_argument("families", nargs="*", default=list(f.FAMILIES))
    args = parser.parse_args()
    f.B = args.rows
    families = {name: family(name, args.positions) for name in args.families}
    c.emit(
        {
            "scenario": "budget_families",
            "rows": f.B,
            "positions": args.positions,
            "families": families,
        }
    )


if __name__ == "__main__":
    main()
