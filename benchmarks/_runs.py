"""What the benchmarks that time a user's own training loop in fresh processes share
(budget_first_steps.py, verify_cost.py): their plans (a Llama from a config, batch, steps, rounds),
the worker's model, optimizer and batch, one fresh process per run, variants interleaved round by
round, and the command line that writes the JSON and the markdown. Nothing of gcpatch is imported
here; torch and transformers only inside the worker (and for the versions the table quotes)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent


def llama(
    layers: int,
    hidden: int,
    intermediate: int,
    kv_heads: int,
    vocab: int,
    positions: int,
    dropout: float,
) -> dict:
    """LlamaConfig's keywords (4 attention heads), in the order the JSON records them."""
    return dict(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        attention_dropout=dropout,
    )


def plan(rounds: int, steps: int, batch: int, seq: int, model: dict) -> dict:
    return dict(rounds=rounds, steps=steps, batch=batch, seq=seq, model=model)


def smoke(dropout: float) -> dict:
    """The --smoke plan: one round of three steps on a 2-layer Llama, batch 2 x 16 tokens."""
    return plan(1, 3, 2, 16, llama(2, 32, 64, 2, 64, 64, dropout))


def user_model(cfg: dict, threads: int | None = None, **config):
    """In the worker: the user's Llama of `cfg["model"]` (untied, `config` added) from seed 0, in
    training mode with `gradient_checkpointing_enable()`, AdamW, and the batch of token ids (seed
    1); warnings silenced, `threads` torch threads if given."""
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(tie_word_embeddings=False, **config, **cfg["model"])
    ).train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["model"]["vocab_size"], (cfg["batch"], cfg["seq"]), generator=gen)
    return model, opt, ids


def fresh_process(script: str, cfg: dict, env: dict[str, str], timeout: float):
    """`script --worker CFG` in a fresh interpreter from `/` (the installed gcpatch, never a
    checkout's), with the caller's environment less its GCPATCH* variables, GCPATCH=1, offline, and
    `env` added: the worker's JSON line, and its stderr."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("GCPATCH")}
    child.update(GCPATCH="1", HF_HUB_OFFLINE="1", **env)
    proc = subprocess.run(
        [sys.executable, script, "--worker", json.dumps(cfg)],
        env=child,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def interleaved(rounds: int, names: tuple, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """`rounds` runs of each variant, alternating round by round, the first of each round taking
    turns."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(run(name))
    return runs


def meta(start: float) -> str:
    """The table's line on when, where and with what it was measured."""
    import torch  # noqa: F401 (versions only)
    import transformers

    return (
        f"Measured {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {sys.modules['torch'].__version__}, transformers "
        f"{transformers.__version__}, {os.cpu_count()} CPUs shared with other jobs, no GPU; {time.time() - start:.0f} s."
    )


def main(
    worker: Callable[[dict], dict],
    run: Callable[[dict, str], dict],
    plans: tuple[dict, dict],
    variants: tuple[str, str],
    summarize: Callable[[dict, dict], dict],
    section: Callable[[dict, dict, str], str],
    outputs: tuple[str, str],
) -> None:
    """`--worker CFG`: one worker's run (`worker(CFG)`), its JSON on stdout. Otherwise the plan
    (`plans`: the full one, or with --smoke the smoke one) run `run(plan, variant)` for each of the
    `variants`, interleaved, summarized and written to `--out` (default: benchmarks/) as the JSON
    and the markdown that `outputs` name; the markdown printed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    cfg = plans[1] if args.smoke else plans[0]
    start = time.time()
    runs = interleaved(cfg["rounds"], variants, lambda name: run(cfg, name))
    summary = summarize(cfg, runs)
    text = section(cfg, summary, meta(start))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / outputs[0]).write_text(
        json.dumps({"config": cfg, "summary": summary, "runs": runs}, indent=1)
    )
    (args.out / outputs[1]).write_text(text)
    print(text)
