"""``sync.reduce: reduce_scatter`` (the sharded synchroniser) on real Gloo ranks, 4 tiny ranks for the 2 x 2 mesh:
the same weights as Lightning's DDP with AdamW over two param groups and global-norm clipping, optimizer state /
dp_shard per rank, gathers waited where compiled blocks need them, accumulation, validation and the monitor, and
what it refuses by name (a parameter frozen during fit, an optimizer that is not element-wise)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lightning as L
from _dist import RankPool
from _mesh_fit import STEPS, assert_same, fit_in, static, tiny_gpt
from lightning_static_dist import OverlapMonitor
from lightning_static_dist.examples.charlm import CharDataModule, CharGPT


@pytest.fixture(scope="module")
def ranks4() -> Iterator[RankPool]:
    """4 Gloo ranks for the mesh cases' fits (ddp's, reduce_scatter's, all_reduce's): one start-up for them all."""
    with RankPool(4) as pool:
        yield pool


@pytest.fixture(scope="module")
def ranks2() -> Iterator[RankPool]:
    """2 Gloo ranks for the compiled and the accumulation cases' fits: one start-up for the five."""
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def ddp4(ranks4: RankPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Lightning's own DDP on 4 ranks: the reference every mesh must reproduce."""
    weights, _ = fit_in(ranks4, str(tmp_path_factory.mktemp("ddp4")), None)
    return weights


@pytest.mark.multiprocess
# 2 x 2 in the default run; the two degenerate meshes with `-m slow` (CI runs both)
@pytest.mark.parametrize(("replicate", "shard"), [(2, 2), pytest.param(1, 4, marks=pytest.mark.slow),
                                                  pytest.param(4, 1, marks=pytest.mark.slow)], ids=["2x2", "1x4", "4x1"])
def test_meshes_train_to_ddp_weights_with_state_split_by_dp_shard(
    ranks4: RankPool, tmp_path: Any, ddp4: dict[str, torch.Tensor], replicate: int, shard: int
) -> None:
    weights, records = fit_in(ranks4, str(tmp_path), (replicate, shard, "reduce_scatter"))
    assert_same(weights, ddp4)
    _, reference = fit_in(ranks4, str(tmp_path / "all_reduce"), (replicate, shard, "all_reduce"))
    full_state = reference[0]["state_bytes"]
    assert full_state == 2 * reference[0]["param_bytes"]  # AdamW: exp_avg + exp_avg_sq, unsharded
    for record in records:
        assert record["sharded"] and not record["full_grads_kept"]
        # the last step's gathers were in flight after its optimizer step; the offer's wait_for_parameters() ended them
        assert record["wait_for_parameters"][1] == 0 and (shard == 1 or record["wait_for_parameters"][0] > 0)
        # the padding of the last chunk of each bucket is the only excess over an exact 1/dp_shard
        assert record["state_bytes"] == pytest.approx(full_state / shard, rel=0.05)
        assert len(record["groups"]) == 2  # the model's param groups (decay / no decay) survive
    assert sum(r["state_bytes"] for r in records[:shard]) >= full_state  # one shard group holds all of it


@pytest.mark.multiprocess
def test_compiled_blocks_wait_for_their_own_gathers_and_the_model_is_whole_after_fit(ranks2: RankPool,
                                                                                      tmp_path: Any) -> None:
    compiled = {"enabled": True, "backend": "aot_eager", "regional": True}
    weights, records = fit_in(ranks2, str(tmp_path / "rs"), (1, 2, "auto"), {"compile": compiled})
    reference, _ = fit_in(ranks2, str(tmp_path / "ar"), (2, 1, "all_reduce"))
    assert_same(weights, reference)
    # the default compile (the whole step cut at the buckets) waits for every gather at the start of the step
    cut, _ = fit_in(ranks2, str(tmp_path / "rs_cut"), (1, 2, "auto"),
                    {"compile": {"enabled": True, "backend": "aot_eager"}})
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
def test_accumulation_validation_and_the_monitor_work_with_reduce_scatter(ranks2: RankPool, tmp_path: Any) -> None:
    runs = {}
    for name, mesh in (("rs", (1, 2, "auto")), ("ar", (2, 1, "all_reduce"))):
        tmp = str(tmp_path / name)
        os.makedirs(tmp)
        weights, records = fit_in(ranks2, tmp, mesh, steps=6, accumulate_grad_batches=2, limit_val_batches=2,
                                  val_check_interval=4, extra_callbacks=(_ValLoss(tmp), OverlapMonitor()))
        runs[name] = (weights, torch.load(os.path.join(tmp, "val_rank0.pt")), records)
    assert runs["rs"][2][0]["sharded"]
    assert_same(runs["rs"][0], runs["ar"][0])
    # validation reads whole, current parameters (waited gathers) at every check
    assert len(runs["rs"][1]) >= 2
    torch.testing.assert_close(torch.tensor(runs["rs"][1]), torch.tensor(runs["ar"][1]), atol=1e-5, rtol=1e-5)


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
