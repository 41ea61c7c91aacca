"""What gcpatch costs a training step, with steps short enough that a per-call cost would show.

    python benchmarks/step_cost.py --python /path/tf525/bin/python --python /path/tf457/bin/python
    python benchmarks/step_cost.py --table-only      # regenerate STEP_COST.md from STEP_COST.json

A tiny Llama (4 layers, hidden 64, batch 2 x 64 tokens, fp32, one CPU thread), all trainable, with
non-reentrant checkpointing asked for (a set-up plain runs correctly, so both sides do the same
work: a partly frozen model under 4.57's reentrant default skips its layers' backward plainly,
faster because wrong), trained with SGD: a step of a few milliseconds, in which each of the 4
checkpoint calls goes through gcpatch's hot path (`checkpoint_call.run`).

Plain and gcpatch alternate step by step inside one interpreter started with GCPATCH=1:
`gcpatch.deactivate()` gives everything back before a plain step, `activate()` arms it again before
a gcpatch step, and the model is enabled again after each switch (outside the timing, with one
untimed step after it; transformers' input-grads hook, which it adds again at every enable, is
taken off first, so each side runs with the hooks of a job that enables once). On a shared 2-CPU
VM, step times drift by 10-40% from one process or one block of steps to the next, which fresh
interpreters alternating round by round could not resolve to 0.5%; neighbouring steps share that
drift. Each step is timed by the process's CPU time, with the garbage collector off inside the
timed loop. Per release: several interpreters (rounds), each with `--pairs` plain/gcpatch pairs;
the table gives the median and the fastest decile of all steps of each side, gcpatch's ratio to
plain, and a bootstrap 95% interval of the ratio of medians. The same pairs with gcpatch off on
both sides (a control) show what noise alone gives. `--sides selective` times the same pairs with
a user's own selective checkpointing (a `context_fn` from `create_selective_checkpoint_contexts`
saving the matmuls), which gcpatch keeps as given: it must cost no more under GCPATCH=1 than
plainly. The per-call cost of the hot path itself is benchmarks/CHECKPOINT_CALL.md's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

from _releases import child_env, main, run_worker

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "STEP_COST.json"
TABLE = HERE / "STEP_COST.md"
GOAL = 1.005

WORKER = r"""
import gc, json, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, __version__ as tf_version
import gcpatch
torch.set_num_threads(1)
pairs, kind = int(sys.argv[1]), sys.argv[2]
control = kind == "control"
asked = {"use_reentrant": False}
if kind == "selective":  # a user's own selective checkpointing: save the matmuls, recompute the rest
    import functools
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    aten = torch.ops.aten
    saved = [aten.mm.default, aten.addmm.default, aten.bmm.default]
    asked["context_fn"] = functools.partial(create_selective_checkpoint_contexts, saved)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, tie_word_embeddings=False))
model.train()
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))

def switch(on):
    gcpatch.activate() if on else gcpatch.deactivate()
    # transformers adds an input-grads hook at every enable (gcpatch takes the earlier ones away):
    # the same hooks on either side, as in a job that enables once
    if getattr(model, "_require_grads_hook", None) is not None:
        model.disable_input_require_grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(asked))
    patched = any(getattr(f, "_self_gcpatch", False) for f in vars(PreTrainedModel).values())
    assert patched == on, ("gcpatch did not switch", on)
    assert len(model.get_input_embeddings()._forward_hooks) <= 1, "input-grads hooks piled up"
    if "context_fn" in asked:  # the user's own, kept as given on either side
        func = model.model.layers[0]._gradient_checkpointing_func
        assert func.keywords.get("context_fn") is asked["context_fn"], ("context_fn lost", func)

def step():
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

for on in (True, False):
    switch(on)
    for _ in range(30):
        step()
times = {"plain": [], "second": []}
gc.collect()
gc.disable()
for index in range(pairs):
    for second in ((False, True) if index % 2 == 0 else (True, False)):
        switch(second and not control)
        step()
        start = time.process_time()
        step()
        times["second" if second else "plain"].append((time.process_time() - start) * 1e3)
print("RESULT " + json.dumps({"transformers": tf_version, "torch": torch.__version__,
                              "times_ms": times}))
"""


def run(python: str, pairs: int, sides: str) -> dict:
    """One interpreter's pairs: plain against gcpatch, plain against plain ("control": the same
    switching and timing with gcpatch off on both sides, which shows what noise alone gives), or
    plain against gcpatch with a user's own `context_fn` ("selective")."""
    return run_worker(python, WORKER, [str(pairs), sides], child_env(True))


def _fastest_decile(times: list[float]) -> float:
    ordered = sorted(times)
    return statistics.mean(ordered[: max(1, len(ordered) // 10)])


def _interval(plain: list[float], ours: list[float], draws: int = 2000) -> list[float]:
    """A bootstrap 95% interval of median(gcpatch) / median(plain), resampling the pairs."""
    rng = random.Random(0)
    pairs = list(zip(plain, ours))
    ratios = []
    for _ in range(draws):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(
            statistics.median(o for _, o in sample) / statistics.median(p for p, _ in sample)
        )
    ratios.sort()
    return [round(ratios[int(0.025 * draws)], 4), round(ratios[int(0.975 * draws) - 1], 4)]


def measure(python: str, args: argparse.Namespace) -> dict:
    out: dict = {"pairs": args.pairs, "rounds": args.rounds}
    for sides in args.sides.split(","):
        plain: list[float] = []
        ours: list[float] = []
        rounds = []
        for index in range(args.rounds):
            result = run(python, args.pairs, sides)
            p, o = result["times_ms"]["plain"], result["times_ms"]["second"]
            plain += p
            ours += o
            rounds.append(round(statistics.median(o) / statistics.median(p), 4))
            print(f"  {sides} round {index + 1}: medians' ratio {rounds[-1]:.4f}", file=sys.stderr)
        out["torch"] = result["torch"]
        out[sides] = {
            "plain": {
                "median_ms": statistics.median(plain),
                "fastest_decile_ms": _fastest_decile(plain),
            },
            "other": {
                "median_ms": statistics.median(ours),
                "fastest_decile_ms": _fastest_decile(ours),
            },
            "ratio_interval": _interval(plain, ours),
            "rounds_ratio": rounds,
        }
    return out


def table(results: dict) -> str:
    lines = [
        "# A training step with and without gcpatch (CPU)",
        "",
        "Reproduce: `python benchmarks/step_cost.py --python <venv>/bin/python ...` (one venv per "
        "transformers release; this file is generated from STEP_COST.json). A tiny Llama, 4 "
        "checkpointed layers, all trainable, `use_reentrant=False` asked (plain is correct there), "
        "SGD, 2 x 64 tokens, one CPU thread. Plain and gcpatch alternate step by step in one "
        "interpreter started with GCPATCH=1 (`gcpatch.deactivate()` / `activate()` and the model "
        "enabled again between steps, untimed, transformers' input-grads hook taken off first so "
        "that it does not pile up), each step's process CPU time, garbage collector "
        "off; several interpreters per release. Goal: gcpatch <= 1.005x plain, met where the "
        "whole 95% interval of the ratio of medians is at or below it. The plain-against-plain "
        "rows run the same switching and timing with gcpatch off on both sides: what noise alone "
        "gives. The context_fn rows pass a user's own selective checkpointing to the enable "
        "(`create_selective_checkpoint_contexts` saving mm, addmm and bmm), which gcpatch keeps as "
        "given. No GPU was lent for these figures.",
        "",
        "| transformers | torch | interpreters x pairs | plain median (ms) | gcpatch (or second plain) median (ms) "
        "| ratio | 95% interval | plain fastest decile (ms) | gcpatch (or second plain) fastest decile (ms) | ratio "
        f"| goal <= {GOAL}x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for release, entry in sorted(results.items()):
        for sides, label in (
            ("gcpatch", release),
            ("selective", f"{release}, a user's own context_fn"),
            ("control", f"{release}, plain against plain"),
        ):
            if sides not in entry:
                continue
            plain, ours = entry[sides]["plain"], entry[sides]["other"]
            ratio = ours["median_ms"] / plain["median_ms"]
            fast = ours["fastest_decile_ms"] / plain["fastest_decile_ms"]
            low, high = entry[sides]["ratio_interval"]
            verdict = "met" if high <= GOAL else ("**missed**" if low > GOAL else "not resolved")
            lines.append(
                f"| {label} | {entry['torch']} | {entry['rounds']} x {entry['pairs']} | "
                f"{plain['median_ms']:.3f} | {ours['median_ms']:.3f} | {ratio:.4f}x | "
                f"{low:.4f}-{high:.4f} | {plain['fastest_decile_ms']:.3f} | "
                f"{ours['fastest_decile_ms']:.3f} | {fast:.4f}x | "
                f"{verdict if sides != 'control' else 'the noise'} |"
            )
    lines += ["", "Per interpreter, the second side's median step over plain's:", ""]
    for release, entry in sorted(results.items()):
        said = {
            "gcpatch": "gcpatch",
            "selective": "a user's own context_fn",
            "control": "plain against plain",
        }
        ratios = [f"{said[k]} {entry[k]['rounds_ratio']}" for k in said if k in entry]
        lines.append(f"- {release} ({entry['when']}, {entry['machine']}): " + "; ".join(ratios))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=1000, help="plain/second step pairs each")
    parser.add_argument("--rounds", type=int, default=3, help="interpreters per release")
    parser.add_argument(
        "--sides",
        default="gcpatch,control",
        help="comma-separated, of gcpatch, control, selective (a user's own context_fn)",
    )
    main(parser, measure, table, RESULTS, TABLE)
