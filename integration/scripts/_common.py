"""Helpers shared by the integration scripts. Ordinary user code: nothing here imports gcpatch.

Every model is built from a fresh config object (gcpatch's R6 sets `config.use_cache=False` on
the config it is handed), from a fixed seed, so two builds give identical weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

SEQ_LEN = 16
VOCAB = 64


def llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def llama_config(
    layers: int, hidden: int, intermediate: int | None = None, dropout: float = 0.0, **extra
) -> dict:
    """The budget scripts' tiny Llama, as LlamaConfig's keywords: 4 heads over 2 KV heads, untied,
    no cache, vocab VOCAB, the MLP twice the hidden size (unless given); `extra` adds or overrides."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden if intermediate is None else intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_dropout": dropout,
        "tie_word_embeddings": False,
        "use_cache": False,
        **extra,
    }


def llama_of(config: dict, seed: int = 0):
    """A LlamaForCausalLM of `config` (LlamaConfig's keywords, e.g. `llama_config(...)`), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config))


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    return GPT2LMHeadModel(config)


def freeze_embeddings_and_first_layer(model) -> None:
    """The partially frozen set-up (R1): embeddings and layer 0 frozen, 11 tensors train."""
    for param in model.model.embed_tokens.parameters():
        param.requires_grad_(False)
    for param in model.model.layers[0].parameters():
        param.requires_grad_(False)


def lora(model, seed: int = 123, dropout: float = 0.0):
    """LoRA (r=4) on q_proj and v_proj, seeded, as most fine-tuning scripts configure it
    (`dropout`: LoRA's own, on the adapters' inputs)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=dropout,
            task_type="CAUSAL_LM",
        ),
    )


def trained_lora_b(model, seed: int = 7) -> None:
    """LoRA's B starts at zero, so lora_A's gradient is zero: give B a value as after some
    training, so that every adapter's gradient is a real number to compare."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def zero3_config() -> dict:
    """DeepSpeed ZeRO-3 on CPU for the tiny models: every parameter partitioned (persistence
    threshold 0), the model's own optimizer kept."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


def input_ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=gen)


class Batch(torch.utils.data.Dataset):
    """Causal-LM samples for a Trainer: each row of `ids` with itself as labels. Two rows of the
    same length with per_device_train_batch_size=2 make the one batch the whole dataset, whatever
    order the sampler picks."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def measured_trainer_args(output_dir: str, batch: int, steps: int, checkpointing: bool, **extra):
    """TrainingArguments for a measured run on CPU: `steps` steps of `batch` rows, seed 11, nothing
    saved, logged, reported or clipped (the gradients compared are the backward's own)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        max_steps=steps,
        report_to=[],
        gradient_checkpointing=checkpointing,
        save_strategy="no",
        max_grad_norm=0.0,
        use_cpu=True,
        logging_strategy="no",
        seed=11,
        disable_tqdm=True,
        **extra,
    )


def trainable_grads(model) -> dict[str, torch.Tensor | None]:
    return {
        name: (None if p.grad is None else p.grad.detach().clone())
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def max_abs_diff(got: dict, ref: dict) -> float:
    """The largest difference between two gradient dicts' tensors (those both have)."""
    return max(
        (
            float((g - ref[n]).abs().max())
            for n, g in got.items()
            if g is not None and ref[n] is not None
        ),
        default=0.0,
    )


def digest(tensors) -> str:
    """A short digest of the tensors' bytes, in order (`None` counts as itself)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(
            b"none"
            if t is None
            else t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return h.hexdigest()[:16]


def compare_grads(got: dict, ref: dict, atol: float = 1e-5) -> dict:
    """How many trainable tensors got no gradient, or one that differs from the reference."""
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    none = sorted(n for n, g in got.items() if g is None)
    ref_none = sorted(n for n, g in ref.items() if g is None)
    differ = sorted(
        n
        for n, g in got.items()
        if g is not None and ref[n] is not None and not torch.allclose(g, ref[n], atol=atol, rtol=0)
    )
    wrong = sorted(set(none) | set(differ) | {n for n in ref_none if got[n] is not None})
    return {
        "trainable": len(got),
        "wrong": len(wrong),
        "grad_none": len(none),
        "grad_differ": len(differ),
        "ref_grad_none": len(ref_none),
        "wrong_names": wrong,
    }


def checkpointed_layers(model) -> int:
    """How many of the model's decoder layers (`model.model.layers`) checkpoint."""
    return sum(
        bool(getattr(layer, "gradient_checkpointing", False)) for layer in model.model.layers
    )


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
                self.made[s._cdata] = self._entry(s)
        return out

    def _entry(self, storage):
        return (StorageWeakRef(storage), storage.nbytes())

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


def held_forward(forward, ids, labels=None):
    """The training forward `forward(input_ids=ids, labels=labels or ids)`, measured: its loss and
    the bytes it holds for the backward (HeldBytes)."""
    with HeldBytes() as held:
        loss = forward(input_ids=ids, labels=ids if labels is None else labels).loss
    return loss, held.alive()


class Recomputes:
    """Counts the layers whose MLP runs during the backward: a recomputed layer."""

    def __init__(self, layers) -> None:
        self.backward = False
        self.count = 0
        for layer in layers:
            layer.mlp.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.backward:
            self.count += 1


def checkpoint_use_reentrant(model):
    """The `use_reentrant` the checkpointed layers will call torch.utils.checkpoint with: the keyword
    of the functools.partial transformers installs (unwrapping any object with a `.func`)."""
    found: list = []
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None or not getattr(module, "gradient_checkpointing", False):
            continue
        for _ in range(10):
            if isinstance(func, functools.partial) or not hasattr(func, "func"):
                break
            func = func.func
        value = (getattr(func, "keywords", None) or {}).get("use_reentrant", "unset")
        if value not in found:
            found.append(value)
    if not found:
        return "no checkpointed layer"
    return found[0] if len(found) == 1 else found


class FirstStepProbe(torch.optim.SGD):
    """An lr=0 SGD handed to the Trainer (`optimizers=(probe, None)`): at its first step, before it
    touches anything, it records the trainable gradients and the use_reentrant the layers hold.
    The Trainer calls the optimizer on every release (its on_pre_optimizer_step callback came later
    than 4.35)."""

    def __init__(self, model) -> None:
        super().__init__([p for p in model.parameters() if p.requires_grad], lr=0.0)
        self.model = model
        self.grads = None
        self.use_reentrant = None
        self.grad_none = None

    def step(self, closure=None):
        if self.grads is None:
            self.grads = trainable_grads(self.model)
            self.use_reentrant = checkpoint_use_reentrant(self.model)
            self.grad_none = sum(1 for g in self.grads.values() if g is None)
        return super().step(closure)


def gcpatch_seen() -> dict:
    """Whether gcpatch is loaded in this interpreter (by the start-up hook, never by this script)
    and from where, so a test can prove it exercised the installed copy."""
    module = sys.modules.get("gcpatch")
    return {
        "gcpatch_loaded": module is not None,
        "gcpatch_file": getattr(module, "__file__", None) if module is not None else None,
    }


def versions() -> dict:
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def emit(result: dict) -> None:
    result = {**result, **versions(), **gcpatch_seen(), "env_GCPATCH": os.environ.get("GCPATCH")}
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)


def end_ranks() -> None:
    """Tear the process group down and leave at once, without letting the DDP wrappers die after
    it. Dying afterwards can deadlock inside torch: the Reducer drops the last reference to the
    gloo group with the GIL held, and ~ProcessGroupGloo joins a worker thread that needs the GIL
    to free a finished barrier (seen plainly, without gcpatch; the class of pytorch/pytorch#56297).
    Every result is out by then."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
