"""``strategy.simulate``: one process as rank 0 of N identical ranks, against real Gloo ranks and plain training;
``strategy.sync.schedule`` (``after_backward``, ``auto``) against Lightning's ``ddp``; ``strategy.sync.comm_sms``.

A simulated world is the default process group of the process that starts it, so every simulated run here has a
fresh spawned process of its own (:func:`_in_fresh_process`): nothing of it reaches the pytest process or another
test. The real-rank comparisons run on real Gloo ranks (``_dist.run_ranks``; the fits against ``ddp`` on one
module-scoped ``RankPool`` through test_strategy.py's ``fit_in``), each rank with its own data where a
synchronisation is checked.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import queue as queue_module
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.demos.boring_classes import RandomDataset
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import lightning as L
from _dist import RankPool, run_ranks
from tests._parts import parts_of, synchronizer_of
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_static_dist import RunSummary, StaticDistStrategy
from lightning_static_dist.compat import all_gather_single, reduce_scatter_single
from lightning_static_dist.config.check import ConfigError
from lightning_static_dist.participants.schedule_trial import SCHEDULE_KEY
from lightning_static_dist.plan.step_plan import resolve_plan
from lightning_static_dist.plan.world import nccl_options
from lightning_static_dist.simulate import BACKEND, LinkConfig, SimulatedGroup, init_simulated_world, set_link
from lightning_static_dist.simulate import group as simulated_group
from lightning_static_dist.plan.strategy_config import StrategyConfig
from tests.test_strategy import assert_same_weights, fit_in

multiprocess = pytest.mark.multiprocess
OVERLAP, AFTER = "overlap/fp32/sms=default", "after_backward/fp32"  # sync.schedule auto's candidates on Gloo (fp32)


# ------------------------------------------------------------------------------------------------ helpers


def _fresh_worker(fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        queue.put(("ok", pickle.dumps(fn(*args))))  # plain pickle: tensors by value
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def _in_fresh_process(fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Any:
    """``fn(*args)`` in a new spawned process (no process group of ours there); its result, or its traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_fresh_worker, args=(fn, args, queue))
    process.start()
    try:
        status, value = queue.get(timeout=timeout)
    except queue_module.Empty:
        raise AssertionError(f"no result from the fresh process within {timeout}s") from None
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    if status != "ok":
        raise AssertionError(f"the fresh process failed:\n{value}")
    return pickle.loads(value)


class _Lines(logging.Handler):
    """Keeps what Lightning's rank-zero logger prints (``rank_zero_info``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _quiet_trainer(**kwargs: Any) -> L.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    return L.Trainer(**{**options, **kwargs})


# ------------------------------------------------------------------------- 1. the collectives, against Gloo

REAL_WORLD = 3  # (SUM of 3 identical fp32 values is exactly 3 * x whatever the order of the additions)


def _collectives(rank: int, world: int, simulated: bool) -> dict[str, Any]:
    """Every collective with the SAME inputs on every rank; what this rank got."""
    R = dist.ReduceOp
    torch.manual_seed(0)
    x = torch.randn(6)
    ints = torch.randint(-50, 50, (6,))
    gathered_in_place = torch.randn(world * 4)  # one buffer, the same on every rank: each gathers its own chunk
    scattered = torch.randn(world * 3)
    out: dict[str, Any] = {}
    for name, op in (("sum", R.SUM), ("max", R.MAX), ("min", R.MIN)):
        t = x.clone()
        dist.all_reduce(t, op=op)
        out[name] = t
    t = ints.clone()
    dist.all_reduce(t)
    out["sum_int"] = t
    t = x.clone()
    dist.all_reduce(t, op=R.AVG if simulated else R.SUM)  # (Gloo has no AVG: the test divides the real SUM)
    out["avg_or_sum"] = t
    t = x.clone()
    dist.reduce(t, dst=0)
    out["reduce"] = t
    t = x.clone()
    dist.reduce(t, dst=world - 1)  # rank 0 is not the destination: its buffer stays as it was
    out["reduce_elsewhere"] = t
    parts = [torch.full_like(x, float("nan")) for _ in range(world)]
    dist.all_gather(parts, x)
    out["all_gather"] = torch.stack(parts)
    t = torch.full((world * 6,), float("nan"))
    all_gather_single(t, x)
    out["all_gather_single"] = t
    t = gathered_in_place.clone()
    all_gather_single(t, t[rank * 4:(rank + 1) * 4])  # the input is this rank's chunk of the output
    out["all_gather_in_place"] = t
    t = torch.full((3,), float("nan"))
    dist.reduce_scatter(t, [p.clone() for p in scattered.chunk(world)])
    out["reduce_scatter"] = t
    t = torch.full((3,), float("nan"))
    reduce_scatter_single(t, scattered.clone())
    out["reduce_scatter_single"] = t
    t = x.clone()
    dist.broadcast(t, src=world - 1)
    out["broadcast"] = t
    dist.barrier()
    obj = {"step": 7, "names": ["a", "b"], "value": 1.5}
    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, obj)
    out["all_gather_object"] = objects
    listed: list[Any] = [dict(obj)]
    dist.broadcast_object_list(listed, src=0)
    out["broadcast_object_list"] = listed
    gathered: list[Any] = [None] * world
    dist.gather_object(obj, gathered if rank == 0 else None, dst=0)
    out["gather_object"] = gathered
    sub = dist.new_group(ranks=[0, 1])
    if rank in (0, 1):
        t = x.clone()
        dist.all_reduce(t, group=sub)
        out["sub_sum"], out["sub_size"] = t, dist.get_world_size(sub)
    out["world"] = dist.get_world_size()
    out["x"] = x
    return out


def _simulated_collectives(worlds: list[int]) -> dict[int, dict[str, Any]]:
    results = {}
    for world in worlds:
        init_simulated_world(world, timedelta(seconds=60))
        try:
            result = _collectives(0, world, simulated=True)
            result["backend"] = dist.get_backend()
            result["group_type"] = type(dist.group.WORLD).__name__
            results[world] = result
        finally:
            dist.destroy_process_group()
    return results


@multiprocess
def test_the_simulated_group_gives_what_real_gloo_ranks_with_identical_inputs_give() -> None:
    real = run_ranks(_collectives, REAL_WORLD, args=(False,))[0]
    simulated = _in_fresh_process(_simulated_collectives, [REAL_WORLD, 4])
    sim = simulated[REAL_WORLD]
    assert sim["backend"] == BACKEND and sim["group_type"] == SimulatedGroup.__name__
    assert sim["world"] == real["world"] == REAL_WORLD
    torch.testing.assert_close(sim["x"], real["x"], rtol=0, atol=0)  # the same inputs
    for key in ("sum", "max", "min", "sum_int", "reduce", "all_gather", "all_gather_single", "all_gather_in_place",
                "reduce_scatter", "reduce_scatter_single", "broadcast", "sub_sum"):
        torch.testing.assert_close(sim[key], real[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(sim["avg_or_sum"], real["avg_or_sum"] / REAL_WORLD, msg="AVG against SUM / N")
    # a reduce to another rank leaves this rank's buffer alone (Gloo may use a non-root's buffer as scratch: not compared)
    torch.testing.assert_close(sim["reduce_elsewhere"], sim["x"], rtol=0, atol=0)
    for key in ("all_gather_object", "broadcast_object_list", "gather_object", "sub_size"):
        assert sim[key] == real[key], key
    # and the comparison is not empty: the world size shows in the results
    x = real["x"]
    torch.testing.assert_close(real["sum"], REAL_WORLD * x)
    torch.testing.assert_close(real["all_gather"], x.expand(REAL_WORLD, -1))
    assert len(real["all_gather_object"]) == REAL_WORLD
    # a sub-group of two ranks in a simulated world of four: its size is 2 and it sums twice
    four = simulated[4]
    assert four["world"] == 4 and four["sub_size"] == 2
    torch.testing.assert_close(four["sub_sum"], 2 * four["x"], rtol=0, atol=0)
    torch.testing.assert_close(four["sum"], 4 * four["x"], rtol=0, atol=0)


# ----------------------------------------------------------- 2. a simulated fit is rank 0's single-device fit


class Regression(L.LightningModule):
    """A small MLP; SGD by default (a gradient scaled by a wrong factor shows in its weights, Adam's would not)."""

    def __init__(self, adam: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.adam = adam
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adam:
            return torch.optim.Adam(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _regression_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))


def _rank0_order(data: TensorDataset, batches: int, batch_size: int = 4) -> list[int]:
    """The samples rank 0 of 4 trains on, in order, over as many epochs as ``batches`` take: Lightning's
    ``DistributedSampler`` (shuffled for training, seed 0, reshuffled each epoch)."""
    order: list[int] = []
    epoch = 0
    while len(order) < batches * batch_size:
        sampler = DistributedSampler(data, num_replicas=4, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order += list(sampler)
        epoch += 1
    return order[:batches * batch_size]


class _SeenBatches(Callback):
    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []
        self.samplers: list[dict[str, Any]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler
        self.samplers.append({"type": type(sampler).__name__, "num_replicas": getattr(sampler, "num_replicas", None),
                              "rank": getattr(sampler, "rank", None)})

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.inputs.append(batch[0].clone())


def _simulated_and_single_fits(steps: int) -> dict[str, Any]:
    data = _regression_data()
    initial = {k: v.clone() for k, v in Regression().state_dict().items()}
    seen = _SeenBatches()
    model = Regression()
    trainer = _quiet_trainer(strategy=StaticDistStrategy(simulate={"world_size": 4}), max_steps=steps, callbacks=[seen])
    trainer.fit(model, DataLoader(data, batch_size=4))
    simulated = {k: v.detach().clone() for k, v in model.state_dict().items()}
    facts = {"world_size": trainer.world_size, "backend": dist.get_backend(), "global_rank": trainer.global_rank,
             "samplers": seen.samplers, "inputs": seen.inputs}
    # rank 0's batches of a 4-rank world, in the same order, on one device without any process group
    single_model = Regression()
    single = _quiet_trainer(max_steps=steps)
    single.fit(single_model, DataLoader(Subset(data, _rank0_order(data, steps)), batch_size=4, shuffle=False))
    return {"simulated": simulated, "single": {k: v.detach().clone() for k, v in single_model.state_dict().items()},
            "initial": initial, "single_strategy": type(single.strategy).__name__, **facts}


@multiprocess
def test_a_fit_in_a_simulated_world_of_4_ends_with_single_device_weights_on_rank_0s_shard() -> None:
    steps = 6  # (an epoch of rank 0's shard is 4 batches: the fit crosses into a second, reshuffled one)
    run = _in_fresh_process(_simulated_and_single_fits, steps)
    assert run["world_size"] == 4 and run["global_rank"] == 0 and run["backend"] == BACKEND
    assert run["single_strategy"] == "SingleDeviceStrategy"
    assert run["samplers"] == [{"type": "DistributedSampler", "num_replicas": 4, "rank": 0}] * 2
    # the batches the simulated rank trained on are rank 0's shard, in order
    data = _regression_data()
    order = _rank0_order(data, steps)
    assert len(run["inputs"]) == steps
    for i, got in enumerate(run["inputs"]):
        torch.testing.assert_close(got, data.tensors[0][order[4 * i:4 * i + 4]], rtol=0, atol=0)
    assert_same_weights(run["simulated"], run["single"], tol=1e-6)
    assert any(not torch.equal(run["simulated"][k], run["initial"][k]) for k in run["initial"])  # it trained


# ------------------------------------------------- 3. sharded optimizer state in a simulated world, and the summary


class _StateSize(Callback):
    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != trainer.max_steps:
            return
        optimizer = trainer.optimizers[0]
        self.facts = {
            "exp_avg_numel": sum(s["exp_avg"].numel() for s in optimizer.state.values() if "exp_avg" in s),
            "exp_avg_sq_numel": sum(s["exp_avg_sq"].numel() for s in optimizer.state.values() if "exp_avg_sq" in s),
            "param_numel": sum(p.numel() for p in pl_module.parameters()),
            "sharded": parts_of(trainer.strategy).gradients.sharded_sync is not None,
            "mesh": tuple(trainer.strategy.device_mesh.shape),
            "world_size": trainer.world_size,
        }


def _sharded_simulated_fit(root: str) -> dict[str, Any]:
    lines = _Lines()
    logging.getLogger("lightning.pytorch").addHandler(lines)
    size = _StateSize()
    trainer = _quiet_trainer(
        strategy=StaticDistStrategy(simulate={"world_size": 4}, mesh={"dp_replicate": 1, "dp_shard": 4},
                                    sync={"reduce": "reduce_scatter"}),
        max_steps=3, callbacks=[size, RunSummary(warmup_steps=0)], default_root_dir=root)
    error = None
    results = io.StringIO()  # (the run summary is a result: printed to stdout, diagnostics go to the logger)
    try:
        with contextlib.redirect_stdout(results):
            trainer.fit(Regression(adam=True), DataLoader(_regression_data(), batch_size=4))
    except Exception as err:  # (kept for the test that checks the fit finishes: the facts were taken before)
        error = f"{type(err).__name__}: {err}"
    return {**size.facts, "log_dir": root, "lines": lines.lines + results.getvalue().splitlines(), "error": error}


def _simulated_fit_with_a_checkpoint(root: str) -> dict[str, Any]:
    trainer = _quiet_trainer(strategy=StaticDistStrategy(simulate={"world_size": 2}), max_steps=2,
                             enable_checkpointing=True, default_root_dir=root,
                             callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_last=False)])
    trainer.fit(Regression(), DataLoader(_regression_data(), batch_size=4))
    path = os.path.join(root, sorted(f for f in os.listdir(root) if f.endswith(".ckpt"))[-1])
    return torch.load(path, weights_only=False).get("static_dist_simulated")


@multiprocess
def test_a_checkpoint_written_in_a_simulated_world_says_so(tmp_path: Any) -> None:
    """A dry run's checkpoint must not pass for a real run's: it carries the simulated world it came from."""
    mark = _in_fresh_process(_simulated_fit_with_a_checkpoint, str(tmp_path))
    assert mark == {"world_size": 2, "link": None}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: Any) -> dict[str, Any]:
    """A fit at mesh 1 x 4 (reduce_scatter) in a simulated world of 4, in a fresh process."""
    return _in_fresh_process(_sharded_simulated_fit, str(tmp_path_factory.mktemp("sharded")))


@multiprocess
def test_dp_shard_4_in_a_simulated_world_keeps_a_quarter_of_the_optimizer_state_and_says_so(
        sharded_run: dict[str, Any]) -> None:
    run = sharded_run
    assert run["sharded"] and run["mesh"] == (1, 4) and run["world_size"] == 4
    quarter = run["param_numel"] / 4
    for key in ("exp_avg_numel", "exp_avg_sq_numel"):
        # a quarter of the elements, allowing for the padding of each bucket to a multiple of the shard count
        assert quarter <= run[key] <= quarter + 4 * 8, (key, run[key], run["param_numel"])
    with open(os.path.join(run["log_dir"], "summary.json")) as f:  # (trainer.log_dir without a logger)
        summary = json.load(f)
    assert summary["simulated_world_size"] == 4
    assert summary["world_size"] == 4 and summary["steps"] == 3
    assert summary["simulated_link"].startswith("free")
    printed = "\n".join(run["lines"])
    assert "lightning-static-dist run summary" in printed and "simulated_world_size" in printed, printed
    assert "simulated world of 4 identical ranks" in printed


@multiprocess
def test_a_sharded_fit_in_a_simulated_world_finishes(sharded_run: dict[str, Any]) -> None:
    assert sharded_run["error"] is None, sharded_run["error"]


# ------------------------------------------------------------- 4. sync.schedule against Lightning's ddp (2 ranks)


STEPS = 8  # one epoch: 64 samples, 2 ranks, batches of 4
BUCKETS = {"first_bucket_mb": 0.001, "bucket_mb": 0.004}  # several buckets: the order of issue matters


class TwoLayer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.l2 = nn.Linear(64, 10)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(batch))).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)  # (a wrongly scaled average shows)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4)


class _IssueLog:
    """A synchroniser's recorder that notes when buckets are issued relative to the end of backward (what the
    synchroniser reports; it hands every call on to the recorder it replaced, if any)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[str] = []

    def bucket_issued(self, *args: Any, **kwargs: Any) -> None:
        self.events.append("issued")
        if self.inner is not None:
            self.inner.bucket_issued(*args, **kwargs)

    def end(self, phase: str, *args: Any, **kwargs: Any) -> None:
        if phase == "backward":
            self.events.append("end of backward")
        if self.inner is not None:
            self.inner.end(phase, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        return getattr(inner, name) if inner is not None else (lambda *args, **kwargs: None)


class ScheduleProbe(Callback):
    """Per rank, to ``<dir>/rank<N>.json``: per step, the schedule's flag and how many buckets were issued during
    backward and in all; the schedule trial as the fit's first batch found it and as the fit ended; whether the
    compiled step was cut."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.facts: dict[str, Any] = {"launch_during_backward": [], "issued_in_backward": [], "issued": [],
                                      "first": None}
        self._log: Any = None
        self._launching: Optional[bool] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.facts["first"] is None:  # (before the strategy's own batch-start hook: a trial would start there)
            trial = parts_of(trainer.strategy).schedule.trial
            self.facts["first"] = {"step": trainer.global_step, "trial": trial is not None,
                                   "choice": trial.choice if trial is not None else None,
                                   "step_s": dict(trial.step_s) if trial is not None else None}
        synchronizer = synchronizer_of(trainer.strategy)
        if synchronizer.recorder is not self._log or self._log is None:
            self._log = synchronizer.recorder = _IssueLog(synchronizer.recorder)
        self._log.events.clear()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        # (read inside the step: a trial that decides at the end of its last step switches before the batch's end)
        self._launching = synchronizer_of(trainer.strategy).schedule.launch_during_backward

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        events = self._log.events
        end = events.index("end of backward") if "end of backward" in events else len(events)
        self.facts["launch_during_backward"].append(self._launching)
        self.facts["issued_in_backward"].append(events[:end].count("issued"))
        self.facts["issued"].append(events.count("issued"))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trial = parts_of(trainer.strategy).schedule.trial  # (the strategy's teardown, after this hook, forgets it)
        report = trainer.strategy.offer.compile_report
        self.facts.update(
            choice=trial.choice if trial is not None else None,
            step_s=dict(trial.step_s) if trial is not None else None,
            compiled=report is not None and bool(report.graphs),
            cut=report is not None and report.splitter is not None,
        )
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.facts, f)


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """The 2 Gloo ranks every fit of sections 4 and 5 runs on (``ddp``'s and ours): one start-up for them all."""
    with RankPool(2) as pool:
        yield pool


def _probed_fit(ranks: RankPool, directory: Any, sync: dict[str, Any], callbacks: tuple = (), max_steps: int = STEPS,
                **kwargs: Any) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Fit TwoLayer under static_dist with ``strategy.sync`` (and ``compile`` where given) on the 2 ranks
    (test_strategy's ``fit_in``: each rank its own half of the data); rank 0's weights and each rank's
    :class:`ScheduleProbe` facts."""
    options = {"sync": sync, **({"compile": kwargs.pop("compile")} if "compile" in kwargs else {})}
    weights, _ = fit_in(ranks, TwoLayer, "static_dist", options,
                        callbacks=[ScheduleProbe(str(directory)), *callbacks], max_steps=max_steps, **kwargs)
    ranks = []
    for rank in range(2):
        with open(os.path.join(str(directory), f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    return weights, ranks


def _issued_during_backward(facts: dict[str, Any]) -> list[bool]:
    return [n > 0 for n in facts["issued_in_backward"]]


@pytest.fixture(scope="module")
def ddp_weights(ranks: RankPool) -> dict[str, torch.Tensor]:
    weights, _ = fit_in(ranks, TwoLayer, "ddp", max_steps=STEPS)
    return weights


@pytest.fixture(scope="module")
def auto_run(ranks: RankPool, tmp_path_factory: Any) -> dict[str, Any]:
    """A fit with sync.schedule auto (2 steps per schedule), checkpointed at its last step."""
    root = tmp_path_factory.mktemp("auto")
    checkpoint = ModelCheckpoint(dirpath=str(root / "ckpt"), filename="last", every_n_train_steps=STEPS, save_top_k=-1,
                                 save_on_train_epoch_end=False)
    weights, facts = _probed_fit(ranks, root / "probe", {"schedule": "auto", "schedule_trial_steps": 2, **BUCKETS},
                                 callbacks=(checkpoint,), enable_checkpointing=True, default_root_dir=str(root))
    return {"weights": weights, "ranks": facts, "ckpt": str(root / "ckpt" / "last.ckpt"), "root": root}


@multiprocess
def test_after_backward_trains_to_ddps_weights(ranks: RankPool, tmp_path: Any,
                                               ddp_weights: dict[str, torch.Tensor]) -> None:
    ours, probed = _probed_fit(ranks, tmp_path, {"schedule": "after_backward", **BUCKETS})
    assert_same_weights(ours, ddp_weights)
    for facts in probed:  # every bucket waited for the end of backward, every step; then all were issued
        assert facts["launch_during_backward"] == [False] * STEPS
        assert facts["issued_in_backward"] == [0] * STEPS
        assert all(n >= 2 for n in facts["issued"]), facts["issued"]  # (several buckets)
        assert facts["first"]["trial"] is False and facts["choice"] is None  # no trial without auto


@multiprocess
def test_auto_trains_to_ddps_weights_while_it_tries_both_schedules(
        auto_run: dict[str, Any], ddp_weights: dict[str, torch.Tensor]) -> None:
    assert_same_weights(auto_run["weights"], ddp_weights)
    for facts in auto_run["ranks"]:
        choice = facts["choice"]
        assert choice in (OVERLAP, AFTER)
        # steps 0-1 overlap, 2-3 after_backward (the first of each untimed), then the choice for the rest
        overlapping = [True, True, False, False] + [choice == OVERLAP] * (STEPS - 4)
        assert facts["launch_during_backward"] == overlapping
        # (step 0 plans the buckets: nothing can be issued during its backward)
        assert _issued_during_backward(facts)[1:] == overlapping[1:], facts["issued_in_backward"]


@multiprocess
def test_after_backward_compiled_is_one_uncut_graph_and_trains_to_ddps_weights(
        ranks: RankPool, tmp_path: Any, ddp_weights: dict[str, torch.Tensor]) -> None:
    ours, probed = _probed_fit(ranks, tmp_path, {"schedule": "after_backward", **BUCKETS},
                               compile={"enabled": True, "backend": "aot_eager"})
    assert_same_weights(ours, ddp_weights, tol=1e-5)
    for facts in probed:
        assert facts["compiled"] and not facts["cut"]
        assert facts["launch_during_backward"] == [False] * STEPS
        assert facts["issued_in_backward"] == [0] * STEPS and all(n >= 2 for n in facts["issued"])
    # what decides the cut: overlap (and auto, which may choose it) cut the step where the buckets end
    for schedule, cut in (("after_backward", False), ("overlap", True), ("auto", True)):
        config = StrategyConfig.from_dict({"sync": {"schedule": schedule, **BUCKETS},
                                           "compile": {"enabled": True, "backend": "aot_eager"}})
        assert (resolve_plan(config, world_size=2, device_type="cuda", num_nodes=1, mesh=None).compile.cut
                is not None) is cut


# -------------------------------------------------------------- 5. auto's choice: every rank's, and kept on resume


@multiprocess
def test_autos_choice_is_every_ranks_and_a_resumed_fit_keeps_it(ranks: RankPool, auto_run: dict[str, Any],
                                                                 tmp_path: Any) -> None:
    first, second = auto_run["ranks"]
    assert first["choice"] == second["choice"] and first["choice"] in (OVERLAP, AFTER)
    assert first["step_s"] == second["step_s"]  # the slowest rank's times: one decision
    assert set(first["step_s"]) == {OVERLAP, AFTER} and all(s > 0 for s in first["step_s"].values())
    saved = torch.load(auto_run["ckpt"], weights_only=False)[SCHEDULE_KEY]
    assert saved["choice"] == first["choice"] and saved["step_s"] == pytest.approx(first["step_s"])

    _, resumed = _probed_fit(ranks, tmp_path, {"schedule": "auto", "schedule_trial_steps": 2, **BUCKETS},
                             ckpt_path=auto_run["ckpt"], max_steps=2 * STEPS)
    for facts in resumed:
        # decided before the resumed fit's first step: the saved choice and times, no trial run again
        assert facts["first"]["step"] == STEPS and facts["first"]["trial"]
        assert facts["first"]["choice"] == saved["choice"]
        assert facts["first"]["step_s"] == pytest.approx(saved["step_s"])
        assert facts["choice"] == saved["choice"] and facts["step_s"] == pytest.approx(saved["step_s"])
        assert facts["launch_during_backward"] == [saved["choice"] == OVERLAP] * STEPS
        assert _issued_during_backward(facts)[1:] == [saved["choice"] == OVERLAP] * (STEPS - 1)


# ------------------------------------------------------------------------ 6. sync.comm_sms reaches the groups


class _Sms(Callback):
    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.facts = {"world_sms": simulated_group.WORLD.sms, "group_sms": dist.group.WORLD.sms,
                      "group_type": type(dist.group.WORLD).__name__}


def _comm_sms_in_a_simulated_world() -> dict[str, Any]:
    probe = _Sms()
    trainer = _quiet_trainer(strategy=StaticDistStrategy(simulate={"world_size": 4}, sync={"comm_sms": 8}),
                             max_steps=1, callbacks=[probe])
    trainer.fit(Regression(), DataLoader(_regression_data(), batch_size=4))
    facts = dict(probe.facts)
    group = dist.group.WORLD
    set_link(LinkConfig(), 8)
    facts["link_and_comm_sms"] = group.sms
    facts["sub_group_sms"] = dist.new_group(ranks=[0, 1]).sms  # every simulated group of the process
    set_link(LinkConfig(sms=4))
    facts["link_only"] = group.sms
    t = torch.ones(3)
    dist.all_reduce(t)  # CPU tensors under a link: the arithmetic alone
    facts["sum_under_link"] = t
    set_link(None, 8)
    facts["free_again"] = group.sms
    return facts


@multiprocess
def test_comm_sms_reaches_the_simulated_groups() -> None:
    facts = _in_fresh_process(_comm_sms_in_a_simulated_world)
    assert facts["group_type"] == SimulatedGroup.__name__
    assert facts["world_sms"] == 8  # set by the strategy's setup from strategy.sync.comm_sms
    assert facts["group_sms"] is None  # free links hold no SMs
    assert facts["link_and_comm_sms"] == 8 and facts["link_only"] == 4 and facts["free_again"] is None
    assert facts["sub_group_sms"] == 8
    torch.testing.assert_close(facts["sum_under_link"], torch.full((3,), 4.0))


class _SmsPerStep(Callback):
    """The simulated world's SMs as each step's backward ran (after the strategy's batch-start switch)."""

    def __init__(self) -> None:
        self.sms: list[Any] = []
        self.candidates: list[str] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sms.append(simulated_group.WORLD.sms)
        self.candidates = [c.name for c in parts_of(trainer.strategy).schedule.trial.candidates]


class _FailsAt(Regression):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.fail_at = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at:
            raise RuntimeError("failing on purpose, mid-trial")
        return super().training_step(batch, batch_idx)


SMS_TRIAL = ["overlap/fp32/sms=default", "overlap/fp32/sms=8", "overlap/fp32/sms=4", "overlap/fp32/sms=2",
             "after_backward/fp32"]


def _schedule_auto_in_a_simulated_world(fail_at: Optional[int], as_if_linked: bool = True) -> dict[str, Any]:
    """sync.schedule auto in a simulated world of 2 with comm_sms 16: the SMs candidates switch the world's SMs; a
    fit (or a fit failing mid-trial) leaves them at 16. A link needs CUDA: ``as_if_linked`` has the schedule take the
    world for one with a link (its free links would switch no SMs, and time the default SMs only)."""
    if as_if_linked:
        from lightning_static_dist.participants import schedule_trial

        schedule_trial.schedule_transport = lambda view: "simulated"  # (this fresh process's own)
    probe, summary, lines = _SmsPerStep(), RunSummary(warmup_steps=0), _Lines()
    logging.getLogger("lightning.pytorch").addHandler(lines)
    strategy = StaticDistStrategy(simulate={"world_size": 2},
                                  sync={"schedule": "auto", "schedule_trial_steps": 2, "comm_sms": 16})
    trainer = _quiet_trainer(strategy=strategy, max_steps=2 * len(SMS_TRIAL) + 2, callbacks=[probe, summary])
    model = Regression() if fail_at is None else _FailsAt(fail_at)
    error = None
    try:
        trainer.fit(model, DataLoader(_regression_data(), batch_size=4))
    except RuntimeError as err:
        error = str(err)
    return {"sms": probe.sms, "after": simulated_group.WORLD.sms, "error": error, "summary": summary.summary,
            "candidates": probe.candidates,
            "chose": [line for line in lines.lines if line.startswith("static_dist: sync.schedule auto:")]}


@multiprocess
@pytest.mark.parametrize("fail_at", [None, 5], ids=["fit", "failure"])
def test_schedule_auto_switches_the_simulated_sms_and_puts_them_back(fail_at: Optional[int]) -> None:
    facts = _in_fresh_process(_schedule_auto_in_a_simulated_world, fail_at, timeout=240)
    assert facts["candidates"] == SMS_TRIAL  # a simulated world switches SMs (16, the default, is not tried twice)
    # two steps per candidate: default (16), 8, 4, 2, then after_backward (default SMs) ...
    per_candidate = [16, 16, 8, 8, 4, 4, 2, 2, 16, 16]
    assert facts["sms"][: len(per_candidate)] == per_candidate[: len(facts["sms"])]
    assert facts["after"] == 16  # as the run found them, after a fit and after a failure
    if fail_at is None:
        assert facts["error"] is None
        summary = facts["summary"]
        assert summary["sync_schedule"] in SMS_TRIAL
        assert summary["sync_schedule_trial_steps"] == 2 * len(SMS_TRIAL) and summary["sync_schedule_trial_s"] > 0
    else:
        assert "failing on purpose" in facts["error"] and len(facts["sms"]) == fail_at


@multiprocess
def test_schedule_auto_with_free_links_times_the_default_sms_only() -> None:
    facts = _in_fresh_process(_schedule_auto_in_a_simulated_world, None, False, timeout=240)
    assert facts["candidates"] == [OVERLAP, AFTER]  # free links hold no SMs: nothing to switch
    assert set(facts["sms"]) == {16} and facts["after"] == 16 and facts["error"] is None
    # free links carry nothing: the choice says it cannot tell the candidates apart, and the summary what a byte
    # count means there (issue 46: "bytes_sent_per_rank 101,105,968" beside "no data crossed a link")
    (chose,) = facts["chose"]
    assert chose.endswith("the choice cannot tell the candidates apart (strategy.simulate.link emulates a link)"), chose
    assert facts["summary"]["simulated_link"] == ("free (no data crossed a link; bytes_sent_per_rank and"
                                                  " bytes_per_round: what each of the 2 ranks would send)")


def _comm_sms_with_a_link_on_cuda() -> dict[str, Any]:
    probe = _Sms()
    strategy = StaticDistStrategy(simulate={"world_size": 4, "link": {"gbps": 50, "latency_us": 10, "sms": 16}},
                                  sync={"comm_sms": 8})
    trainer = _quiet_trainer(accelerator="cuda", strategy=strategy, max_steps=3, callbacks=[probe])
    trainer.fit(Regression(), DataLoader(_regression_data(), batch_size=4))
    t = torch.ones(1024, device="cuda")
    dist.all_reduce(t)  # on the link's stream; the caller's stream waits for it
    return {**probe.facts, "steps": trainer.global_step, "sum": t.cpu()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_comm_sms_replaces_the_links_sms_on_cuda() -> None:
    pytest.importorskip("cupy")  # (link emulation's kernel)
    facts = _in_fresh_process(_comm_sms_with_a_link_on_cuda, timeout=300)
    assert facts["group_type"] == SimulatedGroup.__name__ and facts["steps"] == 3
    assert facts["world_sms"] == 8 and facts["group_sms"] == 8  # strategy.sync.comm_sms over link.sms (16)
    torch.testing.assert_close(facts["sum"], torch.full((1024,), 4.0))


def test_nccl_options_are_given_for_nccl_with_comm_sms_only() -> None:
    assert nccl_options("gloo", 8) == {}
    assert nccl_options("nccl", None) == {}
    assert nccl_options("cpu:gloo,cuda:nccl", 8) == {}


@pytest.mark.skipif(getattr(dist, "ProcessGroupNCCL", None) is None, reason="this torch has no NCCL")
def test_nccl_options_carry_max_ctas() -> None:
    options = nccl_options("nccl", 8)["pg_options"]
    assert options.config.max_ctas == 8
    assert nccl_options("nccl", 1)["pg_options"].config.max_ctas == 1


# -------------------------------------------------------------------------------------------- 7. refusals


def _refused(match: str, make: Callable[[], Any]) -> str:
    with pytest.raises(ConfigError, match=match) as caught:
        make()
    message = str(caught.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("world_size", [1, 0])
def test_a_simulated_world_needs_two_ranks(world_size: int) -> None:
    _refused(rf"strategy\.simulate\.world_size.*{world_size}", lambda: StaticDistStrategy(simulate={"world_size": world_size}))


def test_a_link_needs_a_simulated_world() -> None:
    _refused(r"strategy\.simulate\.link", lambda: StaticDistStrategy(simulate={"link": {"gbps": 50}}))


def test_a_link_on_cpu_is_refused_before_the_fit_starts() -> None:
    def go() -> None:
        strategy = StaticDistStrategy(simulate={"world_size": 4, "link": {"gbps": 50}})
        _quiet_trainer(strategy=strategy, max_steps=1).fit(Regression(), DataLoader(_regression_data(), batch_size=4))

    _refused(r"strategy\.simulate\.link", go)
    assert not dist.is_initialized()


def test_several_devices_in_a_simulated_world_are_refused_before_processes_start() -> None:
    def go() -> None:
        strategy = StaticDistStrategy(simulate={"world_size": 4}, start_method="spawn")
        _quiet_trainer(strategy=strategy, devices=2, max_steps=1).fit(
            Regression(), DataLoader(_regression_data(), batch_size=4))

    _refused(r"strategy\.simulate\.world_size=4.*devices=2", go)
    assert not dist.is_initialized()


@pytest.mark.parametrize(("options", "key"), [
    pytest.param({"sync": {"schedule": "auto"}, "compression": {"name": "auto"}}, "strategy.sync.schedule", id="two-trials"),
    pytest.param({"sync": {"schedule": "after_backward", "mode": "graph"}}, "strategy.sync.schedule", id="graph-mode"),
    pytest.param({"sync": {"schedule": "after_backward", "reduce": "reduce_scatter"}}, "strategy.sync.schedule",
                 id="sharded"),
    pytest.param({"sync": {"schedule_trial_steps": 1}}, "strategy.sync.schedule_trial_steps", id="trial-steps"),
    pytest.param({"sync": {"comm_sms": 0}}, "strategy.sync.comm_sms", id="comm-sms"),
    pytest.param({"simulate": {"world_size": 4, "link": {"sms": 0}}}, "strategy.simulate.link.sms", id="link-sms"),
])
def test_schedule_and_sms_options_are_refused_in_one_line_naming_the_key(options: dict, key: str) -> None:
    message = _refused(key.replace(".", r"\."), lambda: StaticDistStrategy(**options))
    assert message.startswith(key), message


def test_a_two_regime_links_rates_follow_the_sms_it_holds() -> None:
    """Idle 308 GB/s with 16 SMs at 65 GB/s each: 16 and 8 SMs move 308 (the link is the limit), 4 SMs 260, 2 SMs
    130; the busy pace (70) scales alike. Without ``sm_gbps`` the SMs do not matter; without ``idle_gbps`` one pace."""
    link = LinkConfig(gbps=70, idle_gbps=308, latency_us=5, sms=16, sm_gbps=65)
    assert link.rates(16) == link.rates(8) == (70, 308)
    assert link.rates(4) == pytest.approx((70 * 260 / 308, 260))
    assert link.rates(2) == pytest.approx((70 * 130 / 308, 130))
    assert LinkConfig(gbps=70, idle_gbps=308).rates(1) == (70, 308) and LinkConfig(gbps=70, idle_gbps=308).two_regimes
    assert LinkConfig(gbps=70).rates(2) == (70, 70) and not LinkConfig(gbps=70).two_regimes
    assert "308 GB/s idle" in link.describe() and "65 GB/s per SM" in link.describe()


@pytest.mark.parametrize("field", ["idle_gbps", "sm_gbps"])
def test_a_two_regime_links_bad_bandwidths_are_one_line_errors(field: str) -> None:
    _refused(rf"strategy\.simulate\.link\.{field}=0", lambda: StaticDistStrategy(
        simulate={"world_size": 2, "link": {"gbps": 50, field: 0}}))
