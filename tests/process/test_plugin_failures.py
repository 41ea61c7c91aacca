"""A third-party plugin that raises, registered through the real entry-point group: the job
trains with the framework's own behaviour and one log line; strict mode names the culprit
(fail open)."""

from __future__ import annotations

import pytest
from testkit.harness import messages, result_of, run_python
from testkit.subproc import requires_transformers

pytestmark = requires_transformers

PLUGIN = """
import os
from gcpatch.hookspecs import hookimpl
from gcpatch.schema import PluginInfo

WHERE = os.environ.get("RAISE_IN", "")


@hookimpl
def gcpatch_plugin_info():
    if WHERE == "info":
        raise RuntimeError("boom in info")
    return PluginInfo(name="raising", framework="transformers", versions=">=4")


@hookimpl
def gcpatch_patch_points():
    if WHERE == "patch_points":
        raise RuntimeError("boom in patch_points")
    return []


@hookimpl
def gcpatch_vote(facts):
    if WHERE == "vote":
        raise RuntimeError("boom in vote")
    return []
"""

SCRIPT = """
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2))
m.model.embed_tokens.requires_grad_(False); m.train()
m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
ids = torch.randint(0, 64, (2, 8))
m(inputs_embeds=m.get_input_embeddings()(ids), labels=ids).loss.backward()  # frozen features, as a VLM passes them
print("RESULT " + json.dumps({"missing_grads": sum(1 for p in m.parameters() if p.requires_grad and p.grad is None)}))
"""


@pytest.fixture
def plugin_path(tmp_path):
    site = tmp_path / "site"
    (site / "raising_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "raising_plugin.py").write_text(PLUGIN)
    (site / "raising_plugin-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: raising-plugin\nVersion: 0.1\n"
    )
    (site / "raising_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[gcpatch.plugins]\nraising = raising_plugin\n"
    )
    return str(site)


def _lines_naming(stderr: str, word: str) -> list[str]:
    return [line for line in messages(stderr) if word in line]


def test_plugin_raising_while_voting_is_dropped_and_the_built_in_rules_still_decide(
    tmp_path, plugin_path
):
    proc = run_python(SCRIPT, tmp_path, GCPATCH="1", PYTHONPATH=plugin_path, RAISE_IN="vote")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # R2 still applied (reentrant kept, inputs_embeds made to require grad): one bad plugin does not switch it off
    assert result_of(proc)["missing_grads"] == 0
    lines = _lines_naming(proc.stderr, "raising")
    assert (
        len(lines) == 1
        and "boom in vote" in lines[0]
        and "built-in ones included, still decide" in lines[0]
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("hook", ["info", "patch_points"])
def test_plugin_raising_at_load_is_disabled_and_the_others_still_decide(
    tmp_path, plugin_path, hook
):
    proc = run_python(SCRIPT, tmp_path, GCPATCH="1", PYTHONPATH=plugin_path, RAISE_IN=hook)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result_of(proc)["missing_grads"] == 0  # the transformers plugin's R2 still applied
    lines = _lines_naming(proc.stderr, "raising")
    assert len(lines) == 1 and f"boom in {hook}" in lines[0]


@pytest.mark.parametrize("hook", ["info", "patch_points", "vote"])
def test_strict_mode_raises_an_error_naming_the_plugin(tmp_path, plugin_path, hook):
    proc = run_python(
        SCRIPT, tmp_path, GCPATCH="1", GCPATCH_MODE="strict", PYTHONPATH=plugin_path, RAISE_IN=hook
    )
    assert proc.returncode != 0
    assert "GcpatchError: [plugin:raising]" in proc.stderr
    assert f"boom in {hook}" in proc.stderr


def test_blocked_plugin_is_never_loaded(tmp_path, plugin_path):
    proc = run_python(
        SCRIPT,
        tmp_path,
        GCPATCH="1",
        PYTHONPATH=plugin_path,
        RAISE_IN="info",
        GCPATCH_DISABLE_PLUGINS="raising",
    )
    assert proc.returncode == 0
    assert _lines_naming(proc.stderr, "raising") == []
    assert result_of(proc)["missing_grads"] == 0
