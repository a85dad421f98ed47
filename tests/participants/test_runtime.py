"""The process participants: SimulationMark's checkpoint entry and its warning on resume, PeerWatch's heartbeats
(on 2 real Gloo ranks; none at world size 1 or in a simulated world), and SigtermAgreement's loop patch on a real
``Trainer`` (installed for a multi-rank fit only; while installed a rank's own SIGTERM does not stop it alone)."""

from __future__ import annotations

import json
import threading
import warnings
from typing import Any

import pytest
import torch.distributed as dist
from _dist import run_ranks

import lightning as L

from lightning_static_dist.agreement.faults import rendezvous_store
from lightning_static_dist.participants.runtime import SIMULATED_KEY, PeerWatch, SigtermAgreement, SimulationMark
from lightning_static_dist.simulate.config import LinkConfig, SimulateConfig
from lightning_static_dist.processes.watchdog import THREAD_NAME

from ._view import Context, Regression, View


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)


# ------------------------------------------------------------------------------------------------- SimulationMark

def test_a_checkpoint_of_a_simulated_world_names_its_world_and_link() -> None:
    mark = SimulationMark(View(Regression(), simulation=SimulateConfig(world_size=4, link=LinkConfig(gbps=100.0))))
    entries = mark.state_dict()
    assert entries == {SIMULATED_KEY: {"world_size": 4, "link": LinkConfig(gbps=100.0).describe()}}
    assert SimulationMark(View(Regression(), simulation=SimulateConfig(world_size=2))).state_dict() == {
        SIMULATED_KEY: {"world_size": 2, "link": None}}
    assert SimulationMark(View(Regression())).state_dict() == {}  # a real world adds nothing


def test_resuming_a_simulated_checkpoint_outside_that_simulation_warns_and_takes_the_entry() -> None:
    saved = {SIMULATED_KEY: {"world_size": 4, "link": None}, "state_dict": {}}
    for simulation in (None, SimulateConfig(world_size=2)):
        checkpoint = dict(saved)
        with pytest.warns(UserWarning, match="written in a simulated world of 4 identical ranks"):
            SimulationMark(View(Regression(), simulation=simulation)).load_state_dict(checkpoint)
        assert checkpoint == {"state_dict": {}}  # the entry is taken: Lightning never sees it


def test_resuming_it_in_the_same_simulation_or_a_plain_checkpoint_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint = {SIMULATED_KEY: {"world_size": 4, "link": None}}
        SimulationMark(View(Regression(), simulation=SimulateConfig(world_size=4))).load_state_dict(checkpoint)
        assert checkpoint == {}
        SimulationMark(View(Regression())).load_state_dict({"state_dict": {}})


# ------------------------------------------------------------------------------------------------------ PeerWatch

def test_no_watchdog_at_world_size_one_or_in_a_simulated_world(one_rank_gloo: None) -> None:
    for simulation in (None, SimulateConfig(world_size=4)):
        watch = PeerWatch(View(Regression(), simulation=simulation), failed=lambda: False)
        watch.setup_distributed()
        assert _watchdog_threads() == []
        watch.teardown(failed=False)


def _heartbeats(rank: int, world: int) -> dict[str, Any]:
    view = View(Regression())
    view.enter(Context(global_step=7))
    watch = PeerWatch(view, failed=lambda: False)
    watch.setup_distributed()
    watch.setup_distributed()  # a second setup (a later fit's) keeps the one watchdog
    running = len(_watchdog_threads())
    store = rendezvous_store()
    peer = f"static_dist/alive/{1 - rank}"
    store.wait([peer])
    while_running = json.loads(store.get(peer))
    dist.barrier()
    watch.teardown(failed=False)
    dist.barrier()  # both stopped: each one's last heartbeat is written
    return {"running": running, "beat": while_running, "last": json.loads(store.get(peer)),
            "after": len(_watchdog_threads())}


def _on_two_ranks(rank: int, world: int) -> dict[str, Any]:
    return {"heartbeats": _heartbeats(rank, world), "agreement": _agreement(rank, world)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Both 2-rank cases in one start of the ranks (starting them is most of a case's time)."""
    return run_ranks(_on_two_ranks, world_size=2, timeout=90)


@pytest.mark.multiprocess
def test_each_rank_heartbeats_its_step_until_teardown_says_it_stopped(two_ranks: list[dict[str, Any]]) -> None:
    for rank, seen in enumerate(r["heartbeats"] for r in two_ranks):
        assert seen["running"] == 1, rank
        assert (seen["beat"]["state"], seen["beat"]["step"]) == ("running", 7), seen
        assert seen["last"]["state"] == "stopped", seen  # a clean stop: the peer does not take its exit for a death
        assert seen["after"] == 0


# ----------------------------------------------------------------------------------------------- SigtermAgreement

def _is_patched(trainer: L.Trainer) -> bool:
    return "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop)


def test_one_rank_validation_and_fabric_keep_lightning_s_loop(one_rank_gloo: None) -> None:
    trainer = _trainer()
    for context in (Context(trainer_loop=trainer), Context(fitting=False, trainer_loop=_trainer()), Context()):
        agreement = SigtermAgreement(View(Regression()))
        agreement.after_setup(context)
        agreement.on_validation_end()
        assert not _is_patched(trainer)
        agreement.teardown(failed=False)
    assert type(trainer._signal_connector).__name__ == "_SignalConnector"


def _agreement(rank: int, world: int) -> dict[str, Any]:
    trainer = _trainer()
    agreement = SigtermAgreement(View(Regression()))
    agreement.after_setup(Context(trainer_loop=trainer))
    patched = _is_patched(trainer)
    agreement.on_validation_end()  # one blocking round, every rank: no signal, nothing stops
    if rank == 1:
        trainer._signal_connector.received_sigterm = True  # what Lightning's SIGTERM handler writes, here on rank 1
    own_alone = trainer.received_sigterm  # while installed: the flag the ranks agreed on, not the rank's own
    agreement.teardown(failed=False)
    return {"patched": patched, "own_alone": own_alone, "after": trainer.received_sigterm,
            "unpatched": not _is_patched(trainer)}


@pytest.mark.multiprocess
def test_a_multi_rank_fit_patches_the_loop_and_one_rank_s_signal_waits_for_the_agreement(
        two_ranks: list[dict[str, Any]]) -> None:
    results = [r["agreement"] for r in two_ranks]
    assert [r["patched"] for r in results] == [True, True]
    assert [r["own_alone"] for r in results] == [False, False]  # rank 1 does not stop on its own
    assert [r["after"] for r in results] == [False, True]  # uninstalled: each rank's own flag again
    assert [r["unpatched"] for r in results] == [True, True]
