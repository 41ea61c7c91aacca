"""A third-party gcpatch plugin that misbehaves on demand, for the reliability suite.

Installed by `tests/kit/testkit/faultkit.py` as a real distribution (a *.dist-info with a `gcpatch.plugins`
entry point) on PYTHONPATH. The environment picks the fault:
  FAULT_HOOK  info | patch_points | vote | vote_ddp (only the DDP re-decision) | wrapper | apply |
              import (raises as the module is imported, as an argparse at import does)
  FAULT_KIND  raise | garbage (not even a list) | wrong_type (a list of the wrong things) |
              exit (SystemExit(7)) | sleep (FAULT_SLEEP_S seconds, then a good answer)
  FAULT_RANK  only on this RANK (default: every process)
When no fault applies it is a well-behaved plugin with one patch point (faulty_target.work) and
no votes.
"""

import os
import time

from gcpatch.plugin import REQUIRED, USE_REENTRANT, PatchPoint, PluginInfo, Vote, hookimpl

if os.environ.get("FAULT_HOOK") == "import":
    raise SystemExit(7)  # what an argparse that parses sys.argv at import does


def _env():
    """Read at every call: the hook matrix switches faults inside one process."""
    on = os.environ.get("FAULT_RANK") in (None, "", os.environ.get("RANK", "0"))
    return os.environ.get("FAULT_HOOK", "") if on else "", os.environ.get("FAULT_KIND", "raise")


GARBAGE = {"info": "garbage", "patch_points": {"not": "a list"}, "vote": {"not": "a list"}}
WRONG_TYPE = {
    "info": {"name": "faulty"},
    "patch_points": [42],
    # a string where torch and gcpatch need a bool: "False" would read as True
    "vote": [Vote(USE_REENTRANT, "False", REQUIRED, "F1", "wrong type")],
}


def _fault(hook, good):
    active, kind = _env()
    if active != hook:
        return good
    if kind == "raise":
        raise RuntimeError(f"injected fault in {hook}")
    if kind == "exit":
        raise SystemExit(7)
    if kind == "sleep":
        time.sleep(float(os.environ.get("FAULT_SLEEP_S", "30")))
        return good
    return (GARBAGE if kind == "garbage" else WRONG_TYPE)[hook]


@hookimpl
def gcpatch_plugin_info():
    return _fault("info", PluginInfo(name="faulty", framework="transformers", versions=">=4"))


@hookimpl
def gcpatch_patch_points():
    return _fault(
        "patch_points",
        [PatchPoint("faulty_target", "work", _wrapper, why="the fault kit's own target")],
    )


@hookimpl
def gcpatch_vote(facts):
    if _env()[0] == "vote_ddp" and facts.find_unused_parameters:
        raise RuntimeError("injected fault in the DDP re-decision")
    return _fault("vote", [])


def _wrapper(wrapped, instance, args, kwargs):
    if _env()[0] == "wrapper":
        if _env()[1] == "exit":
            raise SystemExit(7)
        raise RuntimeError("injected fault in a patch-point wrapper")
    return wrapped(*args, **kwargs)


if _env()[0] == "apply":  # a failure inside gcpatch itself, on this rank only
    import gcpatch.apply

    def _broken_apply(*args, **kwargs):
        raise RuntimeError("injected fault in apply")

    gcpatch.apply.apply = _broken_apply
