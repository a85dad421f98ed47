"""The Trainer strategy's checkpoint files: how a full checkpoint is written on rank 0, read on every rank, and how
its optimizer states reach Lightning. Functions the strategy's checkpoint hooks call; the agreement of the ranks on
each outcome stays in those hooks (``lightning_static_dist/checkpoint/agreement.py``'s ``agree_on``).

Example::

    write_full(strategy.checkpoint_io, checkpoint, "last.ckpt", storage_options=None)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Callable, Optional

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

from lightning_static_dist.checkpoint import (
    ShardedOptimizerState,
    check_lightning_checkpoint,
    is_sharded_checkpoint,
    load_sharded,
    save_full,
)
from lightning_static_dist.participants import Participants, StepPhases


def write_full(plugin: CheckpointIO, checkpoint: dict[str, Any], filepath: _PATH,
               storage_options: Optional[Any]) -> None:
    """Rank 0's part of a full save. Lightning's own ``TorchCheckpointIO`` writes through a temporary file in
    ``/tmp`` moved into place, a copy where ``/tmp`` is another file system, which a full disk cuts short over the
    previous checkpoint: a local file is written by :func:`~lightning_static_dist.checkpoint.save_full` instead. A
    user's ``CheckpointIO``, or a remote path, is left to the plugin."""
    if type(plugin) is TorchCheckpointIO and storage_options is None and isinstance(get_filesystem(filepath),
                                                                                      LocalFileSystem):
        save_full(checkpoint, os.fspath(filepath))
    else:
        plugin.save_checkpoint(checkpoint, filepath, storage_options=storage_options)


def read(path: _PATH, weights_only: Optional[bool], read_full: Callable[[], dict[str, Any]],
         phases: StepPhases) -> dict[str, Any]:
    """The checkpoint at ``path`` on this rank: sharded (a collective: every rank reads the model's tensors), or
    ``read_full()``'s, whose entries the participants take out. A plain torch file: one line, not Lightning's
    ``KeyError``."""
    if is_sharded_checkpoint(path):
        checkpoint = load_sharded(os.fspath(path), weights_only=weights_only)
        check_lightning_checkpoint(checkpoint)
        return checkpoint
    checkpoint = read_full()
    check_lightning_checkpoint(checkpoint)
    phases.load_state_dict(checkpoint)  # each takes its own entries out (kept until its setup, if before)
    return checkpoint


def model_state_to_load(parts: Participants, checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """The checkpoint as Lightning's ``load_model_state_dict`` is to read it (its model state as this rank loads it)."""
    state = parts.model_state_to_load(checkpoint["state_dict"])
    return checkpoint if state is checkpoint["state_dict"] else {**checkpoint, "state_dict": state}


def optimizer_states_to_load(parts: Participants, optimizers: list[Any],
                             checkpoint: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The checkpoint as Lightning's ``load_optimizer_state_dict`` is to read it (each state as this rank's optimizer
    loads it; an unsharded run resumes from a sharded one); ``None`` where a participant loaded it in its own form."""
    if parts.load_optimizer_states(checkpoint):
        return None
    states = checkpoint["optimizer_states"]
    if any(isinstance(state, ShardedOptimizerState) for state in states):
        states = [s.full() if isinstance(s, ShardedOptimizerState) else s for s in states]
        checkpoint = {**checkpoint, "optimizer_states": states}
    loaded = [parts.optimizer_state_to_load(opt, state) for opt, state in zip(optimizers, states)]
    if any(new is not old for new, old in zip(loaded, states)):
        checkpoint = {**checkpoint, "optimizer_states": loaded}
    return checkpoint
