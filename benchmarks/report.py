"""Reporting: RESULTS.md and results.png from the raw figures measure.py took. Every sentence
with a number is generated from the figures; the fixed text only says how each was measured."""

from __future__ import annotations

from pathlib import Path

from measure import TINY, med, paired_ratio

TARGETS = {
    "startup_off": 1.01,
    "startup_on": 1.05,
    "enable_ms": 1.0,
    "step": 1.01,
    "bytes": 1.00,
    "eval": 1.10,
}


def _median_ci(values: list[float]) -> list[float]:
    """A distribution-free 95% interval of a median (binomial order statistics)."""
    ranked = sorted(values)
    n = len(ranked)
    if not n:
        return [float("nan"), float("nan")]
    half = 1.96 * n**0.5 / 2
    return [ranked[max(0, int(n / 2 - half))], ranked[min(n - 1, int(n / 2 + half))]]


def summarise(raw: dict) -> dict:
    s: dict = _startup_summary(raw["startup"])
    s["enable"] = _enable_summary(raw["enable"])
    cases = raw["cases"]["cases"]
    s["cases"] = []
    pooled: list[float] = []
    worst_bytes = 0.0
    for c in cases:
        row = _case_row(c)
        worst_bytes = max(worst_bytes, row.get("bytes_ratio", 0.0))
        steps = c["step_s"]
        pooled += [a / b for a, b in zip(steps["gcpatch"], steps[c["same_choice"]])]
        if "eval_ratio" in row:
            s["eval"] = row["eval_ratio"]
        s["cases"].append(row)
    rr_pairs = [
        a / b
        for c in cases
        if c["other_choice"]
        for a, b in zip(c["step_s"]["hand-R"], c["step_s"]["hand-NR"])
    ]
    s["reentrant_pooled"] = med(rr_pairs) if rr_pairs else None
    s["reentrant_pooled_ci"] = _median_ci(rr_pairs)
    s["reentrant_pooled_n"] = len(rr_pairs)
    s["step_pooled"] = med(pooled)
    ranked = sorted(pooled)
    n = len(ranked)
    half = (
        1.96 * n**0.5 / 2
    )  # distribution-free 95% interval of a median (binomial order statistics)
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(n / 2 + half))
    s["step_pooled_ci"] = [ranked[lo], ranked[hi]] if n else [float("nan")] * 2
    s["step_pooled_n"] = len(pooled)
    s["bytes_worst"] = worst_bytes
    return s


def _startup_summary(startup: dict) -> dict:
    """Start-up and `import transformers`: each variant's times and their ratios."""
    s: dict = {}
    st = startup["startup_s"]
    s["startup"] = {k: {"min_ms": min(v) * 1000, "median_ms": med(v) * 1000} for k, v in st.items()}
    s["startup_off"] = {
        "median": med(st["unset"]) / med(st["without"]),
        "min": min(st["unset"]) / min(st["without"]),
        "paired": paired_ratio(st["unset"], st["without"]),
    }
    s["startup_on"] = {
        "median": med(st["on"]) / med(st["unset"]),
        "min": min(st["on"]) / min(st["unset"]),
        "paired": paired_ratio(st["on"], st["unset"]),
    }
    im = startup["import_s"]
    s["import"] = {k: {"min_ms": min(v) * 1000, "median_ms": med(v) * 1000} for k, v in im.items()}
    s["import_off"] = {
        "median": med(im["unset"]) / med(im["without"]),
        "min": min(im["unset"]) / min(im["without"]),
    }
    s["import_on"] = {
        "median": med(im["on"]) / med(im["unset"]),
        "min": min(im["on"]) / min(im["unset"]),
        "added_ms": (med(im["on"]) - med(im["unset"])) * 1000,
    }
    return s


def _enable_summary(en: dict) -> dict:
    """The enable calls: each figure without and with gcpatch, pooled over the processes."""

    def pool(name: str, key: str) -> list[float]:
        values: list[float] = []
        for r in en[name]:
            values += r[key] if isinstance(r[key], list) else [r[key]]
        return values

    for name in ("off", "on"):
        for r in en[name]:
            r["import_total_ms"] = r["import_transformers_ms"] + r["import_modeling_ms"]
    summary = {}
    for key in (
        "import_total_ms",
        "first_enable_ms",
        "tiny_enable_ms",
        "small_enable_ms",
        "again_enable_ms",
        "import_transformers_ms",
        "import_modeling_ms",
    ):
        off, on = pool("off", key), pool("on", key)
        summary[key] = {
            "off": med(off),
            "on": med(on),
            "added": med(on) - med(off),
            "n": len(on),
        }
    return summary


def _case_row(c: dict) -> dict:
    """One set-up: gcpatch's bytes against the best correct hand choice and the floor, and its
    step time against the same choice made by hand."""
    v = c["variants"]
    hand = {k: x for k, x in v.items() if k.startswith("hand-")}
    correct = {k: x for k, x in hand.items() if x["correct"]}
    best = min(correct, key=lambda k: (correct[k]["packed"], k)) if correct else None
    row = {
        "setup": c["setup"],
        "label": c["label"],
        "best": best,
        "same": c["same_choice"],
        "other": c["other_choice"],
        "floor": v["none"]["floor_packed"],
        "gcpatch_applied": v["gcpatch"].get("applied", {}),
        "rules": v["gcpatch"].get("rules", []),
    }
    if best:
        row["bytes_ratio"] = v["gcpatch"]["packed"] / v[best]["packed"]
    row["floor_ratio"] = v["gcpatch"]["packed"] / v["none"]["floor_packed"]
    steps = c["step_s"]
    row["step_med"] = {k: med(x) for k, x in steps.items()}
    row["step_ratio"] = paired_ratio(steps["gcpatch"], steps[c["same_choice"]])
    row["step_ratio_median"] = med(steps["gcpatch"]) / med(steps[c["same_choice"]])
    if c["other_choice"]:
        row["reentrant_ratio"] = paired_ratio(steps["hand-R"], steps["hand-NR"])
    if "none" in steps:
        row["ckpt_overhead"] = paired_ratio(steps[c["same_choice"]], steps["none"])
    if c["setup"] == "eval":
        row["eval_ratio"] = v["gcpatch"]["packed"] / v[c["same_choice"]]["packed"]
        row["eval_plain_ratio"] = v["plain"]["packed"] / v[c["same_choice"]]["packed"]
    row["hooks_added"] = v["gcpatch"]["hooks"] - v[c["same_choice"]]["hooks"]
    return row


# ---------------------------------------------------------------------------------------------
# writing: RESULTS.md and the plot
# ---------------------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def verdict(value: float, target: float) -> str:
    return "met" if value <= target + 1e-12 else "**missed**"


VARIANT_TEXT = {
    "none": "no checkpointing",
    "plain": "plain set-up (transformers, the user's ask)",
    "hand-R": "by hand: use_reentrant=True",
    "hand-NR": "by hand: use_reentrant=False",
    "hand-train-R": "by hand: model.train() + use_reentrant=True",
    "hand-train-NR": "by hand: model.train() + use_reentrant=False",
    "gcpatch": "gcpatch (the user's ask)",
}


def write_results(raw: dict, s: dict, out: Path, smoke: bool, plot_note: str) -> Path:
    lines = [
        *_preamble(raw, smoke),
        *_targets(raw, s),
        *_startup_section(raw, s),
        *_import_section(raw, s),
        *_enable_section(raw, s),
        *_step_section(raw, s),
        *_bytes_section(raw, s),
        *_not_measured(plot_note),
    ]
    path = out / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path


STARTUP_VARIANTS = {
    "without": "venv without gcpatch",
    "unset": "gcpatch installed, GCPATCH unset",
    "on": "gcpatch installed, GCPATCH=1",
}


def _preamble(raw: dict, smoke: bool) -> list[str]:
    """How to reproduce the figures, and where they were measured."""
    env = raw["env"]
    lines: list[str] = []
    add = lines.append
    add("# gcpatch benchmarks")
    add("")
    add(
        "Reproduce with one command, from the repository root, with an interpreter whose environment has gcpatch, "
        "transformers and (for the plot) matplotlib installed:"
    )
    add("")
    add("```")
    add("python benchmarks/run.py")
    add("```")
    add("")
    add(
        "It writes this file, `benchmarks/results.png` and `benchmarks/results.json` (raw figures), builds two "
        "scratch venvs under `benchmarks/.work/` (git-ignored) and downloads nothing. "
        "`python benchmarks/run.py --smoke --out DIR` is the smallest setting "
        "(`tests/process/test_benchmark_smoke.py` runs it); `python benchmarks/run.py --render-only` rewrites this file "
        "from `results.json` (measure.py measures, report.py writes)."
    )
    add("")
    if smoke:
        add("> **Smoke run**: the smallest setting, figures are meaningless.")
        add("")
    add(
        f"Measured {env['date']} on {env['machine']}: Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, gcpatch {env['gcpatch']} (repository at {env.get('commit', 'unknown')}), {env['cpus']} CPUs "
        f"(training steps on {raw['cases'].get('threads')} torch thread(s): on a shared 2-core machine two OpenMP "
        f"threads stall each other whenever another job takes a core, which swamps the ratios), no GPU. Total run time {env['run_s']:.0f} s."
    )
    add("")
    add(
        "All comparisons are ratios of variants run interleaved in the same run (round by round, in rotating "
        "order): absolute times on this shared machine drift from run to run, ratios much less."
    )
    add("")
    return lines


def _targets(raw: dict, s: dict) -> list[str]:
    """The targets, each with its measured figure, and the misses explained."""
    e, t = s["enable"], TARGETS
    eval_row = next((r for r in s["cases"] if r["setup"] == "eval"), None)
    lines: list[str] = []
    add = lines.append
    add("## Targets")
    add("")
    add("| what | measured | target | |")
    add("| --- | --- | --- | --- |")
    so, sn = s["startup_off"], s["startup_on"]
    add(
        f"| start-up, gcpatch installed and GCPATCH unset / venv without gcpatch (median of {len(raw['startup']['startup_s']['unset'])} runs) "
        f"| {so['median']:.3f}x (min {so['min']:.3f}x) | <= {t['startup_off']:.2f}x | {verdict(so['median'], t['startup_off'])} |"
    )
    add(
        f"| start-up, GCPATCH=1 / unset, no framework imported (median) "
        f"| {sn['median']:.3f}x (min {sn['min']:.3f}x) | <= {t['startup_on']:.2f}x | {verdict(sn['median'], t['startup_on'])} |"
    )
    io = s["import_on"]
    add(
        f"| `import transformers`, GCPATCH=1 / unset (median) | {io['median']:.3f}x (+{io['added_ms']:.1f} ms) | "
        f"(no target) | |"
    )
    add(
        f"| enable call on a tiny model, added by gcpatch: first call in a process "
        f"| +{e['first_enable_ms']['added']:.2f} ms | <= +{t['enable_ms']:.0f} ms | {verdict(e['first_enable_ms']['added'], t['enable_ms'])} |"
    )
    add(
        f"| enable call on a tiny model, added by gcpatch: each later model (median) "
        f"| +{e['tiny_enable_ms']['added']:.2f} ms | <= +{t['enable_ms']:.0f} ms | {verdict(e['tiny_enable_ms']['added'], t['enable_ms'])} |"
    )
    add(
        f"| training step, gcpatch / the same use_reentrant choice by hand (median of {s['step_pooled_n']} "
        f"interleaved pairs over all set-ups) | {s['step_pooled']:.3f}x (95% CI {s['step_pooled_ci'][0]:.3f}-{s['step_pooled_ci'][1]:.3f}) | <= {t['step']:.2f}x | {verdict(s['step_pooled'], t['step'])} |"
    )
    add(
        f"| saved activation bytes, gcpatch / best correct hand choice (worst set-up) | {s['bytes_worst']:.3f}x | "
        f"<= {t['bytes']:.2f}x | {verdict(s['bytes_worst'], t['bytes'])} |"
    )
    if eval_row:
        add(
            f"| saved activation bytes, model left in eval mode / train mode, with gcpatch | {eval_row['eval_ratio']:.3f}x "
            f"(without gcpatch: {eval_row['eval_plain_ratio']:.2f}x) | <= {t['eval']:.1f}x | {verdict(eval_row['eval_ratio'], t['eval'])} |"
        )
    add("")
    missed = misses(raw, s)
    add("### Targets missed, with the figures this run has on them")
    add("")
    add("\n\n".join(missed) if missed else "None in this run.")
    add("")
    return lines


def _startup_section(raw: dict, s: dict) -> list[str]:
    """1. Interpreter start-up."""
    lines: list[str] = []
    add = lines.append
    add("## 1. Interpreter start-up (`python -c pass`)")
    add("")
    add("| variant | min (ms) | median (ms) |")
    add("| --- | --- | --- |")
    for k, label in STARTUP_VARIANTS.items():
        add(f"| {label} | {s['startup'][k]['min_ms']:.2f} | {s['startup'][k]['median_ms']:.2f} |")
    it = raw["startup"]["importtime"]
    add("")
    own = [m for m in it["modules"] if "gcpatch" in m]
    add(
        f"Direct measurements: with GCPATCH unset, the `gcpatch.pth` line costs **{raw['startup']['pth_line_us']:.2f} µs** "
        f"(timeit, in-process; it imports nothing) and all that site.py does for the file (open, read, run: "
        f"`site.addpackage`) **{raw['startup'].get('pth_file_us', float('nan')):.1f} µs** per start-up. With GCPATCH=1, "
        f"`-X importtime` (which inflates times) attributes **{it['median_ms']:.2f} ms** (median of "
        f"{raw['config']['importtime_runs']}) to gcpatch's start-up imports: {', '.join(own)}, and the modules "
        f"they import that Python had not loaded yet: "
        + ", ".join(f"{n} {ms:.2f} ms" for n, ms in it["heavy"])
        + "."
    )
    add("")
    add(
        "Fair comparison: both venvs are made by `python -m venv` from the same base interpreter and see the "
        "same packages (the benchmarking environment's site-packages, through a path line, which adds a "
        "directory without running its .pth files); both carry copies of that environment's other .pth files. "
        "The `with` venv also has gcpatch's installed files (package, `_gcpatch_startup.py`, `gcpatch.pth`, "
        "dist-info) in its own site-packages. So the only difference is gcpatch being installed."
    )
    add("")
    return lines


def _import_section(raw: dict, s: dict) -> list[str]:
    """2. `import transformers`."""
    e, io = s["enable"], s["import_on"]
    lines: list[str] = []
    add = lines.append
    add("## 2. `import transformers`")
    add("")
    add("| variant | min (ms) | median (ms) |")
    add("| --- | --- | --- |")
    for k, label in STARTUP_VARIANTS.items():
        add(f"| {label} | {s['import'][k]['min_ms']:.1f} | {s['import'][k]['median_ms']:.1f} |")
    add("")
    itf = raw["startup"]["importtime_transformers"]
    add(
        f"Installed and unset / without: {s['import_off']['median']:.3f}x (median). GCPATCH=1 / unset: "
        f"{io['median']:.3f}x, +{io['added_ms']:.1f} ms (gcpatch's engine starts at the first framework import). "
        "`-X importtime` attributes "
        f"{itf['median_ms']:.0f} ms to gcpatch's imports there; the heaviest modules gcpatch imports itself: "
        + ", ".join(f"`{n}` {ms:.1f} ms" for n, ms in itf["heavy"])
        + ". "
        f"Measured inside the enable-call processes: `import transformers` "
        f"{e['import_transformers_ms']['off']:.0f} -> {e['import_transformers_ms']['on']:.0f} ms, and "
        f"`from transformers import LlamaForCausalLM` (torch, modeling_utils, the patches installed) "
        f"{e['import_modeling_ms']['off']:.0f} -> {e['import_modeling_ms']['on']:.0f} ms; both together "
        f"{e['import_total_ms']['off']:.0f} -> {e['import_total_ms']['on']:.0f} ms "
        f"({e['import_total_ms']['added']:+.0f} ms; medians of {e['import_total_ms']['n']} processes each, so "
        "noisy at this scale)."
    )
    add("")
    return lines


def _enable_section(raw: dict, s: dict) -> list[str]:
    """3. The enable call."""
    e = s["enable"]
    lines: list[str] = []
    add = lines.append
    add("## 3. The enable call")
    add("")
    add(
        "`activation_checkpointing_enable()` (transformers 5.x; `gradient_checkpointing_enable()` on 4.x), asking "
        "nothing, in processes with GCPATCH unset and GCPATCH=1, interleaved."
    )
    add("")
    add("| call | without gcpatch (ms) | with gcpatch (ms) | added (ms) | n |")
    add("| --- | --- | --- | --- | --- |")
    rows = [
        ("first enable in the process (tiny model)", "first_enable_ms"),
        ("each further tiny model's first enable (median)", "tiny_enable_ms"),
        ("8-layer model of section 4 (median)", "small_enable_ms"),
        ("the same tiny model enabled again (a Trainer re-enable; median)", "again_enable_ms"),
    ]
    for label, key in rows:
        x = e[key]
        add(f"| {label} | {x['off']:.3f} | {x['on']:.3f} | {x['added']:+.3f} | {x['n']} |")
    add("")
    add(
        f"Tiny model: LlamaConfig({', '.join(f'{k}={v}' for k, v in TINY.items())}). gcpatch's added time "
        "includes its one INFO line on stderr per decision."
    )
    add("")
    return lines


def _step_section(raw: dict, s: dict) -> list[str]:
    """4. Training step time."""
    eval_row = next((r for r in s["cases"] if r["setup"] == "eval"), None)
    lines: list[str] = []
    add = lines.append
    m = raw["config"]["model"]
    add("## 4. Training step time")
    add("")
    add(
        f"LlamaForCausalLM, random init: {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, intermediate "
        f"{m['intermediate_size']}, {m['num_attention_heads']} heads, vocab {m['vocab_size']} "
        f"({raw['cases']['params'] / 1e6:.1f} M parameters, attention `{raw['cases']['attn']}`), batch "
        f"{raw['config']['batch']} x seq {raw['config']['seq']}, fp32 on CPU. One step = forward with labels, "
        f"backward, AdamW. Per set-up the variants run {raw['config']['steps']} timed rounds (after "
        f"{raw['config']['warmup']} warm-up) interleaved in one process; ratios are medians of per-round ratios."
    )
    add("")
    add(
        "| set-up | gcpatch applied | same choice by hand | gcpatch / same (s/step) | ratio | hooks added | reentrant / non-reentrant |"
    )
    add("| --- | --- | --- | --- | --- | --- | --- |")
    for r in s["cases"]:
        applied = ", ".join(f"{k}={v}" for k, v in r["gcpatch_applied"].items())
        rr = (
            f"{r['reentrant_ratio']:.3f}x"
            if "reentrant_ratio" in r
            else "n/a (reentrant is wrong here)"
            if r["setup"] == "lora_embeds"
            else "n/a"
        )
        add(
            f"| {r['label']} | {applied} ({'+'.join(r['rules'])}) | {VARIANT_TEXT[r['same']]} | "
            f"{r['step_med']['gcpatch']:.3f} / {r['step_med'][r['same']]:.3f} | {r['step_ratio']:.3f}x | "
            f"{r['hooks_added']} | {rr} |"
        )
    full = next((r for r in s["cases"] if r["setup"] == "full"), None)
    add("")
    if full and "ckpt_overhead" in full:
        add(
            f"Checkpointing itself (full fine-tune, non-reentrant / no checkpointing): "
            f"{full['ckpt_overhead']:.3f}x step time."
        )
        add("")
    if eval_row:
        add(
            f"Eval-mode set-up: without gcpatch the user's step takes {eval_row['step_med']['plain']:.3f} s, "
            "because checkpointing silently does nothing (and saves no memory, section 5)."
        )
        add("")
    rr_rows = [r for r in s["cases"] if "reentrant_ratio" in r]
    if rr_rows and s.get("reentrant_pooled"):
        text = ", ".join(f"{r['setup']} {r['reentrant_ratio']:.3f}x" for r in rr_rows)
        lo, hi = s["reentrant_pooled_ci"]
        pooled = s["reentrant_pooled"]
        if lo <= 1.0 <= hi:
            verdict_text = (
                "Not measurably, here: the interval contains 1.0 (on CPU, this model, this noise)."
            )
        elif hi < 1.0:
            verdict_text = f"Yes, here: reentrant is about {(1 - pooled) * 100:.0f}% faster."
        else:
            verdict_text = f"No, here: reentrant is about {(pooled - 1) * 100:.0f}% slower."
        add(
            f"**Is reentrant faster (Axolotl's claim)?** Reentrant / non-reentrant step time, both by hand, where "
            f"both are correct: per set-up {text}; all {s['reentrant_pooled_n']} interleaved pairs pooled "
            f"{pooled:.3f}x (95% CI {lo:.3f}-{hi:.3f}). {verdict_text}"
        )
        add("")
    add(
        '"hooks added" counts the module hooks and wrapped checkpoint functions a step runs on gcpatch\'s model '
        "beyond the hand-made one (its R2 input-grads hooks when reentrant is kept, its R5 mode-preserving "
        "wrappers); where it is 0 a step runs exactly the same code, and the ratio is noise."
    )
    add("")
    return lines


def _bytes_section(raw: dict, s: dict) -> list[str]:
    """5. Saved activation bytes."""
    lines: list[str] = []
    add = lines.append
    add("## 5. Saved activation bytes")
    add("")
    add(
        "Bytes packed by `torch.autograd.graph.saved_tensors_hooks` during the forward (numel x element_size of "
        'every saved tensor that is not a parameter or buffer; MiB). "distinct" counts each storage once '
        "(a tensor saved by several ops). The floor is what checkpointing every layer must keep: each "
        "layer's input plus everything saved outside the layers (measured on the model without "
        "checkpointing). Correct = every trainable parameter's gradient matches the model without "
        "checkpointing."
    )
    add("")
    add("| set-up | variant | saved MiB | distinct MiB | correct | vs floor |")
    add("| --- | --- | --- | --- | --- | --- |")
    for c, r in zip(raw["cases"]["cases"], s["cases"]):
        v = c["variants"]
        order = [
            k
            for k in (
                "none",
                "plain",
                "hand-R",
                "hand-NR",
                "hand-train-R",
                "hand-train-NR",
                "gcpatch",
            )
            if k in v
        ]
        for k in order:
            x = v[k]
            if x["correct"]:
                ok = "yes"
            elif x["error"]:
                ok = f"**no**: backward fails ({x['error'][:60]})"
            else:
                ok = f"**no**: {x['wrong_grads']} of {x['trainable']} gradients wrong"
            label = VARIANT_TEXT[k] + (" **(best correct hand choice)**" if k == r["best"] else "")
            add(
                f"| {c['label'] if k == order[0] else ''} | {label} | {mib(x['packed'])} | {mib(x['unique'])} | {ok} | "
                f"{x['packed'] / r['floor']:.2f}x |"
            )
        add(f"| | theoretical floor | {mib(r['floor'])} | | | 1.00x |")
    add("")
    add("| set-up | gcpatch / best correct hand choice | gcpatch / floor |")
    add("| --- | --- | --- |")
    for r in s["cases"]:
        br = f"{r['bytes_ratio']:.3f}x ({r['best']})" if "bytes_ratio" in r else "n/a"
        add(f"| {r['label']} | {br} | {r['floor_ratio']:.3f}x |")
    add("")
    return lines


def _not_measured(plot_note: str) -> list[str]:
    """What this run could not measure, and the plot."""
    lines: list[str] = []
    add = lines.append
    add("## Not measured")
    add("")
    add(
        "GPU figures (peak CUDA memory and step time on a GPU) are not measured: no GPU was "
        "available to this run. The saved-bytes figures above do not depend on the device; the step-time "
        "ratios on a GPU may differ (kernel launch overhead weighs more there)."
    )
    add("")
    add(f"Plot: `results.png` ({plot_note}).")
    add("")
    return lines


def misses(raw: dict, s: dict) -> list[str]:
    """One line per missed target, with the run's own figures that bear on it (nothing written by
    hand that a later run could contradict)."""
    t, e, st = TARGETS, s["enable"], raw["startup"]
    notes = []
    if s["startup_off"]["median"] > t["startup_off"]:
        pth_ms = st.get("pth_file_us", float("nan")) / 1000
        notes.append(
            f"- start-up, off: {s['startup_off']['median']:.3f}x (min {s['startup_off']['min']:.3f}x, "
            f"per-round {s['startup_off']['paired']:.3f}x); site.py's work for gcpatch.pth measured "
            f"directly: {pth_ms:.3f} ms = {pth_ms / s['startup']['without']['min_ms'] * 100:.2f}% of the "
            f"fastest bare start-up ({s['startup']['without']['min_ms']:.1f} ms)."
        )
    if s["startup_on"]["median"] > t["startup_on"]:
        it = st["importtime"]
        notes.append(
            f"- start-up, GCPATCH=1: {s['startup_on']['median']:.3f}x (min {s['startup_on']['min']:.3f}x); "
            f"-X importtime: {it['median_ms']:.2f} ms in "
            + ", ".join(it["modules"])
            + "; heaviest: "
            + ", ".join(f"{n} {ms:.2f} ms" for n, ms in it["heavy"])
            + "."
        )
    if e["first_enable_ms"]["added"] > t["enable_ms"]:
        versions = [
            r["versions_ms"] for r in raw["enable"]["on"] if r.get("versions_ms") is not None
        ]
        notes.append(
            f"- first enable: +{e['first_enable_ms']['added']:.2f} ms (each later model "
            f"+{e['tiny_enable_ms']['added']:.2f} ms, the same model again +{e['again_enable_ms']['added']:.2f} ms); "
            f"version look-up {med(versions):.2f} ms of it. It is where gcpatch's plugins load (pluggy, the "
            f"entry points, the plugins and the modules that decide): at the first call through a patch point, "
            f"not at the framework's import, which costs +{s['import_on']['added_ms']:.1f} ms with GCPATCH=1; "
            f"the two together +{s['import_on']['added_ms'] + e['first_enable_ms']['added']:.1f} ms per process."
        )
    elif e["tiny_enable_ms"]["added"] > t["enable_ms"]:
        notes.append(f"- enable: +{e['tiny_enable_ms']['added']:.2f} ms per model.")
    if s["step_pooled"] > t["step"]:
        zero = [r["setup"] for r in s["cases"] if r["hooks_added"] == 0]
        notes.append(
            f"- step time: {s['step_pooled']:.3f}x (95% CI {s['step_pooled_ci'][0]:.3f}-"
            f"{s['step_pooled_ci'][1]:.3f}); set-ups where gcpatch's model runs the same code as the hand-made "
            f"one (0 hooks added): {', '.join(zero) or 'none'}."
        )
    if s["bytes_worst"] > t["bytes"]:
        worst = max((r for r in s["cases"] if "bytes_ratio" in r), key=lambda r: r["bytes_ratio"])
        notes.append(
            f"- saved bytes: {s['bytes_worst']:.3f}x in {worst['label']} against {worst['best']} (section 5)."
        )
    if s.get("eval", 0) > t["eval"]:
        notes.append(f"- eval mode: {s['eval']:.3f}x (section 5).")
    return notes


def plot(raw: dict, s: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    cases = raw["cases"]["cases"]
    short = {
        "full": "full FT",
        "full_reentrant": "full FT\nasks reentrant",
        "lora": "LoRA-like\nasks reentrant",
        "lora_embeds": "LoRA-like\ninputs_embeds",
        "eval": "left in\neval mode",
    }
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    kinds = [
        ("none", "no checkpointing", "#bbbbbb"),
        ("plain", "plain set-up", "#e07b39"),
        ("best", "best correct hand choice", "#4c72b0"),
        ("gcpatch", "gcpatch", "#55a868"),
    ]
    width = 0.2
    for i, (c, r) in enumerate(zip(cases, s["cases"])):
        for j, (kind, label, color) in enumerate(kinds):
            key = r["best"] if kind == "best" else kind
            if key is None:
                continue
            x = c["variants"][key]
            bar = ax1.bar(
                i + (j - 1.5) * width,
                x["packed"] / 2**20,
                width,
                color=color,
                label=label if i == 0 else None,
                hatch=None if x["correct"] else "//",
                edgecolor="black" if not x["correct"] else None,
            )
            if not x["correct"]:
                ax1.annotate(
                    "wrong",
                    (bar[0].get_x() + width / 2, x["packed"] / 2**20),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=90,
                )
        ax1.hlines(
            r["floor"] / 2**20,
            i - 2 * width,
            i + 2 * width,
            colors="black",
            linestyles="--",
            label="floor" if i == 0 else None,
        )
    ax1.set_xticks(
        range(len(cases)), [short.get(c["setup"], c["setup"]) for c in cases], fontsize=8
    )
    ax1.set_ylabel("saved activations (MiB)")
    ax1.set_title("Saved activation bytes per set-up (hatched: wrong gradients)")
    ax1.legend(fontsize=8)
    order = ["none", "plain", "hand-R", "hand-NR", "hand-train-NR", "hand-train-R", "gcpatch"]
    colors = {
        "none": "#bbbbbb",
        "plain": "#e07b39",
        "hand-R": "#8172b2",
        "hand-NR": "#4c72b0",
        "hand-train-NR": "#4c72b0",
        "hand-train-R": "#8172b2",
        "gcpatch": "#55a868",
    }
    seen = set()
    for i, c in enumerate(cases):
        keys = [k for k in order if k in c["step_s"]]
        for j, k in enumerate(keys):
            vals = c["step_s"][k]
            q = sorted(vals)
            lo, hi = q[len(q) // 4], q[(3 * len(q)) // 4]
            m = med(vals)
            label = VARIANT_TEXT[k].replace("by hand: ", "hand ") if k not in seen else None
            seen.add(k)
            ax2.bar(
                i + (j - (len(keys) - 1) / 2) * width,
                m,
                width,
                color=colors[k],
                label=label,
                yerr=[[m - lo], [hi - m]],
                capsize=2,
            )
    ax2.set_xticks(
        range(len(cases)), [short.get(c["setup"], c["setup"]) for c in cases], fontsize=8
    )
    ax2.set_ylabel("s / training step (median, IQR)")
    ax2.set_title("Training step time per set-up (interleaved)")
    ax2.legend(fontsize=7)
    fig.suptitle(
        f"gcpatch {raw['env']['gcpatch']}, transformers {raw['env']['transformers']}, "
        f"torch {raw['env']['torch']}, CPU",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "memory and step time per set-up"
