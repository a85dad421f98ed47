"""StaticDistFabricStrategy inside real Fabric runs on 2 CPU ranks (Gloo), side by side with Fabric's own ``ddp``.

Each run is ``fabric.launch(fn)`` on two fresh ranks that already share a Gloo group (``fabric_launch`` in
``tests/_dist.py``: Fabric joins the group, as under torchrun), so that rank 0's result (its trained state dict and a
few facts) comes back to the test process. One case launches with the spawn start method, and one runs a script as a
user does, with ``strategy="static_dist"`` (Fabric re-runs the script for rank 1) and logs the metrics through
``fabric.log_dict``.
"""

from __future__ import annotations

import csv
import functools
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from _dist import fabric_launch, fit_on_ranks, fresh_job_env
from tests._parts import synchronizer_of
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning_static_dist import StaticDistFabricStrategy, offer_of
from lightning_static_dist.config import ConfigError

pytestmark = pytest.mark.multiprocess

STEPS = 4


# ------------------------------------------------------------------------------------------ helpers


def make_model() -> nn.Module:
    """Linear layers around a BatchNorm: parameters, buffers broadcast from rank 0, and several gradient buckets."""
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def make_loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    # shuffled: Fabric and the Trainer then both put in a DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED)
    return DataLoader(TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 4, generator=g)), batch_size=4,
                      shuffle=True)


def train(fabric: L.Fabric, steps: int = STEPS, accumulate: int = 1, checkpoint: Optional[str] = None) -> dict[str, Any]:
    """The user's loop: ``steps`` optimizer steps of ``accumulate`` micro-batches each. With ``checkpoint``: save
    after half the steps, finish, load the checkpoint and run the second half again from it."""
    fabric.seed_everything(7)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    batches = list(fabric.setup_dataloaders(make_loader()))

    def run(first: int, last: int) -> None:
        for step in range(first, last):
            for micro in range(accumulate):
                x, y = batches[step * accumulate + micro]
                with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                    fabric.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    facts: dict[str, Any] = {}
    if checkpoint is None:
        run(0, steps)
    else:
        half = steps // 2
        run(0, half)
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": half})
        run(half, steps)
        facts["straight"] = _state(model)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        remainder = fabric.load(checkpoint, state)
        facts["resumed_at"], facts["remainder"] = state["step"], sorted(remainder)
        run(half, steps)
    # every rank holds the same weights
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = fabric.all_gather(flat)
    facts["ranks_agree"] = bool(torch.equal(gathered[0], gathered[1]))
    facts["state"] = _state(model)
    sync = synchronizer_of(fabric.strategy)
    if sync is not None:
        facts["stats"] = dict(vars(sync.stats))
        facts["buckets"] = len(sync.plan.buckets)
    report = offer.compile_report if (offer := offer_of(fabric)) is not None else None
    if report is not None:
        facts["pieces"] = report.splitter.pieces if report.splitter is not None else 0
        facts["recompiles"] = len(report.recompiles)
    if isinstance(fabric.strategy, StaticDistFabricStrategy):
        facts["metrics"] = fabric.strategy.metrics()  # (rank-local; the overlap figures were combined in optimizer.step)
        aggregate = fabric.strategy._figures._aggregate
        facts["aggregate_on_root_device"] = aggregate is not None and aggregate.device == fabric.strategy.root_device
    return facts


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_pickled(fabric: L.Fabric, kwargs: dict[str, Any]) -> bytes:
    # plain pickle (by value): tensors put on the launcher's queue travel as file descriptors that die with the rank
    return pickle.dumps(train(fabric, **kwargs))


def launch(make_strategy: Any, **kwargs: Any) -> dict[str, Any]:
    """``train(fabric, **kwargs)`` on two fresh ranks under the strategy ``make_strategy()``: rank 0's facts."""
    return pickle.loads(fabric_launch(make_strategy, _train_pickled, kwargs))


def static_dist(**kwargs: Any) -> Any:
    """Our Fabric strategy with ``kwargs``, built on each rank (:func:`launch`)."""
    return functools.partial(StaticDistFabricStrategy, **kwargs)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=tol, rtol=tol, msg=lambda m, key=key: f"{key}: {m}")


@pytest.fixture(scope="module")
def ddp_weights() -> dict[str, torch.Tensor]:
    """Fabric ``ddp``'s weights after the plain run (shared by the cases that must end with them)."""
    return launch(DDPStrategy)["state"]


# ------------------------------------------------------------------------------------------- no processes


_REGISTRY_UNTOUCHED = """
from lightning.fabric.strategies import STRATEGY_REGISTRY
before = {name: (entry["strategy"], dict(entry["init_params"]), entry["description"])
          for name, entry in STRATEGY_REGISTRY.items()}
import lightning as L
try:
    L.Fabric(accelerator="cpu", devices=2, strategy="static_dist")
except ValueError as err:
    print("REJECTED BEFORE:", str(err)[:90])
import lightning_static_dist
after = {name: (entry["strategy"], dict(entry["init_params"]), entry["description"])
         for name, entry in STRATEGY_REGISTRY.items()}
assert {name: after[name] for name in before} == before, "an existing entry changed"
print("ADDED:", sorted(set(after) - set(before)))
for name in ("ddp", "ddp_spawn", "ddp_fork", "dp", "fsdp"):
    assert STRATEGY_REGISTRY.get(name).__class__ is before[name][0], name
fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
print("DDP:", type(fabric.strategy).__name__, type(fabric.strategy._backward_sync_control).__name__)
"""


def test_import_adds_the_fabric_names_and_changes_nothing_else() -> None:
    done = subprocess.run([sys.executable, "-c", _REGISTRY_UNTOUCHED], capture_output=True, text=True, timeout=120,
                          env=fresh_job_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REJECTED BEFORE: You selected an invalid strategy name: `strategy='static_dist'`" in done.stdout
    assert "ADDED: ['static_dist', 'static_dist_notebook', 'static_dist_spawn']" in done.stdout, done.stdout
    assert "DDP: DDPStrategy _DDPBackwardSyncControl" in done.stdout, done.stdout


def test_fabric_accepts_the_registered_names() -> None:
    for name, method in (("static_dist", "popen"), ("static_dist_spawn", "spawn"), ("static_dist_notebook", "fork")):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=name)
        assert isinstance(fabric.strategy, StaticDistFabricStrategy)
        assert fabric.strategy.num_processes == 2 and fabric.strategy._start_method == method
        assert fabric.strategy.config.sync.bucket_mb == 100.0  # the Trainer strategy's defaults
    assert "static_dist" in STRATEGY_REGISTRY


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync": {"bucket_mbb": 5}},
         "strategy.sync.bucket_mbb: unknown key; did you mean 'bucket_mb'? allowed: mode, reduce, reduce_dtype,"),
        ({"sync": {"bucket_mb": 0}}, "strategy.sync.bucket_mb=0.0: must be a number of MiB in (0, 4096]"),
        ({"compression": {"name": "powersgd", "rank": 0}}, "strategy.compression.rank=0: must be an integer >= 1"),
        ({"compile": {"backend": "no_such_backend"}}, "strategy.compile.backend='no_such_backend': not a registered"),
        ({"simulate": {"world_size": 8}},
         "strategy.simulate.world_size=8: one process stands for every rank; allowed: Fabric(devices=1, num_nodes=1)"
         " (got devices=2, num_nodes=1)"),
        ({"bucket_cap_mb": 5, "sync": {"bucket_mb": 10}},
         "bucket_cap_mb=5: given twice (also as strategy.sync.bucket_mb); allowed: one of them"),
        ({"start_method": "thread"}, "start_method='thread': allowed: 'popen', 'spawn', 'fork', 'forkserver'"),
        ({"monitor_every_n_steps": -1}, "monitor_every_n_steps=-1: must be an integer >= 0 (0: never)"),
        ({"checkpoint": {"format": "sharded"}},
         "strategy.checkpoint.format='sharded': fabric.save writes one file from rank 0, which cannot hold each rank's"
         " own optimizer ranges; allowed under Fabric: 'auto' or 'full' (gathered)"),
    ],
    ids=["typo", "range", "compression", "backend", "simulate", "twice", "start_method", "monitor", "sharded_format"],
)
def test_invalid_config_is_one_line_naming_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        L.Fabric(accelerator="cpu", devices=2, strategy=StaticDistFabricStrategy(**kwargs))
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_ddp_arguments_and_the_run_file_block_carry_over() -> None:
    from datetime import timedelta

    from lightning_static_dist.plan.strategy_config import StrategyConfig

    strategy = StaticDistFabricStrategy(timeout=timedelta(seconds=37), bucket_cap_mb=5, find_unused_parameters=True)
    assert strategy.config.timeout_s == 37.0 and strategy.config.sync.bucket_mb == 5.0
    block = StrategyConfig.from_dict({"sync": {"bucket_mb": 10}, "compression": {"name": "bf16"}})
    strategy = StaticDistFabricStrategy.from_config(block, bucket_cap_mb=2, start_method="spawn")
    assert strategy.config.sync.bucket_mb == 2.0 and strategy.config.compression.name == "bf16"


# ------------------------------------------------------------------------------------------ 2 Gloo ranks


def test_trains_to_the_weights_fabric_ddp_gives(ddp_weights: dict[str, torch.Tensor]) -> None:
    # small buckets: several collectives per backward, launched from the hooks while backward still runs
    ours = launch(static_dist(sync={"first_bucket_mb": 0.001, "bucket_mb": 0.002}))
    assert_same_weights(ours["state"], ddp_weights)  # BatchNorm's running statistics included (rank 0's)
    assert ours["ranks_agree"]
    assert ours["buckets"] >= 3
    assert ours["stats"]["rounds"] == STEPS and ours["stats"]["skipped_rounds"] == 0
    # the last step's overlap figures, averaged over the ranks, for fabric.log_dict
    metrics = ours["metrics"]
    assert metrics["static_dist/bytes_sent"] == ours["stats"]["last_round_bytes"]  # (the same on both ranks)
    assert metrics["static_dist/compression_ratio"] == 1.0 and 0 <= metrics["static_dist/overlap_ratio"] <= 1
    # combined on the root device, read after launch (on CPU the only device: NCCL's CUDA-only gather is not shown)
    assert ours["aggregate_on_root_device"]
    assert "static_dist/recompiles" not in metrics  # nothing compiled
    untouched = make_model().state_dict()
    assert any(not torch.equal(ours["state"][k], untouched[k]) for k in untouched)  # training did something


def test_no_backward_sync_accumulates_locally_like_ddp() -> None:
    ours = launch(static_dist(), accumulate=3)
    theirs = launch(DDPStrategy, accumulate=3)
    assert_same_weights(ours["state"], theirs["state"])
    assert ours["ranks_agree"]
    # one synchronisation per optimizer step; the two micro-batches before each stayed local
    assert ours["stats"]["rounds"] == STEPS and ours["stats"]["skipped_rounds"] == 2 * STEPS


def test_compiled_model_trains_like_ddp_with_the_graph_cut_at_the_buckets(ddp_weights: dict[str, torch.Tensor]) -> None:
    ours = launch(static_dist(compile={"enabled": True, "backend": "aot_eager"},
                              sync={"first_bucket_mb": 0.001, "bucket_mb": 0.002}))
    assert_same_weights(ours["state"], ddp_weights, tol=1e-5)
    assert ours["pieces"] > 1  # one autograd node per piece: gradients become ready piece by piece
    assert ours["recompiles"] == 0
    assert ours["metrics"]["static_dist/recompiles"] == 0 and ours["metrics"]["static_dist/compile_s"] > 0


def _metrics_on_rank_zero_only(fabric: L.Fabric) -> bytes:
    """The user's loop that logs from rank 0 only (``if fabric.global_rank == 0: fabric.log_dict(...)``)."""
    fabric.seed_everything(7)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = list(fabric.setup_dataloaders(make_loader()))
    seen = []
    for step in range(STEPS):
        x, y = batches[step]
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if fabric.global_rank == 0:
            seen.append(fabric.strategy.metrics())
    gathered = fabric.all_gather(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return pickle.dumps({"seen": seen, "ranks_agree": bool(torch.equal(gathered[0], gathered[1]))})


def test_metrics_are_rank_local_and_always_hold_the_synchronisers_figures() -> None:
    # called on rank 0 alone, every step, with the timeline recorded every other step: no collective inside (rank 1
    # never calls it), the synchroniser's own figures at every step, the overlap figures once per recorded step
    # (launched as a user launches it from a notebook: the spawn start method, each rank pickled over)
    strategy = StaticDistFabricStrategy(start_method="spawn", monitor_every_n_steps=2, timeout_s=60)
    facts = pickle.loads(L.Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(_metrics_on_rank_zero_only))
    assert facts["ranks_agree"]
    for step, figures in enumerate(facts["seen"]):
        assert figures["static_dist/sync_rounds"] == step + 1, figures
        assert figures["static_dist/sync_buckets"] >= 1 and figures["static_dist/sync_round_bytes"] > 0, figures
        assert figures["static_dist/sync_bytes_sent"] >= (step + 1) * figures["static_dist/sync_round_bytes"]  # (+ masks)
        assert ("static_dist/overlap_ratio" in figures) is (step % 2 == 0), (step, figures)  # steps 0 and 2 recorded


class _PowerSGDModule(L.LightningModule):
    """The same model, data and optimizer, for the Trainer strategy."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return make_loader()


POWERSGD = {"name": "powersgd", "rank": 1, "min_numel": 64}


def _trainer_with_powersgd() -> dict[str, torch.Tensor]:
    """The Trainer strategy's fit of the same run (on joined ranks: ``fit_on_ranks``)."""
    from lightning_static_dist import StaticDistStrategy

    L.seed_everything(7)
    module = _PowerSGDModule()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=StaticDistStrategy(compression=POWERSGD),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_compression_matches_the_trainer_strategy(ddp_weights: dict[str, torch.Tensor]) -> None:
    ours = launch(static_dist(compression=POWERSGD))
    trainers = fit_on_ranks(_trainer_with_powersgd)
    named_as_in_the_module = {f"net.{k}": v for k, v in ours["state"].items()}
    assert_same_weights(named_as_in_the_module, trainers)  # the same engine underneath
    assert ours["ranks_agree"]
    # rank-1 PowerSGD sent fewer bytes than the dense gradients and moved the weights off the exact path, not far
    assert ours["stats"]["last_round_bytes"] < ours["stats"]["last_round_dense_bytes"] / 2
    assert ours["metrics"]["static_dist/compression_ratio"] > 2
    diff = max(float((ours["state"][k] - ddp_weights[k]).abs().max()) for k in ddp_weights if "running" not in k)
    assert 0 < diff < 0.2


def test_save_and_load_round_trip_resumes_exactly_with_compression_state(tmp_path: Path) -> None:
    # TopK keeps each rank's error-feedback residual: continuing from the checkpoint equals continuing straight on
    # only when every rank gets its own residual back (and the model and the optimizer's momentum)
    path = str(tmp_path / "run.ckpt")
    ours = launch(static_dist(compression={"name": "topk", "density": 0.25, "min_numel": 1}), checkpoint=path)
    assert_same_weights(ours["state"], ours["straight"], tol=0)
    assert ours["resumed_at"] == STEPS // 2 and ours["remainder"] == []  # (the strategy's entry is not the user's)
    saved = torch.load(path, weights_only=True)
    assert sorted(saved) == ["model", "optimizer", "static_dist_compression", "step"]
    assert saved["static_dist_compression"]["world_size"] == 2
    residuals = [rank["state"]["residuals"]["0.weight"] for rank in saved["static_dist_compression"]["ranks"]]
    assert residuals[0].abs().sum() > 0 and not torch.equal(residuals[0], residuals[1])  # each rank's own


_SCRIPT = """
import sys

import torch
import torch.nn.functional as F
from torch import nn
import lightning as L
import lightning_static_dist
from lightning.fabric.loggers import CSVLogger


def main(fabric):
    fabric.seed_everything(7)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(4):
        x, y = torch.randn(8, 8, device=fabric.device), torch.randn(8, 4, device=fabric.device)
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        fabric.log_dict(fabric.strategy.metrics(), step=step)
    fabric.logger.finalize("success")
    rounds = fabric.strategy.offer.sync_figures().rounds
    sys.stdout.write(f"TRAINED {fabric.global_rank} {type(fabric.strategy).__name__} {rounds}\\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


if __name__ == "__main__":
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="static_dist", loggers=CSVLogger(sys.argv[1]))
    fabric.launch(main)
"""


def test_a_script_with_strategy_static_dist_logs_the_metrics(tmp_path: Path) -> None:
    # as a user runs it: `python train.py`, Fabric re-runs the script for rank 1 (the popen start method)
    (tmp_path / "train.py").write_text(textwrap.dedent(_SCRIPT))
    done = subprocess.run([sys.executable, "train.py", str(tmp_path / "logs")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=fresh_job_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRAINED 0 StaticDistFabricStrategy 4" in done.stdout and "TRAINED 1 StaticDistFabricStrategy 4" in done.stdout
    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert [row["step"] for row in rows] == ["0", "1", "2", "3"]
    for name in ("overlap_ratio", "hidden_comm_fraction", "comm_ms", "compute_ms", "exposed_comm_ms", "bytes_sent",
                 "compression_ratio", "overlap_ratio_max"):
        assert all(row[f"static_dist/{name}"] != "" for row in rows), name
    assert all(float(row["static_dist/bytes_sent"]) > 0 for row in rows)
    assert all(float(row["static_dist/compression_ratio"]) == 1.0 for row in rows)
    assert all(0.0 <= float(row["static_dist/overlap_ratio"]) <= 1.0 for row in rows)


def _a_checkpoint_loaded_after_setup(fabric: L.Fabric, path: str) -> bytes:
    model, optimizer = fabric.setup(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
    ours = offer_of(fabric).measured_schedule()
    fabric.save(path, {"model": model})
    if fabric.global_rank == 0:  # the same world's checkpoint, holding the other schedule's choice
        saved = torch.load(path, weights_only=False)
        entry = saved["static_dist_sync_schedule_measured"]
        other = "after_backward" if entry["choice"].startswith("overlap") else "overlap"
        entry["choice"] = "/".join([other, *entry["choice"].split("/")[1:]])
        torch.save(saved, path)
    fabric.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, {"model": model})  # too late: setup measured, built the synchroniser and the step
    return pickle.dumps({"ours": ours.choice, "theirs": entry["choice"] if fabric.global_rank == 0 else None,
                         "said": [str(w.message) for w in caught if "static_dist" in str(w.message)],
                         "kept": offer_of(fabric).measured_schedule().choice})


def test_a_checkpoint_loaded_after_setup_says_its_schedule_comes_too_late(tmp_path: Path) -> None:
    # Fabric loads a checkpoint after fabric.setup, which has chosen the schedule: the run keeps its own, and says so
    path = str(tmp_path / "run.ckpt")
    facts = pickle.loads(fabric_launch(static_dist(sync={"probe": True}), _a_checkpoint_loaded_after_setup, path))
    assert facts["kept"] == facts["ours"] != facts["theirs"]
    assert facts["said"] == [f"static_dist: the checkpoint's sync.schedule measured choice ({facts['theirs']}) was"
                             f" loaded after setup, which had measured {facts['ours']}: this run keeps {facts['ours']}"
                             " (the schedule is chosen at setup)"]


def _a_second_optimizer_set_up_late(fabric: L.Fabric) -> bytes:
    model = fabric.setup_module(make_model())
    first = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    second = torch.optim.SGD(list(model.parameters())[2:], lr=0.1)
    try:
        fabric.setup_optimizers(first, second)  # the step is set up with the first; the second would be left out
    except ConfigError as err:
        return pickle.dumps(str(err))
    return pickle.dumps(None)


def test_an_optimizer_set_up_after_its_models_step_is_refused_in_one_line() -> None:
    assert pickle.loads(fabric_launch(static_dist(), _a_second_optimizer_set_up_late, world_size=1)) == (
        "fabric.setup_optimizers: an optimizer over a model whose step is set up already (with an optimizer, or at its"
        " first forward); allowed: set the model up with all its optimizers at once, fabric.setup(model, optimizer1,"
        " optimizer2)")


def _out_of_step_then_teardown(fabric: L.Fabric) -> bytes:
    """Rank 1 runs one backward more (accumulated locally) on the last step: the ranks' passes disagree, found at
    teardown; whatever it raises, the model's hooks are gone."""
    from lightning_static_dist.agreement.fingerprint import RankMismatchError

    fabric.seed_everything(7)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))  # (no buffers: no broadcast per forward)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    batches = list(fabric.setup_dataloaders(make_loader()))
    for step in range(3):
        x, y = batches[step]
        if step == 2 and fabric.global_rank == 1:
            with fabric.no_backward_sync(model):
                fabric.backward(F.mse_loss(model(x), y))
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    raised = None
    try:
        fabric.strategy.teardown()
    except RankMismatchError as err:
        raised = str(err)
    hooks = len(net._forward_pre_hooks) + len(net._forward_hooks) + sum(
        len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())
    offer = fabric.strategy.offer  # (still readable after teardown, as the Trainer's after fit)
    return pickle.dumps({"raised": raised, "hooks": hooks, "failed": getattr(fabric.strategy, "has_failed", bool)(),
                         "rounds_after_teardown": offer.sync_figures().rounds if offer is not None else None})


def test_teardown_of_ranks_out_of_step_raises_after_taking_the_hooks_out() -> None:
    facts = pickle.loads(fabric_launch(static_dist(timeout_s=60), _out_of_step_then_teardown))
    assert facts["raised"] is not None and facts["raised"].startswith("static_dist: ranks are in different steps")
    assert facts["hooks"] == 0 and facts["failed"], facts
    assert facts["rounds_after_teardown"] == 3, facts
