"""Every causal-LM family the installed transformers registers (`AutoModelForCausalLM`'s mapping),
tiny and random from its own default config, through the set-ups where checkpointing goes silently
wrong. families.py's table builds 19 families by hand; this reaches the rest the way a user's
script does, through the Auto classes. Ordinary user code: nothing here imports gcpatch.

A family's config is the registry's default with every size key it has shrunk (hidden 32, 4 layers,
4 heads, as many key/value heads, a 64-token vocabulary, no cache), passed to the config's
constructor so that what it derives (head dims, layer patterns) follows. Per family, each against
the same model without checkpointing, `use_reentrant=True` asked, train mode:
- frozen/input_ids, frozen/inputs_embeds: the input embeddings frozen;
- lora: PEFT LoRA on every linear layer (`target_modules="all-linear"`), the base frozen;
- eval: bytes a grad-enabled forward saves in eval mode with checkpointing enabled, over train mode.

With --budget, instead (run under GCPATCH_MEMORY_BUDGET): three SGD steps over 2 x 48 tokens (past
the 32-token sliding window) with checkpointing enabled at the framework's default, the input
embeddings frozen, each step's gradients against the same steps without checkpointing, and what
each forward leaves alive for its backward (counted by a dispatch mode, as the budget tests do)
over the same step's without checkpointing.

A family whose tiny config does not build, or whose forward fails without checkpointing too, is
reported with the reason: a limit of the generic shrinking, not a result.

usage: family_sweep.py [--budget] [MODEL_TYPE ...]     prints one line: RESULT {json}
"""

from __future__ import annotations

import sys
import warnings

import _common as c
import families as f
import torch
from budget_train import HeldBytes

SMALL = dict(
    f.LM,
    # 4 layers: a hybrid's default layer pattern reaches an attention layer; as many key/value
    # heads as heads: multi-head latent attention has no groups
    num_hidden_layers=4,
    num_key_value_heads=4,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=32,
    # other spellings of the same sizes (GPT-2, T5-like, Falcon, Mamba)
    n_embd=32,
    n_layer=4,
    n_head=4,
    n_inner=64,
    n_positions=64,
    d_model=32,
    d_ff=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=4,
    ffn_dim=64,
    hidden_dim=64,
    embed_dim=32,
    rotary_dim=8,
    state_size=8,
    attention_window=8,
    # encoder-decoder stacks (BART, Whisper, PLBart)
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    # mixtures of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    # linear attention
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
LIMIT_PARAMS = 30_000_000  # a default config whose other parts the keys above do not reach
STEPS = 3
BUDGET_IDS = torch.randint(3, f.V, (f.B, 48), generator=torch.Generator().manual_seed(1))


def _shrunk(default) -> dict:
    """The size keys `default` holds as plain values (not properties it derives)."""
    return {
        k: v
        for k, v in SMALL.items()
        if hasattr(default, k)
        and not isinstance(getattr(default, k), (list, dict))
        and not isinstance(getattr(type(default), k, None), property)
    }


def tiny_config(model_type: str):
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = _shrunk(default)
    text = getattr(default, "text_config", None)
    if text is not None and not isinstance(text, (bool, int)):
        kwargs["text_config"] = _shrunk(text)
    # the run without checkpointing builds no cache either, as a checkpointed training forward
    # does (transformers turns it off there): Dory's recurrent per-loop cache computes otherwise
    kwargs["use_cache"] = False
    return AutoConfig.for_model(model_type, **kwargs)


def _model(model_type: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(model_type))


def _lora(model_type: str):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    return get_peft_model(_model(model_type), config)


def _case(name: str, path, freeze: bool) -> dict:
    try:
        case = f.grads_case(name, path, freeze=freeze)
    except Exception as exc:  # the run without checkpointing failed, or the model cannot checkpoint
        return {"unrun": f"{type(exc).__name__}: {exc}"[:160]}
    return {k: case[k] for k in ("wrong", "with_grad", "error", "use_reentrant")}


def _train(model_type: str, checkpointing: bool) -> tuple[list[dict], list[int]]:
    """Each step's trainable gradients and the bytes its forward left alive for the backward."""
    torch.manual_seed(0)
    model = _model(model_type)
    f.freeze_input_embeddings(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    grads, held = [], []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with HeldBytes() as mode:
            loss = f._first_float(model(input_ids=BUDGET_IDS)).float().pow(2).mean()
        held.append(mode.alive())  # the output let go: what the loss's graph keeps
        loss.backward()
        grads.append(c.trainable_grads(model))
        optimizer.step()
    return grads, held


def budget_case(model_type: str) -> dict:
    try:
        reference, plain = _train(model_type, checkpointing=False)
    except Exception as exc:
        return {"unrun": f"{type(exc).__name__}: {exc}"[:160]}
    try:
        grads, held = _train(model_type, checkpointing=True)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200], "wrong": None}
    return {
        "error": None,
        "wrong": [f.compare(g, r)["wrong"] for g, r in zip(grads, reference)],
        "held_fraction": [round(h / p, 3) for h, p in zip(held, plain)],
    }


def _built(model_type: str) -> dict:
    """Why `model_type` cannot be swept ({} when it can): unregistered, unbuilt or too large."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return {"unbuilt": "not registered", "unregistered": True}
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in _model(model_type).parameters())
    except Exception as exc:
        return {"unbuilt": f"{type(exc).__name__}: {exc}"[:160]}
    if params > LIMIT_PARAMS:
        return {"unbuilt": f"{params / 1e6:.0f}M parameters after shrinking"}
    return {}


def sweep(model_type: str) -> dict:
    unbuilt = _built(model_type)
    if unbuilt:
        return unbuilt
    row: dict = {}
    f.BUILT[model_type] = (model_type, lambda: _model(model_type), f.ids_path, f.embeds_path)
    row["frozen/input_ids"] = _case(model_type, f.ids_path, freeze=True)
    row["frozen/inputs_embeds"] = _case(model_type, f.embeds_path, freeze=True)
    lora = f"lora:{model_type}"
    f.BUILT[lora] = (lora, lambda: _lora(model_type), f.ids_path)
    f.FREEZE[lora] = f.freeze_lora
    row["lora"] = _case(lora, f.ids_path, freeze=True)
    try:
        row["eval"] = f.eval_case(model_type, f.ids_path)["ratio_eval_to_train"]
    except Exception as exc:
        row["eval"] = {"unrun": f"{type(exc).__name__}: {exc}"[:160]}
    return row


def main(argv: list[str]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    warnings.filterwarnings("ignore")
    budget = argv[:1] == ["--budget"]
    types = (argv[1:] if budget else argv) or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if budget:
        rows = {t: _built(t) or {"budget": budget_case(t)} for t in types}
    else:
        rows = {t: sweep(t) for t in types}
    c.emit({"families": rows, "budget": budget})


if __name__ == "__main__":
    main(sys.argv[1:])
