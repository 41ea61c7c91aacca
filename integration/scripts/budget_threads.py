"""Two threads of one process, one of them training under a memory budget: the main thread trains
a 4-layer tiny Llama (hidden 64, dropout 0) for two steps with checkpointing enabled
(non-reentrant, `preserve_rng_state=False`: nothing in the model draws, so torch's checkpoint
leaves the global generator alone); a second thread, for as long as those two steps run,
registers a global forward hook (`torch.nn.modules.module.register_module_forward_hook`) that
counts the calls of its own small model, runs that model's forward and backward in a loop on the
same input (each gradient must equal the first), draws `torch.rand(4)` from the global generator
after each call, and notes any torch dispatch mode on its thread's stack (it pushes none). Ordinary
user code: nothing here imports gcpatch.

The second thread is started, and has run once, before the first training forward; each training
forward waits (a pre-hook of the user's own on the embeddings) until the second thread has run
once more inside it, so the threads overlap on both steps whatever the scheduler does. Nothing
else draws from the global generator after it is seeded, so the second thread's draws are exactly
those of a fresh generator given the same seed.

usage: budget_threads.py
prints one line: RESULT {json}
"""

import os
import threading
import time
import warnings

import _common as c
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS, HIDDEN, BATCH, SEQ, STEPS = 4, 64, 2, 64, 2
SEED = 1234
WAIT_S = 120  # the longest a training forward waits for the other thread to run once inside it


def llama():
    return c.llama_of(c.llama_config(LAYERS, HIDDEN))


class Other:
    """The second thread: its own model in a loop, a global forward hook counting that model's
    calls, a draw from the global generator after each call."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)
        )
        self.x = torch.ones(2, 16)
        self.forwards = 0
        self.hook_calls = 0
        self.grads_differ = 0
        self.foreign_modes = 0
        self.first_grad = None
        self.draws: list = []
        self.done = threading.Event()
        self.ready = threading.Event()
        self.ran = threading.Condition()
        self.error = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _hook(self, module, args, output):
        if module is self.model:
            self.hook_calls += 1

    def _loop(self) -> None:
        try:
            handle = torch.nn.modules.module.register_module_forward_hook(self._hook)
            while not self.done.is_set():
                # this thread's own mode stack (torch's is_in_torch_dispatch_mode() is one flag
                # for the whole process: any thread's mode, the user's own too, sets it)
                self.foreign_modes += bool(_get_current_dispatch_mode_stack())
                self.model.zero_grad(set_to_none=True)
                self.model(self.x).square().sum().backward()
                grad = self.model[0].weight.grad.clone()
                if self.first_grad is None:
                    self.first_grad = grad
                self.grads_differ += not torch.equal(grad, self.first_grad)
                self.forwards += 1
                self.draws.append(torch.rand(4).tolist())
                with self.ran:
                    self.ran.notify_all()
                self.ready.set()
                time.sleep(0.001)  # lets the training thread have the interpreter
            handle.remove()
        except Exception as exc:  # reported, not raised in a thread nobody joins on error
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            self.ready.set()

    def wait_for_one_more(self) -> bool:
        """Block until the loop has run once more (True), or WAIT_S passed (False)."""
        seen = self.forwards
        deadline = time.monotonic() + WAIT_S
        with self.ran:
            while self.forwards == seen and self.thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.ran.wait(timeout=left)
        return self.forwards > seen


def main() -> None:
    warnings.filterwarnings("ignore")
    model = llama()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False}
    )
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, c.VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]

    other = Other()
    overlapped: list = []
    waiting = {"armed": False}

    def meet_the_other_thread(module, args):
        if waiting["armed"]:  # once per training forward
            waiting["armed"] = False
            overlapped.append(other.wait_for_one_more())

    model.model.embed_tokens.register_forward_pre_hook(meet_the_other_thread)
    torch.manual_seed(SEED)  # the global generator: the other thread's draws only, from here on
    other.thread.start()
    other.ready.wait(timeout=WAIT_S)
    losses, error = [], None
    try:
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            waiting["armed"] = True
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(float(loss))
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    other.done.set()
    other.thread.join(timeout=WAIT_S)

    fresh = torch.Generator().manual_seed(SEED)
    expected = [torch.rand(4, generator=fresh).tolist() for _ in other.draws]
    seen, repeated = set(), 0
    for draw in other.draws:
        repeated += tuple(draw) in seen
        seen.add(tuple(draw))
    c.emit(
        {
            "scenario": "budget_threads",
            "steps_run": len(losses),
            "steps_planned": STEPS,
            "error": error,
            "other_error": other.error,
            "overlapped": overlapped,
            "other_forwards": other.forwards,
            "other_hook_calls": other.hook_calls,
            "other_grads_differ": other.grads_differ,
            "other_foreign_modes": other.foreign_modes,
            "draws": len(other.draws),
            "draws_repeated": repeated,
            "draws_as_fresh_generator": sum(d == e for d, e in zip(other.draws, expected)),
            "losses": losses,
            "budget": os.environ.get("GCPATCH_MEMORY_BUDGET"),
        }
    )


if __name__ == "__main__":
    main()
