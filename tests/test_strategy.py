"""StaticDistStrategy inside real Lightning Trainers on 2 CPU ranks (Gloo), side by side with Lightning's ``ddp``.

The fits run on one module-scoped pair of Gloo ranks (``fit_in``: the Trainer joins the ranks' group, so our run and
``ddp``'s share one start-up); a case that checks how the process group starts launches its own ranks with the spawn
start method (``fit``). Rank 0's trained weights come back to the test process; per-rank facts (sampler, synchroniser
counters, buffers) are written by a small callback to ``tmp_path``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, ManualOptimBoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import lightning as L
import lightning_static_dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from _dist import RankPool, fresh_job_env, reference_ddp
from tests._parts import synchronizer_of
from lightning_static_dist import StaticDistStrategy
from lightning_static_dist.plan.world import binds_device

pytestmark = pytest.mark.multiprocess


# ------------------------------------------------------------------------------------------- no processes


def test_import_registers_the_strategy_names() -> None:
    for name in ("static_dist", "static_dist_spawn", "static_dist_notebook"):
        assert name in StrategyRegistry
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="static_dist", logger=False)
    assert isinstance(trainer.strategy, StaticDistStrategy)
    assert trainer.strategy.num_processes == 2
    assert trainer._accelerator_connector.is_distributed  # sampler insertion and sync_dist depend on it
    assert lightning_static_dist.StaticDistStrategy is StaticDistStrategy


_UNTOUCHED = """
import lightning.pytorch.trainer.trainer as trainer_module
original = trainer_module._verify_strategy_supports_compile
import torch, lightning_static_dist
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy as Other
assert trainer_module._verify_strategy_supports_compile is original, "the import alone changed Lightning"
lightning_static_dist.StaticDistStrategy()
assert trainer_module._verify_strategy_supports_compile is not original  # widened for static_dist
model = BoringModel()
model._compiler_ctx = {"compiler": "dynamo"}
for strategy in (DDPStrategy(), Other()):
    outcomes = []
    for verify in (original, trainer_module._verify_strategy_supports_compile):
        try:
            verify(model, strategy)
            outcomes.append("ok")
        except Exception as err:
            outcomes.append(f"{type(err).__name__}: {err}")
    assert outcomes[0] == outcomes[1], outcomes
    print(type(strategy).__name__, outcomes[0][:60])
"""


def test_importing_the_package_leaves_other_strategies_as_they_were() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _UNTOUCHED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # ddp accepts a compiled model, a strategy Lightning refuses still refuses: as without the package
    assert "DDPStrategy ok" in done.stdout and "ModelParallelStrategy RuntimeError" in done.stdout, done.stdout


class _WithBatchNorm(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


class _NormsSeen(Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.during = [type(m).__name__ for m in pl_module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_sync_batchnorm_is_reverted_in_teardown_as_ddp_does() -> None:
    # Trainer(sync_batchnorm=True) converts the model's BatchNorm layers in setup; left converted after fit, the model
    # would hold a collective in every training forward (on CPU, SyncBatchNorm refuses to run at all)
    model, seen = _WithBatchNorm(), _NormsSeen()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="static_dist", sync_batchnorm=True, limit_train_batches=0,
                        limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[seen])
    trainer.fit(model)
    assert seen.during == ["SyncBatchNorm"]
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    model.train()
    assert model(torch.randn(4, 32)).shape == (4, 2)  # a plain BatchNorm again: trains without a process group


def test_lightning_cli_accepts_the_class_path() -> None:
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        BoringModel,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.strategy=lightning_static_dist.StaticDistStrategy",
            "--trainer.strategy.sync={'bucket_mb': 5}",
            "--trainer.logger=false",
        ],
    )
    assert isinstance(cli.trainer.strategy, StaticDistStrategy)
    assert cli.trainer.strategy.config.sync.bucket_mb == 5.0


_CLI_SCRIPT = """
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

cli = LightningCLI(BoringModel)
if cli.trainer.is_global_zero:
    config = cli.trainer.strategy.config
    print("TRAINED", cli.trainer.world_size, cli.trainer.global_step, config.sync.bucket_mb,
          config.sync.reduce_dtype, config.compile.enabled, config.compile.backend, config.timeout_s,
          sorted(type(c).__name__ for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_static_dist")))
"""


def _readme_yaml(heading: str) -> str:
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    section = readme[readme.index(heading):]
    return section[section.index("```yaml") + len("```yaml"):section.index("```", section.index("```yaml") + 7)]


def test_the_readme_lightning_cli_file_trains(tmp_path: Any) -> None:
    # the README's LightningCLI run file, as written there, on 2 CPU ranks (Lightning's launcher re-runs the script);
    # only the length and the compile backend are set from the command line, through the typed sections (GraphReport:
    # the callback the strategy adds for the compile report)
    import subprocess
    import sys

    (tmp_path / "conf").mkdir()  # (LightningCLI saves the parsed config as ./config.yaml)
    (tmp_path / "conf" / "config.yaml").write_text(_readme_yaml("### LightningCLI"))
    (tmp_path / "main.py").write_text(_CLI_SCRIPT)
    done = subprocess.run(
        [sys.executable, "main.py", "fit", "--config", "conf/config.yaml", "--trainer.max_steps=3",
         "--trainer.strategy.compile.backend=aot_eager", "--trainer.logger=false",
         "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=fresh_job_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRAINED 2 3 100.0 fp32 True aot_eager 600.0 ['GraphReport', 'OverlapMonitor', 'RunSummary']" in done.stdout, done.stdout[-2000:]


def test_lightning_cli_shows_and_checks_the_typed_sections(capsys: Any) -> None:
    from lightning.pytorch.cli import LightningCLI

    strategy = "--trainer.strategy=lightning_static_dist.StaticDistStrategy"
    with pytest.raises(SystemExit):  # --print_config: a section touched on the command line shows all its fields
        LightningCLI(BoringModel, run=False, args=["--print_config", strategy, "--trainer.strategy.sync.bucket_mb=50"])
    shown = capsys.readouterr().out
    assert "bucket_mb: 50.0" in shown and "reduce_dtype: fp32" in shown and "first_bucket_mb: 1.0" in shown, shown
    # a typo in a field: the strategy's own one-line error, as a parse error (status 2)
    with pytest.raises(SystemExit, match="2"):
        LightningCLI(BoringModel, run=False, args=[strategy, "--trainer.strategy.sync.bucket_mbb=5"])
    assert "strategy.sync.bucket_mbb: unknown key; did you mean 'bucket_mb'" in capsys.readouterr().err
    cli = LightningCLI(BoringModel, run=False, args=[
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false", strategy,
        "--trainer.strategy.sync.reduce_dtype=bf16"])
    assert cli.trainer.strategy.config.sync.reduce_dtype == "bf16"


# ------------------------------------------------------------------------------------------ helpers


class RankReport(Callback):
    """Writes per-rank facts to ``<dir>/rank<N>.json`` at the end of fit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.sampler_indices: list[int] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler
        if isinstance(sampler, DistributedSampler) and not self.sampler_indices:
            self.sampler_indices = list(iter(sampler))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sync = synchronizer_of(trainer.strategy)
        facts = {
            "rank": trainer.global_rank,
            "sampler": type(trainer.train_dataloader.sampler).__name__,
            "sampler_indices": self.sampler_indices,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "stats": vars(sync.stats) if sync is not None else None,
            "state": {k: v.float().sum().item() for k, v in pl_module.state_dict().items()},
        }
        write_rank_report(self.directory, trainer.global_rank, facts)


def write_rank_report(directory: str, rank: int, facts: dict[str, Any]) -> None:
    """``<directory>/rank<N>.json``, as :func:`rank_reports` reads it back."""
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)


def fit(
    make_model: Callable[[], L.LightningModule],
    strategy: Any,
    tmp_path: Any = None,
    seed: int = 7,
    ckpt_path: Any = None,
    **trainer_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Fit on 2 CPU ranks; return rank 0's trained state dict and each rank's report (when tmp_path is given)."""
    L.seed_everything(seed)
    model = make_model()
    callbacks = [RankReport(str(tmp_path))] if tmp_path is not None else []
    callbacks += trainer_kwargs.pop("callbacks", [])
    kwargs = dict(
        accelerator="cpu",
        devices=2,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(strategy=strategy, callbacks=callbacks, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, rank_reports(tmp_path)


def rank_reports(directory: Any) -> list[dict]:
    """Each rank's ``<directory>/rank<N>.json`` (none without a directory)."""
    reports = []
    if directory is not None:
        for rank in range(2):
            with open(os.path.join(directory, f"rank{rank}.json")) as f:
                reports.append(json.load(f))
    return reports


def _fit_on_this_rank(rank: int, world: int, make_model: Callable[[], L.LightningModule], strategy: str,
                      options: dict[str, Any], report_dir: Any, seed: int, ckpt_path: Any,
                      trainer_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
    torch._dynamo.reset()  # (compiled as in a fresh process: nothing cached by an earlier fit on these ranks)
    built = DDPStrategy(**options) if strategy == "ddp" else StaticDistStrategy(**options)
    callbacks = [RankReport(str(report_dir))] if report_dir is not None else []
    callbacks += trainer_kwargs.pop("callbacks", [])
    weights, _ = fit(make_model, built, seed=seed, ckpt_path=ckpt_path, callbacks=callbacks, **trainer_kwargs)
    return weights


def fit_in(ranks: RankPool, make_model: Callable[[], L.LightningModule], strategy: str,
           options: Optional[dict[str, Any]] = None, tmp_path: Any = None, seed: int = 7, ckpt_path: Any = None,
           **trainer_kwargs: Any) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """:func:`fit` on ranks that already exist (a module's :class:`RankPool`): the Trainer joins their Gloo group
    instead of starting processes, so our run and ``ddp``'s share one start-up. ``strategy`` is ``"static_dist"`` or
    ``"ddp"`` (Lightning's own ``DDPStrategy``), built on each rank with ``options``. Only for cases that do not
    check how the process group starts (its timeout, its backend): the pool's group is already there."""
    weights = ranks.run(_fit_on_this_rank, args=(make_model, strategy, options or {}, tmp_path, seed, ckpt_path,
                                                 trainer_kwargs), timeout=300)[0]
    return weights, rank_reports(tmp_path)


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """Two Gloo ranks for the module's fits (:func:`fit_in`): one start-up for every pair of runs."""
    with RankPool(2) as pool:
        yield pool


def static_dist(**kwargs: Any) -> StaticDistStrategy:
    return StaticDistStrategy(start_method="spawn", **kwargs)


def ddp(**kwargs: Any) -> DDPStrategy:
    return reference_ddp(**kwargs)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=tol, rtol=tol, msg=lambda m, key=key: f"{key}: {m}")


def assert_trained(weights: dict[str, torch.Tensor], make_model: Callable[[], L.LightningModule], seed: int = 7) -> None:
    """Training did something: the weights differ from those ``fit``'s seed builds (seen without a launch)."""
    L.seed_everything(seed)
    untouched = make_model().state_dict()
    assert any(not torch.equal(weights[k], untouched[k]) for k in weights)


class DemoWithData(DemoModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4)


class ShuffledBoring(BoringModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=2, shuffle=True)


# ------------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize(
    ("make_model", "extra"),
    [
        pytest.param(BoringModel, {}, id="BoringModel"),
        pytest.param(ManualOptimBoringModel, {}, id="ManualOptimBoringModel"),
    ],
)
def test_lightning_demo_modules_end_with_the_weights_ddp_gives(ranks: RankPool, make_model: Callable,
                                                              extra: dict) -> None:
    ours, _ = fit_in(ranks, make_model, "static_dist", **extra)
    theirs, _ = fit_in(ranks, make_model, "ddp", **extra)
    assert_same_weights(ours, theirs)
    assert_trained(ours, make_model)


class ProcessGroupTimeout(Callback):
    """Each rank writes the timeout its default process group was given."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # after the first optimizer step: start-up runs under a timeout of its own (issue 37), timeout_s from then on
        if trainer.global_step != 1:
            return
        group = torch.distributed.distributed_c10d._get_default_group()
        seconds = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        with open(os.path.join(self.directory, f"timeout{trainer.global_rank}.json"), "w") as f:
            json.dump({"timeout_s": seconds, "bucket_mb": trainer.strategy.config.sync.bucket_mb}, f)


def test_ddps_keyword_arguments_carry_over_and_the_clipped_demo_model_ends_with_ddps_weights(tmp_path: Any) -> None:
    # the constructor of a DDPStrategy(...) the user already has: DDP's timeout reaches the process group, its
    # bucket size the plan; find_unused_parameters is accepted (nothing to do: usage is found at the first step).
    # Lightning's DemoModel, its gradients clipped, is the run (one pair of launches for both)
    from datetime import timedelta

    strategy = static_dist(timeout=timedelta(seconds=37), find_unused_parameters=True, process_group_backend="gloo",
                           bucket_cap_mb=5)
    assert strategy.config.timeout_s == 37.0 and strategy.config.sync.bucket_mb == 5.0
    ours, _ = fit(DemoWithData, strategy, callbacks=[ProcessGroupTimeout(str(tmp_path))], gradient_clip_val=0.05)
    theirs, _ = fit(DemoWithData, ddp(), gradient_clip_val=0.05)
    assert_same_weights(ours, theirs)
    assert_trained(ours, DemoWithData)
    for rank in range(2):
        with open(os.path.join(str(tmp_path), f"timeout{rank}.json")) as f:
            assert json.load(f) == {"timeout_s": 37.0, "bucket_mb": 5.0}


_LATER_BACKEND_SCRIPT = """
import os
import sys
import lightning as L
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_static_dist import StaticDistStrategy


def gloo_by_another_name(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class SayBackend(L.Callback):
    def on_train_start(self, trainer, pl_module):
        # one write(2) of one short line: the two ranks share the pipe, and print() writes its parts one by one
        os.write(1, f"BACKEND {trainer.global_rank} {dist.get_backend()}\\n".encode())


strategy = StaticDistStrategy(process_group_backend=sys.argv[1])  # built first, as a vendor's plugin would find it
dist.Backend.register_backend("lsd_vendor", gloo_by_another_name, devices=["cpu"])  # registered after
L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
          callbacks=[SayBackend()]).fit(BoringModel())
"""


# (the typo, one more 2-rank job, with -m slow)
@pytest.mark.parametrize(("backend", "expected"), [("lsd_vendor", "BACKEND 1 lsd_vendor"),
                                                    pytest.param("lsd_vendr", "process_group_backend='lsd_vendr': allowed:",
                                                                 marks=pytest.mark.slow)],
                         ids=["registered-after-the-strategy", "typo"])
def test_a_backend_registered_after_the_strategy_is_built_runs_the_process_group(tmp_path: Any, backend: str,
                                                                                  expected: str) -> None:
    # as DDP (Lightning's test_ddp_process_group_backend[foo-*]): the name is looked up when the group starts, on
    # 2 real ranks (Lightning's launcher re-runs the script, which registers the backend in every rank)
    import subprocess
    import sys

    (tmp_path / "main.py").write_text(_LATER_BACKEND_SCRIPT)
    done = subprocess.run([sys.executable, "main.py", backend], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env=fresh_job_env())
    output = done.stdout + done.stderr
    assert expected in output, output[-3000:]
    assert (done.returncode == 0) is (backend == "lsd_vendor"), output[-3000:]


def _bf16_average(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's ``bf16_compress_hook`` step for step (cast, divide, sum, copy back); torch allows that hook itself on
    NCCL/XCCL only."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(torch.distributed.get_world_size())
    future = torch.distributed.all_reduce(compressed, async_op=True).get_future()
    return future.then(lambda done: buffer.copy_(done.value()[0]))


# DDP checks the hook's annotations as objects; this module's are strings (``from __future__ import annotations``)
_bf16_average.__annotations__ = {"state": Any, "bucket": torch.distributed.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}


class DDPWithBf16Hook(type(reference_ddp())):  # type: ignore[misc]
    """Lightning's DDP with the bf16 averaging hook registered on CPU too (Lightning registers hooks on CUDA only)."""

    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(state=None, hook=_bf16_average)


@pytest.mark.slow  # three launches; the default run keeps tests/sync/test_reduce_dtype.py's bf16 mean on 2 real ranks
def test_bf16_reduce_dtype_averages_like_ddps_bf16_hook_and_sends_half_the_bytes(tmp_path: Any) -> None:
    # sync.reduce_dtype bf16: cast into a bf16 bucket, divide, sum, copy back (cast) — the order of operations of
    # DDP's bf16_compress_hook, so the weights are DDP's with that hook; half the bytes of the fp32 path
    for name in ("bf16", "fp32"):
        (tmp_path / name).mkdir()
    ours, reports = fit(DemoWithData, static_dist(sync={"reduce_dtype": "bf16"}), tmp_path / "bf16")
    theirs, _ = fit(DemoWithData, DDPWithBf16Hook())
    exact, exact_reports = fit(DemoWithData, static_dist(), tmp_path / "fp32")
    assert_same_weights(ours, theirs)
    assert any(not torch.equal(ours[k], exact[k]) for k in ours)  # the rounding is real
    # gradients (and usage flags) in 2 bytes instead of 4
    assert 2 * reports[0]["stats"]["last_round_bytes"] == exact_reports[0]["stats"]["last_round_bytes"]


class BatchNormNet(L.LightningModule):
    """BatchNorm buffers, a frozen layer, a tied weight and a branch that only starts being used at step 3."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 16)
        self.bn = nn.BatchNorm1d(16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.late = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.back = nn.Linear(16, 16, bias=False)
        self.back.weight = self.out.weight

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        h = self.frozen(self.bn(self.inp(batch)).relu())
        if self.global_step >= 3:
            h = h + self.late(h)
        loss = self.back(self.out(h)).pow(2).mean()
        self.log("rank_value", float(self.global_rank), sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4, shuffle=True)


def test_buffers_usage_change_sync_dist_and_sampler(ranks: RankPool, tmp_path: Any) -> None:
    (tmp_path / "ours").mkdir()
    ours, reports = fit_in(ranks, BatchNormNet, "static_dist", tmp_path=tmp_path / "ours", max_steps=8)
    theirs, _ = fit_in(ranks, BatchNormNet, "ddp", {"find_unused_parameters": True}, max_steps=8)
    assert_same_weights(ours, theirs)  # includes BatchNorm running stats (rank 0's, broadcast like DDP)
    r0, r1 = reports
    # Lightning inserted a DistributedSampler: the ranks see disjoint halves of the data
    assert r0["sampler"] == r1["sampler"] == "DistributedSampler"
    assert set(r0["sampler_indices"]).isdisjoint(r1["sampler_indices"])
    assert len(r0["sampler_indices"]) + len(r1["sampler_indices"]) == 64
    # self.log(sync_dist=True) reduced across ranks: mean of rank 0 and rank 1
    assert r0["metrics"]["rank_value"] == r1["metrics"]["rank_value"] == pytest.approx(0.5)
    # the late branch joined the plan once, when it was first used
    assert r0["stats"]["plan_rebuilds"] == r1["stats"]["plan_rebuilds"] == 1


def test_accumulation_skips_communication_on_non_boundary_steps(ranks: RankPool, tmp_path: Any) -> None:
    ours, reports = fit_in(ranks, ShuffledBoring, "static_dist", tmp_path=tmp_path, max_steps=3,
                           accumulate_grad_batches=4)
    theirs, _ = fit_in(ranks, ShuffledBoring, "ddp", max_steps=3, accumulate_grad_batches=4)
    assert_same_weights(ours, theirs)
    for r in reports:
        assert r["stats"]["rounds"] == 3  # one synchronisation per optimizer step
        assert r["stats"]["skipped_rounds"] == 9  # three local micro-batches before each
        # one bucket per round (BoringModel is tiny) plus the first round's usage mask
        assert r["stats"]["collectives"] == 3 + 1


@pytest.mark.parametrize("precision", ["bf16-mixed", pytest.param("bf16-true", marks=pytest.mark.slow)])
def test_cpu_precisions_match_ddp(ranks: RankPool, precision: str) -> None:
    ours, _ = fit_in(ranks, BoringModel, "static_dist", precision=precision)
    theirs, _ = fit_in(ranks, BoringModel, "ddp", precision=precision)
    assert_same_weights(ours, theirs, tol=1e-2 if precision == "bf16-true" else 1e-5)


# ------------------------------------------------------------------------------------------ checkpoints


class Steady(BoringModel):
    """BoringModel with Adam (optimizer state to restore) and no scheduler."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=4)


def test_checkpoint_round_trips_with_a_single_device_trainer(ranks: RankPool, tmp_path: Any) -> None:
    # static_dist -> plain single-device Lightning
    ours, _ = fit_in(ranks, Steady, "static_dist", max_epochs=1, max_steps=-1, default_root_dir=str(tmp_path / "a"),
                     enable_checkpointing=True)
    ckpt = next((tmp_path / "a").rglob("*.ckpt"))
    loaded = Steady.load_from_checkpoint(str(ckpt))
    assert_same_weights({k: v for k, v in loaded.state_dict().items()}, ours, tol=0)
    single = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                       enable_checkpointing=False, enable_model_summary=False)
    single.fit(Steady(), ckpt_path=str(ckpt))
    assert single.global_step == 8 + 16  # the 2-rank epoch took 8 steps; one rank alone needs 16 per epoch

    # plain single-device Lightning -> static_dist (resume)
    single = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=str(tmp_path / "b"))
    single.fit(Steady())
    ckpt = next((tmp_path / "b").rglob("*.ckpt"))
    resumed, _ = fit_in(ranks, Steady, "static_dist", max_epochs=2, max_steps=-1, ckpt_path=str(ckpt))
    assert not torch.equal(resumed["layer.weight"], Steady.load_from_checkpoint(str(ckpt)).layer.weight)


# plain: the slow variant; the TopK case the default run keeps resumes the same state plus each rank's residual
@pytest.mark.parametrize("compression", [pytest.param(None, marks=pytest.mark.slow),
                                         {"name": "topk", "density": 0.25, "min_numel": 1}],
                         ids=["plain", "topk-residuals"])
def test_resume_continues_exactly(ranks: RankPool, tmp_path: Any, compression: Any) -> None:
    # with TopK each rank carries its own error-feedback residual: bitwise equality needs it back on the same rank
    options = {"compression": compression}
    straight, _ = fit_in(ranks, Steady, "static_dist", options, max_epochs=2, max_steps=-1)
    fit_in(ranks, Steady, "static_dist", options, max_epochs=1, max_steps=-1, default_root_dir=str(tmp_path),
           enable_checkpointing=True)
    ckpt = next(tmp_path.rglob("*.ckpt"))
    resumed, _ = fit_in(ranks, Steady, "static_dist", options, max_epochs=2, max_steps=-1, ckpt_path=str(ckpt))
    assert_same_weights(resumed, straight, tol=0)


class GradProbe(BoringModel):
    """Records, in on_after_backward, how far the ranks' gradients are apart right after backward."""

    def on_after_backward(self) -> None:
        grad = self.layer.weight.grad.detach().clone()
        gathered = [torch.empty_like(grad) for _ in range(2)]
        torch.distributed.all_gather(gathered, grad)
        self.spread = getattr(self, "spread", 0.0) + float((gathered[0] - gathered[1]).abs().max())

    def on_train_end(self) -> None:
        assert self.spread == 0.0, f"on_after_backward saw unsynchronised gradients (spread {self.spread})"


def test_on_after_backward_sees_averaged_gradients(ranks: RankPool) -> None:
    # like DDP: the round finishes as the autograd engine finishes backward, before Lightning's hook
    fit_in(ranks, GradProbe, "static_dist", max_steps=4)


@pytest.mark.parametrize(("backend", "device", "bound"), [
    ("nccl", "cuda:0", True),
    ("gloo", "cuda:0", False),  # Gloo on CUDA tensors: the mesh must not split its groups (torch 2.11 cannot)
    ("cpu:gloo,cuda:nccl", "cuda:1", True),
    ("cpu:gloo,cuda:gloo", "cuda:0", False),
    ("ucc", "cuda:0", False),  # only the accelerator's own library is created eagerly on the device
    ("gloo", "cpu", False),
    ("cpu:gloo,cuda:nccl", "cpu", False),
])
def test_the_process_group_is_bound_to_the_device_for_the_accelerators_own_library_only(backend: str, device: str, bound: bool) -> None:
    assert binds_device(backend, torch.device(device)) is bound
