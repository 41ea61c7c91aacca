"""Axolotl 0.19: `axolotl train cfg.yml --launcher python` on a tiny local Llama + tokenizer
(save_pretrained, built here, no hub) and a 16-row alpaca JSONL, 2 steps, plainly and with GCPATCH=1.

- unfrozen_parameters + use_reentrant: true: Axolotl's validator refuses the config plainly; with
  gcpatch the config-time decision (A1 decided by R1) makes it non-reentrant, it trains, and the
  trainable parameters' first-step gradients equal Axolotl's own run without checkpointing
  (captured by the Axolotl plugin scripts/axolotl_grad_dump.py, named in the config; max_grad_norm 0,
  no dropout, same seed). Strict mode refuses it with gcpatch's error naming R1.
- LoRA (use_reentrant: true asked) and QLoRA (no kwargs): train with gcpatch, the rule's choice
  recorded (R1: non-reentrant) and in force at the first optimizer step.

- QLoRA with `embeddings_skip_upcast: true`: Axolotl re-executes peft's `prepare_model_for_kbit_training`
  source and rebinds the result over gcpatch's wrapper; gcpatch wraps the replacement again, says so
  once, and the enable inside it is still decided as peft's.
- The decision lines show on Axolotl's console although its logging set-up hides other libraries' INFO.
- `gradient_checkpointing: false` is final: with gcpatch it trains exactly as Axolotl alone does.

Nine `axolotl train` processes in all (two of them refused at validation), shared by the tests.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("axolotl")

from _asserts import assert_explained  # noqa: E402
from _framework_runs import (
    Pool,
    build_tiny,
    gcpatch_cli,
    max_abs_diff,
    output,
    report,
    run_axolotl,
    tail,
    workers,
)  # noqa: E402

REFUSED_PLAIN = "`use_reentrant` must be false when used with partially frozen model"
# key: (config, gcpatch, extra env)
RUNS = {
    "unfrozen-plain": ("unfrozen_reentrant.yml", False, {}),
    "unfrozen-gcpatch": ("unfrozen_reentrant.yml", True, {}),
    "unfrozen-strict": ("unfrozen_reentrant.yml", True, {"GCPATCH_MODE": "strict"}),
    "unfrozen-nogc-reference": ("unfrozen_nogc.yml", False, {}),
    "unfrozen-nogc-gcpatch": ("unfrozen_nogc.yml", True, {}),
    "lora-gcpatch": ("lora_reentrant.yml", True, {}),
    "qlora-gcpatch": ("qlora.yml", True, {}),
    "skip-upcast-plain": ("qlora_skip_upcast.yml", False, {}),
    "skip-upcast-gcpatch": ("qlora_skip_upcast.yml", True, {}),
}
LAYER1 = 9  # layer 1's tensors: q, k, v, o, gate, up, down, two norms


@pytest.fixture(scope="session")
def ax_runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("axolotl")
    tiny = build_tiny(base / "tiny")
    pool = Pool(workers())
    for i, (key, (config, gcpatch, env)) in enumerate(RUNS.items()):
        pool.submit(
            key,
            lambda c=config, g=gcpatch, e=env, d=base / f"run{i:02d}-{key}": run_axolotl(
                c, tiny, d, g, e
            ),
        )
    yield pool
    report(request, "axolotl", pool)
    pool.close()


def trained(pool: Pool, key: str):
    run = pool.get(key)
    assert run.returncode == 0 and run.result, (
        f"axolotl did not train or dumped no gradients\n{tail(run)}"
    )
    return run


def records(run, stage=None):
    return [r for r in run.records() if stage is None or r.get("stage") == stage]


def _kept_config_decision(enable: dict) -> bool:
    """An enable after the config-time decision keeps its False: the config's value as asked (where
    the model-level facts make R1 a recommendation or silent) or R1 again."""
    won = enable["decision"]["winners"]["use_reentrant"]
    if won["rule"] == "USER":
        return (
            won["value"] is False
            and enable["asked"]["from"] == "TrainingArguments.gradient_checkpointing_kwargs"
        )
    return won["rule"] == "R1" and won["value"] is False


def test_plain_axolotl_refuses_unfrozen_reentrant(ax_runs):
    run = ax_runs.get("unfrozen-plain")
    assert run.returncode != 0, tail(run)
    assert REFUSED_PLAIN in output(run), tail(run)
    assert not run.result  # never reached the first step
    assert run.records() == []  # GCPATCH=0: nothing recorded although GCPATCH_RECORD was set
    # gcpatch said nothing: its name outside any path (the checkout's folder may be named gcpatch)
    assert "gcpatch" not in re.sub(r"\S*/\S*", "", run.stderr).lower(), tail(run)


def test_gcpatch_trains_unfrozen_reentrant_with_reference_gradients(ax_runs):
    run = trained(ax_runs, "unfrozen-gcpatch")
    ref = trained(ax_runs, "unfrozen-nogc-reference")
    r, q = run.result, ref.result
    assert (
        r["env_GCPATCH"] == "1" and r["gcpatch_loaded"] and "site-packages" in r["gcpatch_file"]
    ), r
    assert q["env_GCPATCH"] == "0" and not q["gcpatch_loaded"], q
    assert r["step"] == 0 and r["max_grad_norm"] == 0
    assert r["checkpointing"] is True and r["use_reentrant"] is False
    assert q["checkpointing"] is False
    assert r["trainable"] == q["trainable"] == LAYER1 and r["frozen"] == q["frozen"] > 0
    assert r["grad_none"] == [] and q["grad_none"] == []
    diffs = max_abs_diff(r["grads"], q["grads"])
    assert all(name.startswith("model.layers.1.") for name in diffs), sorted(diffs)
    assert max(diffs.values()) <= 1e-6, diffs
    assert any(abs(v) > 0 for g in q["grads"].values() for v in g)  # a real gradient, not all zeros


def test_gradient_checkpointing_false_stays_off_and_trains_as_without_gcpatch(ax_runs):
    # The user's "off" is final and leaves no trace: no layer checkpoints, the config's use_cache is
    # Axolotl's own, no enable is decided, and the first step's gradients are bit-identical.
    run, ref = (
        trained(ax_runs, "unfrozen-nogc-gcpatch"),
        trained(ax_runs, "unfrozen-nogc-reference"),
    )
    r, q = run.result, ref.result
    assert r["env_GCPATCH"] == "1" and r["gcpatch_loaded"], r
    assert r["checkpointing"] is False and q["checkpointing"] is False
    assert r["use_cache"] == q["use_cache"], (r["use_cache"], q["use_cache"])
    assert r["grad_none"] == q["grad_none"] == [] and r["trainable"] == q["trainable"] == LAYER1
    assert set(max_abs_diff(r["grads"], q["grads"]).values()) == {0.0}
    assert records(run, "enable") == [], records(run)


def test_gcpatch_records_the_config_decision_r1(ax_runs):
    run = trained(ax_runs, "unfrozen-gcpatch")
    config = records(run, "config")
    assert len(config) == 1, records(run)
    rec = config[0]
    assert rec["source"] == "config" and rec["facts"]["trainer"] == "axolotl"
    assert rec["asked"]["use_reentrant"] is True and "axolotl config" in rec["asked"]["from"]
    assert rec["applied"]["use_reentrant"] is False
    assert rec["applied"]["config"] == "gradient_checkpointing_kwargs.use_reentrant True -> False"
    assert rec["decision"]["winners"]["use_reentrant"]["rule"] == "R1"
    assert rec["decision"]["overruled"][0]["rule"] == "USER"
    # every model-level decision that follows keeps the config-time one: the config's False as asked
    # (Axolotl's own input-grads hook serves the frozen upstream there, so R1 need not vote again)
    enables = records(run, "enable")
    assert enables and all(e["applied"]["use_reentrant"] is False for e in enables), enables
    assert all(_kept_config_decision(e) for e in enables), enables
    # fix mode's warning, through Axolotl's logging set-up (which prints only warnings of other loggers)
    assert "[gcpatch]" in output(run) and "R1 overrules your use_reentrant=True" in output(run), (
        tail(run)
    )
    assert_explained(run, "R1", "use_reentrant=False", "(config, config)")


def test_gcpatch_strict_mode_refuses_naming_r1(ax_runs):
    run = ax_runs.get("unfrozen-strict")
    assert run.returncode != 0, tail(run)
    text = output(run)
    assert "GcpatchError" in text and "[R1]" in text, tail(run)
    assert REFUSED_PLAIN not in text  # gcpatch refused first, with its own error
    assert not run.result


@pytest.mark.parametrize("key,adapter", [("lora-gcpatch", "lora"), ("qlora-gcpatch", "qlora")])
def test_gcpatch_lora_and_qlora_train_with_the_rules_choice(ax_runs, key, adapter):
    run = trained(ax_runs, key)
    r = run.result
    assert r["gcpatch_loaded"] and r["checkpointing"] is True
    assert r["use_reentrant"] is False, r["use_reentrant"]  # in force at the first optimizer step
    assert r["model_class"].startswith("PeftModel")
    assert r["trainable"] == 8 and r["grad_none"] == [], r  # q_proj/v_proj A and B in 2 layers
    assert all(any(abs(v) > 0 for v in g) for name, g in r["grads"].items() if "lora_B" in name)
    config = records(run, "config")
    assert len(config) == 1 and config[0]["applied"]["use_reentrant"] is False, config
    assert config[0]["facts"]["peft"] is True and config[0]["facts"]["kbit"] is (adapter == "qlora")
    assert config[0]["decision"]["winners"]["use_reentrant"]["rule"] == "R1"
    enables = records(run, "enable")
    assert enables, records(run)
    final = enables[-1]
    assert final["applied"]["use_reentrant"] is False and _kept_config_decision(final), final
    if (
        adapter == "qlora"
    ):  # the enable inside peft's prepare_model_for_kbit_training is recorded as peft's
        inside = [e for e in enables if e["source"] == "peft.prepare_model_for_kbit_training"]
        assert len(inside) == 1, [e["source"] for e in enables]
        assert inside[0]["facts"]["kbit"] is True
        assert inside[0]["decision"]["winners"]["input_grads_hook"]["rule"] == "P1"
    assert_explained(run, "R1", "use_reentrant=False")


def test_doctor_lists_the_axolotl_plugin():
    proc = gcpatch_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    plugin = [line for line in lines if line.strip().startswith("axolotl:")]
    assert plugin and "active axolotl 0.19" in plugin[0] and "(supports >=0.10,<1)" in plugin[0], (
        proc.stdout
    )
    assert any("axolotl.utils.config.validate_config: live" in line for line in lines), proc.stdout


def test_decision_lines_show_on_axolotl_console(ax_runs):
    """Axolotl's logging set-up (axolotl/logging_config.py) lets only WARNING and above of other
    libraries' loggers through its console handler (on stdout, in its own format): gcpatch's own
    handler prints its INFO lines on stderr, once each, short; a WARNING line (R1 over the user's
    ask in the config) Axolotl's handler shows, and gcpatch's does not repeat it. Axolotl's
    configuration is left as it is."""
    run = trained(ax_runs, "lora-gcpatch")
    lines = [line for line in run.stderr.splitlines() if line.startswith("gcpatch: ")]
    assert "gcpatch: LlamaForCausalLM: use_reentrant=False as asked" in lines, tail(run)
    assert all(len(line) <= 120 for line in lines) and len(lines) == len(set(lines)), lines
    overrule = (
        "gcpatch: tiny (config): R1 overrules your use_reentrant=True -> False (partly frozen"
    )
    both = (run.stdout + "\n" + run.stderr).splitlines()
    shown = [line for line in both if overrule in line]
    assert len(shown) == 1 and "[WARNING] [gcpatch]" in shown[0], tail(run)  # once, Axolotl's
    assert "GCPATCH_MODE=warn keeps it" in shown[0], shown


def test_embeddings_skip_upcast_replacement_is_wrapped_again(ax_runs):
    plain = trained(ax_runs, "skip-upcast-plain")
    run = trained(ax_runs, "skip-upcast-gcpatch")
    # plainly, Axolotl's exec'd copy replaces peft's function; under gcpatch it runs inside gcpatch's wrapper
    assert plain.result["kbit_prep"] == {
        "gcpatch": False,
        "function": "fixed_prepare_model_for_kbit_training",
    }
    assert run.result["kbit_prep"] == {
        "gcpatch": True,
        "function": "fixed_prepare_model_for_kbit_training",
    }
    told = [line for line in output(run).splitlines() if "was rebound by another tool" in line]
    assert len(told) == 1 and "fixed_prepare_model_for_kbit_training" in told[0], tail(
        run
    )  # said once
    # the enable inside Axolotl's replacement is still decided as peft's kbit preparation (P1, R1)
    enables = records(run, "enable")
    inside = [e for e in enables if e["source"] == "peft.prepare_model_for_kbit_training"]
    assert len(inside) == 1 and inside[0]["facts"]["kbit"] is True, [e["source"] for e in enables]
    assert inside[0]["decision"]["winners"]["input_grads_hook"]["rule"] == "P1"
    assert run.result["use_reentrant"] is False and run.result["grad_none"] == [], run.result
    assert plain.result["use_reentrant"] is True  # Axolotl's own default (A2) without gcpatch
