"""The monitor on a GPU: a recorded step is read only once the GPU has run it, and a steady step, recording every
step or one in three, makes no CUDA synchronisation (the check of ``tests/_gpu_sync_check.py``), every recorded step
still logged under its own step. Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning as L
from _gpu_sync_check import count_syncs
from lightning_static_dist import OverlapMonitor, StaticDistStrategy
from lightning_static_dist.overlap.recorder import StepRecorder
from tests.test_host_syncs import EveryParameterUsed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_closed_step_is_complete_only_once_the_gpu_has_run_it() -> None:
    recorder = StepRecorder(torch.device("cuda", 0))
    recorder.active = True
    recorder.begin_step(step=5, rank=0)
    recorder.begin("forward")
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, queued: the host returns at once
    recorder.end("forward")
    closed = recorder.close_step()
    assert closed is not None and not closed.complete()  # a query: the GPU is still in the sleep
    closed.wait()
    assert closed.complete()
    timeline = closed.timeline()
    ((phase, start, end),) = timeline.compute
    assert phase == "forward" and end > start and timeline.step == 5


class Monitored(EveryParameterUsed):
    """``tests/test_host_syncs.py``'s model with an :class:`OverlapMonitor` of its own (``configure_callbacks``)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.monitor = OverlapMonitor(every_n_steps=every)

    def configure_callbacks(self) -> list[L.Callback]:
        return [self.monitor]


@pytest.mark.parametrize("every", [1, 3])
def test_a_steady_step_with_the_monitor_makes_no_cuda_sync_and_every_recorded_step_is_logged(tmp_path: Any,
                                                                                             every: int) -> None:
    # one GPU as 2 simulated ranks (the world of the monitor-cost benchmark): the figures are combined over the ranks
    # on the host, and read a step or more after the step ran, once its events have completed
    model = Monitored(every)
    strategy = StaticDistStrategy(compile={"enabled": True}, simulate={"world_size": 2})
    (report,) = count_syncs(str(tmp_path), strategy, model, devices=1, step=4, max_steps=9)
    assert report == {"warned": [], "runtime": []}, report
    assert [int(row["step"]) for row in model.monitor.history] == list(range(0, 9, every))
    assert all(row["static_dist/compute_ms"] > 0 for row in model.monitor.history)
