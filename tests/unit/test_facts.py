"""Fact gathering (gcpatch/facts.py) in process, on real tiny transformers models built from
configs: what each rule reads is counted from the model as it is, not assumed."""

from __future__ import annotations

import pytest
from packaging.version import Version
from testkit.subproc import requires_transformers

pytestmark = requires_transformers
torch = pytest.importorskip("torch")

from gcpatch import facts  # noqa: E402
from gcpatch.schema import Stage  # noqa: E402


def llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )


def gather(model, **asked):
    return facts.gather(
        model,
        stage=Stage.ENABLE,
        api="gradient_checkpointing_enable",
        source="call",
        asked_kwargs=asked or None,
        asked_from="the test",
    )


def test_parameter_counts_follow_requires_grad():
    model = llama()
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    embed.requires_grad_(False)
    got = gather(model)
    assert (got.trainable_params, got.frozen_params) == (total - embed.numel(), embed.numel())
    assert got.partially_frozen and got.embeddings_trainable is False


def test_zero3_partitioned_parameters_count_their_full_size():
    """Under ZeRO-3 a parameter's data is a 0-element shard; `ds_numel` is its real size."""
    model = llama()
    embed = model.get_input_embeddings().weight
    full = embed.numel()
    embed.data = torch.empty(0)
    embed.ds_numel = full
    embed.requires_grad_(False)
    assert gather(model).frozen_params == full


def test_checkpointed_layers_their_mode_and_whether_they_train():
    model = llama(layers=3)
    # transformers >= 4.52: each decoder layer is a GradientCheckpointingLayer; before, the model
    # that runs the loop carries the flag (one legacy runner over the same three blocks)
    per_layer = facts.is_checkpoint_layer(model.model.layers[0])
    flagged = 3 if per_layer else 1
    got = gather(model)
    assert got.checkpointed_layers == flagged and got.checkpoint_layer_api is per_layer
    # where the checkpoint sits (F2): transformers/modeling_layers.py checkpoints `__call__` from 4.52, `forward` from 5.23
    import transformers

    release = Version(transformers.__version__)
    assert got.checkpoint_site == (
        "loop"
        if release < Version("4.52")
        else "layer_call"
        if release < Version("5.23")
        else "layer_forward"
    )
    assert got.layers_in_eval_mode == 0 and got.trainable_in_checkpointed_layers
    model.eval()
    for layer in model.model.layers:
        layer.requires_grad_(False)
    got = gather(model)
    assert got.layers_in_eval_mode == flagged
    (stack,) = got.stacks
    assert (
        stack["stack"] == "model.layers"
        and stack["blocks"] == 3
        and not stack["trainable_in_blocks"]
    )
    if per_layer:  # a legacy runner also holds the (trainable) embeddings
        assert not got.trainable_in_checkpointed_layers


def test_the_users_ask_is_read_as_torch_reads_it():
    assert gather(llama(), use_reentrant=False).asked_use_reentrant is False
    assert gather(llama()).asked_use_reentrant is None
    # torch reads `if use_reentrant:`: the string "False" asks for reentrant
    assert gather(llama(), use_reentrant="False").asked_use_reentrant is True


def test_every_config_that_holds_use_cache_is_found():
    model = llama()
    assert gather(model).use_cache_configs == {"config": True}
    model.config.use_cache = False
    assert gather(model).use_cache_configs == {"config": False}


def test_torchs_own_checkpoint_is_not_a_custom_function():
    assert gather(llama()).checkpoint_function == ""


def test_versions_are_read_from_imported_modules_only():
    import transformers

    found = facts.versions()
    assert found["transformers"] == transformers.__version__
    assert set(found) == set(facts.VERSIONED)
