"""CompressionState: each rank's compressor state gathered to rank 0 in a checkpoint and given back to its own rank
(whether the checkpoint is loaded before the synchroniser is built, as Lightning does, or after it); another world
size keeps only the round count; ``compression.name: auto`` swaps its candidates in at batch starts, and a
checkpoint's choice reduces from the first step after a resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from lightning_static_dist.compression import CompressingReducer
from lightning_static_dist.compression.reducer_state import COMPRESSION_KEY
from lightning_static_dist.participants.compression_state import TRIAL_KEY, CompressionState
from lightning_static_dist.participants.gradients import build_synchronizer
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.sync.bucket_reducer import MeanAllReduce

from ._view import Context, Regression, View

TOPK = {"compression": {"name": "topk", "density": 0.1, "min_numel": 16}}  # error feedback: a residual per rank


class _HookGradients:
    """The gradient participant as CompressionState reads it: the hook-driven mode, and its synchroniser."""

    mode = "hooks"

    def __init__(self, synchronizer: Any) -> None:
        self.synchronizer = synchronizer


def _participant(config: StrategyConfig, step: int = 0) -> tuple[Regression, Any, CompressionState, Context]:
    """A model, its (unattached, exact) hook synchroniser over the default group, and the participant, at ``step``;
    the participant's ``setup`` installs the configured compressor."""
    model = Regression()
    view = View(model, config)
    synchronizer = build_synchronizer(model.named_parameters(), view.plan, dist.group.WORLD)
    context = view.enter(Context(global_step=step))
    return model, synchronizer, CompressionState(view, _HookGradients(synchronizer)), context


def _train(model: Regression, synchronizer: Any, rank: int, steps: int) -> None:
    synchronizer.attach()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data: its own residual
        model.training_step((torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)), step).backward()
        synchronizer.finish_if_pending()
        model.zero_grad(set_to_none=True)


def _residuals(rank: int, world: int) -> dict[str, Any]:
    config = StrategyConfig.from_dict(TOPK)
    model, synchronizer, state, _ = _participant(config)
    state.setup(Context())
    _train(model, synchronizer, rank, steps=3)
    trained = synchronizer.reducer.state_dict()
    checkpoint = state.state_dict()  # every rank: a gather to rank 0
    shared: list[Any] = [checkpoint]
    dist.broadcast_object_list(shared, src=0)  # what every rank reads back from rank 0's file

    _, before, loaded_first, _ = _participant(config)  # Lightning loads a checkpoint before the strategy's setup
    entries = dict(shared[0])
    loaded_first.load_state_dict(entries)
    reducer_before_setup = type(before.reducer).__name__  # exact until the participant's setup installs topk
    loaded_first.setup(Context())
    _, after, loaded_late, _ = _participant(config)  # a checkpoint loaded once this fit's synchroniser is built
    loaded_late.setup(Context())
    loaded_late.load_state_dict(dict(shared[0]))
    return {"trained": trained, "written": checkpoint, "taken": entries, "reducer_before_setup": reducer_before_setup,
            "loaded_first": before.reducer.state_dict(), "loaded_late": after.reducer.state_dict()}


def assert_same_state(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert (got["rounds"], got["compressor"]) == (expected["rounds"], expected["compressor"])
    torch.testing.assert_close(got["state"], expected["state"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def residuals() -> list[dict[str, Any]]:
    return run_ranks(_residuals, world_size=2, timeout=90)


@pytest.mark.multiprocess
def test_rank_0_writes_every_rank_s_own_residual(residuals: list[dict[str, Any]]) -> None:
    zero, one = residuals
    assert one["written"] == {}  # gathered to rank 0 only (it writes the file)
    saved = zero["written"][COMPRESSION_KEY]
    assert saved["world_size"] == 2
    for rank, result in enumerate(residuals):
        assert_same_state(saved["ranks"][rank], result["trained"])
        assert result["trained"]["rounds"] == 3
    a, b = (saved["ranks"][r]["state"] for r in (0, 1))
    assert any(not torch.equal(a[kind][name], b[kind][name]) for kind in a for name in a[kind]), \
        "both ranks saved the same residual: the test cannot tell them apart"


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["loaded_first", "loaded_late"])
def test_each_rank_gets_its_own_state_back_whenever_the_checkpoint_is_loaded(
        residuals: list[dict[str, Any]], when: str) -> None:
    for result in residuals:
        assert_same_state(result[when], result["trained"])
        assert COMPRESSION_KEY not in result["taken"]  # the entry is taken: Lightning does not see it
        assert result["reducer_before_setup"] == "MeanAllReduce"  # kept until setup installs the compressor


def test_a_checkpoint_of_another_world_size_keeps_only_the_round_count(one_rank_gloo: None) -> None:
    _, synchronizer, state, _ = _participant(StrategyConfig.from_dict(TOPK))
    state.setup(Context())
    fresh = synchronizer.reducer.state_dict()["state"]
    residual = {"residuals": {"net.0.weight": torch.ones(16, 8)}}
    saved = {"world_size": 2, "ranks": [{"rounds": 5, "compressor": "topk", "state": residual}] * 2}
    with pytest.warns(UserWarning, match="compression state is from 2 ranks and this run has 1"):
        state.load_state_dict({COMPRESSION_KEY: saved})
    assert synchronizer.reducer.rounds == 5
    assert synchronizer.reducer.state_dict()["state"] == fresh  # residuals start from zero


AUTO = {"compression": {"name": "auto", "trial_steps": 2, "min_numel": 16}}


def _kind(synchronizer: Any) -> str:
    reducer = synchronizer.reducer
    if isinstance(reducer, CompressingReducer):
        return reducer.compressor.name
    assert isinstance(reducer, MeanAllReduce)
    return "none"


def test_auto_swaps_each_candidate_in_at_its_steps_and_saves_its_choice(one_rank_gloo: None) -> None:
    _, synchronizer, state, context = _participant(StrategyConfig.from_dict(AUTO))
    state.setup(Context())
    assert state.trial is not None and state.state_dict() == {TRIAL_KEY: {"choice": None, "step_s": {}}}
    reducing = []
    for step in range(7):
        context.step = step
        state.on_train_batch_start()
        reducing.append(_kind(synchronizer))
        state.after_optimizer_step()
    assert reducing[:6] == ["none", "none", "bf16", "bf16", "powersgd", "powersgd"]
    saved = state.state_dict()[TRIAL_KEY]
    assert saved["choice"] in ("none", "bf16", "powersgd(rank=4)") and saved["choice"] == state.trial.choice
    assert set(saved["step_s"]) == {"none", "bf16", "powersgd(rank=4)"}
    state.teardown(failed=False)
    assert state.trial is None


def test_a_resumed_auto_choice_reduces_from_the_first_step_without_a_second_trial(one_rank_gloo: None) -> None:
    _, synchronizer, state, context = _participant(StrategyConfig.from_dict(AUTO), step=6)
    checkpoint = {TRIAL_KEY: {"choice": "bf16", "step_s": {"none": 0.2, "bf16": 0.1, "powersgd(rank=4)": 0.3}}}
    state.load_state_dict(checkpoint)
    assert checkpoint == {}
    state.setup(Context())
    assert state.trial is not None and state.trial.decided
    assert _kind(synchronizer) == "bf16"
    state.on_train_batch_start()  # decided: no candidate is swapped in
    assert _kind(synchronizer) == "bf16"


def test_a_resumed_choice_that_is_no_candidate_any_more_times_them_again(one_rank_gloo: None) -> None:
    _, synchronizer, state, _ = _participant(StrategyConfig.from_dict(AUTO))
    state.setup(Context())
    with pytest.warns(UserWarning, match="the checkpoint chose 'powersgd\\(rank=8\\)', not among"):
        state.load_state_dict({TRIAL_KEY: {"choice": "powersgd(rank=8)", "step_s": {}}})
    assert state.trial is not None and not state.trial.decided
    assert _kind(synchronizer) == "none"
