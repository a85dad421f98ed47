"""What every rank must agree on, compared across ranks (:mod:`lightning_static_dist.agreement.fingerprint`): the first
difference named, and ranks that built different models stopped at once with it."""

from __future__ import annotations

import time

import pytest
from torch import nn

from _dist import run_ranks
from lightning_static_dist.agreement.fingerprint import first_difference


def test_first_difference() -> None:
    assert first_difference([["a", "b"], ["a", "b"]]) is None
    assert first_difference([["a", "b"], ["a", "c"]]) == "rank 0 has 'b' where rank 1 has 'c' (line 2)"
    assert first_difference([["a"], ["a", "x"]]) == "rank 0 has '<nothing>' where rank 1 has 'x' (line 2)"


def _mismatched_models(rank: int, world: int) -> str:
    from lightning_static_dist.agreement.fingerprint import RankMismatchError, check_same_on_all_ranks, describe_parameters

    model = nn.Linear(4, 4 if rank == 0 else 5)  # rank 1 built another model
    started = time.perf_counter()
    try:
        check_same_on_all_ranks("the model's parameters", describe_parameters(model))
    except RankMismatchError as err:
        return f"{time.perf_counter() - started:.1f}s {err}"
    return "no error"


@pytest.mark.multiprocess
def test_ranks_with_different_models_stop_at_once_with_the_difference() -> None:
    for result in run_ranks(_mismatched_models, 2, timeout=60):
        seconds, message = result.split(" ", 1)
        assert float(seconds.rstrip("s")) < 10
        assert "ranks disagree on the model's parameters" in message
        assert "rank 0 has 'param weight (4, 4)" in message and "rank 1 has 'param weight (5, 4)" in message
