"""The GPT-2 small workload that ``gpu1-gpt2s`` and ``gpuN-gpt2s`` share: models, synthetic batches, step timer.

Two shapes of the same network: ``GPT`` (``lightning_static_dist.examples.charlm.CharGPT``, the loss computed in ``training_step``; the
1-GPU scenario's model) and ``NanoGPT`` (nanoGPT's own shape: the blocks looped in ``forward``, the loss computed in
``forward``, ``training_step`` only calls the model; the multi-GPU scenario's, shaped like users' code rather than
like what suits a compiler).

Imported by benchmark *workers* only (it imports torch and Lightning at the top); the repository root must be on
``sys.path``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_static_dist.examples.charlm import Block, CharGPT

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


class NanoGPT(L.LightningModule):
    """GPT-2 as nanoGPT writes it: ``transformer.{wte, wpe, h, ln_f}``, a tied ``lm_head``, the blocks looped in
    ``forward(idx, targets)``, which returns the loss; ``training_step`` just calls the model. Usable as a plain
    ``nn.Module`` too (the plain PyTorch contenders call ``model(x, y)``)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, lr: float = 6e-4,
                 weight_decay: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, 0.0, True) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        x, y = batch
        return self(x, y)

    def configure_optimizers(self):  # type: ignore[override]
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = next(self.parameters()).is_cuda
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95), fused=fused)


def new_nanogpt(cfg: dict[str, int]) -> NanoGPT:
    """The multi-GPU benchmark's model, with the same initial weights in every process."""
    torch.manual_seed(0)
    return NanoGPT(**{k: v for k, v in cfg.items() if k != "batch"})


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


def train_plainly(step: Any, optimizer: torch.optim.Optimizer, batches: Any, timer: "StepTimer",
                  device: torch.device) -> None:
    """The hand-written loop every plain PyTorch contender runs: bf16 autocast forward + loss, backward, optimizer
    step, ``zero_grad(set_to_none=True)``, each step timed by ``timer``."""
    for x, y in batches:
        timer.start()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.end(loss)


class StepTimer(L.Callback):
    """Times training steps and keeps the last loss.

    ``window=1`` (gpu1-gpt2s): each step from a device synchronize to a device synchronize (``on_train_batch_start``
    to ``on_train_batch_end``: zero_grad, training_step, backward and the optimizer step). ``window=k``
    (gpuN-gpt2s): after ``warmup`` steps, the device is synchronized only every ``k`` steps and each window's mean
    step is one figure — within a window the host runs ahead of the GPU as it does in a user's run, so a step's
    host-side work (a framework's loop, a host read inside the step) costs only what it really costs.
    """

    def __init__(self, cuda: bool, window: int = 1, warmup: int = 0, profile: Optional[tuple[str, int]] = None,
                 on_window: Optional[Any] = None, windows: Optional[int] = None) -> None:
        self._cuda = cuda
        self._on_window = on_window
        """Called at each window boundary with (the window starting now, whether the timed windows are over)."""
        self._windows = windows
        self._window = window
        self._warmup = warmup
        self._done = 0
        self._profile = profile
        """(trace path prefix, n): torch.profiler over the last n warmup steps (untimed), one Chrome trace per rank."""
        self._profiler: Optional[torch.profiler.profile] = None
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.marks: list[tuple[int, float]] = []
        """(steps done, time) at each synchronized window boundary (``window > 1``)."""
        self.last_loss: Optional[torch.Tensor] = None

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def start(self) -> None:
        """A step begins (a hand-written loop calls this; a Trainer through the hook below)."""
        if self._profile is not None and self._done == self._warmup - self._profile[1]:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self._cuda else [])
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        if self._window == 1:
            self._sync()
            self.starts.append(time.perf_counter())

    def end(self, loss: torch.Tensor) -> None:
        self._done += 1
        self.last_loss = loss.detach()
        if self._profiler is not None and self._done == self._warmup:
            self._sync()
            self._profiler.stop()
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))
            self._profiler.export_chrome_trace(f"{self._profile[0]}-rank{rank}.json.gz")
            self._profiler = None
        if self._window == 1:
            self._sync()
            self.ends.append(time.perf_counter())
        elif (self._done >= self._warmup and (self._done - self._warmup) % self._window == 0
              and (self._windows is None or len(self.marks) <= self._windows)):  # (the monitored tail: not timed)
            self._sync()
            self.marks.append((self._done, time.perf_counter()))
            if self._on_window is not None:
                started = len(self.marks) - 1
                self._on_window(started, self._windows is not None and started >= self._windows)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.end(outputs["loss"])

    def timings(self, warmup: int, expected: int) -> dict[str, Any]:
        """Timed step seconds (per step, or each window's mean step), the timed loop's wall time, and (per-step
        timing only) the first step's and the warmup's excess over the median."""
        final_loss = float(self.last_loss) if self.last_loss is not None else float("nan")
        if self._window > 1:
            if self._done != expected:
                raise RuntimeError(f"timed {self._done} steps, expected {expected}")
            windows = [(t1 - t0) / (d1 - d0) for (d0, t0), (d1, t1) in zip(self.marks, self.marks[1:])]
            return {"step_s": windows, "loop_s": self.marks[-1][1] - self.marks[0][1], "window": self._window,
                    "first_step_overhead_s": None, "warmup_overhead_s": None, "final_loss": final_loss}
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
            "final_loss": final_loss,
        }
