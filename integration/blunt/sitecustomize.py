"""The blunt fix many training scripts carry, for the side-by-side comparison only: force
`use_reentrant=False` inside `torch.utils.checkpoint.checkpoint`, before anything imports it by
name. Put on PYTHONPATH by integration/_run.py for a Spec with `blunt=True`; never installed."""

import torch.utils.checkpoint as _checkpoint_module

_original = _checkpoint_module.checkpoint


def _forced_non_reentrant(*args, **kwargs):
    kwargs["use_reentrant"] = False
    return _original(*args, **kwargs)


_checkpoint_module.checkpoint = _forced_non_reentrant
