"""What the strategy offers its callbacks (``lightning_static_dist/offer.py``), and the reducer's one owner.

The callbacks read the strategy through :func:`offer_of` on 2 real Gloo ranks (a real Trainer, the guard's step down
to the exact mean going through the offer); under another strategy they get no offer and say so in one line naming
it; swapping the reducer through its owner changes what the next round sends.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel

from _dist import run_ranks
from tests.participants._view import Context, gradient_participant
from tests._parts import synchronizer_of
from lightning_static_dist import StaticDistFabricStrategy, StaticDistStrategy
from lightning_static_dist.callbacks import GraphReport, RunSummary
from lightning_static_dist.compression import CompressionGuard, LowPrecisionCompressor
from lightning_static_dist.offer import StaticDistOffer, offer_of
from lightning_static_dist.callbacks.monitor import OverlapMonitor
from lightning_static_dist.participants.compression_state import CompressionState


def test_callbacks_under_another_strategy_get_no_offer_and_say_so_naming_it(tmp_path: Any) -> None:
    summary = RunSummary(warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(tmp_path),
                        callbacks=[summary, GraphReport(), OverlapMonitor(), CompressionGuard()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    said = [str(w.message) for w in caught]
    assert offer_of(trainer) is None
    assert "OverlapMonitor measures the static_dist strategy only; with SingleDeviceStrategy it does nothing." in said
    assert ("CompressionGuard guards the static_dist strategy's compression only; with SingleDeviceStrategy it does"
            " nothing.") in said
    assert summary.summary["steps"] == 2 and summary.summary["sync_rounds"] is None
    assert "simulated_world_size" not in summary.summary


def test_offer_of_is_none_without_a_static_dist_offer_yet() -> None:
    # a Fabric object as a Trainer: its strategy's offer; before the first fabric.setup there is none
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=StaticDistFabricStrategy())
    assert offer_of(fabric) is None and fabric.strategy.offers == []
    assert offer_of(L.Fabric(accelerator="cpu", devices=1)) is None and offer_of(object()) is None


def _fit_through_the_offer(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from lightning_static_dist import StaticDistStrategy

    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
    L.seed_everything(0)
    strategy = StaticDistStrategy(compression={"name": "bf16"})
    summary, monitor = RunSummary(warmup_steps=0), OverlapMonitor()
    # every check is bad: the guard steps bf16 down to the exact mean after the first check (step 1)
    guard = CompressionGuard(check_every_n_steps=1, patience=1, max_rel_error=1e-12, loss_spike=1e9)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=4, logger=False,
                        default_root_dir=tmp, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[summary, monitor, guard])
    trainer.fit(BoringModel())
    offer = offer_of(trainer)
    assert offer is strategy.offer and isinstance(offer, StaticDistOffer)
    figures = offer.sync_figures()
    assert figures is not None
    sync = synchronizer_of(strategy)
    offer.wait_for_parameters()  # (all_reduce: the parameters are current, it returns at once)
    return {"summary": summary.summary, "figures": figures, "events": [(e["old"], e["new"]) for e in guard.events],
            "reducer": type(sync.reducer).__name__, "compressing": offer.compressing_reducer,
            "dense": sync.stats.last_round_dense_bytes, "monitored": len(monitor.history)}


#: what the strategies' properties returned before 0.2 (removed: the offer says each), and under which front end
REMOVED = {"synchronizer": "both", "compile_report": "both", "sharded_sync": "Trainer", "embedding_sharder": "Trainer",
           "optimizer_overlap": "Trainer", "schedule_trial": "Trainer", "compressing_reducer": "Fabric"}


def test_the_strategies_offer_their_facts_through_the_offer_alone() -> None:
    strategies = {"Trainer": StaticDistStrategy(), "Fabric": StaticDistFabricStrategy()}
    for front_end, strategy in strategies.items():
        kept = [name for name, where in REMOVED.items() if where in ("both", front_end) and hasattr(strategy, name)]
        assert kept == [], f"{front_end}: {kept}"
        assert "offer" in dir(type(strategy))  # (what each says instead)


@pytest.mark.multiprocess
def test_the_callbacks_read_and_swap_through_the_offer_on_two_ranks(tmp_path: Any) -> None:
    for r in run_ranks(_fit_through_the_offer, 2, args=(str(tmp_path),)):
        figures, summary = r["figures"], r["summary"]
        assert r["events"] == [("bf16", "none")]  # the guard's swap went through the reducer's owner
        assert r["reducer"] == "MeanAllReduce" and r["compressing"] is None
        assert figures.mode == "hooks" and figures.rounds == 4 and figures.bytes_per_round == r["dense"]
        assert figures.dense_bytes_per_round == r["dense"]  # (the exact mean since the swap: nothing compressed)
        assert summary["sync_rounds"] == figures.rounds and summary["bytes_sent_per_rank"] == figures.bytes_sent
        assert summary["bytes_per_round"] == figures.bytes_per_round
        assert summary["bucket_plan"] == figures.bucket_plan and summary["sync_mode"] == "hooks"
        assert r["monitored"] == 4  # the monitor's recorder was attached through the offer


def _swapped_rounds(rank: int, world: int) -> dict[str, Any]:
    # the real gradient participant builds the synchroniser on a real view of this rank; its owner installs bf16
    model, view, gradients = gradient_participant({"compression": {"name": "bf16"}})
    reference = copy.deepcopy(model)
    owner = CompressionState(view, gradients)
    context = view.enter(Context())
    for phase in (gradients.setup, gradients.after_setup, owner.setup):  # (the strategy's setup, in its order)
        phase(context)
    sync = gradients.synchronizer
    assert sync is not None
    rounds = []
    for step, change in enumerate([None, lambda: owner.swap(None),
                                   lambda: owner.use(LowPrecisionCompressor(torch.bfloat16))]):
        if change is not None:
            change()
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
        sync.finish_if_pending()
        exact = [p.grad.clone() for p in reference.parameters()]
        for g in exact:
            dist.all_reduce(g)
            g /= world
        rounds.append({"reducer": type(sync.reducer).__name__, "bytes": sync.stats.last_round_bytes,
                       "dense": sync.stats.last_round_dense_bytes,
                       "error": max(float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), exact))})
    gradients.teardown(failed=False)
    return {"rounds": rounds}


@pytest.mark.multiprocess
def test_swapping_the_reducer_through_its_owner_changes_what_the_next_round_sends() -> None:
    for r in run_ranks(_swapped_rounds, 2):
        bf16, exact, again = r["rounds"]
        assert [bf16["reducer"], exact["reducer"], again["reducer"]] == [
            "CompressingReducer", "MeanAllReduce", "CompressingReducer"]
        # the configured bf16 (installed by the owner at setup) sends half of fp32; the swap to exact sends all of it
        # (the first round's plan, made before any gradient order was seen, pads differently from the later rounds')
        assert exact["bytes"] == exact["dense"] and bf16["bytes"] < 0.55 * bf16["dense"]
        assert again["bytes"] < 0.55 * again["dense"] and again["dense"] == exact["dense"]
        assert exact["error"] < 1e-6 < bf16["error"] and again["error"] > 1e-6  # bf16's rounding, gone when exact
