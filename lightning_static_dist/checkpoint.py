"""Sharded checkpoints (``sync.reduce: reduce_scatter``): ``torch.distributed.checkpoint`` directories that any world
size or mesh can resume from, and their consolidation into a plain Lightning checkpoint file.

A sharded checkpoint is a directory (at the path Lightning chose, e.g. ``epoch=0-step=100.ckpt/``) holding:

- ``model/<name>``: every model tensor, whole (replicated on every rank; DCP writes each once);
- ``optim/<i>/<key>/<lo>-<hi>``: elements ``lo..hi`` of the *flattened* original parameter ``i``'s optimizer state
  ``key`` (``exp_avg`` ...), as one rank holds them; ``optim/<i>/<key>``: a per-parameter scalar (Adam's ``step``).
  Ranges refer to the original parameters, not to buckets, so a run with another bucket plan, world size or mesh
  finds what it needs by overlap;
- ``lightning_meta.pt`` (rank 0): the rest of Lightning's checkpoint (loops, callbacks, schedulers, hyper-
  parameters ...) and the optimizer's param groups in full form.

The directory is written as ``<path>.tmp`` and renamed when every rank has finished, so a failure mid-save leaves
the previous checkpoint as it was. :func:`consolidate` (``lsd-consolidate DIR OUT.ckpt``) turns a directory into the
file an unsharded run would have written; the strategy does this for the last checkpoint at the end of ``fit``.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.config.check import check_fields

META_FILE = "lightning_meta.pt"
MODEL = "model/"
OPTIM = "optim/"


@dataclass
class CheckpointConfig:
    """``strategy.checkpoint``: how checkpoints hold state that ``reduce_scatter`` splits between ranks.

    Example::

        StaticDistStrategy(checkpoint={"format": "sharded", "consolidate_at_end": True})
    """

    KEY = "strategy.checkpoint"

    format: Literal["auto", "full", "sharded"] = "auto"
    """``sharded``: a ``torch.distributed.checkpoint`` directory in which each rank writes its own optimizer-state
    ranges (nothing is gathered; any world size or mesh resumes from it). ``full``: one Lightning file with the
    optimizer state gathered to the form an unsharded run writes. ``auto``: ``sharded`` with ``reduce_scatter``,
    else ``full`` (nothing is split then)."""
    consolidate_at_end: bool = True
    """At the end of ``fit``, turn the last sharded checkpoint into a plain Lightning file in place (the same path);
    any other one: ``lsd-consolidate DIR OUT.ckpt``."""

    def __post_init__(self) -> None:
        check_fields(self)


def is_sharded_checkpoint(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, META_FILE))


# ------------------------------------------------------------------------------------------- state as pieces


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


# ----------------------------------------------------------------------------------------------- save / load


def save_sharded(path: str, meta: dict[str, Any], model_state: Mapping[str, Tensor], pieces: Mapping[str, Tensor],
                 rank: int) -> None:
    """Write a sharded checkpoint directory at ``path`` (collective: every rank calls it with its own pieces)."""
    import torch.distributed.checkpoint as dcp

    tmp = f"{os.fspath(path)}.tmp"
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    tensors = {**{MODEL + k: v.detach() for k, v in model_state.items() if torch.is_tensor(v)}, **pieces}
    meta = {**meta, "model_extra": {k: v for k, v in model_state.items() if not torch.is_tensor(v)}}
    dcp.save(tensors, checkpoint_id=tmp)
    if rank == 0:
        torch.save(meta, os.path.join(tmp, META_FILE))
        _replace(tmp, path)
    dist.barrier()


def _replace(new: str, path: str) -> None:
    """Put ``new`` (a file or a directory) at ``path``; the old one is moved aside first and removed last, so a
    failure in between leaves one of the two whole under its own name."""
    old = f"{path}.old"
    if os.path.lexists(path):
        if os.path.islink(path):
            os.remove(path)  # Lightning's save_last="link": the link goes, what it points to stays
        else:
            os.replace(path, old)
    os.replace(new, path)
    if os.path.isdir(old):
        shutil.rmtree(old)
    elif os.path.lexists(old):
        os.remove(old)


def stored_tensors(path: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor a sharded checkpoint holds: name -> (shape, dtype), from its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(path).read_metadata()
    return {name: (entry.size, entry.properties.dtype) for name, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)}


def read_tensors(path: str, names: Iterable[str], stored: Optional[Mapping[str, tuple[torch.Size, torch.dtype]]] = None,
                 no_dist: bool = False) -> dict[str, Tensor]:
    """Load the named tensors of a sharded checkpoint (collective unless ``no_dist``)."""
    import torch.distributed.checkpoint as dcp

    stored = stored if stored is not None else stored_tensors(path)
    tensors = {name: torch.empty(stored[name][0], dtype=stored[name][1]) for name in names}
    with warnings.catch_warnings():  # no_dist: DCP warns that it assumes one process, which is what was asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, checkpoint_id=path, no_dist=no_dist)
    return tensors


def load_sharded(path: str, no_dist: bool = False) -> dict[str, Any]:
    """Lightning's checkpoint dict from a sharded directory, with the model's state whole and the optimizer's left
    on disk: ``optimizer_states`` holds a :class:`ShardedOptimizerState` to be cut by whoever loads it."""
    meta = torch.load(os.path.join(path, META_FILE), weights_only=False)
    stored = stored_tensors(path)
    model = read_tensors(path, [n for n in stored if n.startswith(MODEL)], stored, no_dist=no_dist)
    checkpoint = dict(meta["lightning"])
    checkpoint["state_dict"] = {**{name[len(MODEL):]: tensor for name, tensor in model.items()}, **meta["model_extra"]}
    if meta["has_optimizer"]:  # (a weights-only save has none)
        checkpoint["optimizer_states"] = [ShardedOptimizerState(path, meta["param_groups"], meta["shapes"], stored)]
    return checkpoint


class ShardedOptimizerState:
    """An optimizer's state still in a sharded checkpoint: read whole (:meth:`full`) or only the ranges a rank needs
    (:meth:`pieces`)."""

    def __init__(self, path: str, param_groups: list[dict[str, Any]], shapes: Mapping[int, torch.Size],
                 stored: Mapping[str, tuple[torch.Size, torch.dtype]]) -> None:
        self.path = path
        self.param_groups = param_groups
        self.shapes = shapes
        self.stored = stored

    def pieces(self, wanted: Iterable[tuple[int, int, int]], no_dist: bool = False) -> PieceSource:
        """Read every stored piece overlapping one of ``wanted`` = ``(parameter index, lo, hi)`` (collective)."""
        wanted = list(wanted)
        names = []
        for name in self.stored:
            if not name.startswith(OPTIM):
                continue
            index, _, span = parse_key(name)
            if any(i == index and (span is None or (span[0] < hi and span[1] > lo)) for i, lo, hi in wanted):
                names.append(name)
        return PieceSource(read_tensors(self.path, names, self.stored, no_dist=no_dist))

    def full(self, no_dist: bool = False) -> dict[str, Any]:
        """The full-form ``optimizer.state_dict()`` (collective unless ``no_dist``)."""
        source = self.pieces(((i, 0, int(torch.Size(s).numel())) for i, s in self.shapes.items()), no_dist=no_dist)
        return {"state": full_state_from_pieces(source, self.shapes), "param_groups": self.param_groups}


def consolidate(path: str, out: str) -> None:
    """Write the plain Lightning checkpoint file ``out`` from the sharded directory ``path`` (one process, no group).

    Why not ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: it writes a directory's entries as they
    are, here ``optim/<i>/<key>/<lo>-<hi>`` element ranges; a Lightning checkpoint needs them joined into each
    parameter's optimizer state and placed under the optimizer's own indices, with ``lightning_meta.pt`` merged in.
    The ranges are read the same way (``load_sharded(no_dist=True)``: DCP's own reader, no process group).

    Example::

        consolidate("runs/x/checkpoints/epoch=0-step=100.ckpt", "model.ckpt")   # or: lsd-consolidate DIR OUT
    """
    checkpoint = load_sharded(path, no_dist=True)
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [s.full(no_dist=True) if isinstance(s, ShardedOptimizerState) else s
                                          for s in checkpoint["optimizer_states"]]
    tmp = f"{out}.tmp"
    torch.save(checkpoint, tmp)
    _replace(tmp, out)
