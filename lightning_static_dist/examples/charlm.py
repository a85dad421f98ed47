"""A small byte-level GPT and its data, the workload the strategy is exercised and benchmarked on.

The model reads UTF-8 *bytes* (vocabulary 256), so any text file is a valid corpus: no tokenizer to train,
download or keep in sync between ranks. The default corpus is the Python standard library's own ``.py``
sources, found at run time through ``sysconfig``: it is real, varied text that exists on every machine that
can run this file, so tests, examples and benchmarks need nothing downloaded, and every rank of a run on
the same Python version reads the same bytes (the file list is sorted, not left in directory order).

The model follows nanoGPT (pre-LN blocks, tied input/output embeddings, scaled init of residual
projections); the data is cut into non-overlapping windows so that an epoch has a well-defined length that
a ``DistributedSampler`` can split evenly across ranks. Its training loader keeps its place in the epoch in the
checkpoint, so a run resumed from a mid-epoch checkpoint sees the batches the uninterrupted run would have seen
(:mod:`~lightning_static_dist.examples.bytedata`).
"""

import math
import os
import sysconfig
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from lightning import LightningDataModule, LightningModule
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_static_dist.examples.bytedata import (
    CORPUS_SUFFIXES,
    SKIPPED_STDLIB_DIRS,
    ByteWindows,
    ResumableLoader,
    ResumableSampler,
    read_bytes,
    text_files,
)

__all__ = ["ByteWindows", "CharDataModule", "CharGPT", "ResumableLoader", "ResumableSampler"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): heads become a batch dimension for the fused kernel
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _warmup_factor(step: int, warmup_steps: int) -> float:
    # step counts from 0, so the first optimizer step already uses a non-zero learning rate
    return min(1.0, (step + 1) / warmup_steps)


class CharGPT(LightningModule):
    """A nanoGPT-style decoder over bytes.

    Example::

        model = CharGPT(block_size=128, n_layer=4, n_head=4, n_embd=128)
        logits = model(torch.randint(0, 256, (8, 128)))  # (8, 128, 256)
        trainer = lightning.Trainer(max_steps=100)
        trainer.fit(model, CharDataModule(block_size=128))
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        sizes = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        for name, value in {**sizes, "lr": lr}.items():
            if value <= 0:
                raise ValueError(f"CharGPT: {name}={value} must be positive")
        for name, value in dict(weight_decay=weight_decay, warmup_steps=warmup_steps).items():
            if value < 0:
                raise ValueError(f"CharGPT: {name}={value} must be non-negative")
        if n_embd % n_head != 0:
            raise ValueError(f"CharGPT: n_embd={n_embd} must be divisible by n_head={n_head}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"CharGPT: dropout={dropout} must be in [0, 1)")
        self.save_hyperparameters()

        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # weight tying: one Parameter, reached through two modules; named_parameters() yields it once
        self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        # GPT-2: each block adds two residual branches, so scale their output projections to keep the
        # variance of the residual stream independent of depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        self.val_ppl = torchmetrics.text.Perplexity()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of unique parameters (the tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())  # parameters() de-duplicates shared tensors

    @override
    def forward(self, idx: Tensor) -> Tensor:
        """Map byte ids ``(B, T)`` to next-byte logits ``(B, T, vocab_size)``."""
        T = idx.size(1)
        if T > self.hparams.block_size:
            raise ValueError(f"CharGPT: sequence length {T} exceeds block_size={self.hparams.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-byte cross entropy over every position of every sequence."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        # no sync_dist: a per-step all-reduce would add a collective to every step we want to measure
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", self.loss(logits, y), sync_dist=True)
        # update() rather than __call__: we only want the epoch value, which Lightning computes (and
        # torchmetrics syncs across ranks) when it sees the metric object logged. float() because the
        # softmax inside Perplexity loses too much precision in bf16/fp16.
        self.val_ppl.update(logits.float(), y)
        self.log("val_ppl", self.val_ppl)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        # Decay only the matmul weights. Biases and LayerNorm gains are shifts/scales that decay would pull
        # towards 0 for no benefit; embeddings (including the tied lm_head) are lookup tables whose rare rows
        # decay would erase.
        no_decay_modules = (nn.Embedding, nn.LayerNorm)
        no_decay_ids = {id(p) for m in self.modules() if isinstance(m, no_decay_modules) for p in m.parameters()}
        decay, no_decay = [], []
        for _, p in self.named_parameters():  # de-duplicates the tied weight, so it lands in one group
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
        if self.hparams.warmup_steps == 0:
            return optimizer
        warmup_steps = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _warmup_factor(step, warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CharDataModule(LightningDataModule):
    """Bytes of a text file, a folder of text files, or (by default) the Python standard library's sources. Under a
    Trainer its training loader is a :class:`ResumableLoader`: a fit resumed from a mid-epoch checkpoint goes on with
    the batch the checkpoint was written after.

    Example::

        dm = CharDataModule(path="input.txt", block_size=128, batch_size=32)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))  # (32, 128) int64 each, y is x shifted by one byte
    """

    vocab_size = 256

    def __init__(
        self,
        path: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 32,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("block_size", block_size), ("batch_size", batch_size), ("max_bytes", max_bytes)):
            if value <= 0:
                raise ValueError(f"CharDataModule: data.{name}={value} must be positive")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"CharDataModule: data.val_fraction={val_fraction} must be in (0, 1)")
        if num_workers < 0:
            raise ValueError(f"CharDataModule: data.num_workers={num_workers} must be non-negative")
        # checked here, not in setup(): a launcher validates before it starts any process
        if path is not None and not Path(path).expanduser().exists():
            raise FileNotFoundError(f"CharDataModule: data.path={path!r} does not exist")
        self.save_hyperparameters()
        self.path, self.block_size, self.batch_size, self.max_bytes = path, block_size, batch_size, max_bytes
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.train_data: Optional[Tensor] = None
        self.val_data: Optional[Tensor] = None

    def _read_corpus(self) -> tuple[bytes, str]:
        if self.path is None:
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            return read_bytes(text_files(stdlib, (".py",), SKIPPED_STDLIB_DIRS), self.max_bytes), str(stdlib)
        path = Path(self.path).expanduser()
        files = [path] if path.is_file() else text_files(path, CORPUS_SUFFIXES, set())
        return read_bytes(files, self.max_bytes), str(path)

    @override
    def setup(self, stage: str) -> None:
        # setup(), not prepare_data(): the corpus is local on every machine, and every rank needs its own
        # tensor. prepare_data() runs on one process per node and must not assign state.
        if self.train_data is not None:
            return
        raw, source = self._read_corpus()
        n, window = len(raw), self.block_size + 1
        if n < 2 * window:
            raise ValueError(
                f"CharDataModule: corpus {source!r} has {n} bytes, needs at least {2 * window} "
                f"(two windows of data.block_size + 1)"
            )
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        # at least one full window on each side, whatever val_fraction says
        n_val = min(max(round(n * self.val_fraction), window), n - window)
        self.train_data, self.val_data = data[: n - n_val], data[n - n_val :]

    @override
    def train_dataloader(self) -> DataLoader:
        # drop_last=True: every step sees the same batch shape (no recompilation, no odd-sized last step)
        dataset = ByteWindows(self.train_data, self.block_size)
        if self.trainer is None:
            # outside a Trainer (Fabric, a notebook): shuffle=True, and Fabric's setup_dataloaders puts in the
            # DistributedSampler that gives each rank its share
            return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=True,
                              num_workers=self.num_workers)
        # the sampler Lightning would put in (this rank's share, reshuffled every epoch from the run's seed), ours so
        # that a mid-epoch checkpoint keeps the loader's place; a DistributedSampler, so Lightning leaves it in
        shares = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = ResumableSampler(dataset, num_replicas=shares["num_replicas"], rank=shares["rank"],
                                   seed=int(os.getenv("PL_GLOBAL_SEED", 0)))
        return ResumableLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                               num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(ByteWindows(self.val_data, self.block_size), batch_size=self.batch_size, shuffle=False,
                          drop_last=False, num_workers=self.num_workers)
