"""Sharded checkpoints (``sync.reduce: reduce_scatter``): ``torch.distributed.checkpoint`` directories that any world
size or mesh can resume from, and their consolidation into a plain Lightning checkpoint file.

- :mod:`~lightning_static_dist.checkpoint.format`: the directory's entries, and optimizer state read from ranges;
- :mod:`~lightning_static_dist.checkpoint.sharded`: writing and reading a directory through DCP, consolidation;
- :mod:`~lightning_static_dist.checkpoint.files`: a file or directory put in place atomically, and leftovers;
- :mod:`~lightning_static_dist.checkpoint.agreement`: every rank fails a save or a resume alike, with one line.

A save is written beside its target and renamed into place, the ranks agree on the outcome of every save and resume,
and checkpoints are read as untrusted input (docs/reliability.md: How).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_static_dist.checkpoint.agreement import (
    LIGHTNING_KEYS,
    CheckpointError,
    NotALightningCheckpoint,
    agree_on,
    check_lightning_checkpoint,
    reason_of,
)
from lightning_static_dist.checkpoint.files import (
    is_leftover,
    partial_file,
    remove_leftovers,
    save_full,
    training_progress,
)
from lightning_static_dist.checkpoint.format import (
    DCP_METADATA,
    META_FILE,
    MODEL,
    OPTIM,
    FullSource,
    PieceSource,
    full_state_from_pieces,
    is_sharded_checkpoint,
    parse_key,
    range_key,
    scalar_key,
)
from lightning_static_dist.checkpoint.sharded import (
    MetadataUnpickler,
    ShardedOptimizerState,
    consolidate,
    load_sharded,
    read_tensors,
    save_sharded,
    stored_tensors,
)
from lightning_static_dist.config.check import check_fields

__all__ = [
    "DCP_METADATA", "LIGHTNING_KEYS", "META_FILE", "MODEL", "OPTIM", "CheckpointConfig", "CheckpointError",
    "FullSource", "MetadataUnpickler", "NotALightningCheckpoint", "PieceSource", "ShardedOptimizerState", "agree_on",
    "check_lightning_checkpoint", "consolidate", "full_state_from_pieces", "is_leftover", "is_sharded_checkpoint",
    "load_sharded", "parse_key", "partial_file", "range_key", "read_tensors", "reason_of", "remove_leftovers",
    "save_full", "save_sharded", "scalar_key", "stored_tensors", "training_progress",
]


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
