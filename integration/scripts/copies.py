"""Copies, pickles and saves of checkpointing models, as users make them: `copy.deepcopy` (TRL's
reference model, EMA and teacher copies), `pickle` of `partial(checkpoint, ...)`, and
`torch.save`/`torch.load` of a whole model. Every case that runs plainly must run with gcpatch, and
the copy must train as the original: its trainable gradients after one step are compared with a
model that never checkpointed. Ordinary user code: nothing here imports gcpatch.

usage: copies.py [--cases a,b]    prints one line: RESULT {json}, one entry per case: {"ok": bool,
       ...} or {"error": "..."}; the cases after the first step's work (run with GCPATCH_VERIFY=1 or
       GCPATCH_MEMORY_BUDGET set) only when named
"""

from __future__ import annotations

import copy
import functools
import io
import pickle

import _common as c
import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn

CASES = {}


def case(function):
    CASES[function.__name__] = function
    return function


def step(model, ids, **kwargs) -> dict:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, **kwargs).loss.backward()
    return c.trainable_grads(model)


def reference(build, *, train: bool = True) -> dict:
    """The gradients of the same model, built from the same seed, without checkpointing."""
    model = build()
    model.train(train)
    return step(model, c.input_ids())


def frozen_llama():
    model = c.llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def save_and_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@case
def hf_deepcopy_after_a_step():
    """A frozen-embedding Llama checkpointing with default arguments, copied after its first step."""
    model = frozen_llama().train()
    model.gradient_checkpointing_enable()
    step(model, c.input_ids())
    twin = copy.deepcopy(model)
    got = step(twin, c.input_ids())
    return {
        **c.compare_grads(got, reference(frozen_llama)),
        "use_reentrant": c.checkpoint_use_reentrant(twin),
        "original_use_reentrant": c.checkpoint_use_reentrant(model),
    }


@case
def hf_deepcopy_in_eval_mode_before_first_step():
    """Copied while the first-forward check (R5) is still waiting: the copy's first training forward
    in eval mode is decided for the copy, and the original's check is still armed."""
    model = frozen_llama()
    model.gradient_checkpointing_enable()
    model.eval()
    hooks = len(model.model._forward_pre_hooks)
    twin = copy.deepcopy(model)
    got = step(twin, c.input_ids())
    return {
        **c.compare_grads(got, reference(frozen_llama, train=False)),
        "copy_layers_checkpointing": sum(layer.training for layer in twin.model.layers),
        "original_hooks_before": hooks,
        "original_hooks_after": len(model.model._forward_pre_hooks),
        "copy_hooks_after": len(twin.model._forward_pre_hooks),
    }


@case
def hf_deepcopy_in_eval_mode_after_first_step():
    """Copied after R5 let the eval-mode layers checkpoint: the copy's layers run their own body."""
    model = frozen_llama()
    model.gradient_checkpointing_enable()
    model.eval()
    step(model, c.input_ids())
    twin = copy.deepcopy(model)
    bound = [
        getattr(layer._gradient_checkpointing_func, "layer", lambda: layer)() is layer
        for layer in twin.model.layers
    ]
    got = step(twin, c.input_ids())
    with torch.no_grad():  # a no_grad forward asking for a cache gets it, as without checkpointing
        cache = twin(input_ids=c.input_ids(), use_cache=True).past_key_values
    return {
        **c.compare_grads(got, reference(frozen_llama, train=False)),
        "copy_bound_to_copy": all(bound),
        "cache_under_no_grad": cache is not None,
    }


@case
def peft_lora_deepcopy():
    def build():
        model = c.lora(c.llama())
        c.trained_lora_b(model)
        return model

    model = build().train()
    model.gradient_checkpointing_enable()
    step(model, c.input_ids())
    twin = copy.deepcopy(model)
    return {
        **c.compare_grads(step(twin, c.input_ids()), reference(build)),
        "use_reentrant": c.checkpoint_use_reentrant(twin.base_model.model),
    }


class Blocks(nn.Module):
    """A hand-written model: an embedding, four blocks, a head (no transformers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(c.VOCAB, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(32, c.VOCAB)

    def forward(self, input_ids, labels):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def blocks_step(model) -> dict:
    """One step's trainable gradients, named as in the unwrapped model."""
    model.zero_grad(set_to_none=True)
    model(c.input_ids(), c.input_ids()).backward()
    return {
        name.replace("._checkpoint_wrapped_module", ""): grad
        for name, grad in c.trainable_grads(model).items()
    }


def wrapped_blocks():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = Blocks()
    model.embed.weight.requires_grad_(False)
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, nn.Sequential)
    )
    return model


def plain_blocks():
    model = Blocks()
    model.embed.weight.requires_grad_(False)
    return model


@case
def fsdp_checkpoint_wrapper_deepcopy():
    """FSDP's checkpoint_wrapper (reentrant, frozen embedding): the copy trains as the original."""
    model = wrapped_blocks()
    blocks_step(model)
    return c.compare_grads(blocks_step(copy.deepcopy(model)), blocks_step(plain_blocks()))


@case
def fsdp_checkpoint_wrapper_torch_save():
    model = wrapped_blocks()
    blocks_step(model)
    return c.compare_grads(blocks_step(save_and_load(model)), blocks_step(plain_blocks()))


class PartialBlocks(Blocks):
    """A hand-written model holding `partial(checkpoint, use_reentrant=False)`, as transformers does."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint = functools.partial(checkpoint_module.checkpoint, use_reentrant=False)

    def forward(self, input_ids, labels):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = self.checkpoint(block, hidden)
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@case
def partial_pickle_round_trip():
    made = functools.partial(checkpoint_module.checkpoint, use_reentrant=False)
    loaded = pickle.loads(pickle.dumps(made))
    copied = copy.deepcopy(made)
    return {
        "ok": loaded.func is checkpoint_module.checkpoint
        and loaded.keywords == {"use_reentrant": False}
        and copied.func is made.func,
        "bytes": len(pickle.dumps(made)),
    }


@case
def partial_model_torch_save():
    model = PartialBlocks()
    blocks_step(model)
    loaded = save_and_load(model)
    return {
        **c.compare_grads(blocks_step(loaded), blocks_step(Blocks())),
        "same_function": loaded.checkpoint.func is checkpoint_module.checkpoint,
    }


@case
def hf_torch_save():
    """torch.save of a checkpointing Llama: plainly this fails on transformers 5 (its input-grads
    hook is a local closure), and runs on 4.x; with gcpatch it must run wherever it runs plainly."""
    model = c.llama().train()
    model.gradient_checkpointing_enable()
    step(model, c.input_ids())
    loaded = save_and_load(model)
    return c.compare_grads(step(loaded, c.input_ids()), reference(c.llama))


@case
def trl_reference_model():
    """TRL's create_reference_model: a frozen deep copy of the policy, after checkpointing is on."""
    from trl import create_reference_model

    model = c.llama().train()
    model.gradient_checkpointing_enable()
    ref = create_reference_model(model)
    ids = c.input_ids()
    with torch.no_grad():
        same = torch.equal(ref(input_ids=ids).logits, model(input_ids=ids).logits)
    got = step(model, ids)
    return {
        **c.compare_grads(got, reference(c.llama)),
        "frozen": not any(p.requires_grad for p in ref.parameters()),
        "same_logits": same,
    }


def _copied_while_armed(steps: int) -> dict:
    """A frozen-embedding Llama enabled, then deep-copied before its first step (a TRL reference
    model, an EMA copy) while the first step's work (verify, the budget's plan) waits: the original
    and the copy each train `steps` steps from the same seed, and each is compared with a model
    that never checkpointed, step by step."""
    model = frozen_llama().train()
    model.gradient_checkpointing_enable()
    twin = copy.deepcopy(model)
    out = {}
    for name, m in (("original", model), ("copy", twin)):
        ref = frozen_llama().train()
        wrong = 0
        for step_no in range(steps):
            torch.manual_seed(100 + step_no)
            got = step(m, c.input_ids())
            torch.manual_seed(100 + step_no)
            wrong += c.compare_grads(got, step(ref, c.input_ids()))["wrong"]
        out[f"{name}_wrong"] = wrong
        out[f"{name}_layers_checkpointing"] = sum(
            bool(layer.gradient_checkpointing) for layer in m.model.layers
        )
        out[f"{name}_hooks_left"] = len(m._forward_pre_hooks) + len(m._forward_hooks)
    out["trainable"] = sum(p.requires_grad for p in model.parameters())
    out["wrong"] = out["original_wrong"] + out["copy_wrong"]
    return out


def _copied_after_the_plan() -> dict:
    """An 8-layer Llama planned under the budget (its first step probed, its second planned at its
    forward and run so), then deep-copied (an EMA or reference copy made mid-training); the copy
    trains on batches of 32, 128 and 256 tokens, the original after it on 64. Per step: what the forward held (budget_train's
    dispatch mode) against the same model without checkpointing, the gradients, and how each
    layer ran; how the original's layers run before and after the copy's steps."""
    from budget_train import HeldBytes, llama

    def held_step(model, tokens: int, seed: int) -> tuple[int, dict]:
        ids = torch.randint(
            0, c.VOCAB, (2, tokens), generator=torch.Generator().manual_seed(tokens)
        )
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with HeldBytes() as held:
            loss = model(input_ids=ids, labels=ids).loss
        alive = held.alive()
        loss.backward()
        return alive, c.trainable_grads(model)

    def modes(m) -> list[str]:
        """How each layer runs: plain, whole, its feed-forward block alone checkpointed, or
        checkpointed with a selective policy (its flag and its checkpoint function)."""
        out = []
        for layer in m.model.layers:
            func = getattr(layer, "_gradient_checkpointing_func", None)
            if not layer.gradient_checkpointing:
                out.append("plain")
            elif type(func).__name__ == "FeedForward":
                out.append("feed-forward")
            else:
                selective = "context_fn" in getattr(func, "keywords", {})
                out.append("selective" if selective else "whole")
        return out

    model = llama().train()
    model.gradient_checkpointing_enable()
    held_step(model, 64, 1)  # the first step: probed
    held_step(model, 64, 2)  # the second: its plan made at its forward, and run
    twin = copy.deepcopy(model)
    before = modes(model)
    steps = []
    for name, m, tokens in (
        ("copy", twin, 32),
        ("copy", twin, 128),
        ("copy", twin, 256),
        ("original", model, 64),
    ):
        plain = llama().train()
        plain.load_state_dict(m.state_dict())
        held, got = held_step(m, tokens, 7)
        plain_held, want = held_step(plain, tokens, 7)
        steps.append(
            {
                "model": name,
                "tokens": tokens,
                "held": held,
                "plain_held": plain_held,
                "wrong": c.compare_grads(got, want, atol=0.0)["wrong"],
                "flags": [bool(layer.gradient_checkpointing) for layer in m.model.layers],
                "modes": modes(m),
            }
        )
        if name == "copy":
            steps[-1]["original_modes"] = modes(model)
    return {
        "steps": steps,
        "original_modes_at_copy": before,
        "wrong": sum(s["wrong"] for s in steps),
    }


ARMED = {
    "deepcopy_while_verify_waits": lambda: _copied_while_armed(2),
    "deepcopy_while_the_budget_waits": lambda: _copied_while_armed(3),
    "deepcopy_after_the_plan": _copied_after_the_plan,
}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="")
    chosen = [name for name in parser.parse_args().cases.split(",") if name]
    cases = {name: {**CASES, **ARMED}[name] for name in chosen} if chosen else CASES
    results = {}
    for name, function in cases.items():
        try:
            results[name] = function()
        except Exception as exc:  # noqa: BLE001 (each case says how it failed)
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    c.emit({"cases": results})


if __name__ == "__main__":
    main()
