"""Verify's line describes the step that ran (gcpatch/step/verify.py). Its checked pass counts each
block's runs through a wrapper around the checkpointed function: the wrapper must leave the call's
facts as the user's step shows them, so the call is decided as in the step (a partial's bound
graph tensors passed as inputs, CK1/CK5), and the line says which call rules made it exact.

Before this, the wrapper hid the partial's bound tensors in a closure: the checked pass ran the call
as made, reentrant ran the shared bias's graph once per layer, and verify said "the set-up as
configured fails in its first step: RuntimeError: Trying to backward through the graph a second
time" about a step that was exact (integration/scripts/bound_inputs.py `shared_bias`)."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from transformers import PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

from gcpatch import engine  # noqa: E402
from gcpatch.call import checkpoint_call  # noqa: E402
from gcpatch.step import verify  # noqa: E402

DIM, VOCAB = 16, 32


class BiasConfig(PretrainedConfig):
    model_type = "verify_line_bias"

    def __init__(self, hidden_by_keyword: bool = False, leaf_bias: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden_by_keyword, self.leaf_bias = hidden_by_keyword, leaf_bias


class BiasLayer(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, hidden_states, bias=None):
        return hidden_states + torch.tanh(self.fc(hidden_states) + bias)


class SharedBiasModel(PreTrainedModel):
    """Layers read one bias, computed once per forward, through a keyword argument; the hidden
    states come positionally (CK5 at the call) or by keyword too (CK1)."""

    config_class = BiasConfig
    supports_gradient_checkpointing = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.bias_proj = nn.Linear(DIM, DIM)
        self.bias_seed = nn.Parameter(torch.randn(DIM))
        self.layers = nn.ModuleList(BiasLayer() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)
        self.post_init()

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids):
        h = self.emb(input_ids)
        bias = self.bias_proj(self.bias_seed)
        if self.config.leaf_bias:  # no graph of its own: reentrant reaches it exactly as made
            bias = bias.detach()
        for layer in self.layers:
            if self.config.hidden_by_keyword:
                h = layer(hidden_states=h, bias=bias)
            else:
                h = layer(h, bias=bias)
        return self.head(h)


def _model(hidden_by_keyword: bool, leaf_bias: bool = False) -> SharedBiasModel:
    torch.manual_seed(0)
    config = BiasConfig(hidden_by_keyword=hidden_by_keyword, leaf_bias=leaf_bias)
    return SharedBiasModel(config).train()


def _grads(model: nn.Module, checkpointing: bool) -> dict:
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids).float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def gcpatch_on(monkeypatch):
    def start(mode: str) -> None:
        monkeypatch.setenv("GCPATCH_MODE", mode)
        monkeypatch.setenv("GCPATCH_VERIFY", "1")
        monkeypatch.delenv("GCPATCH_RECORD", raising=False)
        engine.start()

    yield start
    engine.stop()


@pytest.mark.parametrize(
    "hidden_by_keyword, rule", [(False, "CK5"), (True, "CK1")], ids=["positional", "keyword"]
)
@pytest.mark.parametrize("mode", ["warn", "fix"])
def test_verify_line_describes_the_exact_step_a_call_rewrite_made(
    gcpatch_on, caplog, mode, hidden_by_keyword, rule
):
    reference = _grads(_model(hidden_by_keyword), checkpointing=False)
    gcpatch_on(mode)
    with caplog.at_level(logging.INFO, logger="gcpatch"):
        got = _grads(_model(hidden_by_keyword), checkpointing=True)
    # the step itself is exact: every gradient is the no-checkpointing one
    assert got.keys() == reference.keys()
    assert all(torch.allclose(got[n], reference[n], atol=1e-6) for n in reference)
    [line] = [r.getMessage() for r in caplog.records if " verify " in r.getMessage()]
    assert "fails" not in line and "backward through the graph" not in line, line
    assert "gradients match (12 tensors, max abs diff 0," in line, line
    assert f"as gcpatch runs them ({rule}:" in line, line
    [call] = [
        r.getMessage() for r in caplog.records if "checkpoint call at" in r.getMessage()
    ]  # the step's own call, decided once: the checked pass decided it the same way
    assert rule in call, call


def test_a_call_as_made_is_checked_as_made_and_its_line_names_no_rule(gcpatch_on):
    """A correct reentrant call (the bias bound without a graph): nothing rewritten, no rule named."""
    gcpatch_on("fix")
    model = _model(False, leaf_bias=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    report = verify.check(model, (ids,), {})
    assert report.gradients_match and report.call_rules == {}, report.line()
    assert "as gcpatch runs them" not in report.line()


def test_the_counting_wrapper_keeps_the_call_decided_on_the_users_function(gcpatch_on):
    """What the checked pass hands torch's checkpoint is the user's partial, unwrapped for the
    decision; the count is taken inside the checkpoint, forward and recompute."""
    gcpatch_on("fix")
    runs = []
    layer = BiasLayer()
    bias = nn.Linear(DIM, DIM)(torch.ones(DIM))  # a tensor with a graph, bound by keyword
    from functools import partial

    function = partial(layer.__call__, bias=bias)
    counted = checkpoint_call.Counted(function, lambda: runs.append(1))
    h = torch.randn(2, DIM, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(counted, h, use_reentrant=True)
    out.sum().backward()
    assert len(runs) == 2  # forward and recompute
    assert list(counted.rules) == ["CK5"] and "reentrant kept" in counted.rules["CK5"]
    assert h.grad is not None and bias.grad_fn is not None  # the step's call, made exact
