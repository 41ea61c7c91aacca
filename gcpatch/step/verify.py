"""Verify (GCPATCH_VERIFY=1): prove on the user's own job that checkpointing is correct and saves
memory. At the first grad-enabled forward of each model gcpatch enabled checkpointing for, before
that forward runs (gcpatch/step/first_step.py), a slice of its batch is run twice from the same RNG
state: once with checkpointing as applied, once with every checkpointed block run plainly. The two
give the trainable parameters' gradients (compared by name), the activation bytes the forward
saved, and how often each checkpointed block ran in the backward (double recompute when two tools
checkpoint the same blocks). Nothing the user's step sees changes (gcpatch/step/invisible.py): the
RNG streams, the buffers, the parameters' `.grad` objects, every hook and swapped function are put
back, and the passes call the model itself, never a DDP wrapper, so no collective and no reducer
work is triggered. `check()` is the measurement (the pytest plugin's too); `run()` the first
step's verification, with fix mode's correction.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from gcpatch import context, crash_notes, headline, record, settings
from gcpatch.apply import ModePreservingCheckpoint
from gcpatch.budget import size
from gcpatch.errors import GcpatchError
from gcpatch.facts import checkpoint_layers
from gcpatch.ranks import rank
from gcpatch.step import invisible
from gcpatch.step.batch import batch_size, first_rows, tensors

log = logging.getLogger("gcpatch")

# Relative tolerance (to the reference tensor's largest magnitude) under which two gradients are
# the same: recompute runs the same kernels, so fp32 differences are rounding at most.
RTOL = {"float32": 1e-4, "float64": 1e-9}
RTOL_LOW_PRECISION = 2e-2
ATOL = 1e-7
LOW_SAVING = 0.05  # a saving below 5% means checkpointing took (almost) no effect
_NAMES_SHOWN = 8


GRADIENT_FIX = (
    "use_reentrant=False (gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    '{"use_reentrant": False})), or run with GCPATCH=1 and gcpatch decides'
)


@dataclass
class Report:
    """What one verification found. `skipped` is set when it could not run, and says why."""

    model: str
    tensors: int = 0
    rows: int = 0
    batch: int = 0
    missing: list[str] = field(
        default_factory=list
    )  # a gradient without checkpointing, none with it
    extra: list[str] = field(default_factory=list)  # a gradient with checkpointing, none without it
    differ: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    saved_bytes_checkpointed: int = 0
    saved_bytes_plain: int = 0
    blocks: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # block -> {forward, backward} runs
    checkpointing_on: int = 0  # checkpoint layers with gradient_checkpointing set
    seconds: float = 0.0
    skipped: str = ""
    # the set-up as configured raised in the checked step (a known checkpointing crash): the finding
    fails: str = ""
    fix: str = ""
    # the call rules that changed a checkpoint call in the checked pass, as in the user's step
    # (rule -> short reason: CK1, CK5 and CK7 keep a reentrant call exact, CK2 and CK3)
    call_rules: dict[str, str] = field(default_factory=dict)

    @property
    def wrong(self) -> list[str]:
        return sorted(set(self.missing) | set(self.extra) | set(self.differ))

    @property
    def gradients_match(self) -> bool:
        return not self.skipped and not self.fails and not self.wrong

    @property
    def saved_fraction(self) -> float:
        if not self.saved_bytes_plain:
            return 0.0
        return 1.0 - self.saved_bytes_checkpointed / self.saved_bytes_plain

    @property
    def recompute_counts(self) -> list[int]:
        return sorted({runs["backward"] for runs in self.blocks.values()})

    def problems(self, min_saved: float = LOW_SAVING, full: bool = False) -> list[str]:
        """Everything a user should act on, one sentence each (empty: all is well); `full`
        names every tensor (the record), else the first few (the log line)."""
        limit = None if full else _NAMES_SHOWN
        if self.fails:
            return [
                f"the set-up as configured fails: {self.fails}"
                + (f"; fix: {self.fix}" if self.fix else "")
            ]
        if self.skipped:
            return [f"not verified: {self.skipped}"]
        out = []
        if self.missing:
            out.append(
                f"{len(self.missing)} tensor(s) get no gradient with checkpointing but one without"
                f" it: {_names(self.missing, limit)}"
            )
        if self.extra:
            out.append(
                f"{len(self.extra)} tensor(s) get a gradient only with checkpointing: "
                f"{_names(self.extra, limit)}"
            )
        if self.differ:
            out.append(
                f"{len(self.differ)} gradient(s) differ from no checkpointing (max abs diff"
                f" {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}):"
                f" {_names(self.differ, limit)}"
            )
        if out:
            out.append(f"fix: {GRADIENT_FIX}")
        if not self.blocks:
            out.append(
                f"no block was checkpointed in this step ({self.checkpointing_on} module(s) have "
                "checkpointing on; a model left in eval mode skips it); fix: model.train() before"
                " the step, after gradient_checkpointing_enable()"
            )
        elif self.saved_fraction < min_saved:
            out.append(
                f"checkpointing saves {self.saved_fraction:.0%} of the forward's activations "
                f"(expected at least {min_saved:.0%}); fix: checkpoint more of its layers, or"
                " expect less of a model whose layers hold few activations"
            )
        twice = sorted(name for name, runs in self.blocks.items() if runs["backward"] > 1)
        if twice:
            out.append(
                f"{len(twice)} block(s) recomputed more than once in one backward (two tools"
                f" checkpoint the same blocks?): {_names(twice, limit)}; fix: enable checkpointing"
                " in one place only"
            )
        return out

    def failure(self, min_saved: float = LOW_SAVING) -> str:
        """What a test that asserts this verification reads (empty: it passes): each problem
        with the first few names (the report holds them all) and the fix, wrapped at words."""
        problems = self.problems(min_saved=min_saved)
        if not problems:
            return ""
        lines = "\n".join(headline.wrap(f"  - {p}") for p in problems)
        return (
            f"gcpatch verify: checkpointing on {self.model} is not what it should be:\n{lines}\n"
            + headline.wrap(f"  measured: {self.line()}")
        )

    def line(self) -> str:
        """The one log line: gradients; activations saved; recompute."""
        if self.fails:
            fix = f"; fix: {self.fix}" if self.fix else ""
            return (
                f"{self.model}: the set-up as configured fails in its first step"
                f"{self._as_run()}: {self.fails}{fix}"
            )
        if self.skipped:
            return f"{self.model}: not verified ({self.skipped})"
        if self.gradients_match:
            grads = (
                f"gradients match ({self.tensors} tensors, max abs diff {self.max_abs_diff:.3g}, "
                f"max rel diff {self.max_rel_diff:.3g}){self._as_run()}"
            )
        else:
            parts = []
            if self.missing:
                parts.append(f"missing {_names(self.missing)}")
            if self.extra:
                parts.append(f"only with checkpointing {_names(self.extra)}")
            if self.differ:
                parts.append(f"differ {_names(self.differ)} (max rel diff {self.max_rel_diff:.3g})")
            grads = (
                f"gradients DIFFER in {len(self.wrong)} of {self.tensors} tensors"
                f"{self._as_run()}: {'; '.join(parts)}"
            )
        memory = (
            f"activations saved {self.saved_fraction:.0%} ({size(self.saved_bytes_plain)} -> "
            f"{size(self.saved_bytes_checkpointed)} on {self.rows} of {self.batch} rows)"
        )
        counts = self.recompute_counts
        idle = [name for name, runs in self.blocks.items() if runs["backward"] == 0]
        if not self.blocks:
            recompute = "no block checkpointed"
        elif counts == [1]:
            recompute = f"each block recomputed once ({len(self.blocks)} blocks)"
        elif counts == [0, 1] and self.gradients_match:
            # a frozen block whose inputs need no gradient is rightly never recomputed
            recompute = (
                f"each block recomputed at most once ({len(self.blocks)} blocks; no backward"
                f" through {_names(idle)})"
            )
        else:
            recompute = "blocks recomputed " + ", ".join(
                f"{name} x{runs['backward']}" for name, runs in self.blocks.items()
            )
        return f"{self.model}: {grads}; {memory}; {recompute}"

    def _as_run(self) -> str:
        """Which of gcpatch's call rules the checked step ran with, as the user's step does."""
        if not self.call_rules:
            return ""
        said = "; ".join(f"{rule}: {why}" for rule, why in sorted(self.call_rules.items()))
        return f" with the checkpoint calls as gcpatch runs them ({said})"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            gradients_match=self.gradients_match,
            saved_fraction=self.saved_fraction,
            problems=self.problems(full=True),
        )
        return data


# Fix mode's answer to a failed verification: (model, report, attempt) -> what it changed, or ""
# when
# it changed nothing. Attempt 1 switches to non-reentrant, attempt 2 switches checkpointing off for
# the offending blocks (gcpatch.pipeline.correct).
Correct = Callable[[Any, "Report", int], str]
ATTEMPTS = 2


def run(model: Any, module: Any, args: tuple, kwargs: dict, correct: Correct | None) -> None:
    """Verify `model` on this first training forward's batch (`module` is the model or the base
    model whose forward was entered), say it in one line, and in fix mode hand a failed
    verification to `correct` before the user's step runs."""
    cfg = settings.read()
    report = _checked(model, module, args, kwargs)
    _report(report, cfg)
    attempt = 0
    while (
        correct is not None
        and cfg.mode == "fix"
        and _needs_correction(report)
        and attempt < ATTEMPTS
    ):
        attempt += 1
        try:
            changed = correct(model, report, attempt)
        except Exception as exc:  # noqa: BLE001 (fail open: the step runs as decided)
            log.error(
                "gcpatch: verify could not correct %s (%s: %s); the step runs as decided",
                type(model).__name__,
                type(exc).__name__,
                exc,
            )
            return
        if not changed:
            continue
        before, report = report, _checked(model, module, args, kwargs)
        _report_correction(before, report, changed, cfg)


def _checked(model: Any, module: Any, args: tuple, kwargs: dict) -> Report:
    try:
        report = check(module, args, kwargs)
        report.model = context.name(model)
        if module is not model:
            report.model += (
                f" (checked on its base model {type(module).__name__}: "
                f"{type(model).__name__}.forward was entered without a module call)"
            )
    except GcpatchError:
        # strict mode stopped the job at a rule (a call-site rule inside the checked pass): as asked
        raise
    except Exception as exc:  # noqa: BLE001 (fail open: the finding is said, the step runs)
        report = Report(model=context.name(model))
        family = crash_notes.family_of(exc)
        message = (
            headline.shorten(str(exc).strip().splitlines()[0], 200, " ...")
            if str(exc).strip()
            else ""
        )
        if family is not None:  # a known checkpointing crash: the set-up fails as configured
            report.fails, report.fix = f"{type(exc).__name__}: {message}", family.fix
        else:
            report.skipped = f"verify failed: {type(exc).__name__}: {message}"
    return report


def _needs_correction(report: Report) -> bool:
    """Wrong gradients or a block recomputed twice: what fix mode corrects before the first step."""
    return not report.skipped and (
        bool(report.wrong) or any(r["backward"] > 1 for r in report.blocks.values())
    )


def _report_correction(before: Report, after: Report, changed: str, cfg: settings.Settings) -> None:
    """One line: what fix mode changed before the user's first step, why, and the second
    verification."""
    why = (
        f"{len(before.wrong)} of {before.tensors} gradients differed from no checkpointing"
        if before.wrong
        else "blocks were recomputed more than once"
    )
    line = (
        f"gcpatch: rank {rank()} verify {before.model}: changed before the first step: {changed}"
        f" (VERIFY: {why}); verified again: {after.line().split(': ', 1)[-1]}"
    )
    level = logging.WARNING if _needs_correction(after) or after.skipped else logging.INFO
    log.log(level, "%s", headline.wrap(line))
    record.event(
        {
            "stage": "verify",
            "model": after.model,
            "line": line,
            "corrected": changed,
            "details": after.problems(full=True),
            "verify_before": before.to_dict(),
            "verify": after.to_dict(),
        },
        cfg.record_dir,
    )


def _report(report: Report, cfg: settings.Settings) -> None:
    line = f"gcpatch: rank {rank()} verify {report.line()}"
    problems = report.problems(full=True)
    log.log(logging.WARNING if problems else logging.INFO, "%s", headline.wrap(line))
    record.event(
        {
            "stage": "verify",
            "model": report.model,
            "line": line,
            "details": problems,
            "verify": report.to_dict(),
        },
        cfg.record_dir,
    )
    if cfg.strict and report.wrong:
        raise GcpatchError(
            f"verify: with checkpointing as applied, {len(report.wrong)} of {report.tensors}"
            f" trainable tensors of {report.model} get a different gradient than without it:"
            f" {', '.join(report.wrong)}",
            rule="VERIFY",
            fix="see `gcpatch explain`; use_reentrant=False covers most set-ups",
        )


def check(
    model: Any,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    rows: int | None = 1,
    loss_fn: Callable[[Any], Any] | None = None,
) -> Report:
    """Run `model` on the first `rows` rows of this batch (None: all of it) with checkpointing as
    applied and without it, from the same RNG state, and compare. The caller's RNG stream,
    gradients, buffers and the model's hooks are left exactly as they were."""
    torch = sys.modules.get("torch") or __import__("torch")
    start = time.perf_counter()
    kwargs = dict(kwargs or {})
    report = Report(model=type(model).__name__)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    report.tensors = len(trainable)
    report.checkpointing_on = sum(
        1 for m in checkpoint_layers(model) if getattr(m, "gradient_checkpointing", False) is True
    )
    report.skipped = invisible.unsupported(torch, model, trainable, kwargs)
    batch = batch_size(torch, args, kwargs)
    if not report.skipped and batch is None:
        report.skipped = "no tensor input with a batch dimension"
    if report.skipped:
        return report
    report.batch = batch
    report.rows = batch if rows is None else max(1, min(rows, batch))
    s_args, s_kwargs = first_rows(torch, (tuple(args), kwargs), batch, report.rows)
    stash = [(p, p.grad) for p in model.parameters()]
    try:
        with invisible.gcpatch_pass(torch, model):
            rng = invisible.rng_state(torch, model)
            for p, _ in stash:
                p.grad = None
            checkpointed = _run(
                torch, model, s_args, s_kwargs, trainable, loss_fn, report, checkpointing=True
            )
            invisible.set_rng_state(torch, model, rng)
            for p, _ in stash:
                p.grad = None
            plain = _run(
                torch, model, s_args, s_kwargs, trainable, loss_fn, report, checkpointing=False
            )
    finally:
        for p, grad in stash:
            p.grad = grad
    _compare(torch, checkpointed, plain, report)
    report.seconds = time.perf_counter() - start
    return report


def _run(
    torch: Any,
    model: Any,
    args: tuple,
    kwargs: dict,
    trainable: list,
    loss_fn: Any,
    report: Report,
    checkpointing: bool,
) -> dict[str, Any]:
    """One pass on the slice; returns {name: gradient or None} and fills in saved bytes/runs."""
    phase = ["forward"]
    blocks: dict[str, dict[str, int]] = {}
    saved = [0]
    param_storages = set()
    for p in model.parameters():
        with contextlib.suppress(Exception):
            param_storages.add(p.untyped_storage().data_ptr())

    def pack(tensor: Any) -> Any:
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 (tensor subclasses without storage)
            ptr = None
        if ptr not in param_storages:  # weights are not activations
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    rules: dict[str, str] = {}
    restore = _swap_checkpoint_functions(model, checkpointing, blocks, phase, rules)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            output = model(*args, **kwargs)
        loss = _scalar_loss(torch, output, loss_fn)
        phase[0] = "backward"
        if loss is not None and loss.requires_grad:
            loss.backward()
    finally:
        restore()
    grads = {name: p.grad for name, p in trainable}
    if checkpointing:
        report.saved_bytes_checkpointed = saved[0]
        report.blocks = blocks
        report.call_rules = rules
    else:
        report.saved_bytes_plain = saved[0]
    return grads


def _identity(tensor: Any) -> Any:
    return tensor


def _swap_checkpoint_functions(
    model: Any, checkpointing: bool, blocks: dict, phase: list, rules: dict
) -> Callable[[], None]:
    """Every checkpointed module's `_gradient_checkpointing_func` (transformers', or R5's wrapper
    around it) is swapped for one that counts the block's runs (and gathers the call rules that
    changed its calls into `rules`), or for a plain call; the returned function puts back the very
    same objects."""
    names = {id(m): name for name, m in model.named_modules()}
    swapped: list[tuple[Any, str, Any]] = []
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is not True:
            continue
        func = vars(module).get("_gradient_checkpointing_func")
        if not callable(func):
            continue
        # R5's mode-preserving wrapper stays: only the checkpoint call inside it is replaced.
        if isinstance(func, ModePreservingCheckpoint):
            target, attr = func, "func"
        else:
            target, attr = module, "_gradient_checkpointing_func"
        inner = getattr(target, attr)
        new = _counting(inner, name, names, blocks, phase, rules) if checkpointing else _run_plainly
        setattr(target, attr, new)
        swapped.append((target, attr, inner))

    def restore() -> None:
        for target, attr, inner in reversed(swapped):
            setattr(target, attr, inner)

    return restore


def _run_plainly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The block without checkpointing. Checkpoint options bound by transformers
    (use_reentrant, ...) live in the partial this replaces, so `kwargs` are the block's own."""
    return function(*args, **kwargs)


def _counting(
    inner: Callable[..., Any], owner: str, names: dict, blocks: dict, phase: list, rules: dict
) -> Callable[..., Any]:
    """The block's checkpoint function, counting its runs. The function goes to the checkpoint as
    `Counted`, which gcpatch's call decision unwraps: a closure around it would hide a partial's
    bound tensors, and the checked pass would run a call the user's step does not (CK1, CK5)."""
    from gcpatch.call.checkpoint_call import Counted

    calls = [0]

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        block = _block_name(function, names)
        if block is None:  # a loop owner checkpointing its layers in turn (models before 4.52)
            block = f"{owner}[{calls[0]}]"
            calls[0] += 1
        runs = blocks.setdefault(block, {"forward": 0, "backward": 0})

        def count() -> None:
            runs[phase[0]] += 1

        counted = Counted(function, count)
        try:
            return inner(counted, *args, **kwargs)
        finally:
            rules.update(counted.rules)

    return checkpoint


def _block_name(function: Any, names: dict) -> str | None:
    while isinstance(function, functools.partial):
        if function.args and id(function.args[0]) in names:
            return names[id(function.args[0])] or "(model)"
        function = function.func
    owner = getattr(function, "__self__", None)
    if owner is not None and id(owner) in names:
        return names[id(owner)] or "(model)"
    return None


def _scalar_loss(torch: Any, output: Any, loss_fn: Any) -> Any:
    """The model's own loss when it computed one (labels passed), else a fixed random projection
    of every floating output: the same function in both passes, so their gradients compare."""
    if loss_fn is not None:
        return loss_fn(output)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    total = None
    for i, tensor in enumerate(tensors(torch, output)):
        if not tensor.is_floating_point() or not tensor.requires_grad:
            continue
        gen = torch.Generator().manual_seed(1000 + i)
        probe = torch.randn(tuple(tensor.shape), generator=gen).to(tensor.device)
        term = (tensor.float() * probe).sum()
        total = term if total is None else total + term
    return total


def _compare(torch: Any, got: dict[str, Any], ref: dict[str, Any], report: Report) -> None:
    for name, r in ref.items():
        g = got[name]
        if g is None and r is None:
            continue
        if g is None:
            report.missing.append(name)
            continue
        if r is None:
            report.extra.append(name)
            continue
        diff = float((g.detach().double() - r.detach().double()).abs().max()) if g.numel() else 0.0
        scale = float(r.detach().double().abs().max()) if r.numel() else 0.0
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        report.max_abs_diff = max(report.max_abs_diff, diff)
        report.max_rel_diff = max(report.max_rel_diff, rel)
        rtol = RTOL.get(str(r.dtype).replace("torch.", ""), RTOL_LOW_PRECISION)
        if g.shape != r.shape or diff > ATOL + rtol * scale:
            report.differ.append(name)


def _names(names: list[str], limit: int | None = _NAMES_SHOWN) -> str:
    if limit is None or len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f" (+{len(names) - limit} more)"
