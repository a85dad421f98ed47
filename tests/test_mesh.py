"""2-D meshes with ``sync.reduce: reduce_scatter`` on real Gloo ranks (4 tiny ranks for the 2 x 2 mesh): the same
weights as Lightning's DDP with AdamW over two param groups and global-norm clipping, optimizer state / dp_shard per
rank, checkpoints that resume on another world size and mesh, and the topology / config errors."""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch

import lightning as L
from lightning_static_dist.examples.charlm import CharDataModule, CharGPT
from lightning.pytorch.callbacks import ModelCheckpoint
from _dist import reference_ddp
from lightning_static_dist import OverlapMonitor, StaticDistStrategy
from lightning_static_dist.checkpoint import consolidate, is_sharded_checkpoint, parse_key, stored_tensors
from lightning_static_dist.config import ConfigError, StrategyConfig
from lightning_static_dist.mesh import RankPlace, TopologyError, check_topology

STEPS = 12
CLIP = 0.05  # small enough that every step clips: the global norm must be the whole model's


def tiny_gpt() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(vocab_size=256, n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=0, weight_decay=0.1)


class _Record(L.Callback):
    """Per rank at the last step: optimizer-state bytes, whether full gradients were kept, the bucket plan."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.in_flight_at_batch_start: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        sync = getattr(trainer.strategy, "sharded_sync", None)
        if sync is not None:  # gathers issued after the last optimizer step and not waited for yet
            self.in_flight_at_batch_start.append(sum(shard.work is not None for shard in sync.shards))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != trainer.max_steps:
            return
        optimizer = trainer.optimizers[0]
        state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                          if torch.is_tensor(v) and v.dim() > 0)
        sync = getattr(trainer.strategy, "sharded_sync", None)
        record = {
            "state_bytes": state_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            "full_grads_kept": any(p.grad is not None for p in pl_module.parameters()),
            "groups": [len(g["params"]) for g in optimizer.param_groups],
            "sharded": sync is not None,
            "in_flight": self.in_flight_at_batch_start,
            "recompiles": len(report.recompiles) if (report := getattr(trainer.strategy, "compile_report", None)) else None,
        }
        torch.save(record, os.path.join(self.directory, f"record_rank{trainer.global_rank}.pt"))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # after the strategy's teardown
        path = os.path.join(self.directory, f"record_rank{trainer.global_rank}.pt")
        record = torch.load(path)
        params = list(pl_module.parameters())
        optimizer = trainer.optimizers[0]
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        record["after_fit"] = {
            "own_storages": len({p.untyped_storage().data_ptr() for p in params}) == len(params),
            "optimizer_holds_model": held == {id(p) for p in params},
            "full_state": all(optimizer.state[p]["exp_avg"].shape == p.shape for p in params),
        }
        torch.save(record, path)


def fit(tmp: str, devices: int, strategy: Any, steps: int = STEPS, ckpt_path: Optional[str] = None,
        save_at: Optional[int] = None, after: Any = None, extra_callbacks: tuple = (),
        **trainer_kwargs: Any) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    os.makedirs(tmp, exist_ok=True)
    L.seed_everything(0)
    model = tiny_gpt()
    callbacks: list[Any] = [_Record(tmp), *extra_callbacks]
    if save_at is not None:
        callbacks.append(ModelCheckpoint(dirpath=tmp, filename="step{step}", every_n_train_steps=save_at,
                                         save_top_k=-1, save_on_train_epoch_end=False))
    options = dict(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                   callbacks=callbacks, enable_checkpointing=save_at is not None, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0, gradient_clip_val=CLIP, default_root_dir=tmp)
    trainer = L.Trainer(**{**options, **trainer_kwargs})
    trainer.fit(model, datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=40_000), ckpt_path=ckpt_path)
    if after is not None:
        after(model, trainer)
    records = [torch.load(os.path.join(tmp, f"record_rank{r}.pt")) for r in range(devices)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, records


def static(replicate: int, shard: int, reduce: str = "auto", **kwargs: Any) -> StaticDistStrategy:
    # small buckets: several per model, so pieces, padding and group boundaries fall inside buckets
    return StaticDistStrategy(start_method="spawn", mesh={"dp_replicate": replicate, "dp_shard": shard},
                              sync={"reduce": reduce, "first_bucket_mb": 0.01, "bucket_mb": 0.03}, **kwargs)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4, msg=key)


@pytest.fixture(scope="module")
def ddp4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Lightning's own DDP on 4 ranks: the reference every mesh must reproduce."""
    weights, _ = fit(str(tmp_path_factory.mktemp("ddp4")), 4, reference_ddp())
    return weights


@pytest.mark.multiprocess
# 2 x 2 in the default run; the two degenerate meshes with `-m slow` (CI runs both)
@pytest.mark.parametrize(("replicate", "shard"), [(2, 2), pytest.param(1, 4, marks=pytest.mark.slow),
                                                  pytest.param(4, 1, marks=pytest.mark.slow)], ids=["2x2", "1x4", "4x1"])
def test_meshes_train_to_ddp_weights_with_state_split_by_dp_shard(
    tmp_path: Any, ddp4: dict[str, torch.Tensor], replicate: int, shard: int
) -> None:
    weights, records = fit(str(tmp_path), 4, static(replicate, shard, reduce="reduce_scatter"))
    assert_same(weights, ddp4)
    _, reference = fit(str(tmp_path / "all_reduce"), 4, static(replicate, shard, reduce="all_reduce"))
    full_state = reference[0]["state_bytes"]
    assert full_state == 2 * reference[0]["param_bytes"]  # AdamW: exp_avg + exp_avg_sq, unsharded
    for record in records:
        assert record["sharded"] and not record["full_grads_kept"]
        # the padding of the last chunk of each bucket is the only excess over an exact 1/dp_shard
        assert record["state_bytes"] == pytest.approx(full_state / shard, rel=0.05)
        assert len(record["groups"]) == 2  # the model's param groups (decay / no decay) survive
    assert sum(r["state_bytes"] for r in records[:shard]) >= full_state  # one shard group holds all of it


@pytest.mark.multiprocess
def test_sharded_checkpoint_two_ranks_resumes_on_four(tmp_path: Any) -> None:
    # 2 ranks (1 x 2) write a sharded checkpoint at step 6 (kept sharded: no consolidation at the end)
    fit(str(tmp_path / "two"), 2, static(1, 2, checkpoint={"consolidate_at_end": False}), steps=6, save_at=6)
    ckpt = str(tmp_path / "two" / "stepstep=6.ckpt")
    assert is_sharded_checkpoint(ckpt)
    ranges: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for name in stored_tensors(ckpt):
        if name.startswith("optim/"):
            index, key, span = parse_key(name)
            if span is not None:
                ranges.setdefault((index, key), []).append(span)
    # nothing was gathered: some parameter's state is split between the two ranks' pieces
    assert any(len(spans) > 1 for spans in ranges.values())
    # resumed on 4 ranks, 2 x 2 (each reads the ranges its pieces overlap) == 4 ranks all_reduce (reads them all)
    resharded, records = fit(str(tmp_path / "to4"), 4, static(2, 2), ckpt_path=ckpt)
    plain, _ = fit(str(tmp_path / "to4_plain"), 4, static(4, 1, reduce="all_reduce"), ckpt_path=ckpt)
    assert records[0]["sharded"]
    assert_same(resharded, plain)
    # consolidated on request: the file an unsharded run writes, which a plain optimizer loads
    out = str(tmp_path / "plain.ckpt")
    consolidate(ckpt, out)
    checkpoint = torch.load(out, weights_only=False)
    model = tiny_gpt()
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    for param in (p for g in optimizer.param_groups for p in g["params"]):
        assert optimizer.state[param]["exp_avg"].shape == param.shape
    model.load_state_dict(checkpoint["state_dict"])
    assert checkpoint["global_step"] == 6


@pytest.mark.multiprocess
@pytest.mark.slow  # (its mirror, 2 -> 4 ranks, stays in the default run)
def test_four_ranks_checkpoint_consolidated_at_end_resumes_on_two(tmp_path: Any) -> None:
    # 4 ranks (2 x 2) save at step 6, the last checkpoint is consolidated in place at the end of fit
    fit(str(tmp_path / "four"), 4, static(2, 2), steps=6, save_at=6)
    ckpt = str(tmp_path / "four" / "stepstep=6.ckpt")
    assert os.path.isfile(ckpt) and not is_sharded_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    model = tiny_gpt()
    assert len(saved["state"]) == len(list(model.parameters()))  # full form: one entry per original parameter
    for index, param in enumerate(p for g in model.configure_optimizers().param_groups for p in g["params"]):
        assert saved["state"][index]["exp_avg"].shape == param.shape
    resharded, _ = fit(str(tmp_path / "to2"), 2, static(1, 2), ckpt_path=ckpt)
    plain, _ = fit(str(tmp_path / "to2_plain"), 2, static(2, 1, reduce="all_reduce"), ckpt_path=ckpt)
    assert_same(resharded, plain)


@pytest.mark.multiprocess
def test_compiled_blocks_wait_for_their_own_gathers_and_the_model_is_whole_after_fit(tmp_path: Any) -> None:
    compiled = {"enabled": True, "backend": "aot_eager", "regional": True}
    weights, records = fit(str(tmp_path / "rs"), 2, static(1, 2, compile=compiled))
    reference, _ = fit(str(tmp_path / "ar"), 2, static(2, 1, reduce="all_reduce"))
    assert_same(weights, reference)
    # the default compile (the whole step cut at the buckets) waits for every gather at the start of the step
    cut, _ = fit(str(tmp_path / "rs_cut"), 2, static(1, 2, compile={"enabled": True, "backend": "aot_eager"}))
    assert_same(cut, reference)
    for record in records:
        assert record["recompiles"] == 0  # parameters that are views of a bucket buffer: no recompile
        # every step after the first starts with the previous step's gathers still in flight (waited in pre-hooks)
        assert len(record["in_flight"]) == STEPS and record["in_flight"][0] == 0
        assert all(n > 0 for n in record["in_flight"][1:])
        # after fit, on the rank: plain parameters again (each its own storage), the optimizer over them, full state
        assert record["after_fit"] == {"own_storages": True, "optimizer_holds_model": True, "full_state": True}


class _ValLoss(L.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.losses: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.losses.append(float(trainer.callback_metrics["val_loss"]))
        torch.save(self.losses, os.path.join(self.directory, f"val_rank{trainer.global_rank}.pt"))


@pytest.mark.multiprocess
def test_accumulation_validation_and_the_monitor_work_with_reduce_scatter(tmp_path: Any) -> None:
    runs = {}
    for name, strategy in (("rs", static(1, 2)), ("ar", static(2, 1, reduce="all_reduce"))):
        tmp = str(tmp_path / name)
        os.makedirs(tmp)
        weights, records = fit(tmp, 2, strategy, steps=6, accumulate_grad_batches=2, limit_val_batches=2,
                               val_check_interval=4, extra_callbacks=(_ValLoss(tmp), OverlapMonitor()))
        runs[name] = (weights, torch.load(os.path.join(tmp, "val_rank0.pt")), records)
    assert runs["rs"][2][0]["sharded"]
    assert_same(runs["rs"][0], runs["ar"][0])
    # validation reads whole, current parameters (waited gathers) at every check
    assert len(runs["rs"][1]) >= 2
    torch.testing.assert_close(torch.tensor(runs["rs"][1]), torch.tensor(runs["ar"][1]), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("section", "key", "fragment"),
    [
        ({"mesh": {"dp_shard": 0}}, "strategy.mesh.dp_shard", "-1 (infer) or an integer >= 1"),
        ({"mesh": {"dp_replicate": -1, "dp_shard": -1}}, "strategy.mesh.dp_shard", "at most one"),
        ({"mesh": {"dp_shard": 2}, "sync": {"mode": "graph"}}, "strategy.sync.reduce", "graph mode"),
        ({"mesh": {"dp_replicate": 2, "dp_shard": -1}, "sync": {"mode": "graph"}}, "strategy.sync.reduce", "graph mode"),
        ({"mesh": {"dp_shard": 2}, "compression": {"name": "powersgd"}}, "strategy.compression.name", "all_reduce"),
        ({"sync": {"reduce": "reduce_scatter"}, "embedding": {"shard": True}}, "strategy.embedding.shard", "already"),
        ({"sync": {"reduce": "scatter"}}, "strategy.sync.reduce", "reduce_scatter"),
    ],
    ids=["zero", "both-inferred", "graph-mode", "graph-mode-inferred-shard", "compression", "embedding",
         "unknown-primitive"],
)
def test_bad_mesh_configs_name_the_key(section: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StrategyConfig.from_dict(section)
    message = str(excinfo.value)
    assert "\n" not in message and key in message and fragment in message


class _FreezeAt(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            pl_module.ln_f.weight.requires_grad_(False)


@pytest.mark.multiprocess
def test_freezing_a_parameter_during_fit_stops_every_rank_with_its_name(tmp_path: Any) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=static(1, 2), max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[_FreezeAt()],
                        default_root_dir=str(tmp_path))
    with pytest.raises(Exception, match=r"'ln_f.weight' was frozen during fit"):
        trainer.fit(tiny_gpt(), datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=4_000))


class _LBFGSGPT(CharGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.multiprocess
def test_an_optimizer_that_is_not_element_wise_is_refused_by_name(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = _LBFGSGPT(vocab_size=256, n_layer=1, n_embd=16, n_head=2, block_size=16)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=static(1, 2), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=str(tmp_path))
    with pytest.raises(Exception, match=r"strategy.sync.reduce='reduce_scatter': LBFGS does not update each element"):
        trainer.fit(model, datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=4_000))


def test_mesh_that_does_not_fit_the_world_fails_before_any_rank_starts() -> None:
    with pytest.raises(ConfigError, match=r"strategy.mesh: dp_replicate=3 x dp_shard=1 = 3 does not match the world"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=static(3, 1), logger=False, enable_progress_bar=False)
        trainer.fit(tiny_gpt(), datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=4_000))


def test_topology_errors_list_what_each_rank_has() -> None:
    same = [RankPlace("cpu", "a")] * 4
    check_topology(same, 2, 2, shard_across_nodes=False)
    with pytest.raises(TopologyError, match=r"different device types — rank 0: cuda on a; rank 1: cpu on a"):
        check_topology([RankPlace("cuda", "a"), RankPlace("cpu", "a")], 1, 2, False)
    split = [RankPlace("cpu", "a"), RankPlace("cpu", "a"), RankPlace("cpu", "b"), RankPlace("cpu", "b")]
    check_topology(split, 2, 2, False)  # each shard group on one host
    with pytest.raises(TopologyError, match=r"dp_shard=4: shard group 0 spans several hosts .*rank 2: cpu on b"):
        check_topology(split, 1, 4, False)
    check_topology(split, 1, 4, shard_across_nodes=True)
