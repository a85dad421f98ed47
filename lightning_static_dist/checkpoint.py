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
the previous checkpoint as it was; a full checkpoint's file (:func:`save_full`) the same way. The ranks agree on the
outcome of every save and every resume (:func:`agree_on`): where one rank's part fails (a full disk, a damaged file),
every rank raises the same one-line :class:`CheckpointError` naming the file, instead of one rank raising and the
others waiting for it in the next collective. Checkpoints are read as untrusted input: ``lightning_meta.pt`` with
``weights_only`` as the caller asks (torch's default: ``True``), DCP's ``.metadata`` through an allow-list of the
classes it holds (:class:`MetadataUnpickler`). :func:`consolidate` (``lsd-consolidate DIR OUT.ckpt``) turns a
directory into the file an unsharded run would have written; the strategy does this for the last checkpoint at the
end of ``fit``.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import os
import pickle
import re
import shutil
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_static_dist.config.check import check_fields
from lightning_static_dist.processes.faults import waiting_in

META_FILE = "lightning_meta.pt"
DCP_METADATA = ".metadata"  # the name torch.distributed.checkpoint's FileSystemWriter gives its index
MODEL = "model/"
OPTIM = "optim/"

T = TypeVar("T")


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


# ------------------------------------------------------------------------------- failures the ranks agree on


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or read: one line naming the file and what is wrong, raised on every
    rank alike (:func:`agree_on`), which ``lsd-train`` prints instead of a traceback before it exits 1.

    Example::

        static_dist: rank 1: could not write the checkpoint runs/x/last.ckpt: rank 0: [Errno 28] No space left on
        device (nothing was replaced: the previous checkpoints are as they were)
    """


#: What a reader's error says about a checkpoint, in the words of someone who has to fix it: (a piece of the error's
#: text or its type's name, what it means). The first that matches is put before the error's own words.
_DAMAGE = (
    ("PytorchStreamReader", "not a whole checkpoint file (truncated, or not written by torch.save)"),
    ("EOFError", "not a whole checkpoint file (truncated, or not written by torch.save)"),
    ("Weights only load failed", "it holds objects a weights-only load refuses (if you trust where it came from:"
                                 " Trainer.fit(weights_only=False), lsd-consolidate --trust)"),
    ("UnpicklingError", "not a checkpoint file that loads safely"),
    ("Error(s) in loading state_dict", "another model's checkpoint (its parameters do not match this model's)"),
    ("doesn't match the size of optimizer's group", "another model's or optimizer's checkpoint"),
    ("IsADirectoryError", f"a directory without {META_FILE}: not a sharded checkpoint, or its save never finished"),
    ("FileNotFoundError", "a file of the checkpoint is missing"),
    ("MetadataIndex", "a piece its index lists is in none of its files (from a world whose ranks did not all write,"
                      " as a simulated world's, where only rank 0 does?)"),
    ("a rank's pieces are missing", "it lacks optimizer state this world's ranks need (from a world whose ranks"
                                    " did not all write, as a simulated world's, where only rank 0 does?)"),
)


class NotALightningCheckpoint(ValueError):
    """A file that loads (a torch file) but is not what ``Trainer.save_checkpoint`` writes: a tensor, a bare
    ``state_dict``, another program's dict. Its message is the whole reason (:func:`reason_of` adds no type)."""


#: What Lightning reads of every checkpoint it resumes before anything of ours would say what is wrong: the version
#: (its migration of an older checkpoint) and the model's weights.
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")


def check_lightning_checkpoint(checkpoint: Any) -> None:
    """Raise :class:`NotALightningCheckpoint` unless ``checkpoint`` (a loaded file) is a mapping with
    :data:`LIGHTNING_KEYS`: before Lightning reads it, a plain torch file fails deep inside Lightning
    (``KeyError: 'pytorch-lightning_version'``, ``'Tensor' object has no attribute 'pop'``).

    Example::

        check_lightning_checkpoint(torch.load("weights.pt"))   # not a Lightning checkpoint: it holds a Tensor ...
    """
    if not isinstance(checkpoint, Mapping):
        raise NotALightningCheckpoint(f"not a Lightning checkpoint: it holds a {type(checkpoint).__name__}, not the"
                                      " dictionary Trainer.save_checkpoint writes")
    missing = [key for key in LIGHTNING_KEYS if key not in checkpoint]
    if missing:
        keys = [repr(key) for key in list(checkpoint)[:6]] + (["..."] if len(checkpoint) > 6 else [])
        without = " and ".join(map(repr, missing))
        raise NotALightningCheckpoint(f"not a Lightning checkpoint: a dictionary without {without} (its keys:"
                                      f" {', '.join(keys) or 'none'})")


def reason_of(err: BaseException, reading: bool = False) -> str:
    """One line for what went wrong: the error's own words (every line joined, no C++ source location), for DCP's
    :class:`CheckpointException` those of the first rank whose part failed; when ``reading``, what the error means
    for the checkpoint first (:data:`_DAMAGE`)."""
    failures = _dcp_failures(err)
    if failures:
        rank, (inner, _) = min(failures.items())
        return f"rank {rank}'s part: {reason_of(inner, reading)}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if "Weights only load failed" in str(err):  # torch's advice takes 10 lines; the refused global is the point
        lines = [line for line in lines[1:] if "global" in line.lower()][:1] or lines[:1]
    text = re.sub(r"\[enforce fail at [^\]]*\]\s*\.?\s*", "", " ".join(lines))[:300]
    if not isinstance(err, (OSError, NotALightningCheckpoint)):  # (their words say it all)
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    meaning = next((m for key, m in _DAMAGE if key in str(err) or key == type(err).__name__), None) if reading else None
    return f"{meaning}: {text}" if meaning else text


def _dcp_failures(err: BaseException) -> Optional[dict[int, Any]]:
    """DCP's ``CheckpointException`` (a ``BaseException``) gathers every rank's error: rank -> (error, trace).
    ``None`` for any other error (DCP not imported yet: it cannot have raised; it is slow to import)."""
    dcp = sys.modules.get("torch.distributed.checkpoint")
    return err.failures if dcp is not None and isinstance(err, dcp.CheckpointException) else None


def agree_on(attempt: Callable[[], T], path: Any, rank: int, *, reading: bool = False, group: Optional[Any] = None,
             undo: Optional[Callable[[], None]] = None) -> T:
    """``attempt()`` on this rank (a part of writing the checkpoint at ``path``, or of resuming from it when
    ``reading``), then the ranks agree on its outcome: a collective, every rank calls it once its attempt is over.
    Where any rank failed, every rank calls ``undo`` and raises the same :class:`CheckpointError`, naming the first
    rank that failed.

    Example::

        agree_on(lambda: save_full(checkpoint, path) if rank == 0 else None, path, rank)
    """
    failure: Optional[str] = None
    cause: Optional[BaseException] = None
    result: Any = None
    try:
        result = attempt()
    except BaseException as err:
        failures = _dcp_failures(err)
        if failures is None and not isinstance(err, Exception):
            raise  # (KeyboardInterrupt, SystemExit: not the checkpoint's fault)
        cause, failure = err, reason_of(err, reading)
        if failures is None:  # (DCP's error names the failing rank itself, the same on every rank)
            failure = f"rank {rank}: {failure}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        outcomes: list[Optional[str]] = [None] * dist.get_world_size(group)
        with waiting_in(f"the ranks' agreement on {'reading' if reading else 'writing'} {os.fspath(path)}"):
            dist.all_gather_object(outcomes, failure, group=group)
        failure = next((outcome for outcome in outcomes if outcome is not None), None)
    if failure is None:
        return result
    if undo is not None:
        undo()
    doing = "cannot resume from" if reading else "could not write the checkpoint"
    kept = "" if reading else " (nothing was replaced: the previous checkpoints are as they were)"
    raise CheckpointError(f"static_dist: rank {rank}: {doing} {os.fspath(path)}: {failure}{kept}") from cause


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


def save_full(checkpoint: Mapping[str, Any], path: str) -> None:
    """Write a Lightning checkpoint file at ``path`` (one process). Serialised in memory first, as Lightning's
    ``_atomic_save`` does, so a process killed meanwhile leaves nothing on disk; then written to ``<path>.tmp``
    beside it (not to a temporary file elsewhere, whose move onto another file system is a copy that a full disk
    can cut short over the previous checkpoint), flushed to the disk, and put in place by :func:`_replace`. A write
    that fails leaves no ``.tmp`` behind and the previous checkpoint as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = partial_file(path)
    try:
        _write_file(checkpoint, tmp)
        _replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def partial_file(path: str) -> str:
    """Where :func:`save_full` writes ``path`` before it is whole: beside it, under a name with no part of
    ``path``'s own (Lightning's SLURM resume takes the version of any name holding ``hpc_ckpt``, a ``.tmp`` too), the
    same for every save of ``path`` (a later one overwrites what a killed one left)."""
    digest = hashlib.sha1(os.path.basename(path).encode()).hexdigest()[:12]
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".lsd-partial-{digest}.tmp")


def is_leftover(name: str, beside: Container[str]) -> bool:
    """Whether the file or folder ``name``, in a folder holding the names ``beside``, is what an interrupted save
    left: a partial write (:func:`partial_file`'s, a sharded save's ``<path>.tmp``) or the old copy :func:`_replace`
    moved aside, beside its replacement. Never a checkpoint: an ``.old`` alone is the one ``ckpt_path=last`` resumes
    from (the save crashed between its two renames)."""
    if name.endswith(".tmp"):
        return name.startswith(".lsd-partial-") or name.endswith(".ckpt.tmp")
    return name.endswith(".ckpt.old") and name[: -len(".old")] in beside


def remove_leftovers(roots: Iterable[str]) -> list[str]:
    """Remove what interrupted saves left under ``roots`` (each searched whole, as ``ckpt_path=last`` searches it) and
    return the paths removed. Only before any save of the run (``lsd-train``, before its processes start): a save
    in progress has its partial file too."""
    removed: list[str] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            if is_sharded_checkpoint(dirpath):
                dirnames[:] = []  # (its pieces are no leftovers)
                continue
            here = set(dirnames) | set(filenames)
            gone = sorted(name for name in here if is_leftover(name, here))
            for name in gone:
                _remove(os.path.join(dirpath, name))
            removed += [os.path.join(dirpath, name) for name in gone]
            dirnames[:] = [name for name in dirnames if name not in gone]
    return removed


def _write_file(obj: Any, path: str) -> None:
    """``torch.save`` into memory, then the bytes to ``path``, flushed to the disk. Through Python's own file, so a
    failed write is the OS's ``OSError`` (``torch.save`` to a path or a stream reports one as "file write failed"
    or "unexpected pos")."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())


def _os_error_in(err: BaseException) -> Optional[OSError]:
    """The ``OSError`` behind ``err`` (``err`` itself, or what it was raised while handling): torch's zip writer
    turns a short write into ``RuntimeError: unexpected pos ...``, the OS's error left in its ``__context__``."""
    seen: Optional[BaseException] = err
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _writer_naming_os_errors(path: str) -> Any:
    """DCP's ``FileSystemWriter`` for ``path``, raising the OS's own error when a write fails: DCP sends each rank's
    error to the others pickled, which keeps no ``__context__``, and "unexpected pos 704 vs 598" says nothing of a
    full disk."""
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().write_data(*args, **kwargs)
            except Exception as err:
                os_error = _os_error_in(err)
                if os_error is None or os_error is err:
                    raise
                raise os_error from err

    return Writer(path)


def _remove(path: str) -> None:
    """Remove a file, a link (not what it points to) or a directory tree at ``path``, if there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _replace(new: str, path: str) -> None:
    """Put ``new`` (a file or a directory) at ``path``; the old one is moved aside first and removed last, so a
    failure in between leaves one of the two whole under its own name (a crash between the renames leaves
    ``<path>.old``, which ``lsd-train``'s ``ckpt_path=last`` finds), and a failed second rename puts the old one
    back."""
    old = f"{path}.old"
    if os.path.lexists(path):
        if os.path.islink(path):
            os.remove(path)  # Lightning's save_last="link": the link goes, what it points to stays
        else:
            _remove(old)  # (an earlier save's, stopped before its last step: the one at `path` is newer)
            os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        if os.path.lexists(old):
            os.replace(old, path)
        raise
    _sync_folder(os.path.dirname(os.path.abspath(path)))  # the rename on the disk before the old one goes
    _remove(old)


def _sync_folder(folder: str) -> None:
    """Flush a folder's entries (a rename) to the disk; where the OS cannot open a folder for it, nothing."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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

    Why not ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: it writes a directory's entries as they
    are, here ``optim/<i>/<key>/<lo>-<hi>`` element ranges; a Lightning checkpoint needs them joined into each
    parameter's optimizer state and placed under the optimizer's own indices, with ``lightning_meta.pt`` merged in.
    The ranges are read the same way (``load_sharded(no_dist=True)``: DCP's own reader, no process group).

    Example::

        consolidate("runs/x/checkpoints/epoch=0-step=100.ckpt", "model.ckpt")   # or: lsd-consolidate DIR OUT
    """
    checkpoint = load_sharded(path, no_dist=True, weights_only=weights_only)
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [s.full(no_dist=True) if isinstance(s, ShardedOptimizerState) else s
                                          for s in checkpoint["optimizer_states"]]
    save_full(checkpoint, out)


def training_progress(path: str) -> Optional[tuple[int, int]]:
    """``(global_step, completed epochs)`` a checkpoint (a file, or a sharded checkpoint's directory) was saved at,
    read without loading its tensors (a memory-mapped, weights-only load); ``None`` when it cannot be read that way,
    and the resume itself then says what is wrong with it.

    Example::

        training_progress("runs/x/checkpoints/epoch=0-step=300.ckpt")   # (300, 0)
    """
    sharded = is_sharded_checkpoint(path)
    try:
        meta = torch.load(os.path.join(path, META_FILE) if sharded else path, map_location="cpu", mmap=True,
                          weights_only=True)
        meta = meta["lightning"] if sharded else meta  # (a sharded checkpoint keeps Lightning's dict under its key)
        # "processed", as Lightning's own fit loop counts finished epochs: the epoch-end checkpoint is written before
        # "completed" moves on
        epochs = meta.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
        return int(meta["global_step"]), int(epochs.get("processed", 0))
    except Exception:  # (damaged, planted, or not a Lightning checkpoint)
        return None
