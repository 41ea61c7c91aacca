"""Remote-code style models whose checkpointed function gets its tensors other than as positional
inputs, as `trust_remote_code` models and hand-written loops do. Ordinary user code: nothing here
imports gcpatch. One interpreter runs every case it is given (--cases a,b,...) and prints one
RESULT with a figure per case.

bound           the layer input and a scale bound into the checkpointed function:
                `self._gradient_checkpointing_func(partial(layer.__call__, self.scale * 1.0, hidden_states=h))`,
                reentrant asked: no positional input, so reentrant gives 14 of 16 tensors no gradient (CK1)
shared_bias     layers take hidden_states by keyword and add a grad-requiring bias computed once per
                forward: reentrant runs the bias's graph once per layer and crashes (CK1)
autograd_grad   reentrant asked, gradients taken with torch.autograd.grad: torch refuses (known only at
                backward time: the crash note names the fix)
mllama          hidden states positional, image features by keyword (transformers' Mllama
                cross-attention): one cross-attention layer, so reentrant is exact; left as it is
mllama_shared   the same with two cross-attention layers sharing the projected features: reentrant
                runs the projector's graph twice and crashes; CK5 passes them positionally
prebound        a `functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)` built by a
                helper module imported before `import gcpatch` (--import-gcpatch), used by a hand-written
                loop whose first block gets no grad-requiring input
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bound_helper  # noqa: E402,F401  (builds its partial of torch's checkpoint now, before any gcpatch import)
import torch  # noqa: E402
from _common import emit  # noqa: E402
from torch import nn  # noqa: E402
from transformers import PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--cases", required=True)
parser.add_argument("--reentrant", choices=("true", "false", "unset"), default="true")
parser.add_argument(
    "--import-gcpatch", action="store_true", help="an explicit `import gcpatch` after the helpers"
)
args = parser.parse_args()
if args.import_gcpatch:
    import gcpatch  # noqa: F401

DIM, VOCAB, SEQ = 16, 32, 8


class BoundConfig(PretrainedConfig):
    model_type = "bound_inputs"

    def __init__(self, layers: int = 3, cross_layers: tuple = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.layers, self.cross_layers = layers, list(cross_layers)


class ScaledLayer(nn.Module):
    """Not a GradientCheckpointingLayer: the model's loop checkpoints it (pre-4.52 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, scale, hidden_states):
        return hidden_states + scale * torch.tanh(self.fc(self.norm(hidden_states)))


class BoundModel(PreTrainedModel):
    """`bound`: every input of a layer is bound into the checkpointed function."""

    config_class = BoundConfig
    supports_gradient_checkpointing = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.scale = nn.Parameter(torch.ones(()))
        self.layers = nn.ModuleList(ScaledLayer() for _ in range(config.layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = self._gradient_checkpointing_func(
                    functools.partial(layer.__call__, self.scale * 1.0, hidden_states=h)
                )
            else:
                h = layer(self.scale * 1.0, hidden_states=h)
        return self.head(h)


class BiasLayer(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, hidden_states, bias=None):
        return hidden_states + torch.tanh(self.fc(hidden_states) + bias)


class SharedBiasModel(PreTrainedModel):
    """`shared_bias`: layers take hidden_states by keyword; one bias, computed once per forward."""

    config_class = BoundConfig
    supports_gradient_checkpointing = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.bias_proj = nn.Linear(DIM, DIM)
        self.bias_seed = nn.Parameter(torch.randn(DIM))
        self.layers = nn.ModuleList(BiasLayer() for _ in range(config.layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.post_init()

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        h = self.emb(input_ids)
        bias = self.bias_proj(self.bias_seed)
        for layer in self.layers:
            h = layer(hidden_states=h, bias=bias)
        return self.head(h)


class CrossLayer(GradientCheckpointingLayer):
    def __init__(self, cross: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM) if cross else None

    def forward(self, hidden_states, cross_attention_states=None):
        out = self.fc(hidden_states)
        if self.k is not None:
            out = out + self.k(cross_attention_states).mean(1, keepdim=True)
        return hidden_states + torch.tanh(out)


class CrossModel(PreTrainedModel):
    """`mllama`: positional hidden states, projected image features by keyword to every layer."""

    config_class = BoundConfig
    supports_gradient_checkpointing = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.vision = nn.Linear(DIM, DIM)
        self.projector = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(
            CrossLayer(i in config.cross_layers) for i in range(config.layers)
        )
        self.head = nn.Linear(DIM, VOCAB)
        self.post_init()

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, pixel_values=None):
        h = self.emb(input_ids)
        cross = self.projector(torch.relu(self.vision(pixel_values)))
        for layer in self.layers:
            h = layer(h, cross_attention_states=cross)
        return self.head(h)


class HandLoop(nn.Module):
    """`prebound`: a hand-written loop checkpointing through the helper's partial."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(ScaledLayer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("one", torch.ones(()))

    def forward(self, input_ids, ckpt):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = _bound_helper.ckpt(block, self.one, h) if ckpt else block(self.one, h)
        return self.head(h)


def ask() -> dict:
    return {} if args.reentrant == "unset" else {"use_reentrant": args.reentrant == "true"}


def build(case: str):
    torch.manual_seed(0)
    if case == "bound":
        return BoundModel(BoundConfig())
    if case == "shared_bias":
        return SharedBiasModel(BoundConfig())
    if case in ("mllama", "autograd_grad"):
        return CrossModel(BoundConfig(cross_layers=(1,)))
    if case == "mllama_shared":
        return CrossModel(BoundConfig(cross_layers=(0, 2)))
    if case == "prebound":
        return HandLoop()
    raise SystemExit(f"unknown case {case}")


def batch(case: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    out = {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}
    if case.startswith("mllama") or case == "autograd_grad":
        out["pixel_values"] = torch.randn(2, 4, DIM, generator=gen)
    return out


def loss_of(model, inputs: dict, checkpointing: bool, case: str):
    if case == "prebound":
        return model(inputs["input_ids"], checkpointing).float().pow(2).mean()
    return model(**inputs).float().pow(2).mean()


def grads(model) -> dict:
    return {
        n: (None if p.grad is None else p.grad.detach().clone())
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def step(case: str, checkpointing: bool) -> tuple[dict | None, str | None, list]:
    model = build(case)
    model.train()
    if checkpointing and case != "prebound":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ask())
    inputs = batch(case)
    try:
        loss = loss_of(model, inputs, checkpointing, case)
        if case == "autograd_grad":
            params = [p for p in model.parameters() if p.requires_grad]
            for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
                p.grad = g
        else:
            loss.backward()
    except Exception as exc:  # noqa: BLE001 (the figure is the error itself, and any note on it)
        return (
            None,
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
            list(getattr(exc, "__notes__", [])),
        )
    return grads(model), None, []


def compare(got: dict, ref: dict) -> list[str]:
    return sorted(
        n
        for n in ref
        if (got[n] is None) != (ref[n] is None)
        or (got[n] is not None and not torch.allclose(got[n], ref[n], atol=1e-6, rtol=1e-5))
    )


result = {}
for case in args.cases.split(","):
    ref, ref_error, _ = step(case, checkpointing=False)
    assert ref_error is None, ref_error
    got, error, notes = step(case, checkpointing=True)
    wrong = compare(got, ref) if got is not None else None
    result[case] = {
        "trainable": len(ref),
        "wrong": None if wrong is None else len(wrong),
        "wrong_names": wrong,
        "error": error,
        "notes": notes,
    }
emit(result)
