"""What a memory budget's plan holds and recomputes on an 8-layer Llama (hidden 256, batch 2 x 256
tokens, fp32, dropout 0): the same model, from the same seed and on the same two batches, trained
two steps with checkpointing never enabled (`none`) and then with `gradient_checkpointing_enable()`
(`enabled`: under GCPATCH=1 with GCPATCH_MEMORY_BUDGET set, the budget's plan; plainly, full
checkpointing). Ordinary user code: nothing here imports gcpatch.

At the second step the script measures by itself
  held   every storage an operator allocated inside the forward and still alive after it (a
         dispatch mode of its own): what the backward holds;
  flops  torch.utils.flop_counter.FlopCounterMode's total over the backward (matmuls and
         attention): with checkpointing, the backward's own plus what it recomputes;
and compares the second step's trainable gradients with the run without checkpointing.

usage: budget_flops.py
prints one line: RESULT {json}
"""

import os
import warnings

import _common as c
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS, HIDDEN, BATCH, SEQ, VOCAB = 8, 256, 2, 256, 256


class HeldBytes(TorchDispatchMode):
    """Storages allocated by operators inside the `with`; `alive()` sums those still alive."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage()._cdata for t in _flat((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in _flat(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                s = t.untyped_storage()
                self.made[s._cdata] = (StorageWeakRef(s), s.nbytes())
        return out

    def alive(self):
        return sum(n for ref, n in self.made.values() if not ref.expired())


def _flat(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    else:
        yield value


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=HIDDEN * 43 // 16,  # 688: Llama's ratio, a multiple of 8
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_dropout=0.0,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            use_cache=False,
        )
    )


def batches() -> list:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2)]


def train(checkpointing: bool) -> dict:
    model = llama()
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = {}
    for step, ids in enumerate(batches(), start=1):
        opt.zero_grad(set_to_none=True)
        with HeldBytes() as held:
            loss = model(input_ids=ids, labels=ids).loss
        nbytes = held.alive()
        with FlopCounterMode(display=False) as flops:
            loss.backward()
        if step == 2:
            out = {
                "held": nbytes,
                "backward_flops": flops.get_total_flops(),
                "grads": c.trainable_grads(model),
                "checkpointed": sum(
                    bool(getattr(layer, "gradient_checkpointing", False))
                    for layer in model.model.layers
                ),
            }
        opt.step()
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    none = train(checkpointing=False)
    enabled = train(checkpointing=True)
    compared = c.compare_grads(enabled.pop("grads"), none.pop("grads"), atol=1e-5)
    c.emit(
        {
            "scenario": "budget_flops",
            "shape": [BATCH, SEQ],
            "layers": LAYERS,
            "budget": os.environ.get("GCPATCH_MEMORY_BUDGET"),
            "none": none,
            "enabled": enabled,
            "held_fraction": enabled["held"] / none["held"],
            "recomputed_flops": enabled["backward_flops"] - none["backward_flops"],
            "wrong": compared["wrong"],
            "grad_none": compared["grad_none"],
        }
    )


if __name__ == "__main__":
    main()
