"""The GPT-2 small workload that ``gpu1-gpt2s`` and ``gpuN-gpt2s`` share: model, synthetic batches, step timer.

Imported by benchmark *workers* only (it imports torch and Lightning at the top); the repository root must be on
``sys.path`` for ``examples.charlm``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from examples.charlm import CharGPT

FULL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, batch=16)
TINY = dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, batch=4)
PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16, the anchor's denominator
POOL = 8  # distinct batches, cycled: enough to keep the loss honest, small enough to sit on the GPU


def flops_per_token(cfg: dict[str, int], n_params: int) -> int:
    """nanoGPT's estimate: 6 N for the matrix multiplications plus 12 L d T for attention."""
    return 6 * n_params + 12 * cfg["n_layer"] * cfg["n_embd"] * cfg["block_size"]


class GPT(CharGPT):
    """CharGPT with the same two param groups, but a fused AdamW on CUDA and a ``training_step`` without ``self.log``."""

    def configure_optimizers(self):  # type: ignore[override]
        reference = super().configure_optimizers()  # warmup_steps=0: a bare AdamW, no scheduler
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in reference.param_groups]
        # the model is on its device by now (Lightning calls this after placing it; the plain loop moves it first)
        fused = next(self.parameters()).is_cuda
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95), fused=fused)

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        # no self.log: Lightning's fit(torch.compile(model)) compiles training_step, and dynamo fails on
        # self.log's signature inspection there (lightning 2.6.6, torch 2.13); every contender drops it alike
        x, y = batch
        return self.loss(self(x), y)


def new_model(cfg: dict[str, int]) -> GPT:
    """The benchmark's model, with the same initial weights in every process."""
    torch.manual_seed(0)
    return GPT(**{k: v for k, v in cfg.items() if k != "batch"}, dropout=0.0, bias=True, lr=6e-4, weight_decay=0.1,
               warmup_steps=0)


class Batches(Dataset):
    """``total`` items, each a whole (x, y) batch from a pool of random tokens made on ``device`` from ``seed``:
    one epoch is exactly the run. The pool is made on first use, once the rank's device is current."""

    def __init__(self, cfg: dict[str, int], total: int, device: torch.device, seed: int) -> None:
        self._cfg, self._total, self._device, self._seed = cfg, total, device, seed
        self._x: Optional[torch.Tensor] = None
        self._y: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._x is None:
            cfg = self._cfg
            g = torch.Generator(device=self._device).manual_seed(self._seed)
            tokens = torch.randint(0, cfg["vocab_size"], (POOL, cfg["batch"], cfg["block_size"] + 1), generator=g,
                                   device=self._device)
            self._x, self._y = tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()
        assert self._y is not None
        return self._x[i % POOL], self._y[i % POOL]


def loader(cfg: dict[str, int], total: int, device: torch.device, seed: int) -> DataLoader:
    # batch_size=None: the dataset already yields batches, so no per-step collate
    return DataLoader(Batches(cfg, total, device, seed), batch_size=None, shuffle=False, num_workers=0)


class StepTimer(L.Callback):
    """Times each step from a device synchronize to a device synchronize (``on_train_batch_start`` to
    ``on_train_batch_end``: zero_grad, training_step, backward and the optimizer step) and keeps the last loss."""

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.last_loss: Optional[torch.Tensor] = None

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def start(self) -> None:
        """A step begins (a hand-written loop calls this; a Trainer through the hook below)."""
        self._sync()
        self.starts.append(time.perf_counter())

    def end(self, loss: torch.Tensor) -> None:
        self._sync()
        self.ends.append(time.perf_counter())
        self.last_loss = loss.detach()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.end(outputs["loss"])

    def timings(self, warmup: int, expected: int) -> dict[str, Any]:
        """Timed step seconds (after ``warmup``), the loop's wall time over them, and the warmup's excess."""
        step_s = [e - s for s, e in zip(self.starts, self.ends)]
        if len(step_s) != expected:
            raise RuntimeError(f"timed {len(step_s)} steps, expected {expected}")
        timed = step_s[warmup:]
        median = statistics.median(timed)
        return {
            "step_s": timed,
            "loop_s": self.ends[-1] - self.starts[warmup],
            "first_step_overhead_s": step_s[0] - median,
            "warmup_overhead_s": sum(s - median for s in step_s[:warmup]),
            "final_loss": float(self.last_loss) if self.last_loss is not None else float("nan"),
        }
