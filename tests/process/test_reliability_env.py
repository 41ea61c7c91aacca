"""Bad values for every environment variable gcpatch reads, and for the checkpoint arguments:
each gets one line that says exactly what gcpatch does instead, and the job runs. Plugins load
from installed distributions only: a *.dist-info next to the script needs GCPATCH_LOCAL_PLUGINS=1."""

from __future__ import annotations

import pytest
from testkit.faultkit import install_fault_plugin, results, run, tally
from testkit.harness import messages
from testkit.subproc import requires_transformers

TRAIN = """
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).train()
m.model.embed_tokens.requires_grad_(False)
m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": "False"})
ids = torch.randint(0, 64, (2, 8))
m(inputs_embeds=m.get_input_embeddings()(ids), labels=ids).loss.backward()  # frozen features, as a VLM passes them
missing = sum(1 for p in m.parameters() if p.requires_grad and p.grad is None)
print("RESULT " + json.dumps({"missing_grads": missing,
      "use_reentrant": next(x._gradient_checkpointing_func for x in m.modules() if "_gradient_checkpointing_func" in vars(x)).keywords["use_reentrant"]}))
"""

# variable, bad value, the words its one line must hold
BAD = [
    (
        "GCPATCH_MODE",
        "bogus",
        "GCPATCH_MODE='bogus' is not one of fix | warn | strict | off; using fix",
    ),
    (
        "GCPATCH_LOG",
        "loud",
        "GCPATCH_LOG='loud' is not one of debug | info | warning | error | off; using info",
    ),
    (
        "GCPATCH_DISABLE_PLUGINS",
        "trasnformers",
        "GCPATCH_DISABLE_PLUGINS names no installed plugin: trasnformers",
    ),
    ("RANK", "abc", "RANK='abc' is not an integer; gcpatch uses 0"),
    ("WORLD_SIZE", "two", "WORLD_SIZE='two' is not an integer; gcpatch uses 1"),
    (
        "GCPATCH_LOCAL_PLUGINS",
        "maybe",
        "GCPATCH_LOCAL_PLUGINS='maybe' is not an on/off value (1, true, yes or on switch it on;"
        " 0, false, no or off switch it off)",
    ),
    (
        "GCPATCH_VERFY",
        "1",
        "GCPATCH_VERFY is not a gcpatch variable and is ignored; did you mean GCPATCH_VERIFY?",
    ),
    (
        "GCPATCH_BUDGET",
        "0.5",
        "GCPATCH_BUDGET is not a gcpatch variable and is ignored; did you mean",
    ),
    (
        "GCPATCH_MEMORY_BUDGET",
        "lots",
        "GCPATCH_MEMORY_BUDGET='lots' is not a budget: neither a fraction like 0.5 nor a size like 6GiB or 800MB; no budget is applied",
    ),
]


@requires_transformers
def test_every_bad_value_gets_one_line_and_the_job_trains_with_the_rules_applied(tmp_path):
    env = {name: value for name, value, _ in BAD}
    proc = run(TRAIN, tmp_path, GCPATCH="1", **env)
    got = results(proc)
    survived = proc.returncode == 0 and len(got) == 1
    lost = not survived or got[0]["missing_grads"] != 0
    problems = []
    for name, value, words in BAD + [
        ("use_reentrant", "'False'", "use_reentrant='False' is a string, which torch reads as True")
    ]:
        count = sum(1 for line in messages(proc.stderr) if words in line)
        tally("bad values", f"{name}={value}", survived, count == 1, lost)
        if count != 1:
            problems.append((name, count))
    assert survived and not lost, proc.stderr[-3000:]
    # the string is read as True, as torch reads it; R2 still decided (mode fix, transformers plugin not blocked):
    # its inputs_embeds hook keeps that reentrant exact
    assert got[0]["use_reentrant"] is True and got[0]["missing_grads"] == 0
    assert problems == [], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["garbage", "enable"])
def test_a_bad_gcpatch_switch_says_it_stays_off(tmp_path, value):
    proc = run(
        "import gcpatch; print('RESULT {\"active\": %s}' % str(gcpatch.is_active()).lower())",
        tmp_path,
        GCPATCH=value,
    )
    lines = [line for line in messages(proc.stderr) if "GCPATCH=" in line]
    clear = (
        len(lines) == 1 and "stays off, as with GCPATCH=0" in lines[0] and "default" not in lines[0]
    )
    tally("bad values", f"GCPATCH={value}", proc.returncode == 0, clear, False)
    assert proc.returncode == 0 and results(proc) == [{"active": False}]
    assert clear, proc.stderr


IMPORTS_TORCH = "import torch\nprint('RESULT {}')"


def test_variables_set_while_gcpatch_is_unset_get_one_line_at_the_first_framework_import(
    tmp_path,
):
    """The start-up file already reads GCPATCH: with it unset, the other GCPATCH_* variables
    protect nothing, which one line says once a framework is imported (nothing before, so a
    `pip` or a plain script pays no more than the environment's look-up). GCPATCH=0 switched
    gcpatch off on purpose (a comparison run, say): nothing is said."""
    env = {"GCPATCH_MEMORY_BUDGET": "0.5", "GCPATCH_VERIFY": "1"}
    proc = run(IMPORTS_TORCH, tmp_path, **env)
    lines = [line for line in messages(proc.stderr) if line.startswith("gcpatch:")]
    assert results(proc) == [{}], proc.stderr
    assert lines == [
        "gcpatch: GCPATCH_MEMORY_BUDGET, GCPATCH_VERIFY are set but do nothing: gcpatch is off"
        " (GCPATCH unset); set GCPATCH=1 or `import gcpatch`"
    ], proc.stderr
    quiet = run("print('RESULT {}')", tmp_path, **env)  # no framework: nothing said
    assert results(quiet) == [{}] and "gcpatch" not in quiet.stderr, quiet.stderr
    off = run(IMPORTS_TORCH, tmp_path, GCPATCH="0", **env)
    assert results(off) == [{}] and "gcpatch" not in off.stderr, off.stderr


def test_no_line_once_the_script_switches_gcpatch_on_or_only_the_tools_variables_are_set(tmp_path):
    on = run("import gcpatch, torch\nprint('RESULT {}')", tmp_path, GCPATCH_VERIFY="1")
    assert results(on) == [{}] and "is off" not in on.stderr, on.stderr
    tools = run(IMPORTS_TORCH, tmp_path, GCPATCH_CI_STATUS="/tmp/x", GCPATCH_TEST_TIMEOUT_S="9")
    assert results(tools) == [{}] and "gcpatch" not in tools.stderr, tools.stderr


LIST_PLUGINS = """
import json, gcpatch
from gcpatch import engine
print("RESULT " + json.dumps(sorted(s.name for s in engine.start().statuses)))
"""


def test_a_dist_info_next_to_the_script_is_not_loaded_unless_asked(tmp_path):
    install_fault_plugin(
        tmp_path
    )  # faulty_plugin-0.1.dist-info in the working directory, as a stray folder
    plain = run(LIST_PLUGINS, tmp_path, GCPATCH="1")
    opted = run(LIST_PLUGINS, tmp_path, GCPATCH="1", GCPATCH_LOCAL_PLUGINS="1")
    named = [line for line in messages(plain.stderr) if "faulty" in line]
    clear = len(named) == 1 and "GCPATCH_LOCAL_PLUGINS=1" in named[0]
    tally(
        "plugin loading",
        "*.dist-info next to the script",
        plain.returncode == 0,
        clear,
        "faulty" in (results(plain) or [[]])[0],
    )
    assert "faulty" not in results(plain)[0], plain.stderr
    assert clear, plain.stderr
    assert "faulty" in results(opted)[0], opted.stderr


# Values a hostile environment holds (the overflow that once switched gcpatch off whole, NaN,
# digits of another script, empty and blank): each value in its own process, every variable below
# holding it there, so each variable's line is read by its name and one variable's fall-back must not
# take another's feature (or gcpatch) with it.
HOSTILE = ["1e999", "1e300TB", "nan", "\u0661\u0662", "", " \t"]
# What still applies with the variable's feature dropped: the run's correctness rule (R2/R1).
FEATURES = [
    "GCPATCH_MODE",
    "GCPATCH_RECORD",
    "GCPATCH_DISABLE_PLUGINS",
    "GCPATCH_LOG",
    "GCPATCH_VERIFY",
    "GCPATCH_MEMORY_BUDGET",
    "GCPATCH_LOCAL_PLUGINS",
    "GCPATCH_PLUGIN_TIMEOUT_S",
]


def _hostile_run(tmp_path, value):
    where = tmp_path / f"value-{HOSTILE.index(value)}"
    where.mkdir()
    return run(TRAIN, where, GCPATCH="1", **dict.fromkeys(FEATURES, value))


@requires_transformers
@pytest.mark.parametrize("value", HOSTILE, ids=[repr(v) for v in HOSTILE])
def test_a_hostile_value_drops_its_own_feature_with_one_line_and_the_rules_still_apply(
    tmp_path, value
):
    """Before, GCPATCH_MEMORY_BUDGET=1e999MB raised an OverflowError that left gcpatch off whole
    ("not activated"), every correctness rule with it; GCPATCH_VERIFY=2 said nothing."""
    proc = _hostile_run(tmp_path, value)
    got = results(proc)
    survived = proc.returncode == 0 and len(got) == 1 and "Traceback" not in proc.stderr
    lost = not survived or got[0]["missing_grads"] != 0  # the correctness rule still applied
    lines = messages(proc.stderr)
    problems = []
    for name in FEATURES:
        said = [line for line in lines if line.startswith(f"gcpatch: {name}=")]
        # a value gcpatch can use says nothing (a directory named "nan", a plugin "nan" blocked:
        # that one is named by the block list's own line); any other is said once, by name
        usable = name in ("GCPATCH_RECORD", "GCPATCH_DISABLE_PLUGINS") and value.strip()
        clear = len(said) == (0 if usable else 1) and "not activated" not in proc.stderr
        tally("hostile values", f"{name}={value!r}", survived, clear, lost)
        if not (survived and clear and not lost):
            problems.append((name, said))
    assert problems == [], (problems, proc.stderr[-1200:])


def test_a_hostile_gcpatch_switch_leaves_gcpatch_off_with_one_line(tmp_path):
    for value in HOSTILE:
        proc = run(
            "import gcpatch; print('RESULT {\"active\": %s}' % str(gcpatch.is_active()).lower())",
            tmp_path,
            GCPATCH=value,
        )
        said = [line for line in messages(proc.stderr) if line.startswith("gcpatch: GCPATCH=")]
        assert proc.returncode == 0 and results(proc) == [{"active": False}], (value, proc.stderr)
        assert len(said) == 1 and "stays off" in said[0], (value, said)
