"""The example third-party plugin (examples/gcpatch-acme) installed as a user would, through its
own pyproject and entry point: gcpatch loads it, its rule votes, and the record names it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from testkit.harness import result_of, run_python
from testkit.subproc import requires_transformers

pytestmark = requires_transformers
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gcpatch-acme"

SCRIPT = """
import json, torch
import gcpatch
from transformers import LlamaConfig, LlamaForCausalLM

class AcmeForCausalLM(LlamaForCausalLM):
    pass

torch.manual_seed(0)
m = AcmeForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2))
m.train()
m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
last = gcpatch.decisions()[-1]
winner = last["decision"]["winners"]["use_reentrant"]
print("RESULT " + json.dumps({"rule": winner["rule"], "plugin": winner["plugin"],
                              "use_reentrant": next(x._gradient_checkpointing_func for x in m.modules() if "_gradient_checkpointing_func" in vars(x)).keywords["use_reentrant"]}))
"""


def test_example_plugin_installs_through_its_entry_point_and_its_rule_votes(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (target / "gcpatch_acme" / "__init__.py").exists()
    result = result_of(run_python(SCRIPT, tmp_path, PYTHONPATH=str(target)))
    assert result == {"rule": "ACME1", "plugin": "acme", "use_reentrant": False}
    without = result_of(
        run_python(SCRIPT, tmp_path)
    )  # the same model without the plugin: the user's choice
    assert without == {"rule": "USER", "plugin": "core", "use_reentrant": True}
