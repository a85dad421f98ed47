"""The step participants of a strategy, for white-box tests that inspect the objects the offer summarises (the
synchroniser's stats and shards, the embedding sharder, the schedule trial): the strategies offer their facts through
``strategy.offer`` alone (``lightning_static_dist/offer.py``), and keep the objects behind it private."""

from __future__ import annotations

from typing import Any, Optional

from lightning_static_dist.participants import Participants


def parts_of(strategy: Any) -> Optional[Participants]:
    """The Trainer strategy's participants, or the Fabric strategy's first trainable model's (``None`` before its
    ``fabric.setup``, after teardown, and under another strategy)."""
    if hasattr(strategy, "_parts"):
        return strategy._parts
    models = getattr(strategy, "_models", None)
    return models[0].parts if models else None


def synchronizer_of(strategy: Any) -> Any:
    """The gradient synchroniser (``None`` where there is none: one rank, graph mode, another strategy)."""
    parts = parts_of(strategy)
    return parts.gradients.synchronizer if parts is not None else None
