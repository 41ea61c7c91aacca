"""GCPATCH_MEMORY_BUDGET's benchmark: a budget sweep on Llamas (hidden 256 by default), comparing the
activation bytes one step holds, the matmul FLOPs its backward recomputes and its step time for
  gcpatch    the plan gcpatch chose for the budget (the real path: the variable set, the user's
             enable), per layer plain, checkpointed keeping its matmuls or its attention output,
             plain with its MLP alone checkpointed, or checkpointed whole
  full       every layer checkpointed (`gradient_checkpointing_enable()` without gcpatch's budget)
  every_n    the best `every_n_layers` by hand: the largest n whose step meets the budget (n=1 if none)
  selective  torch's selective checkpointing by hand on every layer: a `context_fn` from
             `create_selective_checkpoint_contexts` saving the matmuls' and attention kernels'
             outputs (what Megatron-LM and torchtitan call selective recompute)
  compile    torch.compile's activation_memory_budget at the same budget (the min-cut partitioner)

    python benchmarks/memory_budget.py            # writes benchmarks/MEMORY_BUDGET.md, memory_budget.json/.png
    python benchmarks/memory_budget.py --configs 8x1024 --budgets 0.3,0.5,0.7
    python benchmarks/memory_budget.py --quick --out /tmp/x   # one small model, two budgets, no compile
    python benchmarks/memory_budget.py --device cuda --hidden 1024 --dtype bfloat16 --configs 16x2048
                                                   # on a GPU: writes MEMORY_BUDGET_GPU.md, memory_budget_gpu.json

Run it with an interpreter that has gcpatch, transformers and (for the plot) matplotlib installed.
FLOPs recomputed: torch.utils.flop_counter over one backward (matmuls and attention), less the
backward without checkpointing's, over the same for full checkpointing.
Bytes held: for the eager variants, every storage an operator allocated in the forward that is
still alive after it (gcpatch/step/held.py's instrument), over the same for no checkpointing.
torch.compile's kernels run outside that instrument: its bytes are the distinct storages its
compiled forward saves for the backward, over the same count for eager without checkpointing.
The compiled runs use the `aot_eager_decomp_partition` backend: the same partitioner and the
same recompute decisions as inductor (the saved bytes agree within 0.01% on the 8-layer model),
without inductor's ~40 s C++ build per budget on CPU; its times are therefore reported over its
own budget-1.0 run, not over eager. Times are the median of the timed steps (forward + backward) in
CPU seconds of the one compute thread (OMP_NUM_THREADS=1), variants of one budget interleaved step
by step, as a ratio over no checkpointing timed the same way.

On a GPU (`--device cuda`) steps are timed in wall seconds between CUDA synchronizations, the peak
CUDA memory of a step (over the memory allocated before it) is reported beside the counted bytes,
torch.compile is not run, and a user's own selective checkpointing (the `selective` variant's
`context_fn`) is timed with gcpatch switched off and on, step by step in one interpreter, as
benchmarks/step_cost.py does on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGETS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
CONFIGS = [(8, 1024), (16, 1024)]
QUICK = {"budgets": [0.5, 1.0], "configs": [(4, 32)], "compile": False}
BATCH, VOCAB = 2, 256
# what main's options set: the model's width and dtype, and the device it trains on
SETUP = {"hidden": 256, "dtype": "float32", "device": "cpu"}
CONTEXT_FN_PAIRS = 40  # plain/gcpatch step pairs of a user's own context_fn, on a GPU
STEPS = 7
TOLERANCE = 0.05


def model(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = SETUP["hidden"]
    heads = max(hidden // 64, 1)  # 4 at 256: heads of 64, two queries per key/value head
    torch.manual_seed(0)
    with torch.device(SETUP["device"]):
        m = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=hidden,
                intermediate_size=hidden * 43 // 16,  # 688 at 256: Llama's ratio, a multiple of 8
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=max(heads // 2, 1),
                tie_word_embeddings=False,
                use_cache=False,
            )
        )
    return m.to(getattr(torch, SETUP["dtype"])).train()


def on_gpu() -> bool:
    return SETUP["device"].startswith("cuda")


def synchronize() -> None:
    if on_gpu():
        import torch

        torch.cuda.synchronize()


def held(m, ids) -> int:
    from gcpatch.step.held import held_bytes

    with held_bytes(device_only=on_gpu()) as h:
        loss = m(input_ids=ids, labels=ids).loss
        n = h.total()
    loss.backward()
    m.zero_grad(set_to_none=True)
    return n


def saved(fn) -> int:
    """Distinct storages autograd saves in one forward (the compiled runs' instrument)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        try:
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
        except Exception:  # noqa: BLE001
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    return sum(seen.values())


def backward_flops(m, ids) -> int:
    """The FLOPs of one backward (matmuls and attention, torch.utils.flop_counter). Its attention
    formulas cover the CUDA kernels with as many key/value heads as query heads: each fused kernel
    is counted here with the same formula, key and value widened to the query's heads (CPU's
    kernel, and grouped-query attention, which transformers hands to a GPU's kernel unrepeated)."""
    import torch
    from torch.utils import flop_counter

    def widened(query, key):
        return (*key[:1], query[1], *key[2:])

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, widened(query, key), widened(query, value))

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(
            grad_out, query, widened(query, key), widened(query, value)
        )

    aten = torch.ops.aten
    kernels = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    mapping = {}
    for name in kernels:
        if hasattr(aten, name) and hasattr(aten, f"{name}_backward"):
            mapping[getattr(aten, name)] = forward
            mapping[getattr(aten, f"{name}_backward")] = backward
    loss = m(input_ids=ids, labels=ids).loss
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)
    with counter:
        loss.backward()
    m.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def step(m, ids) -> float:
    """CPU seconds of this thread, the one torch computes on (one intra-op thread): the other
    jobs of a shared machine take wall time, not this thread's CPU time. On a GPU, wall seconds
    between synchronizations."""
    clock = time.perf_counter if on_gpu() else time.thread_time
    synchronize()
    start = clock()
    m(input_ids=ids, labels=ids).loss.backward()
    m.zero_grad(set_to_none=True)
    synchronize()
    return clock() - start


def peak(m, ids) -> int | None:
    """The peak CUDA memory of one step over what was allocated before it (None off a GPU)."""
    if not on_gpu():
        return None
    import torch

    synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(m, ids)
    return torch.cuda.max_memory_allocated() - before


def context_fn_sides(m, ids) -> dict:
    """A user's own context_fn (the `selective` model), gcpatch off against on, step by step in
    one interpreter: `gcpatch.deactivate()` / `activate()` and the model enabled again between
    steps, untimed, with one untimed step after each switch (benchmarks/step_cost.py's method).
    Median seconds of each side."""
    import gcpatch

    asked = dict(m.model.layers[0]._gradient_checkpointing_func.keywords)
    asked.pop("function", None)

    def switch(on: bool) -> None:
        gcpatch.activate() if on else gcpatch.deactivate()
        if getattr(m, "_require_grads_hook", None) is not None:
            m.disable_input_require_grads()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(asked))
        func = m.model.layers[0]._gradient_checkpointing_func
        assert func.keywords.get("context_fn") is asked["context_fn"], ("context_fn lost", func)

    times: dict[str, list[float]] = {"plain": [], "gcpatch": []}
    for index in range(CONTEXT_FN_PAIRS):
        for on in (False, True) if index % 2 == 0 else (True, False):
            switch(on)
            step(m, ids)
            times["gcpatch" if on else "plain"].append(step(m, ids))
    switch(True)
    return {k: statistics.median(v) for k, v in times.items()}


def timed(variants: dict, ids) -> dict:
    """Median step seconds of each variant, interleaved step by step after one warm-up each."""
    for m in variants.values():
        step(m, ids)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(STEPS):
        for k, m in variants.items():
            times[k].append(step(m, ids))
    return {k: statistics.median(v) for k, v in times.items()}


def layers_of(m):
    return [layer for layer in m.model.layers]


def every_n(layers: int, n: int):
    m = model(layers)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(layers_of(m)):
        layer.gradient_checkpointing = bool(n) and i % n == 0
    return m


def selective(layers: int):
    """torch's selective checkpointing by hand, as a user writes it: every layer checkpointed,
    saving the outputs of the matmuls and the fused attention kernels, recomputing the rest."""
    import functools

    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from gcpatch.step.held import matmul_ops

    ops = sorted(matmul_ops(torch), key=str)  # mm, addmm, bmm, baddbmm, the attention kernels
    m = model(layers)
    m.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={
            "use_reentrant": False,
            "context_fn": functools.partial(create_selective_checkpoint_contexts, ops),
        }
    )
    return m


def gcpatch_plan(layers: int, budget: float, ids):
    """The real path: the variable set, the user's enable; the first step runs fully checkpointed
    and is probed, the plan is made and applied at the second training forward."""
    from gcpatch import record

    before = len(record.history())
    os.environ["GCPATCH_MEMORY_BUDGET"] = str(budget)
    try:
        m = model(layers)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        step(m, ids)  # the first training step: gcpatch probes it
        step(m, ids)  # the second: its forward gets the plan
    finally:
        os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    entry = [e for e in record.history()[before:] if e.get("stage") == "budget"][-1]
    return m, entry


def lever_shares(measured: dict) -> dict:
    """Each lever's cost over a whole layer's recompute as the first step measured it: the mean
    over the layers it was offered to (the record's `measured.layers[].shares`)."""
    found: dict[str, list[float]] = {}
    for layer in measured.get("layers", []):
        for lever, share in (layer.get("shares") or {}).items():
            found.setdefault(lever, []).append(share)
    return {lever: statistics.fmean(values) for lever, values in found.items()}


def one_config(layers: int, seq: int, budgets: list[float], with_compile: bool) -> dict:
    import torch

    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(SETUP["device"])
    plain = model(layers)
    full = every_n(layers, 1)
    by_hand = selective(layers)
    plain_held, full_held = held(plain, ids), held(full, ids)
    flops = {"plain": backward_flops(plain, ids), "full": backward_flops(full, ids)}
    flops["selective"] = backward_flops(by_hand, ids)
    plain_saved = saved(lambda: plain(input_ids=ids, labels=ids).loss)
    # n = 0: no layer checkpointed (what a budget of the whole no-checkpointing step allows)
    by_n = {0: plain_held, **{n: held(every_n(layers, n), ids) for n in range(1, layers + 1)}}
    out = {
        "layers": layers,
        "hidden": SETUP["hidden"],
        "seq": seq,
        "plain_bytes": plain_held,
        "full_bytes": full_held,
        "plain_saved_bytes": plain_saved,
        "every_n_bytes": by_n,
        "selective_bytes": held(by_hand, ids),
        "flops": flops,
        "budgets": {},
    }
    if on_gpu():
        out["peak"] = {"plain": peak(plain, ids), "full": peak(full, ids)}
        out["peak"]["selective"] = peak(by_hand, ids)
        out["context_fn_seconds"] = context_fn_sides(by_hand, ids)
        print(
            f"L={layers} seq={seq}: a user's own context_fn {out['context_fn_seconds']}", flush=True
        )
    compiled_ref = None
    for budget in budgets:
        limit = budget * plain_held
        n_best = max((n if n else layers + 1 for n, b in by_n.items() if b <= limit), default=1) % (
            layers + 1
        )
        ours, entry = gcpatch_plan(layers, budget, ids)
        variants = {
            "plain": plain,
            "full": full,
            "gcpatch": ours,
            "every_n": every_n(layers, n_best),
            "selective": by_hand,
        }
        times = timed(variants, ids)
        row = {
            "budget": budget,
            "limit_bytes": limit,
            "every_n": n_best,
            "gcpatch_checkpointed": entry["budget"]["plan"]["checkpointed"],
            "gcpatch_modes": entry["budget"]["plan"]["modes"],
            # what each lever measured: its cost over a whole layer's recompute
            "shares": lever_shares(entry["budget"]["measured"]),
            "flops": {
                "gcpatch": backward_flops(ours, ids),
                "every_n": backward_flops(variants["every_n"], ids),
            },
            "gcpatch_line": entry["line"],
            "bytes": {
                "gcpatch": held(ours, ids),
                "full": full_held,
                "every_n": by_n[n_best],
                "plain": plain_held,
            },
            "seconds": times,
        }
        if on_gpu():
            row["peak"] = {"gcpatch": peak(ours, ids), "every_n": peak(variants["every_n"], ids)}
        if with_compile:
            row["compile"] = compiled(layers, budget, ids)
            if budget == 1.0:
                compiled_ref = row["compile"]
        out["budgets"][str(budget)] = row
        print(
            f"L={layers} seq={seq} budget={budget}: gcpatch {_modes(row['gcpatch_modes'])} "
            f"held {row['bytes']['gcpatch'] / plain_held:.3f} time {times['gcpatch'] / times['plain']:.3f} | full "
            f"time {times['full'] / times['plain']:.3f} | every_n={n_best} {by_n[n_best] / plain_held:.3f} "
            f"{times['every_n'] / times['plain']:.3f}"
            + (f" | compile {row['compile']}" if with_compile else ""),
            flush=True,
        )
    if with_compile and compiled_ref is None:  # its times are over its own budget-1.0 run
        compiled_ref = compiled(layers, 1.0, ids)
    out["compile_reference"] = compiled_ref
    return out


def compiled(layers: int, budget: float, ids) -> dict:
    import torch
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    old = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = budget
    try:
        m = torch.compile(model(layers), backend="aot_eager_decomp_partition")
        nbytes = saved(lambda: m(input_ids=ids, labels=ids).loss)  # compiles
        seconds = timed({"compile": m}, ids)["compile"]
    finally:
        functorch_config.activation_memory_budget = old
    return {"saved_bytes": nbytes, "seconds": seconds}


def summarise(raw: dict) -> list[dict]:
    rows = []
    for cfg in raw["configs"]:
        ref = cfg.get("compile_reference")
        for key, row in cfg["budgets"].items():
            plain_s, plain_b = row["seconds"]["plain"], cfg["plain_bytes"]
            r = {
                "layers": _layers_text(cfg, raw),
                "seq": cfg["seq"],
                "budget": row["budget"],
                "n": row["every_n"],
                "k": row["gcpatch_checkpointed"],
                "modes": _modes(row.get("gcpatch_modes")),
                "shares": row.get("shares", {}),
            }
            for v in ("gcpatch", "full", "every_n"):
                r[f"{v}_bytes"] = row["bytes"][v] / plain_b
                r[f"{v}_time"] = row["seconds"][v] / plain_s
            if "selective" in row["seconds"]:
                r["selective_bytes"] = cfg["selective_bytes"] / plain_b
                r["selective_time"] = row["seconds"]["selective"] / plain_s
                flops = {**cfg["flops"], **row["flops"]}
                extra = flops["full"] - flops["plain"]
                for v in ("gcpatch", "every_n", "selective"):
                    r[f"{v}_flops"] = (flops[v] - flops["plain"]) / extra if extra else None
            if "peak" in cfg:  # on a GPU: peak CUDA memory of a step, over no checkpointing's
                peaks = {**cfg["peak"], **row["peak"]}
                for v in ("gcpatch", "full", "every_n", "selective"):
                    r[f"{v}_peak"] = peaks[v] / peaks["plain"]
            if "compile" in row:
                r["compile_bytes"] = row["compile"]["saved_bytes"] / cfg["plain_saved_bytes"]
                r["compile_time"] = row["compile"]["seconds"] / ref["seconds"] if ref else None
            r["met"] = (
                r["gcpatch_bytes"] <= row["budget"] * (1 + TOLERANCE)
                or row["gcpatch_checkpointed"] == cfg["layers"]
            )
            rows.append(r)
    return rows


# how the table names each mode: whole, keeping the matmuls, keeping the attention output, plain;
# and where any layer runs so, the feed-forward block alone and offloaded (tables of runs before
# those levers read as they did). Each letter's modes: the lever's name, then the name runs
# before the levers' registry recorded (`full`, `offload`).
LETTERS = {
    "W": ("whole", "full"),
    "K": ("keep-matmuls",),
    "A": ("keep-attention",),
    "P": ("plain",),
}
LATER = {"F": ("feed-forward",), "O": ("offload-inputs", "offload")}


def _modes(modes: list[str] | None) -> str:
    """Each mode's layers, counted: `2W 6K 0A 0P`, then `6F` or `2O` where layers run with their
    feed-forward block alone checkpointed or offloaded."""
    if modes is None:
        return "-"

    def count(names: tuple[str, ...]) -> int:
        return sum(modes.count(name) for name in names)

    counted = [f"{count(names)}{letter}" for letter, names in LETTERS.items()]
    counted += [f"{count(names)}{letter}" for letter, names in LATER.items() if count(names)]
    return " ".join(counted)


def _shares(shares: dict, split: bool) -> str:
    """Each lever's measured cost over a whole layer's recompute: `0.24 / 0.71`, and `/ 0.20`
    for the feed-forward block alone where the run measured it (`split`)."""
    levers = ("keep-matmuls", "keep-attention", "feed-forward")[: 3 if split else 2]
    return " / ".join(_fraction(shares.get(mode)) for mode in levers)


def write(raw: dict, out: Path, quick: bool) -> None:
    rows = summarise(raw)
    split = any("feed-forward" in (r.get("shares") or {}) for r in rows)
    levers = "K / A / F" if split else "K / A"
    setup = raw.get("setup", SETUP)  # runs before the GPU option had none: the CPU defaults
    if setup["device"].startswith("cuda"):
        where = (
            f" --device {setup['device']} --hidden {setup['hidden']} --dtype {setup['dtype']} on "
            f"{raw['gpu']} (torch {raw['torch']}, transformers {raw['transformers']}, commit "
            f"{raw['commit']}; steps timed in wall seconds between CUDA synchronizations). Llama, "
            f"hidden {setup['hidden']} (where a row names no other), batch {BATCH}, vocab {VOCAB}, "
            f"{setup['dtype']}, GPU. peak: "
            "a step's peak CUDA memory over what was allocated before it, over no checkpointing's; "
            "torch.compile is not run on the GPU."
        )
        clock = "wall time between CUDA synchronizations"
    else:
        where = (
            f" on {raw['machine']} (torch {raw['torch']}, transformers {raw['transformers']}, commit "
            f"{raw['commit']}, {raw['threads']} thread(s), on a machine shared with other jobs, so "
            f"steps are timed in CPU seconds of the compute thread). Llama, hidden "
            f"{setup['hidden']}, batch {BATCH}, vocab {VOCAB}, fp32, CPU."
        )
        clock = "thread CPU time"
    lines = [
        "# Memory budget: gcpatch's plan against full checkpointing, every_n_layers and torch.compile",
        "",
        "Generated by `python benchmarks/memory_budget.py`"
        + (" --quick (a smoke run)" if quick else "")
        + where,
        "",
        "- bytes: what one step's forward holds for its backward / the same without checkpointing;",
        "- FLOPs: matmul and attention FLOPs the backward recomputes / what full checkpointing "
        "recomputes (torch.utils.flop_counter; each fused attention kernel, CPU's too, counted with "
        "torch's formula, key and value widened to the query's heads);",
        "- gcpatch's layers: `W` checkpointed whole, `K` checkpointed keeping their matmuls' and "
        "attention kernels' outputs, `A` checkpointed keeping their attention kernel's output alone, "
        "`P` plain"
        + (
            ", `F` plain with their MLP alone checkpointed"
            if any("F" in str(r.get("modes")) for r in rows)
            else ""
        )
        + (
            ", `O` checkpointed whole with their inputs offloaded to host memory"
            if any("O" in str(r.get("modes")) for r in rows)
            else ""
        )
        + f"; `{levers} cost`: what each lever measured at the first step, over a whole layer's "
        "recompute (the mean over the layers it was offered to; the solver's input);",
        "- selective: torch's selective checkpointing by hand on every layer (a `context_fn` saving "
        "matmuls and attention kernels);",
        f"- time: step (forward + backward) / no checkpointing, median of {STEPS} steps ({clock}), "
        "variants interleaved;",
        "- `n`: the best `every_n_layers` by hand, the largest whose step meets the budget (0: no "
        "checkpointing meets it, 1: full checkpointing when none does);",
        "- torch.compile: `activation_memory_budget` at the same budget, saved bytes over eager's saved bytes, "
        "time over its own budget-1.0 run (see the script's docstring);",
        "- a budget below full checkpointing's floor is met by full checkpointing (gcpatch says so in one line).",
        "",
    ]
    head = (
        f"| layers | seq | budget | gcpatch layers | {levers} cost | gcpatch bytes | gcpatch time | gcpatch FLOPs "
        "| full bytes | full time | n | every_n bytes | every_n time | every_n FLOPs |"
    )
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    if any("selective_bytes" in r for r in rows):
        head += " selective bytes | selective time | selective FLOPs |"
        sep += "---|---|---|"
    if any("compile_bytes" in r for r in rows):
        head += " compile bytes | compile time |"
        sep += "---|---|"
    peaks = ("gcpatch", "full", "every_n", "selective")
    if any("gcpatch_peak" in r for r in rows):
        head += " " + " | ".join(f"{v} peak" for v in peaks) + " |"
        sep += "---|" * len(peaks)
    lines += [head, sep]
    lines += [_row(r, split, peaks) for r in rows]
    met = sum(r["met"] for r in rows)
    lines += [
        "",
        f"Budgets met (bytes <= budget + {TOLERANCE:.0%}, or full checkpointing below its floor): "
        f"{met} of {len(rows)}.",
        "",
    ]
    lines += [_at_half(r) for r in rows if abs(r["budget"] - 0.5) < 1e-9]
    for cfg in raw["configs"]:
        if "context_fn_seconds" in cfg:
            sides = cfg["context_fn_seconds"]
            lines.append(
                f"- {_layers_text(cfg, raw)} layers, seq {cfg['seq']}: a user's own context_fn (the selective "
                f"variant), median step {sides['plain'] * 1e3:.2f} ms with gcpatch off, "
                f"{sides['gcpatch'] * 1e3:.2f} ms on ({sides['gcpatch'] / sides['plain']:.3f}x; "
                f"{CONTEXT_FN_PAIRS} pairs, gcpatch switched step by step in one interpreter)"
            )
    md, _, png = names(raw)
    lines += ["", f"Plot: `{png}` ({raw.get('plot', '')}).", ""]
    (out / md).write_text("\n".join(lines))


def _row(r: dict, split: bool, peaks: tuple[str, ...]) -> str:
    """One row of the table, with the columns of the variants this run measured."""
    over = "" if r["met"] else " (over)"
    line = (
        f"| {r['layers']} | {r['seq']} | {r['budget']:.1f} | {r['modes']} | "
        f"{_shares(r.get('shares') or {}, split)} | "
        f"{r['gcpatch_bytes']:.3f}{over} | {r['gcpatch_time']:.3f} | {_fraction(r.get('gcpatch_flops'))} | "
        f"{r['full_bytes']:.3f} | {r['full_time']:.3f} | {r['n']} | "
        f"{r['every_n_bytes']:.3f} | {r['every_n_time']:.3f} | {_fraction(r.get('every_n_flops'))} |"
    )
    if "selective_bytes" in r:
        line += (
            f" {r['selective_bytes']:.3f} | {r['selective_time']:.3f} |"
            f" {_fraction(r.get('selective_flops'))} |"
        )
    if "compile_bytes" in r:
        compile_time = f"{r['compile_time']:.3f}" if r["compile_time"] else "-"
        line += f" {r['compile_bytes']:.3f} | {compile_time} |"
    if "gcpatch_peak" in r:
        line += " " + " | ".join(f"{r[f'{v}_peak']:.3f}" for v in peaks) + " |"
    return line


def _at_half(r: dict) -> str:
    """The verdict of a row at budget 0.5: gcpatch's step-time overhead against full
    checkpointing's, and the FLOPs it recomputes."""
    ours, full = r["gcpatch_time"] - 1, r["full_time"] - 1
    verdict = "at most" if ours <= full / 2 else "MORE than"
    flops = r.get("gcpatch_flops")
    said = (
        ""
        if flops is None
        else (
            f"; FLOPs recomputed {flops:.3f} of full checkpointing's "
            f"({'at most' if flops <= 0.35 else 'MORE than'} 0.35)"
        )
    )
    return (
        f"- {r['layers']} layers, seq {r['seq']}, budget 0.5: layers {r['modes']}, step-time "
        f"overhead {ours:+.1%} (full checkpointing {full:+.1%}): {verdict} half of full "
        f"checkpointing's{said}"
    )


def names(raw: dict) -> tuple[str, str, str]:
    """The table, raw results and plot files of a run: a GPU's beside the CPU's, not over them."""
    if raw.get("setup", SETUP)["device"].startswith("cuda"):
        return "MEMORY_BUDGET_GPU.md", "memory_budget_gpu.json", "memory_budget_gpu.png"
    return "MEMORY_BUDGET.md", "memory_budget.json", "memory_budget.png"


def _layers_text(cfg: dict, raw: dict) -> str:
    """A config's layer count, with its hidden size where it is not the run's."""
    hidden = cfg.get("hidden")
    if hidden is None or hidden == raw.get("setup", SETUP)["hidden"]:
        return str(cfg["layers"])
    return f"{cfg['layers']} (hidden {hidden})"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plot(raw: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    rows = summarise(raw)
    configs = [(_layers_text(c, raw), c["seq"]) for c in raw["configs"]]
    fig, axes = plt.subplots(2, len(configs), figsize=(4 * len(configs), 7), squeeze=False)
    for col, (layers, seq) in enumerate(configs):
        mine = [r for r in rows if r["layers"] == layers and r["seq"] == seq]
        xs = [r["budget"] for r in mine]
        for row, what in enumerate(("bytes", "time")):
            ax = axes[row][col]
            for v, style in (
                ("gcpatch", "o-"),
                ("full", "s--"),
                ("every_n", "^-"),
                ("compile", "x:"),
            ):
                ys = [r.get(f"{v}_{what}") for r in mine]
                if all(y is not None for y in ys):
                    ax.plot(xs, ys, style, label=v)
            if what == "bytes":
                ax.plot(
                    xs, [x * (1 + TOLERANCE) for x in xs], color="grey", lw=0.8, label="budget +5%"
                )
                ax.set_title(f"{layers} layers, seq {seq}")
            ax.set_xlabel("budget")
            ax.set_ylabel(
                "held bytes / no checkpointing"
                if what == "bytes"
                else "step time / no checkpointing"
            )
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return "written"


def _commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--configs", help="layers x tokens, comma-separated: 8x1024,16x1024")
    parser.add_argument("--budgets", help="comma-separated: 0.3,0.5,0.7")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (no torch.compile there)")
    parser.add_argument("--hidden", type=int, default=SETUP["hidden"])
    parser.add_argument("--dtype", default=SETUP["dtype"], help="float32, bfloat16")
    parser.add_argument(
        "--from-json", type=Path, help="rewrite the table and plot from a run's memory_budget.json"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        raw = json.loads(args.from_json.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        raw["plot"] = plot(raw, args.out / names(raw)[2])
        write(raw, args.out, quick=False)
        return 0
    SETUP.update(device=args.device, hidden=args.hidden, dtype=args.dtype)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    import gcpatch  # noqa: F401 (switches gcpatch on: the plan is made through the user's enable)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    budgets = QUICK["budgets"] if args.quick else BUDGETS
    configs = QUICK["configs"] if args.quick else CONFIGS
    if args.budgets:
        budgets = [float(b) for b in args.budgets.split(",")]
    if args.configs:
        configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    with_compile = not args.quick and not args.no_compile and not on_gpu()
    raw = {
        "setup": dict(SETUP),
        "gpu": torch.cuda.get_device_name() if on_gpu() else None,
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": _commit(),
        "threads": torch.get_num_threads(),
        "configs": [one_config(layers, seq, budgets, with_compile) for layers, seq in configs],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    md, data, png = names(raw)
    raw["plot"] = plot(raw, args.out / png)
    (args.out / data).write_text(json.dumps(raw, indent=1))
    write(raw, args.out, args.quick)
    print((args.out / md).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
