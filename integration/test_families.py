"""The model-family table: tiny random models of 19 families (decoder-only, MoE, seq2seq, audio,
encoder-only, vision, two towers, VLMs, a PEFT LoRA model) through every input path they have,
plain and with GCPATCH=1, all families in one interpreter per run (scripts/families.py).

With gcpatch every set-up gets the no-checkpointing gradients, checkpointing takes effect in eval
mode (saved bytes within 10% of train mode), on 5.x the enable leaves every config's
`use_cache` as the user's (transformers' own model code drops the cache in a checkpointed training
forward) and a training forward in eval mode leaves none on (R6 with R5 reaches `text_config` and
T5's decoder copy; on 4.x R6 switches them at the enable), and no forward returns an empty cache where plain transformers returns a full one. The plain run shows the failures. docs/FAMILIES.md and the
docs/USAGE.md's family list are rendered from these same two runs (`python integration/_families.py --write`).
"""

from __future__ import annotations

import re
from importlib import metadata

import pytest
from _families import DOC, FAMILIES, USAGE, readme_block, render
from _run import V5, Spec

SCRIPT = "families.py"
STRICT = Spec(SCRIPT, ("whisper", "clip", "--only", "trainable"), env=(("GCPATCH_MODE", "strict"),))
RUNS = [Spec(SCRIPT), STRICT]


def family(script_runs, name: str, gcpatch: bool) -> dict:
    fam = script_runs.get(SCRIPT, gcpatch=gcpatch).result["families"][name]
    assert "setup_error" not in fam, fam
    return fam


def grad_cases(fam: dict) -> dict:
    return {k: v for k, v in fam.items() if k.startswith(("frozen/", "trainable/"))}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_input_path_gets_the_no_checkpointing_gradients(script_runs, name):
    fam = family(script_runs, name, gcpatch=True)
    cases = grad_cases(fam)
    assert any(k.startswith("frozen/") for k in cases) and any(
        k.startswith("trainable/") for k in cases
    )
    for key, case in cases.items():
        assert case["error"] is None and case["wrong"] == 0, (key, case)
        assert case["with_grad"] > 0, (key, case)
        if key.startswith("trainable/") and name != "peft_lora":
            # nothing frozen upstream of any stack: the user's reentrant choice stands (R1 silent),
            # except where a decoder takes the encoder's output by keyword (transformers 4.57 Whisper)
            assert case["use_reentrant"] is (V5 or name != "whisper"), (key, case)


@pytest.mark.parametrize("name", FAMILIES)
def test_eval_mode_saves_what_train_mode_saves(script_runs, name):
    gc = family(script_runs, name, gcpatch=True)["eval"]
    assert 0.9 <= gc["ratio_eval_to_train"] <= 1.1, gc
    assert gc["model_training"] is False  # R5 leaves the model in the user's mode
    plain = family(script_runs, name, gcpatch=False)["eval"]
    if "error" in plain:  # transformers 4.57 Whisper: its reentrant default crashes in train mode
        assert (
            not V5
            and name == "whisper"
            and "backward through the graph a second time" in plain["error"]
        ), plain
        return
    # plainly nothing is checkpointed (PEFT's input-grads hook even adds the embedding output's graph)
    assert plain["saved_eval_gc"] >= plain["saved_eval_nogc"], plain
    # None: 4.x's reentrant default over PEFT's frozen base builds no graph at all in train mode
    assert plain["ratio_eval_to_train"] is None or plain["ratio_eval_to_train"] > 2, plain


@pytest.mark.parametrize("name", FAMILIES)
def test_use_cache_is_off_in_every_config_and_no_cache_comes_back_empty(script_runs, name):
    cache = family(script_runs, name, gcpatch=True)["cache"]
    plain = family(script_runs, name, gcpatch=False)["cache"]
    if V5:  # the enable keeps the user's value (R6 leaves it to transformers' own model code)
        assert cache["use_cache_on"] == plain["use_cache_on"], (cache, plain)
    else:  # 4.x: R6 at the enable (transformers' own switch logs in every forward)
        assert cache["use_cache_on"] == [], cache
    # a training forward in eval mode: the top config, text_config, decoder copies, towers off
    assert cache["use_cache_on_after_forward"] == [], cache
    assert cache["stacks"], cache
    if cache["cache_default"] != "n/a":
        assert cache["cache_default"] in ("none", "full"), cache  # never empty or partial
        assert cache["cache_asked"] == cache["cache_asked_nogc"] == "full", cache


@pytest.mark.parametrize(
    "name", ["llama", "gemma2", "mixtral", "t5", "llava", "qwen2_vl", "peft_lora"]
)
def test_plain_inputs_embeds_with_reentrant_loses_gradients(script_runs, name):
    plain = grad_cases(family(script_runs, name, gcpatch=False))
    assert plain["frozen/inputs_embeds"]["wrong"] > 0, plain
    assert plain["frozen/inputs_embeds"]["use_reentrant"] is True


@pytest.mark.parametrize(
    "name,case", [("whisper", "frozen/input_features"), ("vit", "frozen/pixel_values")]
)
def test_plain_frozen_stem_with_reentrant_loses_gradients(script_runs, name, case):
    plain = grad_cases(family(script_runs, name, gcpatch=False))
    assert plain[case]["wrong"] > 0 and plain[case]["missing"] > 0, plain


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "t5"])
def test_plain_composite_configs_keep_use_cache_on(script_runs, name):
    # what R6 must reach beyond the top config: VLMs' text_config, T5's decoder copy
    plain = family(script_runs, name, gcpatch=False)["cache"]
    nested = [c for c in plain["use_cache_on"] if c != "model.config"]
    assert nested, plain


COMPOSITE = {
    "llava": ("LlavaForConditionalGeneration", "config.text_config"),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "config.text_config"),
    "t5": ("T5ForConditionalGeneration", "decoder.config"),
}


@pytest.mark.parametrize("name", sorted(COMPOSITE))
def test_composite_configs_are_switched_off_and_recorded_per_config(script_runs, name):
    model_class, nested = COMPOSITE[name]
    run = script_runs.get(SCRIPT, gcpatch=True)
    # 5.x: R6 with R5 at the eval-mode training forward; 4.x: R6 at the enable
    stage = "first_forward" if V5 else "enable"
    switched = [
        r
        for r in run.records()
        if r.get("stage") == stage
        and r["facts"]["model_class"] == model_class
        and "R6" in r["rules"]
    ]
    assert switched and all(r["facts"]["use_cache_configs"][nested] is True for r in switched), (
        switched[:1]
    )
    assert all(
        r["applied"]["use_cache_per_config"][nested] == "use_cache True -> False" for r in switched
    )
    if V5:
        enables = [
            r
            for r in run.records()
            if r.get("stage") == "enable" and r["facts"]["model_class"] == model_class
        ]
        assert enables and not any("R6" in r["rules"] for r in enables), enables[:1]


def test_stacks_are_facts_and_r1_names_the_starved_stack(script_runs):
    run = script_runs.get(SCRIPT, gcpatch=True)
    enables = [r for r in run.records() if r.get("stage") == "enable"]
    clip = [r for r in enables if r["facts"]["model_class"] == "CLIPModel"]
    stacks = {s["stack"] for s in clip[0]["facts"]["stacks"]}
    assert stacks == {"text_model.encoder.layers", "vision_model.encoder.layers"}, clip[0]["facts"][
        "stacks"
    ]
    assert clip[0]["applied"]["checkpointed_stacks"] == {
        "text_model.encoder.layers": "2 of 2 CLIPEncoderLayer",
        "vision_model.encoder.layers": "2 of 2 CLIPEncoderLayer",
    }
    r1 = [r for r in enables if r["decision"]["winners"]["use_reentrant"]["rule"] == "R1"]
    reasons = [r["decision"]["winners"]["use_reentrant"]["reason"] for r in r1]
    assert r1 and all(
        "nothing upstream of them" in why or "as a keyword argument" in why for why in reasons
    ), reasons


def test_whisper_and_clip_unfrozen_keep_reentrant_in_strict_mode(script_runs):
    """Whisper freezes its encoder position embeddings at construction; that is not upstream-only:
    the trainable conv stem feeds the encoder, so R1 has nothing to fix and strict mode must not
    raise on this correct set-up."""
    run = script_runs.get(SCRIPT, *STRICT.args, gcpatch=True, env=dict(STRICT.env))
    fams = run.result["families"]
    if not V5:
        # transformers 4.57's WhisperDecoder passes encoder_hidden_states by keyword: reentrant is
        # not a correct set-up there (plain: "backward through the graph a second time")
        assert (
            "R1" in fams["whisper"]["setup_error"] and "keyword" in fams["whisper"]["setup_error"]
        ), fams["whisper"]
        plain = script_runs.get(SCRIPT, *STRICT.args, gcpatch=False)
        assert "backward through the graph a second time" in str(
            plain.result["families"]["whisper"]
        ), plain.result["families"]["whisper"]
    for name in ("whisper", "clip") if V5 else ("clip",):
        assert "setup_error" not in fams[name], fams[name]
        for key, case in grad_cases(fams[name]).items():
            assert case["use_reentrant"] is True and case["wrong"] == 0 and case["error"] is None, (
                name,
                key,
                case,
            )
    if not V5:
        return
    whisper = [
        r
        for r in run.records()
        if r.get("facts", {}).get("model_class") == "WhisperForConditionalGeneration"
    ]
    assert (
        whisper and whisper[0]["facts"]["partially_frozen"] is True
    )  # embed_positions: frozen by the model
    encoder = next(s for s in whisper[0]["facts"]["stacks"] if s["stack"] == "model.encoder.layers")
    assert encoder["inputs_can_require_grad"] and encoder["trainable_upstream"] > 0, encoder


def test_family_table_doc_is_generated_from_these_runs(script_runs):
    gc, plain = script_runs.get(SCRIPT, gcpatch=True), script_runs.get(SCRIPT, gcpatch=False)
    text = DOC.read_text()
    made_on = re.search(r"on transformers (\S+), torch (\S+)\.", text)
    assert made_on, "docs/FAMILIES.md names no versions"
    here = (metadata.version("transformers"), metadata.version("torch"))
    if made_on.groups() != here:
        pytest.skip(
            f"docs/FAMILIES.md was generated on transformers {made_on.group(1)}, torch"
            f" {made_on.group(2)}"
        )
    assert text == render(gc.result, plain.result), (
        "docs/FAMILIES.md is stale: python integration/_families.py --write"
    )
    assert readme_block(gc.result) in USAGE.read_text(), (
        "docs/USAGE.md's family list is stale: python integration/_families.py --write"
    )
