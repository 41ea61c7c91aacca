"""The known checkpointing crashes, each as a user meets it. Ordinary user code: nothing here
imports gcpatch. The script catches the exception and prints its type, message, notes (PEP 678)
and the frames it was raised through, so a run under GCPATCH=1 can be compared with a plain one.

usage: crash_families.py --family recompute|no_grad|twice
   or: python -m torch.distributed.run --nproc_per_node=2 crash_families.py --family ddp
  recompute: GPT-2 with dropout, non-reentrant checkpointing, model.eval() between forward and
             backward: the recompute saves no dropout mask (CheckpointError)
  no_grad:   a custom model whose loop passes hidden states by keyword, embeddings and head frozen,
             use_reentrant=True: the loss has no grad_fn ("element 0 of tensors does not require grad")
  twice:     Llama, inputs_embeds computed once outside the loop from the trainable embedding and
             reused in step 2 ("Trying to backward through the graph a second time")
  ddp:       DDP(find_unused_parameters=True) + use_reentrant=True on 2 ranks ("Expected to mark a
             variable ready only once")
"""

import argparse
import os
import traceback
import warnings

import _common as c
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def recompute() -> None:
    model = c.gpt2().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = c.input_ids(batch=2)
    loss = model(input_ids=ids, labels=ids).loss
    model.eval()  # e.g. an evaluation hook between forward and backward
    loss.backward()


def no_grad() -> None:
    import _kwarg_model

    model = _kwarg_model.build().train()
    for p in list(model.embed.parameters()) + list(model.head.parameters()):
        p.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = c.input_ids(batch=2)
    model(input_ids=ids, labels=ids).loss.backward()


def twice() -> None:
    model = c.llama().train()
    model.gradient_checkpointing_enable()
    ids = c.input_ids(batch=2)
    embeds = model.get_input_embeddings()(ids)  # computed once, with the embedding's graph
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(inputs_embeds=embeds, labels=ids).loss.backward()
        opt.step()


def ddp() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = c.llama().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    wrapped = DDP(model, find_unused_parameters=True)
    ids = c.input_ids(seed=dist.get_rank())
    wrapped(input_ids=ids, labels=ids).loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True, choices=("recompute", "no_grad", "twice", "ddp"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    result = {"scenario": "crash_families", "family": args.family}
    if args.family == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        result["rank"] = dist.get_rank()
    try:
        globals()[args.family]()
        result["error_type"] = None
    except Exception as exc:
        result.update(
            error_type=f"{type(exc).__module__}.{type(exc).__name__}",
            message=str(exc).splitlines()[0][:300] if str(exc) else "",
            notes=list(getattr(exc, "__notes__", [])),
            frames=[
                f"{os.path.basename(f.filename)}:{f.name}"
                for f in traceback.extract_tb(exc.__traceback__)
            ],
            formatted="".join(traceback.format_exception(exc))[-4000:],
        )
    c.emit(result)
    if args.family == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
