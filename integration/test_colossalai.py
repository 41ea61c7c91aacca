"""ColossalAI 0.5: LoRA through `booster.enable_lora`, `gradient_checkpointing_enable()` with
no kwargs, `booster.boost`, one step, on CPU (one process, gloo), for TorchDDPPlugin and
HybridParallelPlugin(tp_size=1, pp_size=1), with and without `model.train()` (scripts/colossalai_lora.py).

Plainly (transformers 4.x: reentrant by default) both set-ups are silently or loudly wrong: the model
ColossalAI's user leaves in eval mode (from_pretrained) checkpoints nothing (saves ~0% of activations),
and after `model.train()` the reentrant checkpoint of a frozen base crashes ("element 0 of tensors does
not require grad"). With GCPATCH=1 every LoRA parameter gets the no-checkpointing gradient and the
forward saves <= 0.6x the activation bytes of the no-checkpointing run, in both cases.

HybridParallelPlugin imports only with the transformers it was written for (4.51): elsewhere its tests
skip, as the script reports.
"""

from __future__ import annotations

import pytest

pytest.importorskip("colossalai")

from _asserts import assert_explained  # noqa: E402
from _framework_runs import Pool, build_tiny, gcpatch_cli, report, run_script_args, tail, workers  # noqa: E402

SCRIPT = "colossalai_lora.py"
PLUGINS = ("ddp", "hybrid")
TRAIN = (False, True)
CASES = [pytest.param(p, t, id=f"{p}-{'train' if t else 'eval'}") for p in PLUGINS for t in TRAIN]
MAX_SAVED_RATIO = 0.6


def key(plugin: str, train: bool, gcpatch: bool) -> str:
    return f"{plugin}-{'train' if train else 'eval'}-{'gcpatch' if gcpatch else 'plain'}"


@pytest.fixture(scope="session")
def cai_runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("colossalai")
    tiny = build_tiny(base / "tiny")
    pool = Pool(workers())
    for plugin in PLUGINS:
        for train in TRAIN:
            for gcpatch in (True, False):
                k = key(plugin, train, gcpatch)
                args = [str(tiny), "--plugin", plugin] + (["--train"] if train else [])
                pool.submit(
                    k, lambda a=args, g=gcpatch, d=base / k: run_script_args(SCRIPT, a, d, g)
                )
    # the order where the checkpointed model is wrapped after the enable (ddp only): eval and train
    for train in TRAIN:
        for gcpatch in (True, False):
            k = key("ddp", train, gcpatch) + "-enable-first"
            args = [str(tiny), "--plugin", "ddp", "--enable-first"] + (["--train"] if train else [])
            pool.submit(k, lambda a=args, g=gcpatch, d=base / k: run_script_args(SCRIPT, a, d, g))
    yield pool
    report(request, "colossalai", pool)
    pool.close()


def get(pool: Pool, plugin: str, train: bool, gcpatch: bool, suffix: str = ""):
    run = pool.get(key(plugin, train, gcpatch) + suffix)
    assert run.returncode == 0 and run.result, (
        f"script failed or printed no single RESULT line\n{tail(run)}"
    )
    if "plugin_unavailable" in run.result:
        pytest.skip(f"{plugin}: {run.result['plugin_unavailable']}")
    assert run.result["env_GCPATCH"] == ("1" if gcpatch else "0")
    assert run.result["gcpatch_loaded"] is gcpatch, run.result
    return run


@pytest.mark.parametrize("plugin,train", CASES)
def test_gcpatch_lora_gets_reference_gradients_and_saves_activations(cai_runs, plugin, train):
    run = get(cai_runs, plugin, train, gcpatch=True)
    r = run.result
    assert "site-packages" in r["gcpatch_file"]
    assert r["error"] is None, r["error"]
    assert (
        r["trainable"] == r["lora_params_in_model"] == 8
    )  # q_proj/v_proj lora_A, lora_B in 2 layers
    assert r["missing_grads"] == 0 and r["wrong_grads"] == 0, r  # max abs error <= 1e-5
    assert r["loss_diff"] <= 1e-6
    assert r["saved_ratio"] <= MAX_SAVED_RATIO, r
    assert r["use_reentrant"] is False
    enables = [e for e in run.records() if e.get("stage") == "enable"]
    assert enables, run.records()
    assert any("colossalai Booster.boost (C1)" in e["source"] for e in enables), [
        e["source"] for e in enables
    ]
    final = enables[-1]
    assert final["applied"]["use_reentrant"] is False
    assert_explained(run, "use_reentrant=False")


@pytest.mark.parametrize("plugin,train", CASES)
def test_plain_colossalai_lora_checkpointing_fails(cai_runs, plugin, train):
    run = get(cai_runs, plugin, train, gcpatch=False)
    r = run.result
    assert run.records() == [] and "gcpatch: " not in run.stderr
    assert r["use_reentrant"] is True  # transformers 4.x: no kwargs means reentrant
    if train:  # reentrant over a frozen base: the loss has no graph
        assert r["error"] and "element 0 of tensors does not require grad" in r["error"], r
        assert r["missing_grads"] == 8, r
    else:  # left in eval mode: checkpointing silently does nothing
        assert r["error"] is None and r["wrong_grads"] == 0, r
        assert r["saved_ratio"] >= 0.95, r


def test_doctor_lists_the_colossalai_plugin():
    proc = gcpatch_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    plugin = [line for line in lines if line.strip().startswith("colossalai:")]
    assert (
        plugin and "active colossalai 0.5" in plugin[0] and "(supports >=0.4,<0.6)" in plugin[0]
    ), proc.stdout
    assert any("colossalai.booster.booster.Booster.boost: live" in line for line in lines), (
        proc.stdout
    )


@pytest.mark.parametrize(
    "suffix", ["", "-enable-first"], ids=["enable-after-lora", "enable-before-lora"]
)
def test_eval_mode_lora_saves_what_train_mode_saves(cai_runs, suffix):
    """R5 through booster.enable_lora: peft 0.13's tuner calls the base model's `forward` directly,
    so an eval-mode fix armed on the model's own hooks never fires when checkpointing was enabled
    before the LoRA wrap; armed where the decoder layers run, it does, in either order."""
    eval_run = get(cai_runs, "ddp", False, True, suffix).result
    train_run = get(cai_runs, "ddp", True, True, suffix).result
    assert (
        eval_run["error"] is None
        and eval_run["missing_grads"] == 0
        and eval_run["wrong_grads"] == 0
    ), eval_run
    assert abs(eval_run["saved_bytes"] / train_run["saved_bytes"] - 1) <= 0.1, (eval_run, train_run)
    plain = get(cai_runs, "ddp", False, False, suffix).result
    assert plain["saved_ratio"] >= 0.95, plain  # plainly the eval-mode model checkpoints nothing
