"""torchrun --nproc_per_node=2 (gloo, CPU): an 8-layer tiny Llama (budget_train.py's config,
attention dropout on) trained four steps under a sharding engine, with
`gradient_checkpointing_enable()` or without checkpointing (`--checkpointing off`: the same job's
reference). Ordinary user code: nothing here imports gcpatch.

usage: python -m torch.distributed.run --nproc_per_node=2 budget_sharded.py --engine fsdp2|zero3
       --tune full|lora [--checkpointing on|off]
  fsdp2: `torch.distributed.fsdp.fully_shard` on every decoder layer and on the model the loop calls
         (the root), AdamW.
  zero3: DeepSpeed ZeRO-3 on CPU (DS_ACCELERATOR=cpu, gloo), the model built under zero.Init
         (HfDeepSpeedConfig before from_config), every parameter partitioned (persistence threshold
         0), `deepspeed.initialize` with AdamW, `engine.backward` and `engine.step`.
  full:  every parameter trains; lora: PEFT LoRA (r=4 on q_proj and v_proj, lora_B given a value)
         after `gradient_checkpointing_enable()`, the base frozen.

The batch's rows and tokens change from step to step and differ between the ranks (STEPS). Each
rank measures by itself what every training forward holds for the backward: the storages an
operator allocated during the forward that are alive after it, at their size then, less the
parameters' (the engines gather parameters during the forward, into storages that are the
parameters' own, freed or kept by the engine: they are not activations). It also reports how many
layers its backward recomputed, and a digest of the full gradient of every trainable tensor
(gathered from the shards: `DTensor.full_tensor()`, `deepspeed.utils.safe_get_full_grad`) before
each optimizer step, and of the full trainable parameters after the last step, so that a run with
GCPATCH_MEMORY_BUDGET can be compared step by step and tensor by tensor with the same job without
checkpointing. Prints one RESULT line per rank.
"""

import argparse
import os
import warnings

import _common as c
import torch
import torch.distributed as dist
from budget_train import CONFIG
from torch.multiprocessing.reductions import StorageWeakRef

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# (rows, tokens) of each step, rank 0's and rank 1's
STEPS = (((2, 64), (2, 64)), ((1, 96), (2, 48)), ((2, 32), (1, 128)), ((2, 64), (2, 80)))
KEPT: list = []  # objects the job keeps alive to its end


class ActivationBytes(c.HeldBytes):
    """Storages allocated by operators inside the `with`; `alive(params)` sums, at their size now,
    those still alive that back none of `params` (a parameter an engine gathered, or resized to
    nothing once it resharded)."""

    def _entry(self, storage):
        return StorageWeakRef(storage)

    def alive(self, params) -> int:
        skip = {_storage(p)._cdata for p in params}
        total = 0
        for key, ref in self.made.items():
            if key in skip or ref.expired():
                continue
            total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total


def decoder_layers(model) -> list:
    """The decoder layers, also once fully_shard made each an FSDP subclass of its own class."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def _storage(p: torch.Tensor):
    local = getattr(p, "_local_tensor", None)  # a DTensor's shard
    return (local if local is not None else p.data).untyped_storage()


def config():
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def tuned(model, args):
    if args.checkpointing == "on":
        model.gradient_checkpointing_enable()
    model.train()
    if args.tune == "lora":
        model = c.lora(model)
        c.trained_lora_b(model)
        model.train()
    return model


def fsdp2(args):
    from torch.distributed.fsdp import fully_shard

    model = tuned(c.llama_of(CONFIG), args)
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)

    def backward_and_step(loss):
        loss.backward()
        grads = [c.digest([p.grad.full_tensor()]) for _, p in trainable]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return grads

    def full_params():
        return c.digest(p.full_tensor() for _, p in trainable)

    return model, model, backward_and_step, full_params


def zero3(args):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from transformers import AutoModelForCausalLM

    try:
        from transformers.integrations import HfDeepSpeedConfig
    except ImportError:  # older layout
        from transformers.deepspeed import HfDeepSpeedConfig

    ds_config = c.zero3_config()
    # kept alive with the model, as zero3_lora.py does: from_config then builds under zero.Init
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    torch.manual_seed(0)
    model = tuned(AutoModelForCausalLM.from_config(config()), args)
    KEPT.append(hf_ds_config)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

    def backward_and_step(loss):
        engine.backward(loss)
        grads = [c.digest([safe_get_full_grad(p)]) for _, p in trainable]
        engine.step()
        return grads

    def full_params():
        return c.digest(safe_get_full_fp32_param(p) for _, p in trainable)

    return model, engine, backward_and_step, full_params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("fsdp2", "zero3"), required=True)
    parser.add_argument("--tune", choices=("full", "lora"), default="full")
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.engine == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, forward, backward_and_step, full_params = {"fsdp2": fsdp2, "zero3": zero3}[args.engine](
        args
    )
    counter = c.Recomputes(decoder_layers(model))
    log = []
    for step, shapes in enumerate(STEPS, start=1):
        rows, tokens = shapes[rank]
        gen = torch.Generator().manual_seed(1000 * rank + step)
        ids = torch.randint(0, c.VOCAB, (rows, tokens), generator=gen)
        counter.backward, counter.count = False, 0
        torch.manual_seed(10 * step + rank)  # attention dropout: the same on every run
        with ActivationBytes() as held:
            loss = forward(input_ids=ids, labels=ids).loss
        nbytes = held.alive(model.parameters())
        counter.backward = True
        grads = backward_and_step(loss)
        counter.backward = False
        log.append(
            {
                "step": step,
                "rows": rows,
                "tokens": tokens,
                "held": nbytes,
                "recomputed": counter.count,
                "loss": float(loss.detach()),
                "grads": grads,
            }
        )
    c.emit(
        {
            "scenario": "budget_sharded",
            "engine": args.engine,
            "tune": args.tune,
            "checkpointing": args.checkpointing,
            "rank": rank,
            "world": dist.get_world_size(),
            "layers": len(decoder_layers(model)),
            "steps": log,
            "params_after": full_params(),
        }
    )
    dist.barrier()
    c.end_ranks()


if __name__ == "__main__":
    main()
