"""Failures the ranks agree on: a checkpoint that cannot be written or read fails on every rank alike, with one line.

Where one rank's part fails (a full disk, a damaged file), every rank raises the same :class:`CheckpointError` naming
the file (:func:`agree_on`), instead of one rank raising and the others waiting for it in the next collective.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, Optional, TypeVar

import torch.distributed as dist

from lightning_static_dist.checkpoint.format import META_FILE
from lightning_static_dist.agreement.faults import waiting_in

T = TypeVar("T")


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
