"""Counts in the package's output, in English: ``1 bucket``, ``3 buckets`` (never ``1 buckets``).

Example::

    counted(len(plan.buckets), "bucket")   # "1 bucket", "2 buckets"
    counted(1, "piece")                    # "1 piece"
"""

from __future__ import annotations


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and ``noun``, the noun plural unless ``n`` is one (``plural``, default ``noun + "s"``, for the irregular:
    ``counted(2, "batch", "batches")``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
