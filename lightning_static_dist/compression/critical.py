"""The critical point of a compressor: how far its aggressiveness can go before training falls behind exact.

Pure bookkeeping over loss curves (``benchmarks/critical_point.py`` runs the sweep that feeds it). A *curve* is one
loss per optimizer step; the *reference* is the exact fp32 run's, from the same seed on the same batches. Both are
smoothed with the same trailing mean (a single step's loss jitters by more than the tolerances). A run *falls behind
by t* at the first step, from compression's start, where its smoothed loss exceeds (1 + t) x the reference's; it
*diverges* at the first step whose loss is not finite or whose smoothed loss exceeds ``diverge_factor`` x the
reference's first loss. A family's critical point is its most aggressive setting reached walking up from the mildest
while every setting stays within ``tolerance``: a lucky pass above a failing setting does not count.

Example::

    comparison = compare_curves(powersgd_r4_losses, exact_losses, start=30)
    comparison.final_loss_ratio, comparison.behind_steps[0.03], comparison.diverged_step
    critical_point([row_r16, row_r8, row_r4, row_r2, row_r1], tolerance=1.03)   # e.g. the r8 row
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

#: the keys of every row of the sweep table (the benchmark adds its own figures beside them)
ROW_KEYS = (
    "setting",
    "family",
    "level",
    "final_train_loss",
    "final_loss_ratio",
    "val_loss",
    "val_loss_ratio",
    "behind_3pct_step",
    "behind_10pct_step",
    "diverged_step",
    "rel_error_median",
    "rel_error_max",
)


def smoothed(curve: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start); a non-finite value stays in its window."""
    if window < 1:
        raise ValueError(f"window={window!r}: must be an integer >= 1")
    out, total = [], 0.0
    for i, value in enumerate(curve):
        total += value
        if i >= window:
            total -= curve[i - window]
        out.append(total / min(i + 1, window))
    return out


@dataclass(frozen=True)
class CurveComparison:
    """How a compressed run's loss curve compares with the exact run's."""

    final_loss_ratio: float
    """Mean loss of the last ``tail`` fraction of steps over the reference's (``inf`` when the run diverged)."""
    behind_steps: dict[float, Optional[int]]
    """Per threshold t: the first step where the smoothed loss exceeds (1 + t) x the reference's (``None``: never)."""
    diverged_step: Optional[int]
    """The first step whose loss is not finite or far above the untrained loss (``None``: it did not diverge)."""


def compare_curves(curve: Sequence[float], reference: Sequence[float], *, start: int = 0, window: int = 20,
                   thresholds: Sequence[float] = (0.03, 0.10), tail: float = 0.1,
                   diverge_factor: float = 1.2) -> CurveComparison:
    """Compare a compressed run's per-step losses with the exact run's (see the module docstring).

    Args:
        curve: the compressed run's loss at each optimizer step.
        reference: the exact run's, at the same steps (only the common length is compared).
        start: the first step that was compressed (the warm-up's ``start_step``); earlier steps are never behind.
        window: steps in the trailing mean both curves are smoothed with.
        thresholds: the relative gaps to report the first crossing of.
        tail: the fraction of the last steps the final loss ratio averages.
        diverge_factor: diverged when the smoothed loss exceeds this times the reference's first loss.
    """
    n = min(len(curve), len(reference))
    if n == 0:
        raise ValueError("compare_curves: both curves need at least one step")
    if not 0 < tail <= 1:
        raise ValueError(f"tail={tail!r}: must be a fraction in (0, 1]")
    curve, reference = list(curve[:n]), list(reference[:n])
    # after a non-finite loss the running sum is garbage; those steps count as diverged, so it is never read
    ours, theirs = smoothed(curve, window), smoothed(reference, window)
    bound = diverge_factor * reference[0]
    diverged = next((i for i in range(n) if not math.isfinite(curve[i]) or ours[i] > bound), None)
    behind: dict[float, Optional[int]] = {}
    for t in thresholds:
        # a diverged step is behind by any margin, however its (non-finite) comparison evaluates
        crossing = (i for i in range(start, n) if (diverged is not None and i >= diverged) or ours[i] > (1 + t) * theirs[i])
        behind[t] = next(crossing, None)
    last = max(1, round(tail * n))
    if diverged is not None:
        ratio = math.inf
    else:
        ratio = statistics.fmean(curve[-last:]) / statistics.fmean(reference[-last:])
    return CurveComparison(ratio, behind, diverged)


def _finite_or_none(value: Optional[float], digits: int = 4) -> Optional[float]:
    return round(value, digits) if value is not None and math.isfinite(value) else None


def sweep_row(setting: str, family: str, level: int, curve: Sequence[float], reference: Sequence[float], *,
              val_loss: float, reference_val_loss: float, rel_errors: Sequence[float] = (), start: int = 0,
              window: int = 20, tail: float = 0.1, diverge_factor: float = 1.2) -> dict[str, Any]:
    """One row of the sweep table (keys: :data:`ROW_KEYS`), from a run's losses and its measured gradient errors.

    ``rel_errors`` are the relative gradient errors |g_hat - g| / |g| read on the run's check steps (``[0.0]`` for
    the exact run; empty when nothing was measured). A ratio that is not finite, or a step never reached, is
    ``None``.
    """
    comparison = compare_curves(curve, reference, start=start, window=window, thresholds=(0.03, 0.10), tail=tail,
                                diverge_factor=diverge_factor)
    last = max(1, round(tail * len(curve)))
    finite_errors = [e for e in rel_errors if math.isfinite(e)]
    return {
        "setting": setting,
        "family": family,
        "level": level,
        "final_train_loss": _finite_or_none(statistics.fmean(curve[-last:])),
        "final_loss_ratio": _finite_or_none(comparison.final_loss_ratio),
        "val_loss": _finite_or_none(val_loss),
        "val_loss_ratio": _finite_or_none(val_loss / reference_val_loss),
        "behind_3pct_step": comparison.behind_steps[0.03],
        "behind_10pct_step": comparison.behind_steps[0.10],
        "diverged_step": comparison.diverged_step,
        "rel_error_median": _finite_or_none(statistics.median(finite_errors)) if finite_errors else None,
        "rel_error_max": _finite_or_none(max(finite_errors)) if finite_errors else None,
    }


def _passes(row: Mapping[str, Any], tolerance: float) -> bool:
    ratio = row.get("final_loss_ratio")
    return row.get("diverged_step") is None and ratio is not None and ratio <= tolerance


def critical_point(rows: Sequence[Mapping[str, Any]], tolerance: float = 1.03) -> Optional[Mapping[str, Any]]:
    """The most aggressive row of one family still within ``tolerance``, walking up from the mildest (by
    ``level``) and stopping at the first that is not; ``None`` when even the mildest is not."""
    found = None
    for row in sorted(rows, key=lambda r: r["level"]):
        if not _passes(row, tolerance):
            break
        found = row
    return found


def critical_points(rows: Sequence[Mapping[str, Any]], tolerance: float = 1.03) -> dict[str, Optional[str]]:
    """Each compressed family's critical setting (its ``setting`` name, or ``None``); the exact rows are left out."""
    families: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row["family"] != "exact":
            families.setdefault(row["family"], []).append(row)
    points = {family: critical_point(members, tolerance) for family, members in families.items()}
    return {family: (row["setting"] if row is not None else None) for family, row in points.items()}
