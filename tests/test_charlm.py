"""Single-process tests of the example workload: the byte-level GPT and its data module."""

from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
import torch.nn as nn

from lightning_static_dist.examples.charlm import CharDataModule, CharGPT

TINY = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_forward_returns_logits_per_position() -> None:
    model = CharGPT(**TINY)
    logits = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.randint(0, 256, (1, 17)))


def test_tied_embedding_is_one_parameter_counted_once() -> None:
    model = CharGPT(**TINY)
    assert model.lm_head.weight is model.wte.weight
    by_hand = sum(p.numel() for name, p in model.named_parameters(remove_duplicate=False) if name != "lm_head.weight")
    assert model.num_parameters() == by_hand
    with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert model.num_parameters() == with_duplicates - model.wte.weight.numel()


def test_invalid_head_count_names_both_arguments() -> None:
    with pytest.raises(ValueError, match="n_embd=30 must be divisible by n_head=4"):
        CharGPT(n_embd=30, n_head=4)


def test_optimizer_groups_cover_every_parameter_once_and_spare_biases_norms_embeddings() -> None:
    model = CharGPT(**TINY)
    optimizer = model.configure_optimizers()["optimizer"]
    grouped = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped})
    assert {id(p) for p in grouped} == {id(p) for p in model.parameters() if p.requires_grad}

    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, (nn.Embedding, nn.LayerNorm)) or pname == "bias":
                assert decay_of[id(p)] == 0.0, f"{name}.{pname} should not be decayed"
            elif isinstance(module, nn.Linear) and module is not model.lm_head:
                assert decay_of[id(p)] == model.hparams.weight_decay, f"{name}.{pname} should be decayed"


def test_no_warmup_means_no_scheduler() -> None:
    assert isinstance(CharGPT(**TINY, warmup_steps=0).configure_optimizers(), torch.optim.AdamW)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("hello world\n" * 500)  # 6000 bytes
    return path


def test_windows_are_shifted_by_one_and_split_into_train_and_val(text_file: Path) -> None:
    dm = CharDataModule(path=str(text_file), block_size=16, batch_size=4, val_fraction=0.1)
    dm.setup("fit")
    corpus = torch.tensor(list(text_file.read_bytes()), dtype=torch.uint8)
    assert len(dm.train_data) + len(dm.val_data) == len(corpus) == 6000
    assert len(dm.val_data) == 600

    train = dm.train_dataloader().dataset
    assert len(train) == (5400 - 1) // 16
    x, y = train[3]
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x, corpus[48:64].long()) and torch.equal(y, corpus[49:65].long())

    xb, yb = next(iter(dm.val_dataloader()))
    assert xb.shape == yb.shape == (4, 16)
    assert torch.equal(xb[:, 1:], yb[:, :-1])


def test_folder_corpus_reads_text_files_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("B" * 100)
    (tmp_path / "a.txt").write_text("A" * 100)
    (tmp_path / "skip.bin").write_bytes(b"\0" * 100)
    dm = CharDataModule(path=str(tmp_path), block_size=8, val_fraction=0.5)
    dm.setup("fit")
    assert bytes(dm.train_data.tolist()) == b"A" * 100 and bytes(dm.val_data.tolist()) == b"B" * 100


def test_default_corpus_is_the_stdlib_sources() -> None:
    dm = CharDataModule()
    dm.setup("fit")
    n = len(dm.train_data) + len(dm.val_data)
    assert 100_000 < n <= 2_000_000
    assert b"def " in bytes(dm.train_data[:50_000].tolist())


def test_missing_path_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.path"):
        CharDataModule(path=str(tmp_path / "nope.txt")).setup("fit")


def test_tiny_corpus_names_its_size(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("x" * 20)
    with pytest.raises(ValueError, match="20 bytes"):
        CharDataModule(path=str(tmp_path / "t.txt"), block_size=16).setup("fit")


class _LossRecorder(lightning.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())


def test_training_on_repetitive_text_lowers_the_loss(text_file: Path) -> None:
    torch.manual_seed(0)
    recorder = _LossRecorder()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=30, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, callbacks=[recorder],
    )
    # 5700 train bytes / 16 = 356 windows / batch 16 = 22 steps: the first epoch ends, so validation runs
    trainer.fit(CharGPT(**TINY, warmup_steps=5), CharDataModule(path=str(text_file), block_size=16, batch_size=16))
    assert len(recorder.losses) == 30
    # starts near ln(256) = 5.5 (uniform over bytes); 30 steps on 12 distinct symbols should get well below
    assert recorder.losses[0] > 5.0
    assert recorder.losses[-1] < 0.5 * recorder.losses[0]
    # perplexity is exp(mean token cross entropy), so the two validation numbers must agree
    metrics = trainer.callback_metrics
    assert metrics["val_ppl"].item() == pytest.approx(metrics["val_loss"].exp().item(), rel=1e-3)
