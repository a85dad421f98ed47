"""Sharded embeddings on 2 real Gloo ranks: training equals unsharded training (tied and untied, with gradient
accumulation, compiled), 1/N of the embedding's memory per rank, checkpoints that plain Lightning loads, resuming
on another world size, and the no-embedding warning. The 2-rank fits share one module-scoped pair of ranks."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import lightning as L
from _dist import RankPool, fit_on_ranks
from tests._parts import parts_of
from lightning_static_dist.examples.charlm import CharDataModule, CharGPT
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_static_dist import StaticDistStrategy
from lightning_static_dist.embedding import EmbeddingConfig
from lightning_static_dist.embedding import find_embeddings

pytestmark = pytest.mark.multiprocess

VOCAB = 301  # not divisible by 2: the last shard is padded


def tiny_gpt(tied: bool = True) -> CharGPT:
    torch.manual_seed(0)
    model = CharGPT(vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=0)
    if not tied:
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


class _Memory(L.Callback):
    """Per rank, after the last step: bytes of the sharded weight, its gradient and its optimizer state."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        sharder = parts.embeddings.sharder if (parts := parts_of(trainer.strategy)) is not None else None
        if sharder is None or trainer.global_step != trainer.max_steps:
            return
        shard = sharder.weights[0].shard
        state = trainer.optimizers[0].state[shard]
        record = {
            "weight": shard.numel() * shard.element_size(),
            "grad": shard.grad.numel() * shard.grad.element_size(),
            "optimizer": sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0),
            "recompiles": list(report.recompiles) if (report := trainer.strategy.offer.compile_report) else None,
            "gather_ms": sharder.timing.gather_s * 1e3,
        }
        torch.save(record, os.path.join(self.directory, f"memory_rank{trainer.global_rank}.pt"))


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """The 2 Gloo ranks every 2-rank fit of the module runs on (sharded and not): one start-up for them all."""
    with RankPool(2) as pool:
        yield pool


def fit(ranks: RankPool, tmp: str, shard: Any, tied: bool = True, steps: int = 10, accumulate: int = 1,
        compile_cfg: Any = None, devices: int = 2, ckpt_path: Any = None,
        checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """Rank 0's weights after fitting the tiny GPT: on ``ranks`` (the Trainer joins their group) with 2 devices, in
    the test process with 1."""
    args = (tmp, shard, tied, steps, accumulate, compile_cfg, ckpt_path, checkpoint)
    if devices == 1:
        return _train(0, 1, *args)
    return ranks.run(_train, args=args, timeout=300)[0]


def _train(rank: int, world: int, tmp: str, shard: Any, tied: bool, steps: int, accumulate: int, compile_cfg: Any,
           ckpt_path: Any, checkpoint: bool) -> dict[str, torch.Tensor]:
    os.makedirs(tmp, exist_ok=True)
    if world > 1:
        os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
        torch._dynamo.reset()  # (compiled as in a fresh process: nothing cached by an earlier fit on these ranks)
    L.seed_everything(0)
    model = tiny_gpt(tied)
    strategy = StaticDistStrategy(embedding={"shard": shard}, compile=compile_cfg,
                                  sync={"first_bucket_mb": 0.02, "bucket_mb": 0.05})
    callbacks: list[Any] = [_Memory(tmp)]
    if checkpoint:  # every 2 steps: training goes on after a save (the live optimizer state must stay sharded)
        callbacks.append(ModelCheckpoint(dirpath=tmp, filename="last", every_n_train_steps=2))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy if world > 1 else "auto", max_steps=steps,
        logger=False, callbacks=callbacks, enable_checkpointing=checkpoint, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, accumulate_grad_batches=accumulate, default_root_dir=tmp,
    )
    trainer.fit(model, datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=40_000), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.fixture(scope="module")
def sharded_tied(ranks: RankPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Any]:
    """The default sharded run (tied, 10 steps): its weights, and the folder its ranks' memory records are in (one
    launch shared by the two cases that read it)."""
    directory = tmp_path_factory.mktemp("sharded_tied")
    return fit(ranks, str(directory), True), directory


def test_sharded_training_equals_unsharded_tied_and_untied(ranks: RankPool, tmp_path: Any,
                                                           sharded_tied: tuple[dict[str, torch.Tensor], Any]) -> None:
    for tied in (True, False):
        plain = fit(ranks, str(tmp_path), False, tied)
        sharded = sharded_tied[0] if tied else fit(ranks, str(tmp_path), True, tied)
        assert_same(sharded, plain)  # same names too: the model is whole again after fit
    assert not torch.equal(plain["wte.weight"], tiny_gpt(False).state_dict()["wte.weight"])  # it trained


def test_each_rank_holds_half_of_the_embedding_weight_grad_and_optimizer_state(
        sharded_tied: tuple[dict[str, torch.Tensor], Any]) -> None:
    directory = sharded_tied[1]
    full = VOCAB * 32 * 4
    for rank in (0, 1):
        record = torch.load(str(directory / f"memory_rank{rank}.pt"))
        assert record["weight"] == record["grad"] == 151 * 32 * 4  # ceil(301 / 2) rows
        assert record["optimizer"] == 2 * 151 * 32 * 4  # AdamW's exp_avg and exp_avg_sq
        assert abs(record["weight"] / (full / 2) - 1) <= 0.05
        assert record["gather_ms"] > 0


@pytest.mark.slow  # (sharded vs unsharded, tied and untied, stays in the default run)
def test_sharded_training_with_accumulation_and_compile_equals_unsharded(ranks: RankPool, tmp_path: Any) -> None:
    assert_same(fit(ranks, str(tmp_path), True, accumulate=2, steps=5), fit(ranks, str(tmp_path), False, accumulate=2, steps=5))
    plain = fit(ranks, str(tmp_path), False)
    for regional in ("auto", False):  # blocks compiled, the embedding eager / the whole training_step in one graph
        compiled = fit(ranks, str(tmp_path), True, compile_cfg={"enabled": True, "backend": "aot_eager", "regional": regional})
        # the gathered weight is a new tensor every step: it must enter the graph as an input, not a constant
        recompiles = torch.load(str(tmp_path / "memory_rank0.pt"))["recompiles"]
        assert recompiles == [], (regional, recompiles)
        assert_same(compiled, plain)


def test_checkpoints_are_plain_lightning_and_resume_on_another_world_size(ranks: RankPool, tmp_path: Any) -> None:
    sharded_dir, plain_dir = tmp_path / "sharded", tmp_path / "plain"
    fit(ranks, str(sharded_dir), True, steps=6, checkpoint=True)
    (ckpt,) = glob.glob(str(sharded_dir / "last*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)
    assert saved["state_dict"].keys() == tiny_gpt().state_dict().keys()  # full weight under its own names
    assert saved["state_dict"]["wte.weight"].shape == (VOCAB, 32)
    # the sharded checkpoint resumes a sharded and an unsharded 2-rank run identically (weights and AdamW state)
    resumed = fit(ranks, str(sharded_dir), True, steps=10, ckpt_path=ckpt)
    assert_same(resumed, fit(ranks, str(plain_dir), False, steps=10, ckpt_path=ckpt))
    # ... and a plain single-device Trainer (another world size) resumes from it
    single = fit(ranks, str(plain_dir), False, steps=10, devices=1, ckpt_path=ckpt)
    assert all(torch.isfinite(v).all() for v in single.values())
    # a plain single-device checkpoint re-shards on load
    fit(ranks, str(plain_dir), False, steps=6, devices=1, checkpoint=True)
    (plain_ckpt,) = glob.glob(str(plain_dir / "last*.ckpt"))
    assert_same(fit(ranks, str(plain_dir), True, steps=10, ckpt_path=plain_ckpt),
                fit(ranks, str(plain_dir), False, steps=10, ckpt_path=plain_ckpt))


def _fit_boring_with_shard_true() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=StaticDistStrategy(embedding={"shard": True}),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(BoringModel())


def test_shard_true_without_embeddings_warns_and_does_nothing(tmp_path: Any, capfd: Any) -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    assert find_embeddings(BoringModel(), EmbeddingConfig(shard=True)) == []
    assert find_embeddings(tiny_gpt(), EmbeddingConfig(shard="auto")) == []  # 301 rows < min_rows 8192
    (names, owners), = find_embeddings(tiny_gpt(), EmbeddingConfig(shard="auto", min_rows=300))
    assert names == ["wte.weight", "lm_head.weight"] and len(owners) == 2
    fit_on_ranks(_fit_boring_with_shard_true)
    assert "strategy.embedding.shard=True found no nn.Embedding; nothing is sharded" in capfd.readouterr().err
