"""The model-family table: every family's tiny random model (built from a config, fixed seed) through
the set-ups where checkpointing goes silently wrong, in one interpreter (one start-up for all
families). Ordinary user code: nothing here imports gcpatch.

Per family:
- frozen/<path>: the input front (embeddings, patch or conv stem) frozen, `use_reentrant=True`
  asked, train mode, one forward+backward through each input path the model has; gradients
  compared with the same model without checkpointing.
- trainable/<path>: nothing frozen, `use_reentrant=True`, each input path (`inputs_embeds` is the
  R2 path): gradients against no checkpointing, and the use_reentrant the layers got.
- eval: checkpointing enabled on a model left in eval mode; bytes autograd saves in a grad-enabled
  forward, against the same model in train mode and without checkpointing.
- cache: every config and sub-config with `use_cache` after enabling and after the first
  grad-enabled forward in eval mode; in eval mode, a grad-enabled forward with the config's
  default and with `use_cache=True`: the cache returned.

usage: families.py [FAMILY ...]     prints one line: RESULT {json}
"""

from __future__ import annotations

import sys
import traceback
import warnings

import _common as c
import torch

B, T = 2, 8
V = 64


def _ids(seed=1, vocab=V, length=T):
    return torch.randint(3, vocab, (B, length), generator=torch.Generator().manual_seed(seed))


def _float(shape, seed=2):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _embeds(model, ids):
    return model.get_input_embeddings()(ids).detach()


def _first_float(out, names=("logits", "logits_per_image", "last_hidden_state")):
    for name in names:
        value = getattr(out, name, None)
        if torch.is_tensor(value):
            return value
    raise RuntimeError(f"no float output in {type(out).__name__}")


# ---- builders: (model class, config) from a fixed seed -------------------------------------------------

LM = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _causal(config_cls, model_cls, **extra):
    def build():
        import transformers

        config = getattr(transformers, config_cls)(**{**LM, **extra})
        return getattr(transformers, model_cls)(config)

    return build


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    )


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=V,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        )
    )


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=V,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        )
    )


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return WhisperForConditionalGeneration(
        WhisperConfig(
            vocab_size=V,
            num_mel_bins=8,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=8,
            max_target_positions=32,
            dropout=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            suppress_tokens=[],
            begin_suppress_tokens=[],
        )
    )


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


VISION = dict(
    image_size=16,
    patch_size=8,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
)


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(**VISION, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    )


def _clip():
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=T,
        projection_dim=16,
    )
    return CLIPModel(
        CLIPConfig(
            text_config=text, vision_config={**VISION, "projection_dim": 16}, projection_dim=16
        )
    )


IMAGE_TOKEN = V - 1


def _llava():
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=LlamaConfig(**LM),
        image_token_index=IMAGE_TOKEN,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    return LlavaForConditionalGeneration(config)


# the Qwen VLMs' special tokens: the image placeholder, the vision span's start and end, video
VL_TOKENS = dict(
    image_token_id=IMAGE_TOKEN,
    vision_start_token_id=V - 2,
    vision_end_token_id=V - 3,
    video_token_id=V - 4,
)


# the Qwen VLMs' multimodal rope: temporal, height and width sections of a head's dimensions
MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {
        **LM,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "rope_parameters": {**MROPE},
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            num_heads=4,
            mlp_ratio=2,
            patch_size=2,
            spatial_merge_size=1,
            temporal_patch_size=1,
            in_channels=3,
        ),
        **VL_TOKENS,
        vocab_size=V,
    )
    return Qwen2VLForConditionalGeneration(config)


def _merged_vlm(config_cls, model_cls, rope, **text_extra):
    """A Qwen2-VL successor whose vision tower merges 2 x 2 patches into one token (the released
    models' spatial_merge_size): four pixel rows per placeholder token. `text_extra`: the text
    model's own keys (a MoE's experts)."""

    def build():
        import transformers

        text = {
            **LM,
            "rope_scaling": {"type": "mrope", **rope},
            "rope_parameters": {**rope},
            **text_extra,
        }
        config = getattr(transformers, config_cls)(
            text_config=text,
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=4,
                patch_size=2,
                spatial_merge_size=2,
                temporal_patch_size=1,
                in_channels=3,
                out_hidden_size=32,
                window_size=8,  # Qwen2.5-VL's windowed vision attention
                fullatt_block_indexes=[1],
                num_position_embeddings=16,  # Qwen3-VL's learned vision positions
                deepstack_visual_indexes=[0],
            ),
            **VL_TOKENS,
        )
        return getattr(transformers, model_cls)(config)

    return build


_qwen2_5_vl = _merged_vlm("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", MROPE)
_qwen3_vl = _merged_vlm(
    "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", {**MROPE, "mrope_interleaved": True}
)
_qwen3_vl_moe = _merged_vlm(
    "Qwen3VLMoeConfig",
    "Qwen3VLMoeForConditionalGeneration",
    {**MROPE, "mrope_interleaved": True},
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    # 5.1+'s default; 5.0.0's text config lacks the key its text model reads
    pad_token_id=None,
)
# Qwen3.5: linear-attention (gated delta rule, torch's fallback on a CPU) and full-attention layers
QWEN3_5_ROPE = {**MROPE, "mrope_interleaved": True, "partial_rotary_factor": 1.0}
QWEN3_5_TEXT = dict(
    head_dim=8,
    partial_rotary_factor=1.0,
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_qwen3_5 = _merged_vlm(
    "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", QWEN3_5_ROPE, **QWEN3_5_TEXT
)
_qwen3_5_moe = _merged_vlm(
    "Qwen3_5MoeConfig",
    "Qwen3_5MoeForConditionalGeneration",
    QWEN3_5_ROPE,
    **QWEN3_5_TEXT,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)


def _lora():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**LM))
    return get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            init_lora_weights=False,
        ),
    )


# ---- input paths --------------------------------------------------------------------------------------


def ids_path(model):
    return {"input_ids": _ids()}


def embeds_path(model):
    # the mask too: Qwen2-VL on transformers 4.57 derives its rope positions from ids or the mask
    return {
        "inputs_embeds": _embeds(model, _ids()),
        "attention_mask": torch.ones(B, T, dtype=torch.long),
    }


def seq2seq_ids(model):
    return {"input_ids": _ids(), "decoder_input_ids": _ids(seed=3)}


def seq2seq_embeds(model):
    emb = model.get_input_embeddings()
    return {
        "inputs_embeds": emb(_ids()).detach(),
        "decoder_inputs_embeds": emb(_ids(seed=3)).detach(),
    }


def audio_path(model):
    # Whisper's encoder wants exactly 2 * max_source_positions frames
    return {"input_features": _float((B, 8, 16)), "decoder_input_ids": _ids(seed=3)}


def pixels_path(model):
    return {"pixel_values": _float((B, 3, 16, 16))}


def clip_path(model):
    return {"input_ids": _ids(), "pixel_values": _float((B, 3, 16, 16))}


def _llava_tokens(model):
    cfg = model.config.vision_config
    return (cfg.image_size // cfg.patch_size) ** 2 + 1  # "full" keeps the CLS token


def llava_pixels_full(model):
    n = _llava_tokens(model)
    ids = _ids(vocab=V - 4, length=T + n)
    ids[:, 1 : 1 + n] = IMAGE_TOKEN
    return {"input_ids": ids, "pixel_values": _float((B, 3, 16, 16))}


def _grid_pixels(tokens, patches, **extra):
    """A Qwen VLM's batch: one 4x4-patch image per row (patch 2) between its start and end
    tokens, its `patches` pixel rows (3*1*2*2 values each) flattened across the rows and standing
    for `tokens` placeholders."""
    ids = _ids(vocab=V - 5, length=T + tokens + 2)
    ids[:, 1] = V - 2
    ids[:, 2 : 2 + tokens] = IMAGE_TOKEN
    ids[:, 2 + tokens] = V - 3
    pixels = torch.cat([_float((patches, 3 * 1 * 2 * 2), seed=4 + i) for i in range(B)])
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor([[1, 4, 4]] * B),
        "mm_token_type_ids": (ids == IMAGE_TOKEN).long(),
        **{name: make(ids) for name, make in extra.items()},
    }


def qwen2_vl_pixels(model):
    return _grid_pixels(16, 16)  # merge 1: a token per patch


def merged_vlm_pixels(model):
    # merge 2: a token per 2 x 2 patches. The processor's attention_mask is passed, as a user's
    # batch has it (without one, transformers 4.57-5.2's Qwen3-VL reads its images as packed
    # sequences wherever no cache is built, which checkpointing turns off; gcpatch's X6 hands it
    # a mask of ones there: integration/test_mrope_mask.py)
    return _grid_pixels(4, 16, attention_mask=torch.ones_like)


# ---- what is frozen in the partially frozen set-up: the input front ----------------------------------


def freeze_input_embeddings(model):
    for p in model.get_input_embeddings().parameters():
        p.requires_grad_(False)


def freeze_named(*prefixes):
    def freeze(model):
        for name, p in model.named_parameters():
            if any(name.startswith(pre) for pre in prefixes):
                p.requires_grad_(False)

    return freeze


def freeze_lora(model):
    pass  # get_peft_model froze the whole base already: only the adapters train


# name, label, build, input paths, freeze, has a KV cache
FAMILIES = {
    "llama": (
        "LlamaForCausalLM",
        _causal("LlamaConfig", "LlamaForCausalLM"),
        ids_path,
        embeds_path,
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        _causal("Qwen2Config", "Qwen2ForCausalLM"),
        ids_path,
        embeds_path,
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        _causal("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
        ids_path,
        embeds_path,
    ),
    "mistral": (
        "MistralForCausalLM",
        _causal("MistralConfig", "MistralForCausalLM"),
        ids_path,
        embeds_path,
    ),
    "mixtral": (
        "MixtralForCausalLM (MoE)",
        _causal("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
        ids_path,
        embeds_path,
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        _causal("Gemma2Config", "Gemma2ForCausalLM", head_dim=8),
        ids_path,
        embeds_path,
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        _causal("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8),
        ids_path,
        embeds_path,
    ),
    "phi3": (
        "Phi3ForCausalLM",
        _causal("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
        ids_path,
        embeds_path,
    ),
    "gpt_neox": ("GPTNeoXForCausalLM", _neox, ids_path, embeds_path),
    "gpt2": ("GPT2LMHeadModel", _gpt2, ids_path, embeds_path),
    "t5": ("T5ForConditionalGeneration", _t5, seq2seq_ids, seq2seq_embeds),
    "bart": ("BartForConditionalGeneration", _bart, seq2seq_ids, seq2seq_embeds),
    "whisper": ("WhisperForConditionalGeneration", _whisper, audio_path),
    "bert": ("BertForMaskedLM", _bert, ids_path, embeds_path),
    "vit": ("ViTForImageClassification", _vit, pixels_path),
    "clip": ("CLIPModel (two towers)", _clip, clip_path),
    "llava": ("LlavaForConditionalGeneration", _llava, llava_pixels_full, embeds_path),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", _qwen2_vl, qwen2_vl_pixels, embeds_path),
    "peft_lora": ("PeftModelForCausalLM (LoRA on Llama)", _lora, ids_path, embeds_path),
}

# Beside the table (its rows and generated doc stay as they are): VLMs whose vision tower merges
# patches, for the budget's cut of flattened images (scripts/budget_families.py) and X6's mask
# (scripts/mrope_mask.py).
MERGED_VLMS = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl, merged_vlm_pixels),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", _qwen3_vl, merged_vlm_pixels),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", _qwen3_vl_moe, merged_vlm_pixels),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", _qwen3_5, merged_vlm_pixels),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", _qwen3_5_moe, merged_vlm_pixels),
}
# every model this script builds, by name: the table's and those beside it
BUILT = {**FAMILIES, **MERGED_VLMS}

FREEZE = {
    "whisper": freeze_named(
        "model.encoder.conv1", "model.encoder.conv2", "model.decoder.embed_tokens"
    ),
    "vit": freeze_named("vit.embeddings"),
    "clip": freeze_named("text_model.embeddings", "vision_model.embeddings"),
    "llava": freeze_named(
        "model.vision_tower", "model.multi_modal_projector", "model.language_model.embed_tokens"
    ),
    "qwen2_vl": freeze_named("model.visual.patch_embed", "model.language_model.embed_tokens"),
    "peft_lora": freeze_lora,
}

PATH_NAMES = {
    ids_path: "input_ids",
    embeds_path: "inputs_embeds",
    seq2seq_ids: "input_ids",
    seq2seq_embeds: "inputs_embeds",
    audio_path: "input_features",
    pixels_path: "pixel_values",
    clip_path: "input_ids+pixel_values",
    llava_pixels_full: "input_ids+pixel_values",
    qwen2_vl_pixels: "input_ids+pixel_values",
}


def build(name):
    torch.manual_seed(0)
    return BUILT[name][1]()


def forward_backward(model, inputs):
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
        loss = _first_float(out).float().pow(2).mean()
    if loss.requires_grad:
        loss.backward()
    return saved[0], loss.requires_grad


def enable(model, **kwargs):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def grads_case(name, path, freeze, reentrant=True):
    ref = build(name)
    if freeze:
        FREEZE.get(name, freeze_input_embeddings)(ref)
    ref.train()
    inputs = path(ref)
    forward_backward(ref, inputs)
    ref_grads = c.trainable_grads(ref)

    model = build(name)
    if freeze:
        FREEZE.get(name, freeze_input_embeddings)(model)
    model.train()
    enable(model, use_reentrant=reentrant)
    error = None
    try:
        forward_backward(model, path(model))
    except Exception as exc:  # a plain reentrant failure may raise instead of dropping gradients
        error = f"{type(exc).__name__}: {exc}"[:200]
    cmp = compare(c.trainable_grads(model), ref_grads)
    frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    return {
        **cmp,
        "frozen_tensors": frozen,
        "error": error,
        "use_reentrant": c.checkpoint_use_reentrant(model),
    }


def compare(got, ref, atol=1e-5):
    """Trainable tensors whose gradient is missing, extra, or differs from the no-checkpointing run
    (a tensor the input path never reaches, e.g. the embedding under inputs_embeds, has none in both)."""
    missing = sorted(n for n in ref if ref[n] is not None and got[n] is None)
    extra = sorted(n for n in ref if ref[n] is None and got[n] is not None)
    differ = sorted(
        n
        for n in ref
        if ref[n] is not None
        and got[n] is not None
        and not torch.allclose(got[n], ref[n], atol=atol, rtol=1e-4)
    )
    wrong = missing + extra + differ
    max_err = max(
        (
            float((got[n] - ref[n]).abs().max())
            for n in ref
            if ref[n] is not None and got[n] is not None
        ),
        default=0.0,
    )
    return {
        "trainable": len(ref),
        "with_grad": sum(1 for g in ref.values() if g is not None),
        "wrong": len(wrong),
        "missing": len(missing),
        "wrong_names": wrong[:4],
        "max_err": max_err,
    }


def eval_case(name, path):
    nogc = build(name).eval()
    saved_nogc, _ = forward_backward(nogc, path(nogc))
    train = build(name).train()
    enable(train)
    saved_train, _ = forward_backward(train, path(train))
    model = build(name).eval()
    enable(model)
    saved_eval, _ = forward_backward(model, path(model))
    return {
        "saved_eval_gc": saved_eval,
        "saved_train_gc": saved_train,
        "saved_eval_nogc": saved_nogc,
        # plain 4.x LoRA: reentrant over a frozen base builds no graph in train mode (saves nothing)
        "ratio_eval_to_train": round(saved_eval / saved_train, 3) if saved_train else None,
        "ratio_eval_to_nogc": round(saved_eval / saved_nogc, 3),
        "model_training": model.training,
    }


def configs_with_cache(config, prefix="config"):
    """Every config object reachable from `config` that has a use_cache attribute."""
    from transformers import PretrainedConfig

    found, seen, todo = {}, set(), [(prefix, config)]
    while todo:
        where, cfg = todo.pop()
        if id(cfg) in seen:
            continue
        seen.add(id(cfg))
        if "use_cache" in vars(cfg) or hasattr(type(cfg), "use_cache"):
            found[where] = getattr(cfg, "use_cache", None)
        for key, value in vars(cfg).items():
            if isinstance(value, PretrainedConfig):
                todo.append((f"{where}.{key}", value))
    return found


def _config_owners(model):
    """Every module with its own config object (a decoder stack's copy, a tower's config)."""
    out, seen = {}, set()
    for mod_name, module in model.named_modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "to_dict"):
            seen.add(id(cfg))
            out.update(configs_with_cache(cfg, f"{mod_name or 'model'}.config"))
    return out


def _cache_state(out):
    if not hasattr(out, "past_key_values"):
        return "n/a"  # the family has no KV cache
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        return "none"
    try:
        lengths = (
            [cache.get_seq_length(i) for i in range(len(cache))]
            if hasattr(cache, "get_seq_length")
            else [len(layer) for layer in cache]
        )
    except Exception:  # noqa: BLE001
        lengths = []
    if hasattr(cache, "self_attention_cache"):
        cache = cache.self_attention_cache
        lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    if not lengths or all(n == 0 for n in lengths):
        return "empty"
    return "full" if all(n > 0 for n in lengths) else "partial"


def stacks(model):
    """Checkpointed blocks per container (encoder/decoder, towers, language model)."""
    out = {}
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) and "." in name:
            container = name.rsplit(".", 1)[0]
            out[container] = out.get(container, 0) + 1
    return out


def cache_case(name, path):
    model = build(name)
    before = _config_owners(model)
    enable(model)
    after = _config_owners(model)
    result = {
        "use_cache_before": before,
        "use_cache_after_enable": after,
        "use_cache_on": sorted(k for k, v in after.items() if v),
        "stacks": stacks(model),
    }
    model.eval()
    inputs = path(model)
    with torch.enable_grad():
        result["cache_default"] = _cache_state(model(**inputs))
        result["use_cache_on_after_forward"] = sorted(
            k for k, v in _config_owners(model).items() if v
        )
        if result["cache_default"] == "n/a":
            result["cache_asked"] = result["cache_asked_nogc"] = "n/a"
            return result
        result["cache_asked"] = _cache_state(model(**inputs, use_cache=True))
    plain = build(name).eval()
    with torch.enable_grad():
        result["cache_default_nogc"] = _cache_state(plain(**path(plain)))
        result["cache_asked_nogc"] = _cache_state(plain(**path(plain), use_cache=True))
    return result


def family(name, only=""):
    label, _, *paths = FAMILIES[name]
    res = {"label": label, "paths": [PATH_NAMES[p] for p in paths]}
    for path in paths:
        if only != "trainable":
            res[f"frozen/{PATH_NAMES[path]}"] = grads_case(name, path, freeze=True)
        res[f"trainable/{PATH_NAMES[path]}"] = grads_case(name, path, freeze=False)
    if only == "trainable":
        return res
    for key, case in (("eval", eval_case), ("cache", cache_case)):
        try:
            res[key] = case(name, paths[0])
        except (
            Exception
        ) as exc:  # plain transformers 4.57 Whisper: reentrant by default crashes in train mode
            traceback.print_exc()
            res[key] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return res


def main(names, only=""):
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    results = {}
    for name in names:
        try:
            results[name] = family(name, only)
        except Exception as exc:  # one family's set-up error must not hide the others' results
            traceback.print_exc()
            results[name] = {"setup_error": f"{type(exc).__name__}: {exc}"[:300]}
    c.emit({"scenario": "families", "only": only, "families": results})


if __name__ == "__main__":
    argv = sys.argv[1:]
    only = argv.pop(argv.index("--only") + 1) if "--only" in argv else ""
    argv = [a for a in argv if a != "--only"]
    main(argv or list(FAMILIES), only)
