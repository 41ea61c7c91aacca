"""The patch points of each transformers generation: installed exactly once whatever the
import order, invisible to 5.x's dispatch, restored by identity (X1)."""

from __future__ import annotations

import pytest
from packaging.version import Version
from testkit.harness import result_of, run_python
from testkit.subproc import requires_transformers, transformers_version

pytestmark = requires_transformers

TINY = """
from transformers import LlamaConfig, LlamaForCausalLM
def tiny():
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
"""

PROBE = (
    TINY
    + """
import json, gcpatch
from transformers.modeling_utils import PreTrainedModel
names = ["gradient_checkpointing_enable", "activation_checkpointing_enable", "_activation_checkpointing_enable"]
ours = sorted(n for n in names if getattr(vars(PreTrainedModel).get(n), "_self_gcpatch", False))
m = tiny()
m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
# the module that holds the flag: each layer from 4.52 on (GradientCheckpointingLayer), the loop
# owner (LlamaModel) before
layer = next(mod for mod in m.modules() if getattr(mod, "gradient_checkpointing", False))
print("RESULT " + json.dumps({
    "ours": ours,
    "overridden": m._is_overridden("gradient_checkpointing_enable") if hasattr(m, "_is_overridden") else None,
    "decisions": len(gcpatch.decisions()),
    "use_reentrant": layer._gradient_checkpointing_func.keywords["use_reentrant"],
    "checkpointing": bool(layer.gradient_checkpointing),
}))
"""
)


@pytest.mark.parametrize("order", ["gcpatch_first", "transformers_first"])
def test_entry_point_of_the_installed_generation_is_patched_once_in_any_import_order(
    tmp_path, order
):
    code = PROBE if order == "gcpatch_first" else "import transformers.modeling_utils\n" + PROBE
    result = result_of(run_python(code, tmp_path))
    # 5.0-5.22 kept 4.x's single entry point (5.17 added every_n_layers/offload to it); the choke
    # point both public names reach exists from 5.23 on
    expected = (
        ["_activation_checkpointing_enable"]
        if transformers_version() >= Version("5.23")
        else ["gradient_checkpointing_enable"]
    )
    assert result["ours"] == expected
    assert result["overridden"] in (False, None), "wrapping must not reroute 5.x's dispatch (X1)"
    assert result["decisions"] == 1
    assert result["checkpointing"] is True
    assert (
        result["use_reentrant"] is True
    )  # all trainable, input_ids: the user's choice is correct and kept


def test_deactivate_restores_the_originals_by_identity(tmp_path):
    result = result_of(
        run_python(
            """
        import json
        from transformers import modeling_utils as mu, trainer as tr
        names = ["gradient_checkpointing_enable", "gradient_checkpointing_disable",
                 "_activation_checkpointing_enable", "_activation_checkpointing_disable"]
        before = {n: vars(mu.PreTrainedModel).get(n) for n in names}
        train_before = vars(tr.Trainer)["train"]
        import gcpatch
        patched = sum(vars(mu.PreTrainedModel).get(n) is not before[n] for n in names)
        gcpatch.deactivate()
        print("RESULT " + json.dumps({
            "patched": patched,
            "restored": all(vars(mu.PreTrainedModel).get(n) is before[n] for n in names),
            "trainer_restored": vars(tr.Trainer)["train"] is train_before,
        }))
    """,
            tmp_path,
        )
    )
    assert result == {"patched": 2, "restored": True, "trainer_restored": True}


def test_enabling_twice_leaves_one_hook_and_the_same_decision(tmp_path):
    result = result_of(
        run_python(
            TINY
            + """
        import json, gcpatch
        m = tiny()
        emb = m.get_input_embeddings()
        for _ in range(2):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        d = gcpatch.decisions()
        print("RESULT " + json.dumps({
            "embedding_hooks": len(emb._forward_hooks),
            "model_pre_hooks": len(m._forward_pre_hooks),
            "runner_pre_hooks": len(m.model._forward_pre_hooks),
            # the same decision again is a count on the first (record._keep), unless what was
            # applied differs (4.x's R6: "use_cache already False" the second time)
            "same": (len(d) == 1 and d[0].get("repeats") == 1) or (
                d[0]["decision"]["values"] == d[1]["decision"]["values"] and d[0]["rules"] == d[1]["rules"]),
            "applied": d[-1]["applied"],
        }))
    """.replace("\n        ", "\n"),
            tmp_path,
            GCPATCH_LOG="off",
        )
    )
    # one embedding-output hook in all (R2/X2: transformers' own where its enable installs one, which
    # 5.x does on every enable without removing the last, else gcpatch's); on the model one
    # inputs_embeds hook (R2) and one first-forward hook (R5); on the decoder stack that runs the
    # layers (m.model, also the base model) one inputs_embeds hook and one first-forward hook.
    assert result["embedding_hooks"] == 1
    assert result["model_pre_hooks"] == 2
    assert result["runner_pre_hooks"] == 2
    assert result["same"] is True
    assert (
        result["applied"]["use_reentrant"] is True and result["applied"]["input_grads_hook"] is True
    )


def test_first_forward_hook_is_gone_after_the_first_training_step(tmp_path):
    result = result_of(
        run_python(
            TINY
            + """
import json, torch
m = tiny(); m.train()
m.gradient_checkpointing_enable()
# R5's first-forward hooks sit on the model and the stack's runner (R2's input-grads hooks stay:
# 4.x is reentrant)
hooks = lambda: sum(type(h).__name__ == "_FirstForward" for mod in (m, m.model) for h in mod._forward_pre_hooks.values())
before = hooks()
ids = torch.randint(0, 64, (1, 8))
with torch.no_grad():
    m(input_ids=ids)
waiting = hooks()
m(input_ids=ids, labels=ids).loss.backward()
print("RESULT " + json.dumps([before, waiting, hooks()]))
""",
            tmp_path,
            GCPATCH="1",
        )
    )
    assert result == [2, 2, 0]  # a no_grad forward does not count as the first training step


def test_points_armed_by_name_are_the_plugins_own(tmp_path):
    """The engine arms the built-in plugins' points by name at the first framework import, before
    any plugin loads (engine.BUILTIN_POINTS): the same points, copies and release test as the
    plugins declare, so deferring the plugins changes nothing that gets wrapped."""
    result = result_of(
        run_python(
            """
        import importlib, json, sys
        from importlib import metadata
        from gcpatch import engine
        declared, applies = set(), []
        for ep in metadata.entry_points(group="gcpatch.plugins"):
            if not ep.value.startswith("gcpatch_plugins."):
                continue
            plugin = ep.load()
            for p in getattr(plugin, "gcpatch_patch_points", lambda: [])():
                declared.add((ep.name, p.module, p.target, p.copies))
                if p.module.startswith("transformers"):
                    try:
                        module = importlib.import_module(p.module)
                    except ModuleNotFoundError:  # a model this release does not have (X6)
                        continue
                    applies.append([p.target, p.applies(module)])
        armed = {point[:4] for point in engine.BUILTIN_POINTS}
        load_time = engine.LOAD_TIME_POINTS <= {(p[1], p[2]) for p in declared}
        declared = {p for p in declared if (p[1], p[2]) not in engine.LOAD_TIME_POINTS}
        tests = {(m, t): a for _, m, t, _, a in engine.BUILTIN_POINTS}
        armed_applies = [[t, tests[(m, t)] is None or tests[(m, t)](sys.modules[m])]
                         for m, t in [(p[1], p[2]) for p in sorted(declared)]
                         if m.startswith("transformers") and m in sys.modules]
        print("RESULT " + json.dumps({"load_time": load_time, "only_declared": sorted(map(list, declared - armed)),
                                      "only_armed": sorted(map(list, armed - declared)),
                                      "applies": sorted(applies), "armed_applies": sorted(armed_applies)}))
    """,
            tmp_path,
            GCPATCH="0",
        )
    )
    assert (
        result["only_declared"] == [] and result["only_armed"] == [] and result["load_time"] is True
    )
    assert result["applies"] == result["armed_applies"]


def test_a_framework_import_loads_no_plugin_until_a_call(tmp_path):
    """Importing torch and transformers under GCPATCH=1 arms the patch points and loads nothing
    else (no wrapt, no pluggy, no entry-point scan, no plugin, no crash notes); the first enable
    loads the plugins. Every built-in point is a function or method: wrapt's proxy is never
    needed, so wrapt is not imported at all."""
    result = result_of(
        run_python(
            TINY
            + """
        import json, sys
        import torch, transformers.modeling_utils, torch.utils.checkpoint as cp
        loaded = lambda: sorted(m for m in sys.modules if m.startswith(("wrapt", "pluggy", "gcpatch_plugins", "gcpatch.crash_notes",
                                                                        "gcpatch.manager", "gcpatch.pipeline")))
        before, armed = loaded(), getattr(cp.checkpoint, "_self_gcpatch", False)
        m = tiny()
        m.gradient_checkpointing_enable()
        print("RESULT " + json.dumps({"before": before, "armed": armed, "after": loaded(),
                                      "decisions": len(sys.modules["gcpatch"].decisions())}))
    """.replace("\n        ", "\n"),
            tmp_path,
            GCPATCH="1",
        )
    )
    assert result["before"] == [] and result["armed"] is True
    assert "pluggy" in result["after"] and "gcpatch_plugins.transformers" in result["after"]
    assert "gcpatch.crash_notes" in result["after"] and result["decisions"] == 1
    assert not any(m.startswith("wrapt") for m in result["after"]), result["after"]
