"""The budget's offloading lever (gcpatch/step/levers/offload.py): a layer checkpointed whole whose
saved inputs wait in host memory, offered only on an accelerator. Here the CPU stands in for one
and the host is a numpy array (memory torch's allocator and the instrument never see, as a GPU's
pinned copies are not the device's). The probed step's figures (gcpatch/step/probe.py) are what a
forward holds in every mix of plain, whole and offloaded layers (toy stacks, a tiny Llama), which
trains exactly; a plan below whole's floor offloads; a layer that moved nothing is whole from the
next step, said with the reason."""

from __future__ import annotations

import functools
import gc
import itertools
import logging

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from gcpatch import headline  # noqa: E402
from gcpatch.budget import parse  # noqa: E402
from gcpatch.step import cost_model, levers, shapes, solver  # noqa: E402
from gcpatch.step.held import held_bytes  # noqa: E402
from gcpatch.step.levers import feed_forward, offload  # noqa: E402
from gcpatch.step.probe import Probe  # noqa: E402
from gcpatch.step.solver import PLAIN  # noqa: E402

WHOLE, OFFLOAD = levers.WHOLE.name, offload.LEVER.name
WIDTH, BATCH = 8, 3
HIDDEN = BATCH * WIDTH * 4  # a toy layer's input or output, fp32


def _to_host(tensor):
    """Its bytes in a numpy array (numpy has no bfloat16), with what makes them a tensor again."""
    data = tensor.detach().cpu().contiguous()
    return data.view(-1).view(torch.uint8).numpy().copy(), data.dtype, data.shape


def _to_device(host, device):
    array, dtype, shape = host
    return torch.from_numpy(array).view(dtype).reshape(shape).to(device)


@pytest.fixture
def cpu_as_device(monkeypatch):
    """The CPU standing in for an accelerator: layers on it are offered offloading, and its host
    is the numpy arrays above."""
    monkeypatch.setattr(offload, "accelerator_of", lambda module: "cpu")
    monkeypatch.setattr(offload, "_on_host", lambda tensor: False)
    monkeypatch.setattr(offload, "_to_pinned", _to_host)
    monkeypatch.setattr(offload, "_to_device", _to_device)


class Layer(torch.nn.Module):
    """Runs its body plain, or through its `_gradient_checkpointing_func` when its
    `gradient_checkpointing` flag is set (as transformers' layers do)."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=reentrant
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
    Linear saves too: that storage is held whichever of the two is checkpointed."""

    def _body(self, x):
        return torch.relu(self.down(torch.relu(self.up(x))))


def _probed(model, layers, step, shape, accelerator=True):
    """`step()` (forward, returns the loss) probed with every layer checkpointed whole; the cost
    model built from it."""
    probe = Probe(layers, [feed_forward.block(m) for m in layers], shape, accelerator)
    probe.start()
    try:
        loss = step()
        probe.forward_done()
        loss.backward()
    finally:
        facts = probe.finish()
    model.zero_grad(set_to_none=True)
    assert facts.complete
    return cost_model.build(facts, layers, [m._gradient_checkpointing_func for m in layers])


def _every_mix(model, layers, costs, step, shape, mixes):
    """Per mix of modes: (bytes really held less the bytes the plan says, the gradients)."""
    plans = shapes.ShapePlans(model, layers, costs, parse("0.5"), "m")
    at, outside, _ = costs.at(*shape)
    out = {}
    for mix in mixes:
        plans.apply(solver.Plan(list(mix), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
        with held_bytes() as held:
            loss = step()
        missed = held.total(returned=loss) - outside - sum(c.held(m) for c, m in zip(at, mix))
        loss.backward()
        out[mix] = (missed, [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        funcs = [m._gradient_checkpointing_func for m in layers]
        assert [isinstance(f, offload.Offload) for f in funcs] == [m == OFFLOAD for m in mix]
        assert all(f.moved > 0 for f in funcs if isinstance(f, offload.Offload)), mix
    return out


@pytest.mark.parametrize("kind", [Residual, Block])
def test_the_figures_of_every_mix_of_plain_whole_and_offloaded_layers_are_what_it_holds(
    kind, cpu_as_device
):
    """Residual: whole, a layer holds its input, offloaded nothing; every mix holds exactly its
    figures. Block: an input the layer before saves too counts outside the layers: no mix holds
    more, one offloading after a checkpointed layer less. Gradients: whole's, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(kind() for _ in range(3)))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)

    def step():
        return model(x * 1.0).pow(2).sum()  # makes the first input; the loss saves the output

    costs = _probed(model, list(model), step, (BATCH, 1))
    at, _, _ = costs.at(BATCH, 1)
    assert [c.held(OFFLOAD) for c in at] == [0] * 3
    # Block: the first input, made by `x * 1.0` (which saves nothing), is the first layer's alone
    assert [c.held(WHOLE) for c in at] == ([HIDDEN] * 3 if kind is Residual else [HIDDEN, 0, 0])
    every = itertools.product((PLAIN, WHOLE, OFFLOAD), repeat=3)
    mixes = _every_mix(model, list(model), costs, step, (BATCH, 1), every)
    for mix, (missed, grads) in mixes.items():
        freed = sum(b == OFFLOAD and a != PLAIN for a, b in zip(mix, mix[1:]))
        assert missed == (0 if kind is Residual else -freed * HIDDEN), mix
        as_whole = mixes[tuple(WHOLE if m == OFFLOAD else m for m in mix)][1]
        assert all(torch.equal(a, b) for a, b in zip(grads, as_whole)), mix


def _llama(dtype=torch.float32, reentrant=False):
    """3 layers, hidden 32, attention dropout; every layer checkpointed; its step."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "attention_dropout": 0.1}
    config = transformers.LlamaConfig(vocab_size=64, use_cache=False, **shape, **heads)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).to(dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))

    def step():
        torch.manual_seed(7)  # dropout draws the same masks in every run
        return model(input_ids=ids, labels=ids).loss

    return model, list(model.model.layers), step


def _trained(model, step) -> list:
    """The gradients of one step."""
    step().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


# every mode in every place, and every ordered pair of modes side by side
MIXES = [(m,) * 3 for m in (PLAIN, WHOLE, OFFLOAD)] + [
    (a, b, c)[i:] + (a, b, c)[:i]
    for a, b, c in ((PLAIN, WHOLE, OFFLOAD), (PLAIN, OFFLOAD, WHOLE))
    for i in range(3)
]


@pytest.mark.parametrize(
    "dtype, reentrant",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "reentrant"],
)
def test_a_real_llama_holds_what_its_figures_say_in_every_mix_and_trains_exactly(
    dtype, reentrant, cpu_as_device
):
    """Whole, a layer holds its hidden states (bf16: the input dies in a plain layer); offloaded,
    nothing. Reentrant saves its inputs through the same hooks (its layers' saves read in the
    recompute). Every mix's gradients are those without checkpointing, bit for bit."""
    model, layers, step = _llama(dtype, reentrant)
    costs = _probed(model, layers, step, (1, 16))
    at, _, _ = costs.at(1, 16)
    assert [(c.held(WHOLE), c.held(OFFLOAD)) for c in at] == [(16 * 32 * dtype.itemsize, 0)] * 3
    mixes = _every_mix(model, layers, costs, step, (1, 16), MIXES)
    plain = mixes[(PLAIN,) * 3][1]
    for mix, (missed, grads) in mixes.items():
        # all the figures miss: what held_bytes counts and the probe does not see saved (the
        # embedding's index input, made before the forward)
        assert abs(missed) <= 256, (mix, missed)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain)), mix


def test_offloading_is_offered_only_on_an_accelerator_and_not_over_a_users_context_fn(
    monkeypatch,
):
    """A CPU has nowhere else to put the inputs; a user's own context_fn stands as given."""
    model, layers, step = _llama()
    assert offload.accelerator_of(model) is None
    assert offload.accelerator_of(torch.nn.Linear(2, 2, device="meta")) is None
    costs = _probed(model, layers, step, (1, 16), accelerator=False)
    for layer in costs.layers:
        assert OFFLOAD not in layer.held
        assert layer.refused[OFFLOAD].startswith("the layers run on no accelerator")
    func = layers[0]._gradient_checkpointing_func
    assert levers.own(offload.Offload(func)) is func  # a planned copy's function unwrapped
    monkeypatch.setattr(offload, "accelerator_of", lambda module: "cpu")
    layers[0]._gradient_checkpointing_func = functools.partial(
        func.func, use_reentrant=False, context_fn=torch.utils.checkpoint.noop_context_fn
    )
    costs = _probed(model, layers, step, (1, 16))
    assert costs.layers[0].refused[OFFLOAD] == "the user's own context_fn stands as given"
    assert OFFLOAD in costs.layers[1].held


def _below_whole(model, layers, step):
    """Plans from the probed step at a budget below whole checkpointing's floor that one whole
    and two offloaded layers meet."""
    for m in layers:  # probed as the framework enabled them (an earlier plan's wrappers off)
        m.gradient_checkpointing = True
        m._gradient_checkpointing_func = levers.own(m._gradient_checkpointing_func)
    costs = _probed(model, layers, step, (1, 16))
    at, outside, _ = costs.at(1, 16)
    limit = outside + costs.calls_at(1, 16) + at[0].held(WHOLE)
    assert limit < outside + sum(c.held(WHOLE) for c in at)  # whole's floor
    return shapes.ShapePlans(model, layers, costs, parse(f"{int(limit) + 1}B"), "m")


def _lines(caplog, plans) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="gcpatch"):
        plans.fired()
    return [headline.unwrap(r.getMessage()) for r in caplog.records if " budget " in r.getMessage()]


def test_a_plan_below_whole_checkpointings_floor_offloads_and_trains_exactly(cpu_as_device, caplog):
    """Two layers offloaded, one whole: its forward moves their inputs and its gradients are
    whole checkpointing's. A layer planned offloaded that moved nothing (its flag switched off
    behind the plan's back) is whole from the next step, said once."""
    model, layers, step = _llama()
    whole = _trained(model, step)
    plans = _below_whole(model, layers, step)
    plan = plans.plan_for(1, 16)
    assert sorted(plan.modes) == [OFFLOAD, OFFLOAD, WHOLE] and not plan.below_floor, plan.modes
    plans.apply(plan)
    assert all(torch.equal(a, b) for a, b in zip(_trained(model, step), whole))
    plans.ran = True
    assert _lines(caplog, plans) == [] and not plans.misfired  # both moved their inputs

    again = _below_whole(model, layers, step)
    plan = again.plan_for(1, 16)
    again.apply(plan)
    idle = plan.modes.index(OFFLOAD)
    layers[idle].gradient_checkpointing = False  # behind the plan's back: it never runs offloaded
    step().backward()
    again.ran = True
    [line] = _lines(caplog, again)
    assert f"offloading the inputs moved nothing in layer(s) {idle}; they" in line, line
    assert again.misfired == {(idle, OFFLOAD)}
    assert again.plan_for(1, 16).modes[idle] == WHOLE


def test_a_copy_to_the_host_that_fails_leaves_the_input_on_the_device_and_says_so(
    cpu_as_device, monkeypatch, caplog
):
    """Fails open: the step trains as whole checkpointing would, the wrappers moved nothing, and
    the plan's check says so in one line with the reason: those layers are whole from the next
    step."""
    model, layers, step = _llama()
    whole = _trained(model, step)
    plans = _below_whole(model, layers, step)

    def refuse(tensor):
        raise RuntimeError("no pinned memory left")

    monkeypatch.setattr(offload, "_to_pinned", refuse)
    plan = plans.plan_for(1, 16)
    plans.apply(plan)
    with held_bytes() as held:
        loss = step()
    assert held.total(returned=loss) > plan.total  # the inputs stayed on the device
    loss.backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), whole))
    plans.ran = True
    [line] = _lines(caplog, plans)
    offloaded = ", ".join(str(i) for i, m in enumerate(plan.modes) if m == OFFLOAD)
    assert (
        f"moved nothing in layer(s) {offloaded} (the copy to the host failed: RuntimeError: no"
        " pinned memory left); they checkpoint whole from the next step" in line
    ), line
    again = plans.plan_for(1, 16).modes
    assert all(again[i] == WHOLE for i, m in enumerate(plan.modes) if m == OFFLOAD), again


def test_the_probes_hooks_hold_what_autograd_would_and_hand_every_save_on():
    """An operator that saves its own output (exp) makes a cycle through its node where a hook
    returns the tensor itself: its bytes outlive the step until the garbage collector runs. A
    saved parameter held as an alias of its storage outlives a framework swapping its data out
    (DeepSpeed ZeRO-3 frees what it gathered). The probe's hooks do neither, and a user's own
    hooks beneath them (torch's save_on_cpu, say) see every save they would without the probe."""
    scale, x = torch.nn.Parameter(torch.randn(16)), torch.randn(4, 16, requires_grad=True)

    def freed(hooks) -> tuple[bool, bool]:
        with hooks:
            out, product = (x * 2.0).exp(), (x * 1.0) * scale
        output, weight = (StorageWeakRef(t.untyped_storage()) for t in (out, scale))
        del out
        scale.data = torch.randn(16)  # what ZeRO-3 does to a gathered parameter after use
        return output.expired(), weight.expired() and product.grad_fn is not None

    gc.disable()
    try:
        itself = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        alias = torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)
        assert (freed(itself)[0], freed(alias)[1]) == (False, False)  # what a hook can do wrong
        probe = Probe([], [], (4, 16), accelerator=False)
        assert freed(probe.saving("operators", -1)) == (True, True)
    finally:
        gc.enable()
    model, layers, step = _llama()
    seen = []

    def counted(tensor):
        seen.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(counted, lambda t: t):
        step().backward()
        alone, seen[:] = list(seen), []
        _probed(model, layers, step, (1, 16), accelerator=False)
    assert seen == alone
