"""Fault injection into every hookspec of a third-party plugin (raise, garbage, wrong type) in fix
and strict mode, through the real entry-point group (tests/kit/testkit/faults/plugin.py).

Fix mode: the job trains, the plugin is dropped or disabled with exactly one line naming it, and
the built-in rules still decide (R1 keeps the gradients right). Strict mode: a GcpatchError naming
the plugin. A failing patch-point wrapper logs once, not on every call.
"""

from __future__ import annotations

import json

import pytest
from testkit.faultkit import FAULTS, install_fault_plugin, results, run, tally
from testkit.harness import messages
from testkit.subproc import requires_transformers

pytestmark = requires_transformers


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_fault_plugin(tmp_path_factory.mktemp("faulty") / "site")


def _matrix(site, tmp_path, mode):
    proc = run(
        f"import runpy; runpy.run_path({str(FAULTS / 'hook_matrix.py')!r}, run_name='__main__')",
        tmp_path,
        GCPATCH="1",
        GCPATCH_MODE=mode,
        PYTHONPATH=site,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    cases = [
        json.loads(line[len("RESULT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(cases) == 14, proc.stdout[-2000:]
    return cases


def test_fix_mode_a_faulty_plugin_costs_nothing_but_one_line(site, tmp_path):
    problems = []
    for case in _matrix(site, tmp_path, "fix"):
        name = f"{case['hook'] or 'control'}/{case['kind'] or '-'}"
        survived = case["error"] is None and case["work"] == [1, 2, 3, 4]
        lost = case["wrong_grads"] != 0  # the built-in R1 must still decide: 0 wrong gradients
        expected_lines = 0 if not case["hook"] else 1
        clear = len(case["faulty_lines"]) == expected_lines and all(
            "faulty" in line and ("disabled" in line or "dropped" in line or "unpatched" in line)
            for line in case["faulty_lines"]
        )
        if case["hook"] == "vote":
            clear = clear and "built-in ones included, still decide" in case["faulty_lines"][0]
        tally("plugin faults (fix)", name, survived, clear, lost)
        if not (survived and clear and not lost):
            problems.append((name, case))
    assert problems == []


def test_strict_mode_raises_one_error_naming_the_plugin(site, tmp_path):
    problems = []
    for case in _matrix(site, tmp_path, "strict"):
        name = f"{case['hook'] or 'control'}/{case['kind'] or '-'}"
        if not case["hook"]:
            ok = case["error"] is None and case["wrong_grads"] == 0
            tally("plugin faults (strict)", name, ok, ok, case["wrong_grads"] != 0)
        else:
            error = case["error"] or ""
            ok = (
                error.startswith("GcpatchError: [plugin:faulty]")
                and "injected fault" in error
                or (error.startswith("GcpatchError: [plugin:faulty]") and case["kind"] != "raise")
            )
            tally("plugin faults (strict)", name, not error.startswith("CRASH"), ok, False)
        if not ok:
            problems.append((name, case))
    assert problems == []


# A user's training step under one injected fault: its gradients against no checkpointing, how
# long the enable took, and gcpatch's lines.
STEP = """
import json, time, warnings, torch
warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM

def llama():
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    m.model.embed_tokens.requires_grad_(False)
    return m.train()

def grads(m, checkpoint):
    seconds = 0.0
    if checkpoint:
        start = time.perf_counter()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        seconds = time.perf_counter() - start
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    m(inputs_embeds=m.get_input_embeddings()(ids), labels=ids).loss.backward()
    return {n: p.grad for n, p in m.named_parameters() if p.requires_grad}, seconds

ref, _ = grads(llama(), False)
got, first = grads(llama(), True)
_, second = grads(llama(), True)  # a later decision
wrong = sum(1 for n in ref if got[n] is None or not torch.allclose(got[n], ref[n]))
print("RESULT " + json.dumps({"wrong": wrong, "first_enable_s": first, "second_enable_s": second}))
"""


def _step(site, tmp_path, **env):
    proc = run(STEP, tmp_path, GCPATCH="1", PYTHONPATH=site, **env)
    lines = [line for line in messages(proc.stderr) if "faulty" in line]
    return proc, lines


def test_a_plugin_that_exits_at_import_costs_one_line_not_the_job(site, tmp_path):
    """An argparse at a plugin's import raises SystemExit: before, the job ended there with its
    code and said nothing."""
    proc, lines = _step(site, tmp_path, FAULT_HOOK="import")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = results(proc)[0]
    assert result["wrong"] == 0  # the built-in rules still decide
    assert len(lines) == 1 and "plugin faulty disabled" in lines[0] and "SystemExit: 7" in lines[0]
    tally("plugin faults (fix)", "import/exit", True, len(lines) == 1, result["wrong"] != 0)


def test_a_slow_plugin_hook_is_said_and_a_hung_one_is_not_waited_for(site, tmp_path):
    slow, slow_lines = _step(
        site, tmp_path, FAULT_HOOK="vote", FAULT_KIND="sleep", FAULT_SLEEP_S="1.5"
    )
    result = results(slow)[0]
    assert slow.returncode == 0 and result["wrong"] == 0, slow.stderr[-3000:]
    assert len(slow_lines) == 1 and "took 1." in slow_lines[0] and "gcpatch_vote" in slow_lines[0]
    hung, hung_lines = _step(
        site,
        tmp_path,
        FAULT_HOOK="vote",
        FAULT_KIND="sleep",
        FAULT_SLEEP_S="120",
        GCPATCH_PLUGIN_TIMEOUT_S="2",
    )
    result = results(hung)[0]
    assert hung.returncode == 0 and result["wrong"] == 0, hung.stderr[-3000:]
    # the first decision waited the limit, then went on without it; a later one does not wait
    assert 2 <= result["first_enable_s"] < 20 and result["second_enable_s"] < 1, result
    assert len(hung_lines) == 1 and "did not return within 2 s" in hung_lines[0], hung_lines
    tally("plugin faults (fix)", "vote/hung", True, len(hung_lines) == 1, result["wrong"] != 0)
