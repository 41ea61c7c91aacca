"""Memory of transformers' `every_n_layers` and `offload` (5.17+) with gcpatch against the same
settings by hand, without gcpatch: saved-activation bytes, peak RSS growth of the step, and the
gradients against no checkpointing.

    python benchmarks/enable_arguments.py [--out benchmarks/ENABLE_ARGUMENTS.md] [--layers 8]

Each variant runs in a fresh interpreter (GCPATCH=1 or GCPATCH=0; gcpatch must be installed in
this interpreter's environment), one training step of a tiny Llama built from a config. Two
set-ups: a full fine-tune that asks nothing, and a partially frozen model (the embeddings frozen,
the batch as inputs_embeds) that asks use_reentrant=True, where plain transformers drops
gradients and gcpatch applies R1. "by hand" is the same enable call without gcpatch, and for the
frozen set-up also the correct hand choice (use_reentrant=False).

transformers' offloading checkpointer calls `save_on_cpu(pin_memory=True)`, which a CPU-only torch
cannot allocate: every variant (plain and gcpatch) gets it unpinned. On a CPU-only machine
offloading moves nothing (the activations already live in host memory): its figures show what
the pack hooks see, not device memory saved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEQ, BATCH, HIDDEN, VOCAB = 256, 4, 128, 512


def worker(spec: dict) -> dict:
    import resource

    import torch
    import transformers.modeling_utils as mu
    from transformers import LlamaConfig, LlamaForCausalLM

    original = getattr(mu, "save_on_cpu", None)
    if original is not None:  # see the module docstring
        mu.save_on_cpu = lambda pin_memory=False, device_type=None: original(
            pin_memory=False, device_type=device_type
        )
    torch.set_num_threads(1)

    def build():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=4 * HIDDEN,
            num_hidden_layers=spec["layers"],
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
        if spec["setup"] == "frozen":
            for p in model.model.embed_tokens.parameters():
                p.requires_grad_(False)
        return model.train()

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    def batch(model):
        if spec["setup"] == "frozen":
            return {"inputs_embeds": model.get_input_embeddings()(ids).detach(), "labels": ids}
        return {"input_ids": ids, "labels": ids}

    def step(model, count: bool):
        params = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
        saved = {"bytes": 0}

        def pack(t):
            if id(t) not in params:
                saved["bytes"] += t.numel() * t.element_size()
            return t

        inputs = batch(model)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if count:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(**inputs).loss
        else:
            loss = model(**inputs).loss
        loss.backward()
        grow = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        grads = {
            n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()
            if p.requires_grad
        }
        return saved["bytes"], grow * 1024, grads  # ru_maxrss is in KiB on Linux

    model = build()
    if spec["variant"] != "none":
        kwargs = {"use_reentrant": spec["ask"]} if spec["ask"] is not None else None
        model.gradient_checkpointing_enable(
            kwargs, every_n_layers=spec["n"], offload=spec["offload"]
        )
    layers = [
        i
        for i, layer in enumerate(model.model.layers)
        if getattr(layer, "gradient_checkpointing", False)
    ]
    saved, rss, grads = step(model, count=True)
    del model
    reference = build()
    _, _, ref = step(reference, count=False)
    wrong = sorted(
        n
        for n, g in grads.items()
        if g is None or ref[n] is None or not torch.allclose(g, ref[n], atol=1e-5, rtol=1e-4)
    )
    return {
        **spec,
        "saved_bytes": saved,
        "rss_growth_bytes": rss,
        "checkpointed_layers": layers,
        "trainable": len(grads),
        "wrong": len(wrong),
        "gcpatch_loaded": "gcpatch" in sys.modules,
    }


def variants(layers: int) -> list[dict]:
    out = []
    for setup, ask in (("full", None), ("frozen", True)):
        out.append(
            dict(
                setup=setup,
                variant="none",
                ask=None,
                n=1,
                offload=False,
                gcpatch=False,
                layers=layers,
            )
        )
        for n, offload in ((1, False), (2, False), (1, True), (2, True)):
            base = dict(setup=setup, n=n, offload=offload, layers=layers)
            out.append(dict(base, variant="hand", ask=ask, gcpatch=False))
            if setup == "frozen":
                out.append(dict(base, variant="hand-correct", ask=False, gcpatch=False))
            out.append(dict(base, variant="gcpatch", ask=ask, gcpatch=True))
    return out


def run_one(spec: dict) -> dict:
    env = dict(
        os.environ,
        GCPATCH="1" if spec["gcpatch"] else "0",
        HF_HUB_OFFLINE="1",
        GCPATCH_LOG="warning",
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker failed for {spec}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


LABELS = {
    "none": "no checkpointing",
    "hand": "by hand: the same call, no gcpatch",
    "hand-correct": "by hand: use_reentrant=False, no gcpatch",
    "gcpatch": "gcpatch: the same call",
}


def table(results: list[dict], meta: str) -> str:
    mib = 1024 * 1024
    rows = [
        "# every_n_layers and offload: memory with gcpatch vs by hand",
        "",
        "Written by `python benchmarks/enable_arguments.py` (module docstring: what is measured and how).",
        "",
        meta,
        "",
        "Saved = bytes packed by `torch.autograd.graph.saved_tensors_hooks` during the forward (every saved tensor "
        "that is not a parameter or buffer). RSS = growth of the process's peak resident memory over the step "
        "(forward + backward; 0 where the step stayed under an earlier peak). Correct = every trainable "
        "gradient matches the model without checkpointing.",
        "",
        "Offload: transformers' `save_on_cpu` packs the tensors saved inside the checkpointed layers with its "
        "own hook, which this measurement's outer hook does not see; on a CPU-only machine they stay in host "
        "memory either way (compare the RSS column), so the lower saved figure with offload is not memory "
        "saved here. On a GPU they would leave device memory.",
        "",
    ]
    for setup, title in (
        ("full", "Full fine-tune, asks nothing"),
        ("frozen", "Embeddings frozen, inputs_embeds, asks use_reentrant=True"),
    ):
        rows += [
            f"## {title}",
            "",
            "| every_n_layers | offload | variant | checkpointed layers | saved MiB | "
            "vs no checkpointing | peak RSS growth MiB | correct |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        mine = [r for r in results if r["setup"] == setup]
        none = next(r for r in mine if r["variant"] == "none")
        for r in mine:
            n = "-" if r["variant"] == "none" else str(r["n"])
            off = "-" if r["variant"] == "none" else ("yes" if r["offload"] else "no")
            ok = (
                "yes"
                if not r["wrong"]
                else f"**no**: {r['wrong']} of {r['trainable']} gradients wrong"
            )
            rows.append(
                f"| {n} | {off} | {LABELS[r['variant']]} | {len(r['checkpointed_layers'])} of {r['layers']} | "
                f"{r['saved_bytes'] / mib:.2f} | {r['saved_bytes'] / max(none['saved_bytes'], 1):.3f}x | "
                f"{r['rss_growth_bytes'] / mib:.1f} | {ok} |"
            )
        rows.append("")
        pairs = []
        for n, offload in ((1, False), (2, False), (1, True), (2, True)):

            def pick(variant):
                return next(
                    r
                    for r in mine
                    if r["variant"] == variant and r["n"] == n and r["offload"] == offload
                )

            g = pick("gcpatch")
            hand = pick("hand-correct" if setup == "frozen" else "hand")
            pairs.append(
                f"| {n} | {'yes' if offload else 'no'} | {g['saved_bytes'] / max(hand['saved_bytes'], 1):.3f}x "
                f"| {len(g['checkpointed_layers'])} = {len(hand['checkpointed_layers'])} layers |"
            )
        best = (
            "the correct hand choice (use_reentrant=False)"
            if setup == "frozen"
            else "the same call by hand"
        )
        rows += [
            f"gcpatch / {best}:",
            "",
            "| every_n_layers | offload | saved bytes ratio | checkpointed |",
            "| --- | --- | --- | --- |",
            *pairs,
            "",
        ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker")
    parser.add_argument("--out", default=str(HERE / "ENABLE_ARGUMENTS.md"))
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    start = time.time()
    results = [run_one(spec) for spec in variants(args.layers)]
    for r in results:
        assert r["gcpatch_loaded"] == r["gcpatch"], r
    from importlib import metadata

    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "transformers", "gcpatch"))
    meta = (
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, {versions}, CPU only, 1 torch thread; a {args.layers}-layer Llama "
        f"(hidden {HIDDEN}, vocab {VOCAB}), batch {BATCH} x {SEQ} tokens; {len(results)} processes, "
        f"{time.time() - start:.0f} s."
    )
    Path(args.out).write_text(table(results, meta) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
