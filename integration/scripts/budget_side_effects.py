"""A layer that keeps state on its module, trained under a memory budget: a 4-layer tiny Llama
(hidden 64, dropout 0) whose MLPs keep an auxiliary loss from their own activations on the module
(`self.l_aux = ...`, as DeepSpeed-MoE's gates do) and whose training loss adds it, four steps of
SGD, checkpointing enabled non-reentrant. Ordinary user code: nothing here imports gcpatch.

  --where last   the loss adds 100 * the last layer's `mlp.l_aux`, read after the forward
  --where first  the same with layer 0's
  --where list   each MLP also appends its aux loss to a list the step clears and sums

The same model, built from the same seed and trained on the same batches, never checkpoints: every
trainable gradient of every step is compared with it. Each MLP counts its own forward calls, step
by step (with full checkpointing a layer's MLP runs twice a step: its forward and the backward's
recompute; a plain layer's once). A step that raises is reported with its error, and the loop
stops there.

usage: budget_side_effects.py --where last|first|list
prints one line: RESULT {json}
"""

import argparse
import os
import warnings

import _common as c
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS, HIDDEN, BATCH, SEQ, STEPS = 4, 64, 2, 64, 4
AUX_WEIGHT = 100.0
LR = 0.05
AUX_LIST: list = []  # --where list: the step's aux losses, appended by the MLPs as they run


def patch_mlp(where: str) -> None:
    """LlamaMLP.forward keeps an auxiliary loss on the module and counts its calls."""
    from transformers.models.llama import modeling_llama

    plain_forward = modeling_llama.LlamaMLP.forward

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        out = plain_forward(self, x)
        self.l_aux = out.float().pow(2).mean()
        if where == "list":
            AUX_LIST.append(self.l_aux)
        return out

    modeling_llama.LlamaMLP.forward = forward


def llama():
    return c.llama_of(c.llama_config(LAYERS, HIDDEN))


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, c.VOCAB, (BATCH, SEQ), generator=gen)


def train(where: str, checkpointing: bool) -> dict:
    model = llama()
    if checkpointing:
        # non-reentrant, asked for: a reentrant checkpoint runs the layer's forward without a graph,
        # so an aux loss kept from it gets no gradient, budget or not
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    mlps = [layer.mlp for layer in model.model.layers]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps, error = [], None
    for step in range(STEPS):
        ids = batch(step)
        opt.zero_grad(set_to_none=True)
        AUX_LIST.clear()
        for mlp in mlps:
            mlp.calls = 0
        try:
            out = model(input_ids=ids, labels=ids)
            if where == "last":
                aux = mlps[-1].l_aux
            elif where == "first":
                aux = mlps[0].l_aux
            else:
                aux = sum(AUX_LIST)
            loss = out.loss + AUX_WEIGHT * aux
            loss.backward()
        except RuntimeError as exc:  # the crash a user meets, reported rather than raised
            error = {
                "step": step + 1,
                "type": type(exc).__name__,
                "message": str(exc)[:300],
                "calls": [mlp.calls for mlp in mlps],
            }
            break
        steps.append(
            {
                "calls": [mlp.calls for mlp in mlps],
                "aux_terms": len(AUX_LIST) if where == "list" else 1,
                "loss": float(loss),
                "grads": c.trainable_grads(model),
            }
        )
        opt.step()
    return {"steps": steps, "error": error}


def compare(got: dict, ref: dict) -> dict:
    """How many trainable tensors differ from the reference beyond fp32 rounding, and by how much."""
    compared = c.compare_grads(got, ref, atol=1e-5)
    return {
        "wrong": compared["wrong"],
        "grad_none": compared["grad_none"],
        "trainable": compared["trainable"],
        "wrong_names": compared["wrong_names"][:6],
        "max_abs_diff": c.max_abs_diff(got, ref),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--where", choices=("last", "first", "list"), default="last")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    patch_mlp(args.where)
    ref = train(args.where, checkpointing=False)
    run = train(args.where, checkpointing=True)
    steps = []
    for step, ref_step in zip(run["steps"], ref["steps"]):
        steps.append(
            {
                "calls": step["calls"],
                "ref_calls": ref_step["calls"],
                "aux_terms": step["aux_terms"],
                "ref_aux_terms": ref_step["aux_terms"],
                "loss": step["loss"],
                "ref_loss": ref_step["loss"],
                **compare(step["grads"], ref_step["grads"]),
            }
        )
    c.emit(
        {
            "scenario": "budget_side_effects",
            "where": args.where,
            "layers": LAYERS,
            "steps_run": len(run["steps"]),
            "steps_planned": STEPS,
            "error": run["error"],
            "ref_error": ref["error"],
            "steps": steps,
            "wrong_total": sum(s["wrong"] for s in steps),
            "mlp_calls_total": sum(sum(s["calls"]) for s in steps),
            "budget": os.environ.get("GCPATCH_MEMORY_BUDGET"),
        }
    )


if __name__ == "__main__":
    main()
