"""The budget's offloading lever (gcpatch/step/offload.py): a layer checkpointed whole whose saved
inputs wait in host memory. Its byte accounting, on a CPU: the figures read from one plain forward
(gcpatch/step/held.py `Held.offloaded`) add up to what a forward really holds for every mix of
plain, whole and offloaded layers. A CPU has no device to offload from, so here the host is a
numpy array (memory torch's allocator and the instrument never see, as a GPU's pinned copies are
not the device's), on toy stacks whose saved tensors are known by hand and on a real tiny Llama,
non-reentrant and reentrant, fp32 and bf16, with dropout: its gradients are whole
checkpointing's, bit for bit."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import layer_costs, offload, planner, selective, shapes  # noqa: E402
from gcpatch.step.cost_model import CostModel, Curve  # noqa: E402
from gcpatch.step.held import Held, held_bytes  # noqa: E402
from gcpatch.step.solver import FULL, KEEP_ATTENTION, KEEP_MATMULS, OFFLOAD, PLAIN  # noqa: E402

WIDTH, BATCH = 8, 3
F32 = 4


def _to_host(tensor):
    """Its bytes in a numpy array (numpy has no bfloat16), with what makes them a tensor again."""
    data = tensor.detach().cpu().contiguous()
    return data.view(-1).view(torch.uint8).numpy().copy(), data.dtype, data.shape


def _to_device(host, device):
    array, dtype, shape = host
    return torch.from_numpy(array).view(dtype).reshape(shape).to(device)


def _offloaded(func):
    return offload.Offload(func, _to_host, _to_device)


class Layer(torch.nn.Module):
    """Runs its body plain, or through its `_gradient_checkpointing_func` when its
    `gradient_checkpointing` flag is set (as transformers' layers do)."""

    gradient_checkpointing = False

    def __init__(self) -> None:
        super().__init__()
        self._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        )
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        if self.gradient_checkpointing:
            return self._gradient_checkpointing_func(self._body, x)
        return self._body(x)


class Residual(Layer):
    """x + W2 relu(W1 (2x)): no op saves the layer's input or its output (a decoder layer's
    residual stream): offloaded, its input leaves the device whatever the layer before does."""

    def _body(self, x):
        return x + self.down(torch.relu(self.up(x * 2.0)))


class Block(Layer):
    """relu(W2 relu(W1 x)): the last ReLU saves the layer's output, which the next layer's first
    Linear saves too: offloading the next layer takes it off the device only where this one is
    checkpointed."""

    def _body(self, x):
        return torch.relu(self.down(torch.relu(self.up(x))))


def _every_mix(layers, forward, measured, shape):
    """Per mix of plain, whole and offloaded layers: (bytes really held less the bytes the
    figures predict, the gradients of the input and every parameter)."""
    model = measured.model
    costs = {
        PLAIN: [c(*shape) for c in model.plain],
        FULL: [c(*shape) for c in model.checkpointed],
        OFFLOAD: [c(*shape) for c in model.offloaded],
    }
    own = [m._gradient_checkpointing_func for m in layers]
    out = {}
    for modes in itertools.product((PLAIN, FULL, OFFLOAD), repeat=len(layers)):
        for m, mode, func in zip(layers, modes, own):
            m.gradient_checkpointing = mode != PLAIN
            m._gradient_checkpointing_func = _offloaded(func) if mode == OFFLOAD else func
        with held_bytes() as held:
            result = forward()
        predicted = model.outside(*shape) + sum(costs[mode][i] for i, mode in enumerate(modes))
        missed = held.total(returned=result) - predicted
        params = [p for m in layers for p in m.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        getattr(result, "loss", result).backward()  # reentrant checkpointing refuses .grad()
        out[modes] = (missed, [p.grad for p in params])
        moved = [
            m._gradient_checkpointing_func.moved for m, o in zip(layers, modes) if o == OFFLOAD
        ]
        assert all(moved), modes  # each offloaded layer moved its saved inputs
        del result
    for m, func in zip(layers, own):
        m.gradient_checkpointing, m._gradient_checkpointing_func = False, func
    return out


def _measure_stack(model):
    x = torch.randn(BATCH, WIDTH, requires_grad=True)

    def forward(rows=BATCH):
        # the forward makes the first layer's input, and returns a loss (which saves the output)
        return model(x[:rows] * 1.0).pow(2).sum()

    measured = layer_costs.measure(
        model,
        list(model),
        lambda rows, tokens: functools.partial(forward, rows),
        (BATCH, 1),
        ["Layer"] * len(model),
    )
    return measured, forward


@pytest.mark.parametrize("kind", [Residual, Block])
def test_the_figures_of_every_mix_of_plain_whole_and_offloaded_layers_are_what_it_holds(kind):
    """Residual: an offloaded layer's figure is its output less its input (0 a row), so a stack's
    figures telescope to what it holds. Block: the layer before saves that input itself, so it
    stays on the device while that layer runs plain, and the figure is whole's (the first layer's
    input, which no op before it saves, leaves); an input left on the device is never counted as
    moved. Offloaded, every gradient is whole checkpointing's, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(kind() for _ in range(3)))
    measured, forward = _measure_stack(model)
    offloaded = [c(BATCH, 1) for c in measured.model.offloaded]
    hidden = BATCH * WIDTH * F32
    if kind is Residual:  # the last output, saved by the loss, is the last layer's
        assert offloaded == [0, 0, hidden]
    else:  # the first input is made outside the layers, by `x * 1.0`, which saves nothing
        assert offloaded == [0, hidden, hidden]
        assert [c(BATCH, 1) for c in measured.model.checkpointed] == [hidden] * 3
    mixes = _every_mix(list(model), forward, measured, (BATCH, 1))
    for modes, (missed, grads) in mixes.items():
        # Block: an offloaded layer after a checkpointed one takes that input off the device
        # too, which its figure (whole's) does not promise: the plan holds less, never more
        freed = sum(b == OFFLOAD and a != PLAIN for a, b in zip(modes, modes[1:]))
        assert missed == (0 if kind is Residual else -freed * hidden), modes
        as_whole = mixes[tuple(FULL if m == OFFLOAD else m for m in modes)][1]
        assert all(torch.equal(a, b) for a, b in zip(grads, as_whole)), modes


def _llama(dtype, reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        attention_dropout=0.1,
    )
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).to(dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    layers = list(model.model.layers)
    for m in layers:
        m.gradient_checkpointing = False
    return model, layers


@pytest.mark.parametrize(
    "dtype, reentrant",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "reentrant"],
)
def test_a_real_llama_holds_what_its_figures_say_in_every_mix_and_trains_exactly(dtype, reentrant):
    """In fp32 the next layer's norm saves the hidden state: an offloaded layer sheds its input
    from the figure of the layer that made it. In bf16 the norm saves an fp32 copy and the input
    dies plain: whole holds it, offloaded does not. Reentrant checkpointing saves its inputs
    through the same hooks. The position embeddings every layer takes stay on the device."""
    model, layers = _llama(dtype, reentrant)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def forward(rows=2, tokens=16):
        torch.manual_seed(7)  # dropout draws the same masks in every run
        return model(input_ids=ids[:rows, :tokens], labels=ids[:rows, :tokens])

    measured = layer_costs.measure(
        model,
        layers,
        lambda rows, tokens: functools.partial(forward, rows, tokens),
        (2, 16),
        ["LlamaDecoderLayer"] * 3,
        [8, 16],
    )
    hidden = 2 * 16 * 32 * dtype.itemsize
    checkpointed = [c(2, 16) for c in measured.model.checkpointed]
    offloaded = [c(2, 16) for c in measured.model.offloaded]
    assert [w - o for w, o in zip(checkpointed, offloaded)] == [hidden] * 3
    mixes = _every_mix(layers, forward, measured, (2, 16))
    # the position ids every layer takes, kept by any checkpoint and left out of each layer's
    # figure (gcpatch/step/held.py), are all the figures miss
    shared = 16 * torch.int64.itemsize
    for modes, (missed, _) in mixes.items():
        assert missed == (0 if modes == (PLAIN,) * 3 else shared), modes
    plain = mixes[(PLAIN,) * 3][1]
    for modes, (_, grads) in mixes.items():
        # offloaded, a layer's gradients are whole checkpointing's, bit for bit
        as_whole = mixes[tuple(FULL if m == OFFLOAD else m for m in modes)][1]
        assert all(torch.equal(a, b) for a, b in zip(grads, as_whole)), modes
        assert all(torch.allclose(a.float(), b.float(), atol=1e-2) for a, b in zip(grads, plain))


def test_offloading_is_offered_only_on_an_accelerator_and_not_over_a_users_context_fn():
    """A CPU has nowhere else to put the inputs; a user's own context_fn stands as given."""
    model, layers = _llama(torch.float32, False)
    assert offload.accelerator(model) is None
    assert not any(selective.offloadable(m) for m in layers)
    func = layers[0]._gradient_checkpointing_func
    assert offload.offered(func)
    assert not offload.offered(functools.partial(func.func, context_fn=lambda: None))
    assert selective.own(_offloaded(func)) is func  # a planned copy's function unwrapped
    meta = torch.nn.Linear(2, 2, device="meta")
    assert offload.accelerator(meta) is None


@pytest.fixture
def cpu_as_device(monkeypatch):
    """The CPU standing in for an accelerator (this machine has none): layers on it are offered
    offloading, and its host is the numpy arrays above."""
    monkeypatch.setattr(offload, "accelerator", lambda module: "cpu")
    monkeypatch.setattr(offload, "_on_host", lambda tensor: False)
    monkeypatch.setattr(offload, "_to_pinned", _to_host)
    monkeypatch.setattr(offload, "_to_device", _to_device)


def _costs(layers: int):
    """Every layer: 100 bytes plain, 10 whole (1 s), 2 offloaded (1.5 s)."""
    flat = functools.partial(Curve, row_b=0.0, fixed_a=0.0, fixed_b=0.0, t_max=16.0)

    def per_row(n):
        return flat(row_a=n / 16, row_at_max=float(n), fixed_at_max=0.0)

    return CostModel(
        plain=[per_row(100)] * layers,
        checkpointed=[per_row(10)] * layers,
        outside=per_row(0),
        seconds=[1.0] * layers,
        timed_at=(1, 16),
        kinds=["Layer"] * layers,
        offloaded=[per_row(2)] * layers,
        offloaded_seconds=[1.5] * layers,
    )


def _checkpointed_llama():
    """The tiny Llama with every layer checkpointed whole, and a step that returns its gradients
    (the same dropout masks every time)."""
    model, layers = _llama(torch.float32, False)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))

    def grads():
        model.zero_grad()
        torch.manual_seed(7)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for m in layers:
        m.gradient_checkpointing = True
    return model, layers, grads


def test_a_plan_below_whole_checkpointings_floor_offloads_and_trains_exactly(cpu_as_device, caplog):
    """A budget of 0.066 (19.8 bytes of 300) is below whole checkpointing's 30: two layers
    offloaded, one whole; its forward moves their inputs and its gradients are whole
    checkpointing's. A layer
    planned offloaded that moved nothing (its flag switched off behind the plan's back) is
    whole from the next step, said once."""
    model, layers, grads = _checkpointed_llama()
    whole = grads()
    plans = shapes.ShapePlans(model, layers, _costs(3), parse("0.066"), "LlamaForCausalLM")
    plan = plans.plan_for(1, 16)
    assert plan.modes.count(OFFLOAD) == 2 and plan.modes.count(FULL) == 1, plan.modes
    assert plan.total <= 19.8 and " (2 offloading their inputs)" == selective.kept_text(plan.modes)
    plans.apply(plan)
    wrappers = [layers[i]._gradient_checkpointing_func for i, m in enumerate(plan.modes)]
    assert [isinstance(w, offload.Offload) for w in wrappers] == [m == OFFLOAD for m in plan.modes]
    assert all(torch.equal(a, b) for a, b in zip(grads(), whole))
    assert all(w.moved > 0 for w in wrappers if isinstance(w, offload.Offload))
    plans.ran = True
    plans.fired()  # both moved their inputs: nothing to say
    assert not plans.misfired

    again = shapes.ShapePlans(model, layers, _costs(3), parse("0.066"), "LlamaForCausalLM")
    plan = again.plan_for(1, 16)
    again.apply(plan)
    idle = plan.modes.index(OFFLOAD)
    layers[idle].gradient_checkpointing = False  # behind the plan's back: it never runs offloaded
    grads()
    again.ran = True
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        again.fired()
    [line] = [r.getMessage() for r in caplog.records if "moved nothing" in r.getMessage()]
    assert f"offloading the inputs moved nothing in layer(s) {idle}" in line, line
    assert again.misfired == {(idle, OFFLOAD)}
    assert again.plan_for(1, 16).modes[idle] == FULL


def test_offloading_is_timed_on_one_layer_where_it_is_offered(cpu_as_device, monkeypatch):
    """Its cost is measured like the levers' (gcpatch/step/selective.py `shares`), its copies in
    it: the offloaded mode ran and moved the layer's inputs in every round; where it is not
    offered it is not timed (the CPU's own test below)."""
    model, layers = _llama(torch.float32, False)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    copies = []

    def counted(tensor):
        copies.append(tensor.shape)
        return _to_host(tensor)

    monkeypatch.setattr(offload, "_to_pinned", counted)
    shares = selective.shares(layers, lambda: model(input_ids=ids, labels=ids))
    assert OFFLOAD in shares
    # a warm-up round and at least ROUNDS timed ones, each moving the layer's hidden states
    assert copies.count(torch.Size([2, 16, 32])) >= 1 + selective.ROUNDS, copies
    share = shares[OFFLOAD]
    assert share is None or share > 0  # None: this clock could not tell whole from plain


def test_without_an_accelerator_offloading_is_neither_timed_nor_planned():
    model, layers = _llama(torch.float32, False)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    assert OFFLOAD not in selective.shares(layers, lambda: model(input_ids=ids, labels=ids))
    costs = _costs(3)
    costs.offloaded_seconds = None
    assert all(layer.offloaded is None for layer in costs.layers(1, 16)[0])


def test_reading_who_saved_what_leaves_no_cycle_behind():
    """The savers' hooks hold what autograd would hold and no more: an operator that saves its
    own output (exp) made a cycle through its node while the hook returned the tensor itself, and
    the measuring forward's bytes then outlived it until the garbage collector ran (counted by
    the user's step the first forward runs in)."""
    x = torch.randn(64, 64, requires_grad=True)
    gc.disable()
    try:
        held = Held(savers=True)
        with held:
            out = (x * 2.0).exp()
        assert held.total(returned=out) == 0  # exp saves `out` itself, the returned tensor
        assert set().union(*held.saved_by.values()) == {-1}  # saved outside every layer
        del out
        assert held.total() == 0  # its graph went with it, without a collection
    finally:
        gc.enable()


def test_a_copy_to_the_host_that_fails_leaves_the_input_on_the_device_and_says_so(
    cpu_as_device, monkeypatch, caplog
):
    """Fails open: the step runs and trains as whole checkpointing would, the wrappers moved
    nothing, and the plan's check says so in one line with the reason: those layers are whole
    from the next step."""
    model, layers, grads = _checkpointed_llama()
    whole = grads()

    def refuse(tensor):
        raise RuntimeError("no pinned memory left")

    monkeypatch.setattr(offload, "_to_pinned", refuse)
    plans = shapes.ShapePlans(model, layers, _costs(3), parse("0.066"), "LlamaForCausalLM")
    plan = plans.plan_for(1, 16)
    plans.apply(plan)
    assert all(torch.equal(a, b) for a, b in zip(grads(), whole))
    plans.ran = True
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        plans.fired()
    [line] = [r.getMessage() for r in caplog.records if "offloading" in r.getMessage()]
    offloaded = ", ".join(str(i) for i, m in enumerate(plan.modes) if m == OFFLOAD)
    assert (
        f"moved nothing in layer(s) {offloaded} (the copy to the host failed: RuntimeError: no"
        " pinned memory left)" in line
    ), line
    again = plans.plan_for(1, 16).modes
    assert all(again[i] == FULL for i, m in enumerate(plan.modes) if m == OFFLOAD), again


def test_reading_who_saved_what_holds_a_parameter_as_autograd_does():
    """A parameter an operator saves for the backward (a product saves both factors) is held as
    itself, not as an alias of its storage: a framework that swaps its data out after use
    (DeepSpeed ZeRO-3 frees what it gathered) frees the old storage in the measuring forward as
    in a plain one."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def freed(savers):
        scale = torch.nn.Parameter(torch.randn(16))
        x = torch.randn(4, 16, requires_grad=True)
        with Held(savers=savers) if savers else contextlib.nullcontext():
            out = (x * 1.0) * scale
        old = StorageWeakRef(scale.untyped_storage())
        scale.data = torch.empty(0)  # what ZeRO-3 does to a gathered parameter after use
        assert out.grad_fn is not None  # the graph, and what it saved, still alive
        return old.expired()

    assert freed(False) and freed(True)


def test_explain_says_what_offloading_measured_apart_from_the_selective_levers():
    """Under reentrant checkpointing the selective levers are not offered and offloading is: each
    line says its own (gcpatch explain reads them from the record)."""
    why = "reentrant checkpointing, which selective checkpointing cannot run under"
    shares = {KEEP_MATMULS: None, KEEP_ATTENTION: None, OFFLOAD: 1.3}
    lines = planner._levers({"shares": shares, "not_offered": why})
    assert lines[:2] == [
        f"{n}: not offered, {why}" for n in ("keeping the matmuls", "keeping the attention output")
    ]
    assert (
        lines[2]
        == "offloading the inputs: costs 1.30 of a whole layer's recompute (measured on one layer)"
    )
    shares[OFFLOAD] = None
    assert planner._levers({"shares": shares, "not_offered": None})[2] == (
        "offloading the inputs: not chosen, its cost could not be told on this clock (or it moved"
        " nothing)"
    )
