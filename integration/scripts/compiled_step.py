"""A compiled training step with checkpointing, as a user writes it: `torch.compile(model)` and a
step, with dynamo's graph-break counter read after each case. Ordinary user code: nothing here
imports gcpatch.

Cases (one process, dynamo reset between them):
  llama      a tiny Llama, embedding frozen, gradient_checkpointing_enable() with default arguments
  reentrant  a hand-written model whose compiled forward calls checkpoint(block, h, use_reentrant=True)
             on the output of a frozen embedding (eager reentrant gives those blocks no gradient)

usage: compiled_step.py [--backend aot_eager]    prints one line: RESULT {json}
"""

from __future__ import annotations

import argparse

import _common as c
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint


def frozen_llama():
    model = c.llama().train()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


class Blocks(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.embed = nn.Embedding(c.VOCAB, 32)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, c.VOCAB)

    def forward(self, input_ids, labels):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = (
                checkpoint(block, hidden, use_reentrant=True)
                if self.checkpointed
                else block(hidden)
            )
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


def llama_step(model):
    ids = c.input_ids()
    model(input_ids=ids, labels=ids).loss.backward()


def blocks_step(model):
    model(c.input_ids(), c.input_ids()).backward()


def case(build_ref, build, enable, step, backend: str) -> dict:
    ref = build_ref()
    step(ref)
    model = build()
    enable(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    step(compiled)
    first = c.compare_grads(c.trainable_grads(model), c.trainable_grads(ref), atol=1e-6)
    model.zero_grad(set_to_none=True)
    graphs = counters["stats"]["unique_graphs"]
    step(compiled)  # a second step: no recompile
    second = c.compare_grads(c.trainable_grads(model), c.trainable_grads(ref), atol=1e-6)
    return {
        "wrong": first["wrong"] + second["wrong"],
        "trainable": first["trainable"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": graphs,
        "recompiles": counters["stats"]["unique_graphs"] - graphs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="aot_eager")
    backend = parser.parse_args().backend
    result = {
        "llama": case(
            frozen_llama,
            frozen_llama,
            lambda m: m.gradient_checkpointing_enable(),
            llama_step,
            backend,
        ),
        "reentrant": case(
            lambda: Blocks(False), lambda: Blocks(True), lambda m: None, blocks_step, backend
        ),
    }
    c.emit(result)


if __name__ == "__main__":
    main()
