"""Checkpoint files put in place atomically: written beside their path, flushed, renamed over the old one last.

A write that fails leaves the previous checkpoint as it was; what an interrupted save left is recognised
(:func:`is_leftover`) and removed before a run starts (:func:`remove_leftovers`).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from collections.abc import Container, Iterable, Mapping
from typing import Any, Optional

import torch

from lightning_static_dist.checkpoint.format import META_FILE, is_sharded_checkpoint


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
