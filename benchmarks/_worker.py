"""Measurements that need a fresh interpreter, run by benchmarks/run.py as subprocesses.

    python benchmarks/_worker.py enable '{"runs": 20, ...}'
    python benchmarks/_worker.py case   '{"setup": "full", ...}'

Each prints one `RESULT {json}` line on stdout. Not meant to be run by hand.

`case` builds every hand-made variant first, with gcpatch not imported at all, then imports
gcpatch (which starts its engine at once, transformers being imported already: the same path
as GCPATCH=1 at start-up) and builds gcpatch's variant. So the hand variants run exactly
transformers' own code, and every variant of a set-up lives in one process, where their
training steps can be interleaved round by round to cancel this shared machine's drift.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
import time

T_START = time.perf_counter()


def _now_ms() -> float:
    return time.perf_counter() * 1000.0


# --------------------------------------------------------------------------------------------
# enable: import cost inside the process, and the enable call on fresh tiny models
# --------------------------------------------------------------------------------------------


def task_enable(args: dict) -> dict:
    t0 = _now_ms()
    import transformers  # noqa: F401  (lazy module: the watcher starts gcpatch's engine here)

    t1 = _now_ms()
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
    )  # torch + modeling_utils: patches installed

    t2 = _now_ms()
    import torch

    torch.manual_seed(0)
    tiny = LlamaConfig(**args["tiny"])
    small = LlamaConfig(**args["small"])
    n = int(args["models"])
    tiny_models = [LlamaForCausalLM(tiny) for _ in range(n + 1)]
    small_models = [LlamaForCausalLM(small) for _ in range(int(args["small_models"]))]

    def enable(model) -> float:
        start = time.perf_counter_ns()
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
        return (time.perf_counter_ns() - start) / 1e6

    first = enable(tiny_models[0])  # the first enable in the process (one-off costs included)
    tiny_ms = [enable(m) for m in tiny_models[1:]]  # each model's own first enable
    small_ms = [enable(m) for m in small_models]
    again_ms = [
        enable(tiny_models[1]) for _ in range(n)
    ]  # the same model enabled again (Trainer re-enable)
    active = "gcpatch.engine" in sys.modules and sys.modules["gcpatch.engine"]._host is not None
    versions_ms = None
    if active:  # what each decision's version look-up costs (facts.versions)
        from gcpatch import facts

        samples = []
        for _ in range(5):
            start = time.perf_counter_ns()
            facts.versions()
            samples.append((time.perf_counter_ns() - start) / 1e6)
        versions_ms = sorted(samples)[len(samples) // 2]
    return {
        "import_transformers_ms": t1 - t0,
        "import_modeling_ms": t2 - t1,
        "first_enable_ms": first,
        "tiny_enable_ms": tiny_ms,
        "small_enable_ms": small_ms,
        "again_enable_ms": again_ms,
        "gcpatch_active": bool(active),
        "versions_ms": versions_ms,
    }


# --------------------------------------------------------------------------------------------
# case: saved-activation bytes, gradient correctness and interleaved step times of one set-up
# --------------------------------------------------------------------------------------------

SETUPS = {
    # name: (what the user trains, the mode the model is left in, the user's ask, the input)
    "full": dict(
        train="all", mode="train", ask=None, feed="input_ids", label="full fine-tune, asks nothing"
    ),
    "full_reentrant": dict(
        train="all",
        mode="train",
        ask=True,
        feed="input_ids",
        label="full fine-tune, asks use_reentrant=True",
    ),
    "lora": dict(
        train="qv",
        mode="train",
        ask=True,
        feed="input_ids",
        label="LoRA-like (q/v trainable), asks use_reentrant=True",
    ),
    "lora_embeds": dict(
        train="qv",
        mode="train",
        ask=True,
        feed="inputs_embeds",
        label="LoRA-like, inputs_embeds (VLM-style), asks use_reentrant=True",
    ),
    "eval": dict(
        train="all",
        mode="eval",
        ask=None,
        feed="input_ids",
        label="full fine-tune, model left in eval mode, asks nothing",
    ),
}


class SavedBytes:
    """A saved_tensors_hooks pack hook: sums numel*element_size of every saved tensor that is
    not a parameter or buffer (the issue's metric), and the bytes of the distinct storages
    behind them (what is really held, a tensor saved by several ops counted once)."""

    def __init__(self, model) -> None:
        import torch

        self.skip = {
            t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())
        }
        self.packed = 0
        self.count = 0
        self.storages: dict[int, int] = {}
        self.inside = 0  # > 0 while a checkpoint layer's forward runs (for the floor)
        self.packed_outside = 0
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip:
            size = tensor.numel() * tensor.element_size()
            self.packed += size
            self.count += 1
            self.storages[ptr] = max(self.storages.get(ptr, 0), storage.nbytes())
            if not self.inside:
                self.packed_outside += size
        return tensor

    @property
    def unique(self) -> int:
        return sum(self.storages.values())


def _layers(model):
    return [
        m
        for m in model.modules()
        if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
    ] or list(model.model.layers)


def task_case(args: dict) -> dict:
    """One or more set-ups. Every hand variant of every set-up is built and measured before
    gcpatch is imported; then gcpatch's variants; then the interleaved steps, set-up by set-up."""
    case = _Case(args)
    names = args["setups"]
    setups = {name: SETUPS[name] for name in names}
    models: dict[str, dict] = {name: {} for name in names}
    out: dict[str, dict] = {name: {} for name in names}
    for name, setup in setups.items():
        variants = ["none", "plain", "hand-R", "hand-NR"]
        if setup["mode"] == "eval":
            variants += ["hand-train-R", "hand-train-NR"]
        for variant in variants:
            models[name][variant] = model = case.build(setup, variant)
            out[name][variant] = _measure(variant, model, case.forward_of(setup))

    t0 = time.perf_counter()
    import gcpatch  # starts the engine now: transformers is imported already

    import_gcpatch_ms = (time.perf_counter() - t0) * 1000
    results = []
    for name, setup in setups.items():
        results.append(_with_gcpatch(gcpatch, case, name, setup, models[name], out[name]))
    return {
        "cases": results,
        "threads": case.torch.get_num_threads(),
        "import_gcpatch_ms": import_gcpatch_ms,
        "params": sum(p.numel() for p in case.base.parameters()),
        "attn": getattr(case.config, "_attn_implementation", None),
    }


class _Case:
    """The model every variant copies and the batch every step runs, and how a variant is built."""

    def __init__(self, args: dict) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        if args.get("threads"):
            torch.set_num_threads(int(args["threads"]))
        torch.manual_seed(0)
        self.torch, self.args = torch, args
        self.config = LlamaConfig(**args["model"])
        self.base = LlamaForCausalLM(self.config)
        batch, seq = int(args["batch"]), int(args["seq"])
        self.input_ids = torch.randint(0, self.config.vocab_size, (batch, seq))
        # Features from a frozen encoder, computed once (a VLM's projected image and text tokens).
        with torch.no_grad():
            self.features = self.base.get_input_embeddings()(self.input_ids).clone()
        self.v5 = hasattr(self.base, "activation_checkpointing_enable")

    def build(self, setup: dict, variant: str):
        model = copy.deepcopy(self.base)
        for name, param in model.named_parameters():
            param.requires_grad_(
                setup["train"] == "all" or name.endswith(("q_proj.weight", "v_proj.weight"))
            )
        mode = (
            "train" if variant.startswith("hand-train") else setup["mode"]
        )  # hand fix: model.train()
        model.train(mode == "train")
        if variant != "plain":
            model.config.use_cache = False  # what a careful user (and gcpatch, R6) does
        if variant == "none":
            return model
        if variant in ("plain", "gcpatch"):
            kwargs = None if setup["ask"] is None else {"use_reentrant": setup["ask"]}
        else:
            kwargs = {"use_reentrant": variant.endswith("-R")}
        if self.v5:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if variant.startswith("hand") and variant.endswith("-R"):
            _inputs_require_grad(model)  # reentrant made exact by hand, as gcpatch's R2 hook does
        return model

    def forward_of(self, setup: dict):
        input_ids, features = self.input_ids, self.features
        if setup["feed"] == "inputs_embeds":
            return lambda model: model(inputs_embeds=features, labels=input_ids).loss
        return lambda model: model(input_ids=input_ids, labels=input_ids).loss


def _measure(variant: str, model, forward) -> dict:
    counter = SavedBytes(model)
    boundary = [0]
    handles = _tag_layers(model, counter, boundary) if variant == "none" else []
    error = None
    with counter.ctx:
        loss = forward(model)
    for handle in handles:
        handle.remove()
    try:
        loss.backward()
    except RuntimeError as exc:  # reentrant with no input requiring grad: nothing trains
        error = str(exc).splitlines()[0]
    result = {
        "packed": counter.packed,
        "unique": counter.unique,
        "saved_tensors": counter.count,
        "error": error,
        "hooks": _hook_count(model),
    }
    if variant == "none":
        result.update(
            floor_packed=counter.packed_outside + boundary[0],
            boundary=boundary[0],
            outside=counter.packed_outside,
        )
    return result


def _tag_layers(model, counter: SavedBytes, boundary: list) -> list:
    """Hooks that tag what is saved inside the layers, and add up what enters them."""
    import torch

    def pre(module, inputs):
        counter.inside += 1
        boundary[0] += sum(
            t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor)
        )

    def post(module, inputs, output):
        counter.inside -= 1

    handles = []
    for layer in _layers(model):
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


def _with_gcpatch(gcpatch, case: _Case, name: str, setup: dict, models: dict, out: dict) -> dict:
    """gcpatch's variant of one set-up, every variant's gradients checked, and the steps timed."""
    before = len(gcpatch.decisions())
    models["gcpatch"] = model = case.build(setup, "gcpatch")
    out["gcpatch"] = _measure("gcpatch", model, case.forward_of(setup))
    applied: dict = {}
    rules: list = []
    for entry in gcpatch.decisions()[before:]:
        applied.update(entry.get("applied", {}))
        rules += [r for r in entry.get("rules", []) if r not in rules]
    out["gcpatch"].update(applied=applied, rules=rules)
    _check_grads(case.torch, models, out)

    # gcpatch's use_reentrant made by hand: the variant its step time is compared with.
    choice = "R" if applied.get("use_reentrant") else "NR"
    same = f"hand-train-{choice}" if applied.get("eval_mode_fix") else f"hand-{choice}"
    other = f"hand-{'NR' if choice == 'R' else 'R'}"
    timed = ["gcpatch", same]
    if setup["mode"] == "train" and out[other]["correct"]:
        timed.append(other)  # reentrant vs non-reentrant, where both are correct
    if setup["mode"] == "eval":
        timed.append("plain")  # what the eval-mode user runs without gcpatch
    elif name == "full":
        timed.append("none")  # what checkpointing itself costs
    steps = _interleaved_steps(
        {v: models[v] for v in timed},
        case.forward_of(setup),
        int(case.args["warmup"]),
        int(case.args["steps"]),
    )
    result = {
        "setup": name,
        "label": setup["label"],
        "ask": setup["ask"],
        "mode": setup["mode"],
        "variants": out,
        "same_choice": same,
        "other_choice": other if other in timed else None,
        "step_s": steps,
        "trainable_params": sum(
            p.numel() for p in models["gcpatch"].parameters() if p.requires_grad
        ),
    }
    for variant in timed:  # free the optimiser-trained copies before the next set-up
        models[variant] = None
    return result


def _check_grads(torch, models: dict, out: dict) -> None:
    """Gradient correctness against the same set-up without checkpointing."""
    ref = {n: p.grad for n, p in models["none"].named_parameters() if p.requires_grad}
    for variant, model in models.items():
        bad = sum(
            1
            for n, p in model.named_parameters()
            if p.requires_grad
            and (p.grad is None or not torch.allclose(p.grad, ref[n], rtol=1e-4, atol=1e-6))
        )
        out[variant].update(
            wrong_grads=bad,
            trainable=len(ref),
            correct=bad == 0 and out[variant]["error"] is None,
        )


def _inputs_require_grad(model) -> None:
    """What a careful user does for reentrant checkpointing behind frozen inputs: the embedding's
    output and a passed inputs_embeds require grad (transformers' enable_input_require_grads covers
    the first only)."""
    model.enable_input_require_grads()

    def embeds(module, args, kwargs):
        value = kwargs.get("inputs_embeds")
        if value is not None and not value.requires_grad:
            kwargs["inputs_embeds"] = value.detach().requires_grad_(True)
        return args, kwargs

    model.register_forward_pre_hook(embeds, with_kwargs=True)


def _hook_count(model) -> int:
    """Module hooks on the model and its submodules plus wrapped checkpoint functions: the code
    a training step runs besides the model's own."""
    count = 0
    for module in model.modules():
        for attr in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            count += len(getattr(module, attr, {}) or {})
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None and not isinstance(func, functools.partial):
            count += 1
    return count


def _interleaved_steps(models: dict, forward, warmup: int, steps: int) -> dict:
    """Training steps (forward, backward, AdamW) of every variant, round by round, in a rotating
    order so that no variant always runs first or last."""
    import torch

    optims = {
        v: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
        for v, m in models.items()
    }
    names = list(models)
    times: dict[str, list[float]] = {v: [] for v in names}
    for round_ in range(warmup + steps):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for variant in order:
            model, optim = models[variant], optims[variant]
            optim.zero_grad(set_to_none=True)
            start = time.perf_counter()
            forward(model).backward()
            optim.step()
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                times[variant].append(elapsed)
    return times


def main() -> None:
    task, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    result = {"enable": task_enable, "case": task_case}[task](args)
    result["process_s"] = time.perf_counter() - T_START
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
