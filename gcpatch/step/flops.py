"""The matrix-multiply FLOPs a step runs, counted by torch's own FLOP counter
(torch/utils/flop_counter.py): its matmuls and attention kernels, CPU's fused attention kernel
included through the formulas torch gives the accelerators' (the counter's registry names those
alone). A count does not move with a shared machine's clock, so it breaks the ties the clock cannot
(gcpatch/step/solver.py `SLACK`)."""

from __future__ import annotations

import sys
from typing import Any

# CPU's fused attention forward and backward, given the formulas of the accelerators' kernels
CPU_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)


def counter() -> Any | None:
    """A FLOP counter to run a step under (`get_total_flops()` after), or None where this torch
    has none (before 2.1)."""
    torch = sys.modules["torch"]
    try:
        from torch.utils import flop_counter
    except ImportError:
        return None
    if not hasattr(flop_counter, "sdpa_backward_flop_count"):
        return None
    forward, backward = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count

    def attention(query: Any, key: Any, value: Any, *rest: Any, **kwargs: Any) -> int:
        return forward(query, key, value)

    def attention_backward(
        grad: Any, query: Any, key: Any, value: Any, *rest: Any, **kw: Any
    ) -> int:
        return backward(grad, query, key, value)

    # the counter hands a formula its arguments' shapes; CPU's kernels take the accelerators'
    ops = (getattr(torch.ops.aten, name, None) for name in CPU_ATTENTION)
    mapping = {op: f for op, f in zip(ops, (attention, attention_backward)) if op is not None}
    return flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)
