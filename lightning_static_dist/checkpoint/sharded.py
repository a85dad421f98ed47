"""Sharded checkpoints written and read through ``torch.distributed.checkpoint``, and their consolidation.

The directory is written as ``<path>.tmp`` and renamed when every rank has finished (:func:`save_sharded`). It is
read as untrusted input: DCP's ``.metadata`` through an allow-list of the classes it holds
(:class:`MetadataUnpickler`), ``lightning_meta.pt`` with ``weights_only`` as the caller asks.
"""

from __future__ import annotations

import importlib
import os
import pickle
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_static_dist.checkpoint.agreement import agree_on
from lightning_static_dist.checkpoint.files import _remove, _replace, _write_file, _writer_naming_os_errors, save_full
from lightning_static_dist.checkpoint.format import (
    DCP_METADATA,
    META_FILE,
    MODEL,
    OPTIM,
    PieceSource,
    full_state_from_pieces,
    parse_key,
)


def save_sharded(path: str, meta: dict[str, Any], model_state: Mapping[str, Tensor], pieces: Mapping[str, Tensor],
                 rank: int, group: Optional[Any] = None) -> None:
    """Write a sharded checkpoint directory at ``path`` (collective: every rank calls it with its own pieces). A rank
    whose part fails (DCP gathers its writers' errors to every rank; ``lightning_meta.pt`` and the rename are rank
    0's) fails the save on every rank alike (:func:`agree_on`): the half-written ``<path>.tmp`` is removed and the
    checkpoint at ``path``, if any, is left as it was."""
    import torch.distributed.checkpoint as dcp

    tmp = f"{os.fspath(path)}.tmp"
    # a save that crashed left its half: removed before any rank writes (the agreement is the barrier)
    agree_on(lambda: _remove(tmp) if rank == 0 else None, path, rank, group=group)
    tensors = {**{MODEL + k: v.detach() for k, v in model_state.items() if torch.is_tensor(v)}, **pieces}
    meta = {**meta, "model_extra": {k: v for k, v in model_state.items() if not torch.is_tensor(v)}}

    def write() -> None:
        dcp.save(tensors, storage_writer=_writer_naming_os_errors(tmp))
        if rank == 0:
            _write_file(meta, os.path.join(tmp, META_FILE))
            _replace(tmp, path)

    agree_on(write, path, rank, group=group, undo=lambda: _remove(tmp) if rank == 0 else None)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index through an allow-list of the classes it holds. DCP's own
    ``FileSystemReader.read_metadata`` calls ``pickle.load`` on it, which runs whatever a planted file's
    ``__reduce__`` says; here any other global is an ``UnpicklingError``, before anything is called.

    Example::

        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = MetadataUnpickler(f).load()
    """

    #: module -> the names in it a ``.metadata`` file refers to (torch 2.6 - 2.13)
    ALLOWED = {
        "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                  "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                  "StorageMeta", "_MEM_FORMAT_ENCODING"),
        "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
        "torch.serialization": ("_get_layout",),  # (a layout pickles as its name, read back by this function)
        "torch": ("Size",),
        "pathlib": ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),  # (StorageMeta.checkpoint_id)
        "pathlib._local": ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),  # (as Python 3.13 pickles)
        "collections": ("OrderedDict",),
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self.ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):  # a dtype pickles as its name
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{DCP_METADATA} refers to {module}.{name}, which is none of the classes a"
                                     " checkpoint's index holds: refused (a planted file?)")


def _metadata_reader(path: str) -> Any:
    """DCP's ``FileSystemReader`` for ``path``, reading the index through :class:`MetadataUnpickler`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(os.path.join(path, DCP_METADATA), "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:  # (as DCP's own reader does)
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(path)


def stored_tensors(path: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor a sharded checkpoint holds: name -> (shape, dtype), from its metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _metadata_reader(path).read_metadata()
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
        dcp.load(tensors, storage_reader=_metadata_reader(path), no_dist=no_dist)
    return tensors


def load_sharded(path: str, no_dist: bool = False, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's checkpoint dict from a sharded directory, with the model's state whole and the optimizer's left
    on disk: ``optimizer_states`` holds a :class:`ShardedOptimizerState` to be cut by whoever loads it.

    ``weights_only`` is ``torch.load``'s for ``lightning_meta.pt`` (``None``: torch's default, ``True``; ``False``
    only for a checkpoint you trust, as with ``Trainer.fit(weights_only=False)``)."""
    meta = torch.load(os.path.join(path, META_FILE), weights_only=weights_only)
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


def consolidate(path: str, out: str, weights_only: Optional[bool] = None) -> None:
    """Write the plain Lightning checkpoint file ``out`` from the sharded directory ``path`` (one process, no group).

    The optimizer's element ranges are read with DCP's own reader (``load_sharded(no_dist=True)``, no process
    group) and joined into each parameter's state. Why not DCP's ``dcp_to_torch_save``: docs/internals.md,
    "checkpoint/sharded.py".

    Example::

        consolidate("runs/x/checkpoints/epoch=0-step=100.ckpt", "model.ckpt")   # or: lsd-consolidate DIR OUT
    """
    checkpoint = load_sharded(path, no_dist=True, weights_only=weights_only)
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [s.full(no_dist=True) if isinstance(s, ShardedOptimizerState) else s
                                          for s in checkpoint["optimizer_states"]]
    save_full(checkpoint, out)
