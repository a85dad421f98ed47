"""Fit the tiny char GPT on CPU ranks over a ``dp_replicate x dp_shard`` mesh and record, per rank, what sharding
left behind (optimizer-state bytes, kept gradients, param groups, gathers in flight, the model after fit).

Shared by test_sharded.py, test_checkpoint.py and test_mesh.py: ``static`` builds the strategy with small buckets,
``fit`` trains and returns rank 0's weights with every rank's record (``fit_in`` the same on the ranks of a
``RankPool``), ``assert_same`` compares two runs' weights.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from _dist import RankPool
from tests._parts import parts_of
from lightning_static_dist import StaticDistStrategy, offer_of
from lightning_static_dist.examples.charlm import CharDataModule, CharGPT


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
        sync = _sharded_sync(trainer)
        if sync is not None:  # gathers issued after the last optimizer step and not waited for yet
            self.in_flight_at_batch_start.append(sum(shard.work is not None for shard in sync.shards))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != trainer.max_steps:
            return
        optimizer = trainer.optimizers[0]
        state_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                          if torch.is_tensor(v) and v.dim() > 0)
        sync = _sharded_sync(trainer)
        in_flight = sum(shard.work is not None for shard in sync.shards) if sync is not None else 0
        if (offer := offer_of(trainer)) is not None:
            offer.wait_for_parameters()  # (the strategy would wait before the next read; a user's callback asks now)
        record = {
            "state_bytes": state_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            "full_grads_kept": any(p.grad is not None for p in pl_module.parameters()),
            "groups": [len(g["params"]) for g in optimizer.param_groups],
            "sharded": sync is not None,
            "in_flight": self.in_flight_at_batch_start,
            # gathers in flight after the last optimizer step, before and after the offer's wait_for_parameters()
            "wait_for_parameters": (in_flight, sum(s.work is not None for s in sync.shards) if sync is not None else 0),
            "recompiles": len(report.recompiles) if offer is not None and (report := offer.compile_report) else None,
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


def _sharded_sync(trainer: L.Trainer) -> Any:
    """The sharded synchroniser holding this rank's shards (``None`` without ``reduce_scatter``, or under ``ddp``)."""
    parts = parts_of(trainer.strategy)
    return parts.gradients.sharded_sync if parts is not None else None


def fit(tmp: str, devices: int, strategy: Any, steps: int = STEPS, ckpt_path: Optional[str] = None,
        save_at: Optional[int] = None, after: Any = None, extra_callbacks: tuple = (),
        weights_only: Optional[bool] = None, **trainer_kwargs: Any) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    weights = _train(tmp, devices, strategy, steps, ckpt_path, save_at, after, extra_callbacks, weights_only,
                     **trainer_kwargs)
    return weights, _records(tmp, devices)


def _records(tmp: str, devices: int) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(tmp, f"record_rank{r}.pt")) for r in range(devices)]


def _train(tmp: str, devices: int, strategy: Any, steps: int = STEPS, ckpt_path: Optional[str] = None,
           save_at: Optional[int] = None, after: Any = None, extra_callbacks: tuple = (),
           weights_only: Optional[bool] = None, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
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
    trainer.fit(model, datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=40_000), ckpt_path=ckpt_path,
                weights_only=weights_only)
    if after is not None:
        after(model, trainer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_on_this_rank(rank: int, world: int, tmp: str, mesh: Optional[tuple[int, int, str]],
                        strategy_kwargs: dict[str, Any], fit_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
    torch._dynamo.reset()  # (compiled as in a fresh process: nothing cached by an earlier fit on these ranks)
    strategy = DDPStrategy() if mesh is None else static(*mesh, start_method="popen", **strategy_kwargs)
    return _train(tmp, world, strategy, **fit_kwargs)


def fit_in(ranks: RankPool, tmp: str, mesh: Optional[tuple[int, int, str]],
           strategy_kwargs: Optional[dict[str, Any]] = None, **fit_kwargs: Any
           ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """:func:`fit` on ranks that already exist (a module's :class:`RankPool`, its size the device count): the
    Trainer joins their Gloo group instead of starting processes, so several runs share one start-up. ``mesh`` is
    ``(replicate, shard, reduce)`` for :func:`static` (with ``strategy_kwargs``), or None for Lightning's own
    ``DDPStrategy``."""
    weights = ranks.run(_train_on_this_rank, args=(tmp, mesh, strategy_kwargs or {}, fit_kwargs), timeout=300)[0]
    return weights, _records(tmp, ranks.world_size)


def static(replicate: int, shard: int, reduce: str = "auto", start_method: str = "spawn",
           **kwargs: Any) -> StaticDistStrategy:
    # small buckets: several per model, so pieces, padding and group boundaries fall inside buckets
    return StaticDistStrategy(start_method=start_method, mesh={"dp_replicate": replicate, "dp_shard": shard},
                              sync={"reduce": reduce, "first_bucket_mb": 0.01, "bucket_mb": 0.03}, **kwargs)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=2e-5, rtol=1e-4, msg=key)
