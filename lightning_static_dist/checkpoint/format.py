"""The sharded checkpoint's layout: the names of its entries, and optimizer state read from element ranges.

A directory holds ``model/<name>`` (every model tensor, whole), ``optim/<i>/<key>/<lo>-<hi>`` (elements ``lo..hi`` of
the flattened original parameter ``i``'s optimizer state ``key``, as one rank holds them), ``optim/<i>/<key>`` (a
per-parameter scalar) and ``lightning_meta.pt``. Ranges refer to the original parameters, not to buckets, so a run
with another bucket plan, world size or mesh finds what it needs by overlap.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

META_FILE = "lightning_meta.pt"
DCP_METADATA = ".metadata"  # the name torch.distributed.checkpoint's FileSystemWriter gives its index
MODEL = "model/"
OPTIM = "optim/"


def is_sharded_checkpoint(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, META_FILE))



def range_key(index: int, key: str, lo: int, hi: int) -> str:
    return f"{OPTIM}{index}/{key}/{lo}-{hi}"


def scalar_key(index: int, key: str) -> str:
    return f"{OPTIM}{index}/{key}"


def parse_key(name: str) -> tuple[int, str, Optional[tuple[int, int]]]:
    """``optim/3/exp_avg/0-128`` -> ``(3, "exp_avg", (0, 128))``; ``optim/3/step`` -> ``(3, "step", None)``."""
    parts = name[len(OPTIM):].split("/")
    if len(parts) == 3:
        lo, hi = parts[2].split("-")
        return int(parts[0]), parts[1], (int(lo), int(hi))
    return int(parts[0]), parts[1], None


class PieceSource:
    """Optimizer state read from pieces: elements of any range of a flattened parameter, assembled by overlap.

    Example::

        source = PieceSource({"optim/0/exp_avg/0-2": torch.ones(2), "optim/0/exp_avg/2-4": torch.zeros(2)})
        source.elements(0, "exp_avg", 1, 3)   # tensor([1., 0.])
    """

    def __init__(self, tensors: Mapping[str, Tensor], missing_as_zeros: bool = False) -> None:
        self.missing_as_zeros = missing_as_zeros
        """Elements no piece holds read as zeros instead of raising (a simulated world: only rank 0's pieces exist)."""
        self.ranges: dict[tuple[int, str], list[tuple[int, int, Tensor]]] = defaultdict(list)
        self.scalars: dict[tuple[int, str], Tensor] = {}
        for name, tensor in tensors.items():
            if not name.startswith(OPTIM):
                continue
            index, key, span = parse_key(name)
            if span is None:
                self.scalars[(index, key)] = tensor
            else:
                self.ranges[(index, key)].append((span[0], span[1], tensor))

    def keys(self, index: int) -> dict[str, bool]:
        """State keys of parameter ``index``: ``True`` for element-wise ones, ``False`` for scalars."""
        found = {key: True for (i, key) in self.ranges if i == index}
        found.update({key: False for (i, key) in self.scalars if i == index})
        return found

    def scalar(self, index: int, key: str) -> Tensor:
        return self.scalars[(index, key)].clone()

    def elements(self, index: int, key: str, lo: int, hi: int) -> Tensor:
        pieces = self.ranges[(index, key)]
        out = (torch.zeros if self.missing_as_zeros else torch.empty)(hi - lo, dtype=pieces[0][2].dtype)
        covered = 0
        for a, b, tensor in pieces:
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out[s - lo : e - lo].copy_(tensor.reshape(-1)[s - a : e - a])
                covered += e - s
        if covered < hi - lo and not self.missing_as_zeros:
            raise ValueError(f"static_dist: the checkpoint holds {covered} of elements {lo}..{hi} of parameter {index}'s"
                             f" optimizer state {key!r} (a rank's pieces are missing?)")
        return out


class FullSource:
    """Optimizer state read from a full-form ``optimizer.state_dict()`` (an unsharded run, or a gathered one)."""

    def __init__(self, state: Mapping[Any, Mapping[str, Any]], numels: Mapping[int, int]) -> None:
        self.state = state
        self.numels = numels

    def _entry(self, index: int) -> Mapping[str, Any]:
        return self.state.get(index, self.state.get(str(index), {}))  # type: ignore[call-overload]

    def keys(self, index: int) -> dict[str, bool]:
        numel = self.numels[index]
        return {key: torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel for key, v in self._entry(index).items()}

    def scalar(self, index: int, key: str) -> Any:
        value = self._entry(index)[key]
        return value.clone() if torch.is_tensor(value) else value

    def elements(self, index: int, key: str, lo: int, hi: int) -> Tensor:
        return self._entry(index)[key].reshape(-1)[lo:hi]


def full_state_from_pieces(source: PieceSource, shapes: Mapping[int, torch.Size]) -> dict[int, dict[str, Any]]:
    """The full-form ``state`` (parameter index -> {key: tensor shaped like the parameter}) from pieces."""
    state: dict[int, dict[str, Any]] = {}
    for index, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        entry = {}
        for key, elementwise in source.keys(index).items():
            entry[key] = source.elements(index, key, 0, numel).view(shape) if elementwise else source.scalar(index, key)
        if entry:
            state[index] = entry
    return state
