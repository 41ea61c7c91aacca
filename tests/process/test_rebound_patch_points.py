"""Another tool rebinding one of gcpatch's patch points (Axolotl's `embeddings_skip_upcast` execs
peft's source of `prepare_model_for_kbit_training` and assigns the result) is found at the next
decision: gcpatch wraps the replacement, says so once, and the replacement's enable calls are
attributed to peft again."""

from __future__ import annotations

import pytest
from packaging.version import Version
from testkit.harness import messages, result_of, run_python
from testkit.subproc import requires_transformers

pytestmark = requires_transformers
peft = pytest.importorskip("peft")
if Version(peft.__version__) < Version("0.10"):
    pytest.skip(
        f"peft {peft.__version__} is below the peft plugin's range (>=0.10): P3's patch point is not installed",
        allow_module_level=True,
    )
pytest.importorskip("bitsandbytes")

SCRIPT = """
import inspect, json, tempfile, torch
import gcpatch, peft, peft.utils.other as other
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

path = tempfile.mkdtemp(dir=".")  # the test's own folder
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)

def tiny():  # a real 4-bit model: peft's kbit preparation enables checkpointing only on those
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, device_map="cpu")

# what Axolotl's patch_peft_prep_code does: re-execute peft's source in peft's namespace, then rebind
source = inspect.getsource(other.prepare_model_for_kbit_training)
exec(compile(source, "<patched peft source>", "exec"), other.__dict__)
peft.prepare_model_for_kbit_training = other.prepare_model_for_kbit_training

peft.prepare_model_for_kbit_training(tiny())      # runs unwrapped: found at its enable decision
first = gcpatch.decisions()[-1]["source"]
ours_now = [getattr(other.prepare_model_for_kbit_training, "_self_gcpatch", False),
            other.prepare_model_for_kbit_training.__wrapped__.__code__.co_filename == "<patched peft source>",
            peft.prepare_model_for_kbit_training is other.prepare_model_for_kbit_training]
peft.prepare_model_for_kbit_training(tiny())      # wrapped again: recorded as peft's call
second = gcpatch.decisions()[-1]["source"]
print("RESULT " + json.dumps({"first": first, "ours_now": ours_now, "second": second}))
"""


def test_a_rebound_patch_point_is_wrapped_again_and_reported_once(tmp_path):
    proc = run_python(SCRIPT, tmp_path, GCPATCH="1")
    result = result_of(proc)
    assert result == {
        "first": "call",
        "ours_now": [True, True, True],
        "second": "peft.prepare_model_for_kbit_training",
    }, proc.stderr
    reports = [line for line in messages(proc.stderr) if "was rebound by another tool" in line]
    assert len(reports) == 1 and "<patched peft source>" in reports[0], proc.stderr
