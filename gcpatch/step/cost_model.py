"""What each checkpointable layer costs at any batch shape, fitted from the measuring forwards of
the first training step: one budget holds on every step, however its shape changes.

Each quantity (a layer's bytes held plain, held checkpointed, and what runs outside the layers) is
measured at 1 and 2 rows, and at the batch's token count T and a truncated T/2. Per token count t
it splits into a per-row part (the 2-row figure minus the 1-row one) and a fixed part (a causal
mask, a rotary table: 2 x the 1-row figure minus the 2-row one), each fitted as `a*t + b*t**2`
through the two token counts: the t**2 term is what attention materialises where it is eager
(its scores). Beyond the largest measured length the prediction is never below the linear one
through that point, so a fit that bends down cannot promise less than was seen. Where the tokens
could not be truncated (one token count measured) every part is taken as proportional to t, and
where the first row could not run alone (one row count measured) as proportional to the rows; the
record says so.

A layer's recompute seconds, timed once at the measured shape, scale with its plain bytes (the work
its forward does, attention's quadratic part included), and so do the seconds of checkpointing it
under a selective lever (gcpatch/step/selective.py): keeping its matmuls' outputs, whose bytes held
are its outputs plus what its matmuls produce, or its attention kernel's output alone, plus what
that kernel produces, each fitted like the rest; and, on an accelerator, of checkpointing it whole
with its inputs offloaded (gcpatch/step/offload.py), which holds what whole holds less those
inputs, and of running it plain with its feed-forward block alone checkpointed
(gcpatch/step/feed_forward.py), which holds what plain holds less what the block made. Pure
arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gcpatch.step.solver import FEED_FORWARD, KEEP_ATTENTION, KEEP_MATMULS, OFFLOAD, LayerCost


@dataclass(frozen=True)
class Curve:
    """`per_row(t) * rows + fixed(t)`, each `a*t + b*t**2`, fitted up to `t_max` tokens."""

    row_a: float
    row_b: float
    fixed_a: float
    fixed_b: float
    t_max: float
    row_at_max: float  # the measured per-row part at t_max (the linear floor beyond it)
    fixed_at_max: float

    def __call__(self, rows: float, tokens: float) -> float:
        per_row = _part(self.row_a, self.row_b, self.t_max, self.row_at_max, tokens)
        fixed = _part(self.fixed_a, self.fixed_b, self.t_max, self.fixed_at_max, tokens)
        return max(0.0, per_row * rows + fixed)

    @classmethod
    def fit(cls, points: dict[tuple[int, int], float]) -> Curve:
        """From {(rows, tokens): value} at rows 1 and 2 (one row count alone, as for a one-row
        batch: proportional to the rows) and one or two token counts."""
        lengths = sorted({t for _, t in points})
        parts = []
        for t in lengths:
            counts = sorted(r for r, u in points if u == t)
            if len(counts) == 1:
                parts.append((t, points[(counts[0], t)] / counts[0], 0.0))
                continue
            one, two = points[(1, t)], points[(2, t)]
            parts.append((t, two - one, 2 * one - two))
        t_max = float(lengths[-1])
        _, row_max, fixed_max = parts[-1]
        if len(parts) == 1:  # tokens not measured: proportional to t
            return cls(row_max / t_max, 0.0, fixed_max / t_max, 0.0, t_max, row_max, fixed_max)
        (t1, r1, f1), (t2, r2, f2) = parts[0], parts[-1]
        row_a, row_b = _through(t1, r1, t2, r2)
        fixed_a, fixed_b = _through(t1, f1, t2, f2)
        return cls(row_a, row_b, fixed_a, fixed_b, t_max, row_max, fixed_max)


def _through(t1: float, v1: float, t2: float, v2: float) -> tuple[float, float]:
    """(a, b) with a*t + b*t**2 through both points."""
    det = t1 * t2 * t2 - t2 * t1 * t1
    b = (t1 * v2 - t2 * v1) / det
    a = (v1 - b * t1 * t1) / t1
    return a, b


def _part(a: float, b: float, t_max: float, at_max: float, tokens: float) -> float:
    value = a * tokens + b * tokens * tokens
    if tokens > t_max and t_max > 0:
        value = max(value, at_max * tokens / t_max)
    return value


@dataclass
class CostModel:
    """Per layer: bytes plain and checkpointed, and recompute seconds, at any (rows, tokens)."""

    plain: list[Curve]
    checkpointed: list[Curve]
    outside: Curve
    seconds: list[float]  # measured at `timed_at`
    timed_at: tuple[int, int]
    kinds: list[str]
    measured_at: list[tuple[int, int]] = field(default_factory=list)
    tokens_measured: bool = True
    # what a layer's matmuls produce (kept by the selective lever) and that lever's seconds per
    # step at `timed_at` (None: not available on that layer): gcpatch/step/selective.py; the same
    # for its fused attention kernel's outputs alone
    matmul: list[Curve] | None = None
    kept_seconds: list[float | None] | None = None
    attention: list[Curve] | None = None
    attention_seconds: list[float | None] | None = None
    # checkpointed whole with its inputs offloaded (gcpatch/step/offload.py): bytes held (what
    # whole holds less those inputs) and seconds at `timed_at` (None: not offered on that layer)
    offloaded: list[Curve] | None = None
    offloaded_seconds: list[float | None] | None = None
    # plain with its feed-forward block alone checkpointed (gcpatch/step/feed_forward.py): bytes
    # held and seconds at `timed_at` (None: not offered on that layer)
    feed_forward: list[Curve | None] | None = None
    feed_forward_seconds: list[float | None] | None = None
    # what each lever recomputes of a whole layer's matmul FLOPs, counted on one layer
    # (gcpatch/step/selective.py `_Trial.matmul_shares`); None where not counted
    matmul_shares: dict[str, float] | None = None

    def layers(self, rows: int, tokens: int) -> tuple[list[LayerCost], float]:
        """Every layer's cost and what runs outside the layers, at this shape."""
        out = []
        for i, (plain, ckpt) in enumerate(zip(self.plain, self.checkpointed)):
            p = plain(rows, tokens)
            c = min(ckpt(rows, tokens), p)
            at = plain(*self.timed_at)
            scale = p / at if at > 0 else (rows * tokens) / (self.timed_at[0] * self.timed_at[1])
            kind = self.kinds[i] if i < len(self.kinds) else ""
            kept, kept_s = _lever(*self.lever(KEEP_MATMULS), i, rows, tokens, p, scale, c)
            att, att_s = _lever(*self.lever(KEEP_ATTENTION), i, rows, tokens, p, scale, c)
            off, off_s = _lever(*self.lever(OFFLOAD), i, rows, tokens, c, scale)
            ff, ff_s = _lever(*self.lever(FEED_FORWARD), i, rows, tokens, p, scale)
            out.append(
                LayerCost(
                    f"{i}",
                    p,
                    c,
                    self.seconds[i] * scale,
                    kind,
                    kept=kept,
                    kept_seconds=kept_s,
                    attention=att,
                    attention_seconds=att_s,
                    offloaded=off,
                    offloaded_seconds=off_s,
                    feed_forward=ff,
                    feed_forward_seconds=ff_s,
                    matmuls=tuple(sorted((self.matmul_shares or {}).items())),
                )
            )
        return out, self.outside(rows, tokens)

    def lever(self, lever: str) -> tuple[list[Curve | None] | None, list[float | None] | None]:
        """A lever's fitted bytes (kept, or held offloaded or with the feed-forward block alone
        checkpointed) and measured seconds, per layer."""
        return {
            KEEP_MATMULS: (self.matmul, self.kept_seconds),
            KEEP_ATTENTION: (self.attention, self.attention_seconds),
            OFFLOAD: (self.offloaded, self.offloaded_seconds),
            FEED_FORWARD: (self.feed_forward, self.feed_forward_seconds),
        }[lever]

    def plain_total(self, rows: int, tokens: int) -> float:
        layers, outside = self.layers(rows, tokens)
        return outside + sum(layer.plain for layer in layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plain": [asdict(c) for c in self.plain],
            "checkpointed": [asdict(c) for c in self.checkpointed],
            "outside": asdict(self.outside),
            "seconds": self.seconds,
            "timed_at": list(self.timed_at),
            "kinds": self.kinds,
            "measured_at": [list(s) for s in self.measured_at],
            "tokens_measured": self.tokens_measured,
            "matmul": _curves(self.matmul),
            "kept_seconds": self.kept_seconds,
            "attention": _curves(self.attention),
            "attention_seconds": self.attention_seconds,
            "offloaded": _curves(self.offloaded),
            "offloaded_seconds": self.offloaded_seconds,
            "feed_forward": _curves(self.feed_forward),
            "feed_forward_seconds": self.feed_forward_seconds,
            "matmul_shares": self.matmul_shares,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        return cls(
            plain=[Curve(**c) for c in data["plain"]],
            checkpointed=[Curve(**c) for c in data["checkpointed"]],
            outside=Curve(**data["outside"]),
            seconds=[float(s) for s in data["seconds"]],
            timed_at=(int(data["timed_at"][0]), int(data["timed_at"][1])),
            kinds=list(data["kinds"]),
            measured_at=[(int(r), int(t)) for r, t in data.get("measured_at", [])],
            tokens_measured=bool(data.get("tokens_measured", True)),
            matmul=_read_curves(data.get("matmul")),
            kept_seconds=data.get("kept_seconds"),
            attention=_read_curves(data.get("attention")),
            attention_seconds=data.get("attention_seconds"),
            offloaded=_read_curves(data.get("offloaded")),
            offloaded_seconds=data.get("offloaded_seconds"),
            feed_forward=_read_curves(data.get("feed_forward")),
            feed_forward_seconds=data.get("feed_forward_seconds"),
            matmul_shares=data.get("matmul_shares"),
        )


def _lever(
    curves: list[Curve | None] | None,
    seconds: list[float | None] | None,
    i: int,
    rows: int,
    tokens: int,
    most: float,
    scale: float,
    base: float = 0.0,
) -> tuple[float | None, float]:
    """A lever's bytes held at this shape (`base` plus its curve, never above `most`) and its
    seconds, or (None, 0) where the layer does not offer it. A selective lever's curve is what it
    keeps beside the layer's outputs (base: whole's bytes; most: plain's); offloading's and the
    feed-forward block's are what the layer holds (most: whole's and plain's)."""
    measured = seconds[i] if seconds else None
    curve = curves[i] if curves else None
    if curve is None or measured is None:
        return None, 0.0
    return min(most, base + curve(rows, tokens)), measured * scale


def _curves(curves: list[Curve | None] | None) -> list[dict | None] | None:
    """Serialized curves; a layer without the lever stays None."""
    return [asdict(c) if c else None for c in curves] if curves is not None else None


def _read_curves(data: list[dict | None] | None) -> list[Curve | None] | None:
    return [Curve(**c) if c else None for c in data] if data else None
