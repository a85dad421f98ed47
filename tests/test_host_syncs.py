"""Host reads of tensor values in a steady training step, counted by who made them (2 Gloo ranks).

On a GPU every read of a device tensor's value by the host (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``
...) waits for the GPU to get there: the host loses its head start and the GPU idles while the host catches up. On
CPU there is no device to wait for, so this counts the reads themselves, by the code that made them, wrapping the
Python-level read methods of ``torch.Tensor`` for one steady step (``tests/test_gpu.py`` checks the same on CUDA
with ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest
import torch

import lightning as L
from _dist import RankPool
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning_static_dist import StaticDistStrategy
from tests.compile.test_compile import SMALL_BUCKETS, NestedGPT, nested_gpt

pytestmark = pytest.mark.multiprocess

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")


def _reader_of(frame: Any) -> str:
    """``area:function`` of the innermost frame outside torch: ``ours`` (this package), ``lightning`` or ``other``."""
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/" not in path:
            area = "ours" if "/lightning_static_dist/" in path else "lightning" if "/lightning/" in path else "other"
            return f"{area}:{frame.f_code.co_qualname if hasattr(frame.f_code, 'co_qualname') else frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


class CountHostReads(Callback):
    """Counts the host reads of tensor values over one whole iteration of the training loop — from the end of batch
    ``step - 1`` to the end of batch ``step``: the loop's own per-step work, the batch, forward, backward and the
    optimizer step — on every rank; writes ``{reader: count}`` to ``<directory>/rank<R>.json``."""

    def __init__(self, directory: str, step: int) -> None:
        self.directory, self.step = directory, step
        self.counts: Counter[str] = Counter()
        self._originals: dict[str, Callable[..., Any]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._originals:
            self._restore()
            with open(os.path.join(self.directory, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump(dict(self.counts), f)
        elif batch_idx == self.step - 1:
            self._install()

    def _install(self) -> None:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counting(tensor: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_reader_of(sys._getframe(1))] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counting)

    def _restore(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals = {}


class EveryParameterUsed(NestedGPT):
    def __init__(self) -> None:
        super().__init__()
        del self.unused


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """The 2 Gloo ranks every count runs on (ours and ddp's): one start-up for the module."""
    with RankPool(2) as pool:
        yield pool


def _fit_on_this_rank(rank: int, world: int, tmp: str, mode: Optional[str],
                      make_model: Callable[[], L.LightningModule]) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
    torch._dynamo.reset()  # (compiled as in a fresh process: nothing cached by an earlier fit on these ranks)
    L.seed_everything(0)
    strategy = DDPStrategy() if mode is None else _static(mode)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[CountHostReads(tmp, step=3)])
    trainer.fit(make_model())


def _count(ranks: RankPool, tmp_path: Any, mode: Optional[str], make_model: Callable[[], L.LightningModule]
           ) -> list[dict[str, int]]:
    """Each rank's host reads in step 3 of a fit on ``ranks`` (the Trainer joins their group): static_dist with the
    default compile in sync ``mode``, or Lightning's own ``DDPStrategy`` with ``mode`` None."""
    ranks.run(_fit_on_this_rank, args=(str(tmp_path), mode, make_model), timeout=300)
    counts = []
    for rank in range(2):
        with open(os.path.join(str(tmp_path), f"rank{rank}.json")) as f:
            counts.append(json.load(f))
    return counts


def _static(mode: str = "hooks") -> StaticDistStrategy:
    return StaticDistStrategy(compile={"enabled": True, "backend": "aot_eager"},
                              sync={"mode": mode, **SMALL_BUCKETS})


#: Lightning's one read per step in a multi-process run, replaced by the strategy (lightning_static_dist/processes/sigterm.py)
LIGHTNING_SIGTERM = {"lightning:_TrainingEpochLoop._broadcast_sigterm_tensor": 1}
#: ...by the same broadcast host to host over Gloo (a CPU tensor: no device wait)
OURS_SIGTERM = {"ours:HostSigtermBroadcast._agreed": 1}


@pytest.mark.parametrize("mode", ["hooks", "graph"])
def test_a_steady_step_reads_no_device_value_on_the_host(ranks: RankPool, tmp_path: Any, mode: str) -> None:
    # the default compile (the whole step cut at the buckets) and graph mode, a model using every parameter.
    # Both read rank 0's SIGTERM flag, as Lightning does, but broadcast host to host (Lightning broadcasts it through
    # the device: on a GPU its read waits for the previous step to finish). hooks: also the previous round's
    # pass-number verdict, copied to pinned host memory a round earlier and read once its CUDA event has completed
    expected = {**OURS_SIGTERM, **({"ours:_RoundCheck.sums": 1} if mode == "hooks" else {})}
    for counts in _count(ranks, tmp_path, mode, EveryParameterUsed):
        assert counts == expected, counts


def test_lightning_ddp_reads_the_sigterm_flag_every_step(ranks: RankPool, tmp_path: Any) -> None:
    # the reference: the read the strategy replaces is there in Lightning's own ddp
    for counts in _count(ranks, tmp_path, None, EveryParameterUsed):
        assert counts == LIGHTNING_SIGTERM, counts


def test_a_parameter_no_rank_uses_costs_one_blocking_usage_check_per_step(ranks: RankPool, tmp_path: Any) -> None:
    # a branch no rank used in the first step is left out of the plan; every later step asks all ranks whether
    # it got a gradient anywhere (one small all-reduce read on the host, like DDP's find_unused_parameters):
    # the one read that waits for the device, and only where that decision exists
    for counts in _count(ranks, tmp_path, "hooks", nested_gpt):
        assert counts == {**OURS_SIGTERM, "ours:_RoundCheck.sums": 1,
                          "ours:PlanMembership.reduce_usage": 1}, counts


def _sigterm_on_one_rank(rank: int, world: int, signalled: int) -> tuple[str, list[bool], bool]:
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_static_dist.processes.sigterm import LAG, HostSigtermBroadcast, host_group

    class Trainer:  # what the check and Lightning's own per-batch check read of a trainer
        training = True

        def __init__(self) -> None:
            self._signal_connector = _SignalConnector(self)  # type: ignore[arg-type]

        @property
        def received_sigterm(self) -> bool:
            return self._signal_connector.received_sigterm

    trainer = Trainer()
    check = HostSigtermBroadcast(trainer, host_group())
    local_checks = []  # what Lightning's end-of-batch check of this rank's own flag saw at each step
    stopped = "never stopped"
    for step in range(8):
        try:
            check()
        except SIGTERMException:
            stopped = f"stopped at step {step} (lag {LAG})"
            break
        if rank == signalled and step == 2:
            trainer._signal_connector.received_sigterm = True  # what Lightning's handler does
        local_checks.append(trainer.received_sigterm)
    check.close()
    return stopped, local_checks, trainer.received_sigterm


@pytest.mark.parametrize("signalled", [0, 1])
def test_a_sigterm_on_any_rank_stops_every_rank_at_the_same_step(signalled: int) -> None:
    # read LAG steps after the round that carries it, started at the step after the signal; until then no rank's
    # own check sees a flag while training (it would stop that rank alone); after the fit, the rank's own flag
    from _dist import run_ranks

    from lightning_static_dist.processes.sigterm import LAG

    (r0, r1) = run_ranks(_sigterm_on_one_rank, 2, args=(signalled,))
    assert r0[0] == r1[0] == f"stopped at step {3 + LAG} (lag {LAG})"
    assert r0[1] == r1[1] == [False] * (3 + LAG)
    assert (r0[2], r1[2]) == ((True, False) if signalled == 0 else (False, True))
