"""A tiny Axolotl plugin, named in an Axolotl config the ordinary way:

    plugins:
      - axolotl_grad_dump.GradDumpPlugin

(this directory on PYTHONPATH). It adds a TrainerCallback that, just before the first optimizer step
(after clipping: the configs set max_grad_norm 0), writes every trainable parameter's gradient to
$GRAD_DUMP (JSON), with what the model looked like then: the use_reentrant its checkpointed layers
call torch.utils.checkpoint with, and whether gcpatch was loaded in this process (by the start-up
hook: nothing here imports gcpatch). Ordinary user code.
"""

import json
import os

import _common as c
from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback


def kbit_prep() -> dict:
    """What `peft.utils.other.prepare_model_for_kbit_training` is now: whether gcpatch's wrapper
    stands there and the function inside (Axolotl's embeddings_skip_upcast replaces it with
    `fixed_prepare_model_for_kbit_training`)."""
    import sys

    fn = getattr(sys.modules.get("peft.utils.other"), "prepare_model_for_kbit_training", None)
    inner = getattr(fn, "__wrapped__", fn)
    return {
        "gcpatch": bool(getattr(fn, "_self_gcpatch", False)),
        "function": getattr(inner, "__name__", repr(inner)),
    }


class GradDump(TrainerCallback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.done = False

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.done or model is None:
            return
        self.done = True
        grads, none = {}, []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            if param.grad is None:
                none.append(name)
            else:
                grads[name] = param.grad.detach().float().reshape(-1).tolist()
        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        dump = {
            "step": state.global_step,
            "trainable": len(grads) + len(none),
            "frozen": sum(1 for p in model.parameters() if not p.requires_grad),
            "grad_none": sorted(none),
            "grads": grads,
            "checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in layers),
            "use_reentrant": c.checkpoint_use_reentrant(model),
            "use_cache": getattr(getattr(model, "config", None), "use_cache", None),
            "max_grad_norm": args.max_grad_norm,
            "model_class": type(model).__name__,
            "env_GCPATCH": os.environ.get("GCPATCH"),
            "kbit_prep": kbit_prep(),
            **c.gcpatch_seen(),
        }
        with open(self.path, "w") as handle:
            json.dump(dump, handle)


class GradDumpPlugin(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        path = os.environ.get("GRAD_DUMP")
        return [GradDump(path)] if path else []
