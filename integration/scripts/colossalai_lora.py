"""ColossalAI 0.5 + LoRA + gradient checkpointing, one process on CPU (gloo). Unchanged user
code in the style of ColossalChat's lora_finetune.py: from_pretrained (which leaves the model in eval
mode), optionally model.train(), booster.enable_lora, gradient_checkpointing_enable() with no kwargs,
booster.boost, one forward/backward. Nothing here imports gcpatch.

The reference is the same model with the same LoRA weights (peft.get_peft_model, same seed), in train
mode, without checkpointing and without ColossalAI. The script reports how many LoRA gradients are
missing or differ from it, and the bytes autograd saved in each forward (saved_tensors_hooks).

usage: colossalai_lora.py MODEL_DIR --plugin ddp|hybrid [--train]
prints one line: RESULT {json}
"""

import argparse
import socket
import traceback

import _common as c
import torch

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--plugin", choices=["ddp", "hybrid"], default="ddp")
parser.add_argument("--train", action="store_true", help="call model.train() before boosting")
parser.add_argument(
    "--enable-first",
    action="store_true",
    help="gradient_checkpointing_enable() before booster.enable_lora (peft 0.13's tuner then calls "
    "the base model's forward directly, bypassing its hooks)",
)
args = parser.parse_args()
base = {"plugin": args.plugin, "train_called": args.train, "enable_first": args.enable_first}

try:
    import colossalai
    from colossalai.booster import Booster

    if args.plugin == "ddp":
        from colossalai.booster.plugin import TorchDDPPlugin as Plugin
    else:
        import colossalai.shardformer.modeling.llama  # noqa: F401  (what its Llama policy imports at boost)
        from colossalai.booster.plugin import HybridParallelPlugin as Plugin
except Exception as exc:
    # shardformer's Llama support imports only with the transformers it was written for
    c.emit({**base, "plugin_unavailable": f"{type(exc).__name__}: {exc}"[:300]})
    raise SystemExit(0) from None

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

LORA = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "v_proj"],
    lora_dropout=0.0,
    init_lora_weights=False,
)
ids = torch.randint(3, 400, (2, 32), generator=torch.Generator().manual_seed(1))


def load():
    return AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)


def saved_bytes():
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    return total, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def lora_grads(model):
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            while name.startswith("module."):
                name = name[len("module.") :]
            out[name] = None if param.grad is None else param.grad.detach().clone()
    return out


with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
colossalai.launch(rank=0, world_size=1, host="127.0.0.1", port=port, backend="gloo", verbose=False)

# the reference: no checkpointing, no ColossalAI
reference = load().train()
torch.manual_seed(1)
reference = get_peft_model(reference, LoraConfig(**LORA))
ref_total, ref_hook = saved_bytes()
with ref_hook:
    ref_loss = reference(input_ids=ids, labels=ids).loss
ref_loss.backward()
ref_grads = lora_grads(reference)

# the user's code
plugin = Plugin() if args.plugin == "ddp" else Plugin(tp_size=1, pp_size=1, precision="fp32")
booster = Booster(plugin=plugin)
model = load()
if args.train:
    model.train()
if args.enable_first:
    model.gradient_checkpointing_enable()
torch.manual_seed(1)
model = booster.enable_lora(model, lora_config=LoraConfig(**LORA))
if not args.enable_first:
    model.gradient_checkpointing_enable()
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
user_model = model
model, optimizer, *_ = booster.boost(model, optimizer)

error, total, loss = None, [0], None
try:
    total, hook = saved_bytes()
    with hook:
        out = model(input_ids=ids, labels=ids)
    loss = out.loss if hasattr(out, "loss") else out["loss"]
    booster.backward(loss, optimizer)
except Exception as exc:  # the plain crash of a reentrant checkpoint whose inputs need no grad
    error = f"{type(exc).__name__}: {exc}"
    traceback.print_exc()

got = lora_grads(user_model)
errors = {
    n: (
        float("inf")
        if got.get(n) is None or ref_grads[n] is None
        else (got[n] - ref_grads[n]).abs().max().item()
    )
    for n in ref_grads
}
layers = [m for m in user_model.modules() if hasattr(m, "gradient_checkpointing")]
c.emit(
    {
        **base,
        "error": error,
        "trainable": len(ref_grads),
        "lora_params_in_model": len(got),
        "missing_grads": sum(1 for n in ref_grads if got.get(n) is None),
        "wrong_grads": sum(1 for e in errors.values() if e > 1e-5),
        "max_err": max(errors.values()) if errors else None,
        "loss_diff": None if loss is None else abs(loss.item() - ref_loss.item()),
        "saved_bytes": total[0],
        "saved_bytes_no_gc_ref": ref_total[0],
        "saved_ratio": total[0] / ref_total[0],
        "checkpointing_flags": sorted(
            {f"{type(m).__name__}:{m.gradient_checkpointing}" for m in layers}
        ),
        "use_reentrant": c.checkpoint_use_reentrant(user_model),
        "colossalai": colossalai.__version__,
    }
)
