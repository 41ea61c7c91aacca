"""Call shapes that a framework's default or the blunt patch gets wrong, as ordinary training code
writes them. Nothing here imports gcpatch. One interpreter runs every case it is given
(--cases a,b,...) and prints one RESULT with a figure per case: how many trainable tensors got a
gradient other than a model's that never checkpointed (`wrong`), or the error (`error`).

hf_recompute_differs     a tiny Llama whose MLP activation saves a different number of tensors the
                         first time it runs than later (a cache built on the first call: the same
                         values, other operations), default `gradient_checkpointing_enable()`, a
                         hand-written training step. Non-reentrant refuses such a recompute
                         (CheckpointError); reentrant runs it exactly (transformers 4.x's default).
trainer_recompute_differs  the same through the Trainer (gradient_checkpointing=True).
direct_frozen_input      `checkpoint(block, x, use_reentrant=True)` where x needs no grad and the
                         block trains and saves other tensors on its recompute: reentrant loses the
                         block's gradients, non-reentrant crashes; reentrant with an input that
                         requires grad is exact.
list_input, dict_input, dataclass_input
                         two blocks called with their hidden state and a shared memory bank (both
                         with a graph) inside a list, a dict or a dataclass, reentrant: reentrant
                         does not look into containers and runs the bank's graph once per block.
dict_out, model_output_out, tuple_none_out
                         blocks returning a dict, a transformers ModelOutput, or (hidden, None),
                         reentrant: reentrant tracks only a tensor or a tuple's tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import _common as c
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--cases", required=True)
args = parser.parse_args()
DIM = 16


class LazySiLU(nn.Module):
    """SiLU, computed the first time through `relu(x) - relu(-x)` (the same values, two more saved
    tensors): what a layer that builds a cache on its first call looks like to checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            x = x.relu() - (-x).relu()
        return F.silu(x)


def lazy_llama(seed: int = 0):
    model = c.llama(seed)
    for layer in model.model.layers:
        layer.mlp.act_fn = LazySiLU()
    return model


def outcome(step, reference) -> dict:
    """Figures of one case: the step's gradients against the reference's, or the step's error."""
    try:
        got = step()
    except Exception as exc:  # the outcome is the error, and the note gcpatch put on it
        return {
            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            "note": "\n".join(getattr(exc, "__notes__", ()))[:3000],
            "wrong": None,
        }
    return {"error": None, **c.compare_grads(got, reference())}


def llama_step(model) -> dict:
    model.train()
    ids = c.input_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    return c.trainable_grads(model)


def hf_recompute_differs() -> dict:
    def step():
        model = lazy_llama()
        model.gradient_checkpointing_enable()
        result["use_reentrant"] = c.checkpoint_use_reentrant(model)
        return llama_step(model)

    result: dict = {}
    return {**outcome(step, lambda: llama_step(lazy_llama())), **result}


def trainer_recompute_differs() -> dict:
    """The first step's gradients through the Trainer (taken by its optimizer before it steps),
    against the same Trainer without checkpointing."""
    result: dict = {}

    def trained(checkpointing: bool) -> dict:
        probe = train_one_step(checkpointing)
        if checkpointing:
            result["use_reentrant"] = probe.use_reentrant
        return probe.grads

    return {**outcome(lambda: trained(True), lambda: trained(False)), **result}


def train_one_step(checkpointing: bool) -> c.FirstStepProbe:
    import tempfile

    from transformers import Trainer, TrainingArguments

    model = lazy_llama()
    probe = c.FirstStepProbe(model)
    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(
            output_dir=out,
            gradient_checkpointing=checkpointing,
            max_steps=1,
            per_device_train_batch_size=2,
            report_to=[],
            use_cpu=True,
            learning_rate=0.0,
            max_grad_norm=0.0,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        Trainer(
            model=model,
            args=arguments,
            train_dataset=c.Batch(c.input_ids()),
            optimizers=(probe, None),
        ).train()
    return probe


class Block(nn.Module):
    """A hand-written block: a linear layer and SiLU (LazySiLU: its recompute saves other tensors
    than its first run); returns its output in the case's shape."""

    def __init__(self, returns: str = "tensor", lazy: bool = True) -> None:
        super().__init__()
        self.lin, self.returns = nn.Linear(DIM, DIM), returns
        self.act = LazySiLU() if lazy else nn.SiLU()

    def forward(self, h, memory=None):
        out = self.act(self.lin(h))
        if memory is not None:
            out = out + memory
        if self.returns == "dict":
            return {"hidden": out, "aux": out.mean()}
        if self.returns == "model_output":
            from transformers.modeling_outputs import BaseModelOutput

            return BaseModelOutput(last_hidden_state=out)
        if self.returns == "tuple_none":
            return (out, None)
        return out


def hidden(result):
    if isinstance(result, tuple):
        return result[0]
    if isinstance(result, dict):
        return result["hidden"] if "hidden" in result else result["last_hidden_state"]
    return result


class Stack(nn.Module):
    """An embedding-like projection, a shared memory bank, two blocks, a head."""

    def __init__(self, returns: str, frozen_input: bool, lazy: bool, memory: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(DIM, DIM)
        if memory:
            self.bank = nn.Linear(DIM, DIM)
            self.seed = nn.Parameter(torch.randn(DIM))
        self.blocks = nn.ModuleList(Block(returns, lazy) for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        if frozen_input:
            self.up.requires_grad_(False)


CONTAINERS = ("list_input", "dict_input", "dataclass_input")


@dataclasses.dataclass
class Carry:
    hidden: torch.Tensor
    memory: torch.Tensor


def unpack(block, packed):
    if isinstance(packed, Carry):
        return block(packed.hidden, packed.memory)
    if isinstance(packed, dict):
        return block(packed["hidden"], packed["memory"])
    return block(packed[0], packed[1])


def run_stack(model: Stack, how: str, checkpointing: bool) -> dict:
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    h = model.up(x)
    memory = model.bank(model.seed) if how in CONTAINERS else None
    for block in model.blocks:
        if how in CONTAINERS:
            packed = {
                "list_input": lambda: [h, memory],
                "dict_input": lambda: {"hidden": h, "memory": memory},
                "dataclass_input": lambda: Carry(h, memory),
            }[how]()
            call = functools.partial(unpack, block)
            h = hidden(
                checkpoint(call, packed, use_reentrant=True) if checkpointing else call(packed)
            )
        else:
            h = hidden(checkpoint(block, h, use_reentrant=True) if checkpointing else block(h))
    model.head(h).pow(2).sum().backward()
    return c.trainable_grads(model)


def stack_case(how: str, returns: str = "tensor", frozen_input: bool = False) -> dict:
    # containers in: blocks whose recompute repeats their forward (non-reentrant is the fix there)
    memory = how in CONTAINERS
    return outcome(
        lambda: run_stack(Stack(returns, frozen_input, not memory, memory), how, True),
        lambda: run_stack(Stack(returns, frozen_input, not memory, memory), how, False),
    )


CASES = {
    "hf_recompute_differs": hf_recompute_differs,
    "trainer_recompute_differs": trainer_recompute_differs,
    "direct_frozen_input": lambda: stack_case("direct_frozen_input", frozen_input=True),
    "list_input": lambda: stack_case("list_input"),
    "dict_input": lambda: stack_case("dict_input"),
    "dataclass_input": lambda: stack_case("dataclass_input"),
    "dict_out": lambda: stack_case("out", returns="dict"),
    "model_output_out": lambda: stack_case("out", returns="model_output"),
    "tuple_none_out": lambda: stack_case("out", returns="tuple_none"),
}

c.emit({name: CASES[name]() for name in args.cases.split(",")})
