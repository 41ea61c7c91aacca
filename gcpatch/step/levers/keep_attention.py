"""Keep the attention output: the fused attention kernels' outputs alone saved (Axolotl's choice,
axolotl-ai-cloud/axolotl#3786), so the backward recomputes the projections and the MLP but not
attention, for a few bytes more than whole. Unfused attention (CPU attention with dropout runs as
matmul, softmax and dropout) has no such kernel: not offered there."""

from __future__ import annotations

from typing import Any

from gcpatch.step.held import attention_ops
from gcpatch.step.levers.keep_matmuls import KeepMatmuls
from gcpatch.step.probe import ATTENTION


class KeepAttention(KeepMatmuls):
    name = "keep-attention"
    title = "keeping the attention output"
    says = "keeping their attention output"
    brief = "attention kept"
    part = ATTENTION

    def ops(self, torch: Any) -> frozenset:
        return attention_ops(torch)


LEVER = KeepAttention()
