"""The step participants of a strategy, for white-box tests that inspect the objects the offer summarises (the
synchroniser's stats and shards, the embedding sharder, the schedule trial): the strategies' properties that returned
them are deprecated (``lightning_static_dist/offer.py``), and a test must not trigger their warning."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Optional

from lightning_static_dist import offer
from lightning_static_dist.participants import Participants

#: a deprecated property's name -> (the internal object it returns, read from the participants; what its warning names)
Deprecated = dict[str, tuple[Callable[[Participants], Any], str]]


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


def deprecated_reads(strategy: Any, table: Deprecated) -> dict[str, Any]:
    """Each deprecated property in ``table`` read twice (on a rank, then returned): the warnings it gave, and whether
    both reads returned the internal object."""
    offer._WARNED.clear()  # (the warning is once per process: a fresh count for this test)
    facts = {}
    for name, (internal, _) in table.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = getattr(strategy, name), getattr(strategy, name)
        facts[name] = {"same": first is internal(parts_of(strategy)) and second is first,
                       "said": [(w.category.__name__, str(w.message)) for w in caught]}
    return facts


def check_deprecated(facts: dict[str, Any], table: Deprecated) -> None:
    """Each property warned once, a one-line ``FutureWarning`` naming it and its replacement, and returned the same
    object as the participants hold."""
    for name, (_, replacement) in table.items():
        (category, message), = facts[name]["said"]
        assert category == "FutureWarning" and "\n" not in message, (name, message)
        assert message.startswith(f"static_dist: strategy.{name} is deprecated (removed in 0.3): "), message
        assert replacement in message and facts[name]["same"], (name, message)
