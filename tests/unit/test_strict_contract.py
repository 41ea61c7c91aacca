"""Strict mode's contract (docs/HOW-IT-WORKS.md, "Strict mode"): strict never changes on its own what
the user asked or the model's state. Wherever fix mode would change it (use_reentrant over an
explicit ask, R5's eval-mode fix, use_cache, the input-grads hook, a checkpoint call's rewrites),
strict raises GcpatchError naming the rule, what fix mode would change and the user's fix; where
gcpatch only fills in an unset default, agrees with the ask or a recommendation yields to it,
strict proceeds.

One case per deciding rule of every built-in plugin's rule table (a new deciding rule without a case
fails `test_every_deciding_rule_has_a_strict_case`). Each case is a real set-up, run twice: strict
raises with the rule id and the fix; fix mode applies the change, shown by gradients against a run
without checkpointing, bytes saved, or the value applied. The transformers, PEFT and torch rules
run end to end in this process (tiny models, real checkpoint calls). DDP over several processes,
ZeRO-3, Axolotl, ColossalAI, TRL's trainers and FSDP cannot run here: their rules are decided from a
real tiny model's facts with the launcher's or framework's facts set, by the plugins' own votes and
the resolver (their end-to-end runs are in integration/ and tests/process/test_reliability_ranks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_framework_facts import AsInstalled  # noqa: E402
from test_plugin_votes import PLUGINS  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils import checkpoint as torch_checkpoint  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

from gcpatch import apply, decisions, engine, resolve  # noqa: E402
from gcpatch import facts as facts_mod  # noqa: E402
from gcpatch.errors import GcpatchError  # noqa: E402
from gcpatch.manager import PluginHost  # noqa: E402
from gcpatch.schema import INPUT_GRADS_HOOK, USE_REENTRANT, Stage  # noqa: E402

DIM, VOCAB = 16, 64


def _plugin(name: str) -> Any:
    return importlib.import_module(f"gcpatch_plugins.{name}")


def deciding_rules() -> set[str]:
    return {
        rule.id
        for name in PLUGINS
        for rule in _plugin(name).gcpatch_plugin_info().rules
        if not rule.documents
    }


@contextlib.contextmanager
def gcpatch_in(mode: str, monkeypatch: pytest.MonkeyPatch, blocked: str = ""):
    """gcpatch on in this process, in `mode`, as GCPATCH_MODE sets it; off again after."""
    monkeypatch.setenv("GCPATCH_MODE", mode)
    for name in ("GCPATCH_RECORD", "GCPATCH_VERIFY", "GCPATCH_MEMORY_BUDGET", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if blocked:
        monkeypatch.setenv("GCPATCH_DISABLE_PLUGINS", blocked)
    else:
        monkeypatch.delenv("GCPATCH_DISABLE_PLUGINS", raising=False)
    engine.start()
    try:
        yield
    finally:
        engine.stop()


# -- models and steps -------------------------------------------------------------------------


def llama(frozen: tuple[str, ...] = ()) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).train()
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            p.requires_grad_(False)
    return model


IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor | None]:
    loss.backward()
    return {
        n: (None if p.grad is None else p.grad.clone())
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def exact(got: dict, ref: dict) -> int:
    """How many gradients differ from the reference's (a missing one counts)."""
    assert got.keys() == ref.keys()
    return sum(
        1
        for n in ref
        if (got[n] is None) != (ref[n] is None)
        or (got[n] is not None and not torch.allclose(got[n], ref[n], atol=1e-6, rtol=1e-5))
    )


def llama_step(model: nn.Module, embeds: bool = False) -> dict:
    if embeds:  # computed beforehand, as a user passing inputs_embeds does (no module hook runs)
        weight = model.get_input_embeddings().weight.detach().float()
        out = model(inputs_embeds=nn.functional.embedding(IDS, weight), labels=IDS)
    else:
        out = model(input_ids=IDS, labels=IDS)
    return grads(model, out.loss)


class StemConfig(PretrainedConfig):
    model_type = "strict_contract_stem"

    def __init__(self, use_cache: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if use_cache is not None:  # a remote-code config with a KV cache switch
            self.use_cache = use_cache


class Block(GradientCheckpointingLayer):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, hidden_states):
        return hidden_states + torch.tanh(self.fc(hidden_states))


class StemModel(PreTrainedModel):
    """A remote-code style model: a linear stem (no input embeddings), transformers' checkpoint
    layers, a loop in its own forward (not transformers' model code)."""

    config_class = StemConfig
    supports_gradient_checkpointing = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.stem = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        self.post_init()

    def forward(self, features):
        h = self.stem(features)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


FEATURES = torch.randn(2, 4, DIM, generator=torch.Generator().manual_seed(2))


def stem(frozen_stem: bool = False, **config: Any) -> StemModel:
    torch.manual_seed(0)
    model = StemModel(StemConfig(**config)).train()
    model.stem.requires_grad_(not frozen_stem)
    return model


def stem_step(model: StemModel) -> dict:
    return grads(model, model(FEATURES).pow(2).mean())


def enable(model: nn.Module, reentrant: bool | None) -> None:
    kwargs = {} if reentrant is None else {"use_reentrant": reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# -- hand-written checkpoint calls (the torch plugin's rules) ------------------------------------


class Net(nn.Module):
    """A frozen embedding and three trainable blocks a loop checkpoints by a function it is given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.bias_proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)
        self.runs = 0

    def run_block(self, block, h, bias=None):
        self.runs += 1
        out = torch.tanh(block(h))
        return out if bias is None else out + bias

    def forward(self, ckpt: Callable | None):
        h = self.emb(IDS)
        bias = self.bias_proj(torch.ones(DIM))
        for block in self.blocks:
            h = h + (self.run_block(block, h, bias) if ckpt is None else ckpt(self, block, h, bias))
        return self.head(h).pow(2).mean()


def net_grads(ckpt: Callable | None) -> dict:
    net = Net()
    return grads(net, net(ckpt))


def ck1_call(net, block, h, bias):  # h needs no grad: reentrant gives the blocks no gradient
    return torch_checkpoint.checkpoint(block, h, use_reentrant=True).tanh() + bias


def ck3_call(net, block, h, bias):  # selective checkpointing asks for non-reentrant
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context = functools.partial(create_selective_checkpoint_contexts, [])
    out = torch_checkpoint.checkpoint(block, h, use_reentrant=True, context_fn=context)
    return out.tanh() + bias


def ck5_call(net, block, h, bias):  # the shared bias, with a graph, bound by keyword
    h = h.detach().requires_grad_(True) if not h.requires_grad else h
    run = functools.partial(net.run_block, block, bias=bias)
    return torch_checkpoint.checkpoint(run, h, use_reentrant=True)


def ck7_call(net, block, h, bias):  # a dict back: reentrant tracks only tensors and tuples
    def as_dict(x):
        return {"h": torch.tanh(block(x))}

    x = h if h.requires_grad else h.detach().requires_grad_(True)
    return torch_checkpoint.checkpoint(as_dict, x, use_reentrant=True)["h"] + bias


def ck2_call(net, block, h, bias):  # a checkpoint inside a checkpoint's function
    def outer(x):
        return torch_checkpoint.checkpoint(
            functools.partial(net.run_block, block), x, use_reentrant=True
        )

    x = h if h.requires_grad else h.detach().requires_grad_(True)
    return torch_checkpoint.checkpoint(outer, x, use_reentrant=False) + bias


# -- facts-level decisions (frameworks and launchers that cannot run in this process) -----------


def decide_facts(mode: str, facts: Any) -> Any:
    host = PluginHost(strict=mode == "strict")
    for name in PLUGINS:
        if name != "torch_checkpoint":
            host.add(AsInstalled(_plugin(name)), name)
    return resolve.resolve(resolve.stance_votes(facts) + host.votes(facts), mode)


def enable_facts(model: nn.Module, reentrant: bool | None, context=None, **overrides) -> Any:
    """The enable-time facts of a real model, with what a launcher or framework would add."""
    with facts_mod.one_walk():
        facts = facts_mod.gather(
            model,
            stage=Stage.ENABLE,
            api="gradient_checkpointing_enable",
            source=overrides.pop("source", "call"),
            asked_kwargs={} if reentrant is None else {"use_reentrant": reentrant},
            asked_from="the test's gradient_checkpointing_enable",
            context=context,
            trainer=overrides.pop("trainer", ""),
        )
    return dataclasses.replace(facts, **overrides)


def config_facts(reentrant: bool | None, trainer: str, **kw: Any) -> Any:
    return facts_mod.for_config(
        api="axolotl config",
        model_class="LlamaForCausalLM",
        asked_kwargs={} if reentrant is None else {"use_reentrant": reentrant},
        asked_from="the config's gradient_checkpointing_kwargs",
        partially_frozen=kw.pop("partially_frozen", False),
        trainer=trainer,
        **{"peft": False, "kbit": False, "zero3": False, "world_size": 1, **kw},
    )


def versions(**pins: str) -> dict:
    return {**facts_mod.versions(), **pins}


# -- the table ----------------------------------------------------------------------------------


@dataclass
class Case:
    rule: str
    setup: str
    run: Callable[[str, pytest.MonkeyPatch, Any], Any]  # (mode, monkeypatch, tmp_path)
    fix: str = ""  # the words of the user's fix strict's message must carry
    raises: bool = True  # False: strict proceeds (a recommendation, an unset default filled)


def _end_to_end(step: Callable[[], Any]) -> Callable:
    def run(mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
        with gcpatch_in(mode, monkeypatch):
            return step()

    return run


def _r1() -> Any:
    ref = stem_step(stem(frozen_stem=True))
    model = stem(frozen_stem=True)
    enable(model, True)
    got = stem_step(model)
    assert exact(got, ref) == 0 and model.layers[0].gradient_checkpointing
    return "use_reentrant True -> False, gradients exact"


def _r2() -> Any:
    frozen = ("model.embed_tokens", "model.layers.0.")
    ref = llama_step(llama(frozen), embeds=True)
    model = llama(frozen)
    enable(model, True)
    got = llama_step(model, embeds=True)
    # transformers 5.x hooks the embeddings itself; inputs_embeds need gcpatch's hook (X2)
    assert apply.input_hooks_installed(model) >= 1 and exact(got, ref) == 0
    return "input-grads hook installed, use_reentrant=True kept, gradients exact"


def _p1(mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    from transformers import BitsAndBytesConfig

    pytest.importorskip("bitsandbytes")
    llama().save_pretrained(tmp_path / "tiny")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)

    def load() -> Any:
        torch.manual_seed(0)
        return LlamaForCausalLM.from_pretrained(
            tmp_path / "tiny", quantization_config=quant, device_map="cpu"
        ).train()

    ref = llama_step(load(), embeds=True)
    with gcpatch_in(mode, monkeypatch):
        model = load()
        enable(model, True)
        got = llama_step(model, embeds=True)
        assert model.is_loaded_in_4bit and apply.input_hooks_installed(model) >= 1
    assert exact(got, ref) == 0
    return "input-grads hook installed on the 4-bit model, gradients exact"


def _r5() -> Any:
    def saved_bytes(model: nn.Module) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=IDS, labels=IDS).loss  # what the forward holds for backward
        loss.backward()
        return total[0]

    plain = saved_bytes(llama().eval())
    model = llama().eval()
    enable(model, None)
    fixed = saved_bytes(model)
    assert fixed < 0.5 * plain, (fixed, plain)  # checkpointing took effect in eval mode
    assert not model.model.layers[0].mlp.training  # the user's eval mode inside the layers
    return f"eval-mode layers checkpoint: {fixed} of {plain} bytes saved"


def _r6() -> Any:
    ref = stem_step(stem(use_cache=True))
    model = stem(use_cache=True)
    enable(model, None)
    assert model.config.use_cache is False
    assert exact(stem_step(model), ref) == 0
    return "use_cache True -> False"


def _ck(call: Callable) -> Callable[[], Any]:
    def step() -> Any:
        ref = net_grads(None)
        got = net_grads(call)
        assert exact(got, ref) == 0
        return "gradients exact"

    return step


def _facts(expect: Callable[[Any], None], facts: Callable[[], Any]) -> Callable:
    def run(mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
        decision = decide_facts(mode, facts())
        expect(decision)
        return decision.values

    return run


def _reentrant_is(value: bool) -> Callable[[Any], None]:
    def expect(decision: Any) -> None:
        assert decision.values[USE_REENTRANT] is value, decision.values

    return expect


def _lora_frozen() -> nn.Module:
    return llama(("model.embed_tokens", "model.layers.0."))


def _r3_facts() -> Any:
    return enable_facts(_lora_frozen(), False, zero3=True, versions=versions(deepspeed="0.18.9"))


def _r3_expect(decision: Any) -> None:
    assert decision.values[USE_REENTRANT] is True and decision.values[INPUT_GRADS_HOOK] is True


def _ck2_run(mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    plain = Net()
    plain(ck2_call).backward()  # gcpatch off: the block runs in the forward and twice after
    ref = net_grads(None)
    with gcpatch_in(mode, monkeypatch):
        net = Net()
        got = grads(net, net(ck2_call))
    assert exact(got, ref) == 0 and net.runs < plain.runs, (net.runs, plain.runs)
    return f"block runs per step: {net.runs} (nested as made: {plain.runs})"


CASES = [
    Case(
        "R1",
        "frozen stem, no input embeddings, use_reentrant=True asked",
        _end_to_end(_r1),
        "use_reentrant=False",
    ),
    Case(
        "R2",
        "Llama, embeddings + layer 0 frozen, inputs_embeds, use_reentrant=True asked",
        _end_to_end(_r2),
        "enable_input_require_grads",
    ),
    Case(
        "P1",
        "4-bit Llama (bitsandbytes), inputs_embeds, use_reentrant=True asked",
        _p1,
        "enable_input_require_grads",
    ),
    Case(
        "R5",
        "Llama left in eval mode, checkpointing enabled, a training forward",
        _end_to_end(_r5),
        "model.train()",
    ),
    # R6 switches off only what transformers switches off itself in every checkpointed training
    # forward (4.35.2 models/llama/modeling_llama.py LlamaModel.forward, with a warning each
    # time): the job runs as it would without gcpatch, so strict proceeds
    Case(
        "R6",
        "remote-code style model, config.use_cache=True",
        _end_to_end(_r6),
        raises=False,
    ),
    Case(
        "CK1",
        "checkpoint(block, h, use_reentrant=True), h needs no grad",
        _end_to_end(_ck(ck1_call)),
        "requires grad",
    ),
    Case(
        "CK2",
        "a reentrant checkpoint inside a non-reentrant checkpoint's function",
        _ck2_run,
        "checkpoint each block in one place only",
    ),
    Case(
        "CK3",
        "context_fn with use_reentrant=True",
        _end_to_end(_ck(ck3_call)),
        "use_reentrant=False",
    ),
    Case(
        "CK5",
        "a shared bias with a graph bound by keyword, use_reentrant=True",
        _end_to_end(_ck(ck5_call)),
        "positionally",
    ),
    Case(
        "CK7",
        "the checkpointed function returns a dict, use_reentrant=True",
        _end_to_end(_ck(ck7_call)),
        "return a tensor or a tuple",
    ),
    Case(
        "R3",
        "ZeRO-3 facts, frozen layers, DeepSpeed 0.18.9, use_reentrant=False asked",
        _facts(_r3_expect, _r3_facts),
        "use_reentrant=True",
    ),
    Case(
        "R4",
        "DDP facts: 2 processes, find_unused_parameters=True, use_reentrant=True asked",
        _facts(
            _reentrant_is(False),
            lambda: enable_facts(
                llama(),
                True,
                context={"find_unused_parameters": True},
                world_size=2,
                distributed="ddp",
            ),
        ),
        "use_reentrant=False",
    ),
    Case(
        "R4-RL",
        "TRL GRPOTrainer facts, QLoRA over 2 processes, use_reentrant=True asked",
        _facts(
            _reentrant_is(False),
            lambda: enable_facts(
                llama(),
                True,
                trainer="trl.trainer.grpo_trainer.GRPOTrainer",
                kbit=True,
                peft=True,
                world_size=2,
                distributed="ddp",
            ),
        ),
        "use_reentrant=False",
    ),
    Case(
        "A4",
        "Axolotl rl config, QLoRA over 2 processes, use_reentrant: true",
        _facts(
            _reentrant_is(False),
            lambda: config_facts(True, "axolotl:rl", kbit=True, peft=True, world_size=2),
        ),
        "use_reentrant=False",
    ),
    # recommendations never overrule an explicit ask: strict keeps it, as fix mode does
    Case(
        "A2",
        "Axolotl standard config, use_reentrant: false",
        _facts(_reentrant_is(False), lambda: config_facts(False, "axolotl")),
        raises=False,
    ),
    Case(
        "C2",
        "ColossalAI's enable, use_reentrant=True asked",
        _facts(
            _reentrant_is(True), lambda: enable_facts(llama(), True, source="colossalai booster")
        ),
        raises=False,
    ),
    Case(
        "F2",
        "FSDP2 facts, GradientCheckpointingLayer's call, use_reentrant=True asked",
        _facts(
            _reentrant_is(True),
            lambda: enable_facts(llama(), True, fsdp="fsdp2", checkpoint_site="layer_call"),
        ),
        raises=False,
    ),
    Case(
        "T1",
        "TRL SFTTrainer facts on transformers 4.57, use_reentrant=True asked",
        _facts(
            _reentrant_is(True),
            lambda: enable_facts(
                llama(),
                True,
                trainer="trl.trainer.sft_trainer.SFTTrainer",
                versions=versions(transformers="4.57.6"),
            ),
        ),
        raises=False,
    ),
]


def test_every_deciding_rule_has_a_strict_case():
    assert deciding_rules() - {c.rule for c in CASES} == set(), "add a strict case for it"
    assert {c.rule for c in CASES} - deciding_rules() == set()


@pytest.mark.parametrize("case", [c for c in CASES if c.raises], ids=lambda c: c.rule)
def test_strict_raises_naming_the_rule_the_change_and_the_fix_where_fix_mode_applies_it(
    case, monkeypatch, tmp_path
):
    with pytest.raises(GcpatchError) as err:
        case.run("strict", monkeypatch, tmp_path / "strict")
    text = str(err.value)
    assert err.value.rule == case.rule and text.startswith(f"[{case.rule}] "), text
    assert "fix mode would" in text and "Fix: " in text and case.fix in err.value.fix, text
    # fix mode applies what strict refused (each run asserts its own figures)
    assert case.run("fix", monkeypatch, tmp_path / "fix")


@pytest.mark.parametrize("case", [c for c in CASES if not c.raises], ids=lambda c: c.rule)
def test_strict_proceeds_where_a_recommendation_yields_to_the_ask(case, monkeypatch, tmp_path):
    assert case.run("strict", monkeypatch, tmp_path) == case.run("fix", monkeypatch, tmp_path)


def test_strict_never_raises_on_a_job_correct_as_made_and_installs_nothing(monkeypatch):
    """Reentrant asked on an all-trainable Llama, and on one with frozen embeddings fed input_ids
    (transformers 5.x hooks their output itself): exact as made, so strict proceeds, and gcpatch's
    input-grads hook, which fix mode would add, is not installed."""
    for frozen in ((), ("model.embed_tokens",)):
        ref = llama_step(llama(frozen))
        with gcpatch_in("strict", monkeypatch):
            model = llama(frozen)
            enable(model, True)
            got = llama_step(model)
            assert apply.input_hooks_installed(model) == 0
        assert exact(got, ref) == 0, frozen
    ref = net_grads(None)
    with gcpatch_in("strict", monkeypatch):  # a reentrant call whose input requires grad
        got = net_grads(lambda net, block, h, bias: ck5_call(net, block, h, None) + bias)
    assert exact(got, ref) == 0


def test_strict_fills_an_unset_default_as_fix_mode_does(monkeypatch):
    """No use_reentrant asked: the framework's default (here torch's reentrant, X5) is a default
    and no choice of the user's, so R1 changing it is filling it in: strict proceeds."""
    ref = stem_step(stem(frozen_stem=True))
    with gcpatch_in("strict", monkeypatch):
        model = stem(frozen_stem=True)
        enable(model, None)
        got = stem_step(model)
        [last] = [d for d in decisions() if d.get("stage") == "enable"]
    assert last["applied"]["use_reentrant"] is False and last["decision"]["rules"][0] == "R1"
    assert exact(got, ref) == 0


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_labels=3,
    )
    model = ViTForImageClassification(config).train()
    model.vit.embeddings.requires_grad_(False)  # frozen patch embeddings, trainable layers
    return model


def _vit_grads(model: nn.Module) -> dict:
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    return grads(model, model(pixel_values=pixels).logits.pow(2).mean())


def offload_checkpoint(function, *args, use_reentrant=None, **kwargs):
    """An offloading checkpointer's stand-in: reentrant whatever it is asked."""
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


@pytest.mark.parametrize("unseen", ["custom checkpoint function", "torch plugin blocked"])
def test_strict_raises_at_the_enable_where_gcpatch_cannot_see_the_checkpoint_calls(
    monkeypatch, unseen
):
    """Frozen patch embeddings (transformers hooks no pixel_values model itself), reentrant: the
    hook is needed, and no call rule would see the layer calls, through an offloading checkpointer
    in place of torch's (integration/scripts/custom_checkpointer.py), or with the torch plugin
    blocked. Strict raises R2 at the enable; fix mode installs the hook."""
    import transformers.modeling_utils

    ref = _vit_grads(_vit())
    blocked, reentrant = "torch", True
    if unseen == "custom checkpoint function":
        monkeypatch.setattr(transformers.modeling_utils, "checkpoint", offload_checkpoint)
        blocked, reentrant = "", False
    with gcpatch_in("strict", monkeypatch, blocked), pytest.raises(GcpatchError) as err:
        enable(_vit(), reentrant)
    assert err.value.rule == "R2" and "gcpatch cannot see the checkpoint calls" in str(err.value)
    assert "enable_input_require_grads" in err.value.fix
    with gcpatch_in("fix", monkeypatch, blocked):
        model = _vit()
        enable(model, reentrant)
        got = _vit_grads(model)
        assert apply.input_hooks_installed(model) >= 1
    assert exact(got, ref) == 0
