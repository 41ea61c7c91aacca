"""The import/patch/unpatch ordering matrix, each in a fresh interpreter: gcpatch before or after
the framework, imported twice, the start-up line run twice, `python -I`, a spawned child,
deactivate and activate again. Every order ends with the enable call wrapped exactly once and R2
deciding (a model with frozen embeddings asking for reentrant keeps it, and its inputs_embeds get
the input-grads hook that makes it exact)."""

from __future__ import annotations

import pytest
from testkit.faultkit import results, run, tally
from testkit.subproc import requires_transformers

pytestmark = requires_transformers

CHECK = """
def check():
    import torch, transformers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
    name = "_activation_checkpointing_enable" if hasattr(PreTrainedModel, "_activation_checkpointing_enable") \\
        else "gradient_checkpointing_enable"
    func, depth = PreTrainedModel.__dict__[name], 0
    while getattr(func, "_self_gcpatch", False):
        depth, func = depth + 1, func.__wrapped__
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).train()
    m.model.embed_tokens.requires_grad_(False)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 64, (2, 8))
    m(inputs_embeds=m.get_input_embeddings()(ids), labels=ids).loss.backward()  # R2's hook: exact under reentrant
    return {"wrapped": depth, "missing_grads": sum(1 for p in m.parameters() if p.requires_grad and p.grad is None)}
"""

ORDERS = {
    "gcpatch first": ("import gcpatch, transformers", {}, []),
    "framework first": ("import transformers, gcpatch", {}, []),
    "imported twice": (
        "import gcpatch, importlib, sys; del sys.modules['gcpatch']; import gcpatch; import transformers",
        {},
        [],
    ),
    "start-up line twice": (
        "import _gcpatch_startup; _gcpatch_startup.bootstrap(); _gcpatch_startup.bootstrap()",
        {"GCPATCH": "1"},
        [],
    ),
    "GCPATCH=1 and import": ("import gcpatch, transformers", {"GCPATCH": "1"}, []),
    "python -I": ("import transformers", {"GCPATCH": "1"}, ["-I"]),
    "deactivate, activate": (
        "import gcpatch, transformers; gcpatch.deactivate(); gcpatch.activate()",
        {},
        [],
    ),
    "spawned child": (
        """
import gcpatch, multiprocessing as mp
def child(q):
    q.put(check())
if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()
    out = q.get(timeout=120); p.join(); print("RESULT " + __import__("json").dumps(out))
    raise SystemExit(0)
""",
        {},
        [],
    ),
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_every_order_patches_once_and_decides(tmp_path, order):
    code, env, args = ORDERS[order]
    script = tmp_path / "user_script.py"  # a file: spawn re-imports the main module
    script.write_text(
        CHECK + "\n" + code + "\nimport json\nif __name__ == '__main__':\n"
        "    print('RESULT ' + json.dumps(check()))\n"
    )
    proc = run(
        f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
        if order != "spawned child"
        else f"import sys, runpy; sys.argv = [{str(script)!r}]; runpy.run_path({str(script)!r}, run_name='__main__')",
        tmp_path,
        args=args,
        **env,
    )
    got = results(proc)
    survived = proc.returncode == 0 and bool(got) and "Traceback" not in proc.stderr
    ok = survived and got[0] == {"wrapped": 1, "missing_grads": 0}
    tally("import/patch order", order, survived, ok, not ok)
    assert survived, proc.stderr[-3000:]
    assert got[0] == {"wrapped": 1, "missing_grads": 0}, (got, proc.stderr[-2000:])
