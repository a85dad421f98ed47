"""A char-level GPT that injects one fault on one rank at one step: the fault tests run it through ``lsd-train``.

    lsd-train configs/charlm_cpu.yaml model.class_path=tests.faulty.FaultyCharGPT model.fault=kill model.fault_rank=1
"""

from __future__ import annotations

import os
import resource
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


def break_writes(how: str, path: str) -> None:
    """Make this process's next write of the checkpoint at ``path`` fail in the OS, for real: ``enospc`` (its
    partial file is a link to ``/dev/full``, where every write is "No space left on device"), ``efbig`` (a 64 KiB
    limit on the size of any file this process writes, SIGXFSZ ignored: "File too large"), ``eacces`` (its folder
    made read-only: "Permission denied"; not for root, whom permissions do not stop)."""
    if how == "enospc":
        from lightning_static_dist.checkpoint import partial_file

        os.symlink("/dev/full", partial_file(path))
    elif how == "efbig":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    elif how == "eacces":
        os.chmod(os.path.dirname(path), 0o555)
    else:
        raise ValueError(f"save_error={how!r}: allowed: enospc, efbig, eacces")


class FaultyCharGPT(CharGPT):
    """``fault``: ``kill`` (SIGKILL itself), ``hang`` (stop participating, alive, for ``hang_s`` seconds), ``nan``
    (a NaN loss), ``kill_in_save`` (SIGKILL while writing the checkpoint), ``sigterm`` (SIGTERM itself, as a
    scheduler would), ``sigterm_in_val`` (the same, in the first validation batch after step ``fault_step``),
    ``kill_peer_while_blocked`` (SIGKILL itself, printing the time, while every other rank sleeps ``hang_s`` outside
    any collective: no error can reach them, as on NCCL behind a device read), ``sigusr1`` (SLURM's requeue signal,
    to itself: rank 0 inside ``training_step``, every other rank inside ``on_after_backward``, at ``fault_step``),
    ``raise_timeout`` (a ``RuntimeError`` of the user's own whose message says "timeout"), ``raise_peer_words`` (one
    whose message carries a backend's words: "Timed out waiting", "Connection reset by peer"), ``raise_oom``
    (``torch.OutOfMemoryError``); each ``raise_*`` prints the time it raises at; ``fail_at_end`` (a ``RuntimeError``
    in ``on_train_end``, after the last collective); ``slow_end`` (3 s more in ``teardown``, after the last
    collective: a rank that ends later than the others, successfully);
    ``print_steps`` (no fault: the step lines only); ``kill_in_schedule_decision`` (SIGKILL itself as
    ``sync.schedule: auto``'s trial starts deciding, in the all-reduce of the step times);
    ``save_fails`` (the save at ``fault_step`` fails in the OS as ``save_error`` says: :func:`break_writes`),
    ``save_fails_at_end`` (the same for every write after training, as the consolidation of a sharded checkpoint).
    ``save_every``: ``trainer.save_checkpoint`` to ``<default_root_dir>/ckpt/last.ckpt`` every N steps. With a
    fault, each rank prints its process id when the fit starts and each step it starts."""

    def __init__(self, fault: str = "none", fault_rank: int = 1, fault_step: int = 3, save_every: int = 0,
                 hang_s: float = 3600.0, save_error: str = "enospc", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault, self.fault_rank, self.fault_step, self.save_every = fault, fault_rank, fault_step, save_every
        self.hang_s, self.save_error = hang_s, save_error

    def _faulty_here(self, fault: str) -> bool:
        return self.fault == fault and self.global_rank == self.fault_rank and self.global_step == self.fault_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.save_every and self.global_step % self.save_every == 0:
            path = os.path.join(self.trainer.default_root_dir, "ckpt", "last.ckpt")
            if self._faulty_here("save_fails"):
                break_writes(self.save_error, path)
            self.trainer.save_checkpoint(path)

    def teardown(self, stage: str) -> None:
        if self.fault == "slow_end" and self.global_rank == self.fault_rank:
            time.sleep(3.0)

    def on_fit_start(self) -> None:
        if self.fault != "none":
            print(f"rank {self.global_rank} pid {os.getpid()}", file=sys.stderr, flush=True)

    def on_train_start(self) -> None:
        if self.fault == "kill_in_schedule_decision" and self.global_rank == self.fault_rank:
            kill_in_schedule_decision(self)

    def on_train_end(self) -> None:
        if self.fault == "fail_at_end" and self.global_rank == self.fault_rank:
            raise RuntimeError("the user's own error in on_train_end (injected)")
        if self.fault == "save_fails_at_end" and self.global_rank == self.fault_rank:
            break_writes(self.save_error, os.path.join(self.trainer.default_root_dir, "ckpt", "last.ckpt"))

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
            if self.fault == "raise_peer_words":
                raise RuntimeError("Timed out waiting for the data server: Connection reset by peer (injected)")
            raise RuntimeError("timeout while waiting for the data server (injected, the user's own error)")
        if self._faulty_here("hang"):
            time.sleep(self.hang_s)
        loss = super().training_step(batch, batch_idx)
        if self._faulty_here("nan"):
            loss = loss * float("nan")
        return loss


class BucketwiseCharGPT(CharGPT):
    """The char-level GPT with none of the hooks that read gradients (``FaultyCharGPT`` overrides
    ``on_after_backward``, which turns ``sync.optimizer_overlap`` off), for faults on the optimizer overlap's path.

    ``fault``: ``kill_between_buckets`` (SIGKILL itself between the first and the second bucket of the optimizer step
    at ``fault_step``: bucket 0 stepped, bucket 1 not yet waited for), ``late_step_hook`` (every rank registers an
    optimizer step pre-hook in ``on_train_start``, after setup, and prints how often it ran when the fit ends),
    ``print_steps`` (no fault: the step lines only). With a fault, each rank prints each step it starts."""

    def __init__(self, fault: str = "none", fault_rank: int = 1, fault_step: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault, self.fault_rank, self.fault_step = fault, fault_rank, fault_step
        self.hook_calls = 0

    def on_train_start(self) -> None:
        if self.fault == "late_step_hook":
            self.trainer.optimizers[0].register_step_pre_hook(self._count_step)

    def _count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.hook_calls += 1

    def on_train_end(self) -> None:
        if self.fault == "late_step_hook":
            print(f"rank {self.global_rank} step hook calls {self.hook_calls}", file=sys.stderr, flush=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.fault != "none":
            print(f"rank {self.global_rank} starts step {self.global_step}", file=sys.stderr, flush=True)
        if self.fault == "kill_between_buckets" and self.global_rank == self.fault_rank \
                and self.global_step == self.fault_step:
            from tests._parts import synchronizer_of

            sync = synchronizer_of(self.trainer.strategy)
            settle = sync.settle

            def settle_or_die(bucket_index: Any = None) -> None:
                if bucket_index == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                settle(bucket_index)

            sync.settle = settle_or_die  # (this object's own: the optimizer step calls settle(k) per bucket)


def kill_in_schedule_decision(module: Any) -> None:
    """SIGKILL this process where ``sync.schedule: auto``'s trial decides: as it starts the all-reduce of the
    candidates' step times (the other ranks wait in it)."""
    from tests._parts import parts_of

    trial = parts_of(module.trainer.strategy).schedule.trial
    slowest = trial._slowest_rank

    def die(step_s: Any) -> Any:
        print(f"rank {module.global_rank} dies deciding at step {module.global_step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return slowest(step_s)

    trial._slowest_rank = die
