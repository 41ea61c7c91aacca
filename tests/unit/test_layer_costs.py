"""The budget's instrument and measurements (gcpatch/step/held.py, gcpatch/step/layer_costs.py): the
bytes a forward leaves alive for its backward, per layer, on a stack whose saved tensors are known
by hand."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from gcpatch.step import layer_costs  # noqa: E402
from gcpatch.step.held import held_bytes  # noqa: E402
from gcpatch.step.solver import solve  # noqa: E402

WIDTH, BATCH = 8, 3
F32 = 4


class Switchable(torch.nn.Module):
    """A layer whose body runs checkpointed (non-reentrant) when its `checkpointed` flag is set."""

    checkpointed = False

    def forward(self, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Block(Switchable):
    """relu(W2 relu(W1 x)), W1 widening 4x. ReLU saves its output and the next Linear its input
    (the same storage), so a plain block holds its hidden relu (4*WIDTH floats a row) and its
    output (WIDTH); the Linear outputs die. Checkpointed, it holds its output only."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def _body(self, x):
        return torch.relu(self.down(torch.relu(self.up(x))))


def _stack(n: int = 4):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block() for _ in range(n)))


def test_measured_bytes_are_the_saved_tensors_extrapolated_to_the_batch():
    model = _stack()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    measured = layer_costs.measure(
        model, list(model), lambda rows, tokens: lambda: model(x[:rows]), (BATCH, 1), ["Block"] * 4
    )
    assert measured.rows == [1, 2]
    for layer in measured.layers:
        assert layer.plain == BATCH * 5 * WIDTH * F32
        assert layer.checkpointed == BATCH * WIDTH * F32
        assert layer.seconds > 0
    assert (
        len({layer.seconds for layer in measured.layers}) == 1
    )  # one kind, one averaged recompute cost
    assert measured.outside == 0  # x was made before the forward: not the forward's to hold


def test_a_plan_holds_what_it_predicts():
    model = _stack()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    measured = layer_costs.measure(
        model, list(model), lambda rows, tokens: lambda: model(x[:rows]), (BATCH, 1), ["Block"] * 4
    )
    plan = solve(measured.layers, measured.outside, 0.5 * measured.plain_total)
    assert plan.count == 3  # each checkpointed block sheds 4/5 of its bytes: 3 of 4 reach 50%
    for block, flag in zip(model, plan.checkpoint):
        block.checkpointed = flag
    with held_bytes() as held:
        out = model(x)
    assert held.total() == plan.total
    out.sum().backward()  # the checkpointed stack still trains
    assert all(p.grad is not None for p in model.parameters())


class Residual(Switchable):
    """x + W2 relu(W1 (2x)): no op saves the block's input or its output (a scalar product and a
    sum save nothing), as in a bf16 Llama layer whose norm saves an fp32 copy of its input. Plain,
    it holds 2x (WIDTH) and its hidden relu (4*WIDTH) a row and lets its input die; checkpointed,
    it holds its input alone, which the plain forward never shows alive."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def _body(self, x):
        return x + self.down(torch.relu(self.up(x * 2.0)))


def _every_plan(model, layers):
    """Measured on a forward that makes its own input, then run checkpointed every way: per set
    of flags, the bytes really held less the bytes predicted."""
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    measured = layer_costs.measure(
        model,
        layers,
        lambda rows, tokens: lambda: model(x[:rows] * 1.0),
        (BATCH, 1),
        ["Layer"] * len(layers),
    )
    missed = {}
    for flags in itertools.product((False, True), repeat=len(layers)):
        for layer, flag in zip(layers, flags):
            layer.checkpointed = flag
        with held_bytes() as held:
            out = model(x * 1.0)
        predicted = measured.outside + sum(
            c.checkpointed if flag else c.plain for c, flag in zip(measured.layers, flags)
        )
        missed[flags] = held.total(returned=out) - predicted
        del out
    return measured, missed


def test_a_checkpointed_layer_holds_the_input_a_plain_forward_lets_die():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Residual() for _ in range(4)))
    measured, missed = _every_plan(model, list(model))
    for layer in measured.layers:
        assert layer.plain == BATCH * 5 * WIDTH * F32
        assert layer.checkpointed == BATCH * WIDTH * F32
    assert set(missed.values()) == {0}, missed


class MaskedResidual(Residual):
    """Residual plus a tensor every layer takes (a padding mask eager attention adds, which no op
    saves)."""

    def forward(self, x, mask):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(self._masked, x, mask, use_reentrant=False)
        return self._masked(x, mask)

    def _masked(self, x, mask):
        return self._body(x) + mask


class MaskedStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(MaskedResidual() for _ in range(3))

    def forward(self, x):
        mask = torch.ones_like(x) * 0.5  # made in the forward, taken by every layer
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_an_input_several_layers_take_is_left_out_of_each_layers_figure():
    """Held once whichever layer is checkpointed: counted in each it would be counted thrice
    with all three checkpointed; left out, the plan is short by that one tensor exactly where a
    layer is checkpointed (and the hidden states are still counted)."""
    torch.manual_seed(0)
    model = MaskedStack()
    measured, missed = _every_plan(model, list(model.layers))
    assert [c.checkpointed for c in measured.layers] == [BATCH * WIDTH * F32] * 3
    mask = BATCH * WIDTH * F32
    for flags, short in missed.items():
        assert short == (mask if any(flags) else 0), flags


class Attention(Switchable):
    """Eager attention in miniature: softmax(x x^T) x over the tokens of each row. Plain it holds
    its scores' softmax (tokens x tokens a row) and its output; checkpointed, its output only."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def _body(self, x):
        h = self.proj(x)
        return torch.softmax(h @ h.transpose(1, 2), dim=-1) @ h


def _cut(x, rows, tokens):
    """The first rows and tokens as a new leaf, as gcpatch's measuring passes cut a batch
    (gcpatch/step/batch.py): contiguous, so no layer saves a copy a slice would make it take."""
    return x[:rows, :tokens].detach().clone().requires_grad_(x.requires_grad)


def _attention_stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(Attention(), Attention())


@pytest.mark.parametrize("rows, tokens", [(1, 7), (3, 16), (4, 33), (8, 64)])
def test_the_cost_model_predicts_held_bytes_at_shapes_it_never_measured(rows, tokens):
    """Measured at 1-2 rows x 8-16 tokens, predicted at other shapes (longer ones too): the bytes
    the plain and the fully checkpointed forward then really hold, within 10%."""
    model = _attention_stack()
    x = torch.randn(2, 16, WIDTH, requires_grad=True)
    measured = layer_costs.measure(
        model,
        list(model),
        lambda r, t: (lambda cut: lambda: model(cut))(_cut(x, r, t)),
        (2, 16),
        ["Attention"] * 2,
        [8, 16],
    )
    assert measured.model.tokens_measured and measured.tokens == [8, 16]
    layers, outside = measured.model.layers(rows, tokens)
    probe = torch.randn(rows, tokens, WIDTH, requires_grad=True)
    for checkpointed in (False, True):
        for block in model:
            block.checkpointed = checkpointed
        with held_bytes() as held:
            out = model(probe)
        real = held.total(returned=out)
        predicted = outside + sum(c.checkpointed if checkpointed else c.plain for c in layers)
        assert abs(predicted - real) <= 0.10 * real, (rows, tokens, checkpointed, predicted, real)
        del out


def test_tokens_not_measured_are_taken_as_proportional_and_say_so():
    model = _attention_stack()
    x = torch.randn(2, 16, WIDTH, requires_grad=True)
    measured = layer_costs.measure(
        model,
        list(model),
        lambda r, t: (lambda cut: lambda: model(cut))(_cut(x, r, t)),
        (2, 16),
        ["Attention"] * 2,
    )
    assert not measured.model.tokens_measured
    at_16 = measured.model.plain_total(2, 16)
    assert measured.model.plain_total(2, 32) == pytest.approx(2 * at_16)
