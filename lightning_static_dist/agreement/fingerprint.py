"""Cross-rank agreement checks: every rank must train the same program, or collectives pair up wrongly and hang.

Each rank describes what it has as a list of lines (parameter names and shapes; the compiled graphs' structures);
the lists are exchanged once with ``all_gather_object`` and compared on every rank, so that on a mismatch *every*
rank raises the same one-paragraph error naming the ranks and the first difference, within seconds — never a
collective that waits until the timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch.distributed as dist
from torch import nn


class RankMismatchError(RuntimeError):
    """Ranks disagree on the model or on what they compiled."""


def describe_parameters(module: nn.Module) -> list[str]:
    """One line per parameter and buffer: name, shape, dtype, requires_grad."""
    lines = [f"param {n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}" for n, p in module.named_parameters()]
    lines += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    return lines


def first_difference(per_rank: Sequence[Sequence[str]]) -> Optional[str]:
    """Where rank descriptions first differ from rank 0's, as a sentence; ``None`` when all agree.

    Example::

        >>> first_difference([["a", "b"], ["a", "c"]])
        "rank 0 has 'b' where rank 1 has 'c' (line 2)"
    """
    reference = per_rank[0]
    for rank, lines in enumerate(per_rank[1:], start=1):
        for i in range(max(len(reference), len(lines))):
            mine = reference[i] if i < len(reference) else "<nothing>"
            theirs = lines[i] if i < len(lines) else "<nothing>"
            if mine != theirs:
                return f"rank 0 has {mine!r} where rank {rank} has {theirs!r} (line {i + 1})"
    return None


def check_same_on_all_ranks(what: str, lines: list[str], group: Optional[dist.ProcessGroup] = None) -> None:
    """Raise :class:`RankMismatchError` on every rank unless every rank passed the same ``lines``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered: list[Optional[list[str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, lines, group=group)
    difference = first_difference([g or [] for g in gathered])
    if difference is not None:
        raise RankMismatchError(f"static_dist: ranks disagree on {what}: {difference}. Every rank must run the same program.")
