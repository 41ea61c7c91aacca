"""A custom model family no gcpatch rule knows (as a `trust_remote_code` model would be): its
blocks are transformers' GradientCheckpointingLayer, but its loop passes the hidden states by
keyword. transformers documents that reentrant checkpointing then sees no tensor input
(modeling_layers.py, GradientCheckpointingLayer docstring): the blocks and the embedding get no
gradient, silently. gcpatch has no rule for it (the model is not partially frozen), so with
use_reentrant=True the gradients stay wrong: verify mode is what shows it. Ordinary user code.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutput


class KwargConfig(PretrainedConfig):
    model_type = "kwarg_blocks"

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 32,
        num_layers: int = 3,
        dropout: float = 0.1,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size, self.num_layers, self.dropout = (
            vocab_size,
            hidden_size,
            num_layers,
            dropout,
        )


class KwargBlock(GradientCheckpointingLayer):
    def __init__(self, config: KwargConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        self.fc = nn.Linear(config.hidden_size, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.drop(torch.tanh(self.fc(self.norm(hidden_states))))


class KwargModel(PreTrainedModel):
    config_class = KwargConfig
    supports_gradient_checkpointing = True
    base_model_prefix = "model"

    def __init__(self, config: KwargConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(KwargBlock(config) for _ in range(config.num_layers))
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs
    ) -> CausalLMOutput:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(
                hidden_states=hidden
            )  # by keyword: what reentrant checkpointing cannot see
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def build(seed: int = 0) -> KwargModel:
    torch.manual_seed(seed)
    return KwargModel(KwargConfig())
