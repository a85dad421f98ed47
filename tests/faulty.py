"""A char-level GPT that injects one fault on one rank at one step: the fault tests run it through ``lsd-train``.

    lsd-train configs/charlm_cpu.yaml model.class_path=tests.faulty.FaultyCharGPT model.fault=kill model.fault_rank=1
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch

from lightning_static_dist.examples.charlm import CharGPT


class _KillWhilePickled:
    """Part of a checkpoint that kills the process while ``torch.save`` serialises it."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        return (object, ())


class FaultyCharGPT(CharGPT):
    """``fault``: ``kill`` (SIGKILL itself), ``hang`` (stop participating, alive, for ``hang_s`` seconds), ``nan``
    (a NaN loss), ``kill_in_save`` (SIGKILL while writing the checkpoint), ``sigterm`` (SIGTERM itself, as a
    scheduler would), ``sigterm_in_val`` (the same, in the first validation batch after step ``fault_step``),
    ``kill_peer_while_blocked`` (SIGKILL itself, printing the time, while every other rank sleeps ``hang_s`` outside
    any collective: no error can reach them, as on NCCL behind a device read), ``sigusr1`` (SLURM's requeue signal,
    to itself: rank 0 inside ``training_step``, every other rank inside ``on_after_backward``, at ``fault_step``),
    ``raise_timeout`` (a ``RuntimeError`` of the user's own whose message says "timeout"), ``raise_oom``
    (``torch.OutOfMemoryError``); each ``raise_*`` prints the time it raises at;
    ``print_steps`` (no fault: the step lines only).
    ``save_every``: ``trainer.save_checkpoint`` to ``<default_root_dir>/ckpt/last.ckpt`` every N steps. With a
    fault, each rank prints each step it starts."""

    def __init__(self, fault: str = "none", fault_rank: int = 1, fault_step: int = 3, save_every: int = 0,
                 hang_s: float = 3600.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault, self.fault_rank, self.fault_step, self.save_every = fault, fault_rank, fault_step, save_every
        self.hang_s = hang_s

    def _faulty_here(self, fault: str) -> bool:
        return self.fault == fault and self.global_rank == self.fault_rank and self.global_step == self.fault_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.save_every and self.global_step % self.save_every == 0:
            self.trainer.save_checkpoint(os.path.join(self.trainer.default_root_dir, "ckpt", "last.ckpt"))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._faulty_here("kill_in_save"):
            checkpoint["poison"] = _KillWhilePickled()

    def on_after_backward(self) -> None:
        if self.fault == "sigusr1" and self.global_rank != 0 and self.global_step == self.fault_step:
            os.kill(os.getpid(), signal.SIGUSR1)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 0 and self._faulty_here("sigterm_in_val"):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().validation_step(batch, batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fault != "none":
            print(f"rank {self.global_rank} starts step {self.global_step}", file=sys.stderr, flush=True)
        if self._faulty_here("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "kill_peer_while_blocked" and self.global_step == self.fault_step:
            if self.global_rank == self.fault_rank:
                print(f"rank {self.global_rank} kills itself at {time.time():.3f}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.hang_s)
        if self._faulty_here("sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.fault == "sigusr1" and self.global_rank == 0 and self.global_step == self.fault_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if self.fault.startswith("raise_") and self.global_rank == self.fault_rank and self.global_step == self.fault_step:
            print(f"rank {self.global_rank} raises at {time.time():.3f}", file=sys.stderr, flush=True)
            if self.fault == "raise_oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            raise RuntimeError("timeout while waiting for the data server (injected, the user's own error)")
        if self._faulty_here("hang"):
            time.sleep(self.hang_s)
        loss = super().training_step(batch, batch_idx)
        if self._faulty_here("nan"):
            loss = loss * float("nan")
        return loss
