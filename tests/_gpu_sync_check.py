"""The steady-step synchronisation check of ``tests/test_gpu.py``: every time the host waits for a GPU during one
whole training step, on every rank, whoever asked for it.

A host that waits for its GPU loses its head start: the GPU then idles while the host runs the loop and launches the
next kernels. The window is one whole iteration of the training loop — from the end of batch ``step - 1`` (after its
optimizer step) to the end of batch ``step``: the loop's own per-step work (Lightning's SIGTERM broadcast among it),
the batch's transfer, forward, backward and the optimizer step. Two witnesses look at it:

- ``torch.cuda.set_sync_debug_mode("warn")``: torch warns at each synchronising call it knows of (a value read,
  ``.item()``; a blocking copy; a stream synchronisation); the caller is named from the Python stack. It does not
  see ``Event.synchronize()``, nor a synchronisation on a thread that runs no Python.
- ``torch.profiler`` (CPU and CUDA activities): the CUDA runtime calls that block the host — stream, event and device
  synchronisations, blocking copies — on any thread of the process, named with the operators they ran in.
"""

from __future__ import annotations

import json
import os
import sysconfig
import traceback
import warnings
from typing import Any

import torch

import lightning as L

#: the CUDA runtime calls that block the host (``cudaMemcpy``: the blocking copy, not ``cudaMemcpyAsync``)
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
#: the warning of ``set_sync_debug_mode("warn")`` (its switch's own "... prototype feature ..." warning is not one)
SYNC_WARNING = "called a synchronizing CUDA operation"
_WINDOW = "sync_check_window"
_TORCH, _STDLIB = os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep


def _torch_or_stdlib(frame: str) -> bool:
    """A frame of torch or of the standard library (packages installed under the standard library's folder, as a
    Python without a virtual environment keeps them, are neither)."""
    if frame.startswith(_TORCH):
        return True
    installed = any(f"{os.sep}{folder}{os.sep}" in frame for folder in ("site-packages", "dist-packages"))
    return frame.startswith(_STDLIB) and not installed


class CudaSyncs(L.Callback):
    """Counts the host's CUDA synchronisations over one whole steady step (see the module's docstring), on every
    rank; writes ``{"warned": [caller, ...], "runtime": [call, ...]}`` to ``<directory>/rank<R>.json`` and prints
    them. A warned synchronisation's caller is the innermost frame of the stack outside torch and the standard
    library (the code that asked torch for a value or a wait); a runtime call is named with its thread and the
    operators it ran in. The callback's own calls are not counted: the profiler's final device synchronisation
    comes after the window's range closes, and the debug mode's switch warns with another message."""

    def __init__(self, directory: str, step: int = 4) -> None:
        self.directory, self.step = directory, step
        self._profile: Any = None
        self._range: Any = None
        self._catcher: Any = None
        self._seen: list[list[str]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._profile is not None:
            self._close(trainer)
        elif batch_idx == self.step - 1:
            self._open()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._profile is not None:  # fit ended inside the window (an error): leave nothing switched on
            self._stop()

    def _open(self) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        self._profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profile.__enter__()
        self._range = record_function(_WINDOW)
        self._range.__enter__()
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._warned
        torch.cuda.set_sync_debug_mode("warn")

    def _warned(self, message: Any, *_: Any, **__: Any) -> None:
        if SYNC_WARNING in str(message):  # on whichever thread ran it (autograd's device thread, for a hook)
            self._seen.append([f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]])

    def _stop(self) -> Any:
        """Switch everything off, in the reverse order; the finished profile."""
        torch.cuda.set_sync_debug_mode(0)
        self._catcher.__exit__(None, None, None)
        self._range.__exit__(None, None, None)
        profile, self._profile, self._range, self._catcher = self._profile, None, None, None
        profile.__exit__(None, None, None)
        return profile

    def _close(self, trainer: L.Trainer) -> None:
        events = self._stop().events()
        (window,) = [e for e in events if e.name == _WINDOW and e.device_type == torch.autograd.DeviceType.CPU]
        start, end = window.time_range.start, window.time_range.end
        runtime = [_runtime_call(e) for e in events if e.name in BLOCKING_CALLS and start <= e.time_range.start <= end]
        warned = [next((f for f in reversed(stack) if not _torch_or_stdlib(f)), "?") for stack in self._seen]
        rank = trainer.global_rank
        print(f"rank {rank}: CUDA syncs in one steady step ({type(trainer.strategy).__name__}): {len(warned)} warned,"
              f" {len(runtime)} blocking runtime calls")
        for caller, stack in zip(warned, self._seen):
            print(f"  warned: {caller}\n    " + "\n    ".join(stack[-8:]))
        for call in runtime:
            print(f"  runtime: {call}")
        with open(os.path.join(self.directory, f"rank{rank}.json"), "w") as f:
            json.dump({"warned": warned, "runtime": runtime}, f)


def _runtime_call(event: Any) -> str:
    """``cudaStreamSynchronize (thread 12) in aten::_local_scalar_dense < aten::item``: innermost operator first."""
    inside, parent = [], event.cpu_parent
    while parent is not None and parent.name != _WINDOW and len(inside) < 4:
        inside.append(parent.name)
        parent = parent.cpu_parent
    return f"{event.name} (thread {event.thread})" + (f" in {' < '.join(inside)}" if inside else "")


def count_syncs(directory: str, strategy: Any, model: L.LightningModule, devices: int = 2, step: int = 4,
                max_steps: int = 6, precision: str = "bf16-mixed") -> list[dict[str, list[str]]]:
    """Fit ``model`` for ``max_steps`` with :class:`CudaSyncs` over step ``step``; each rank's report, by rank."""
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="gpu", devices=devices, strategy=strategy, precision=precision,
                        max_steps=max_steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[CudaSyncs(directory, step)])
    trainer.fit(model)
    reports = []
    for rank in range(devices):
        with open(os.path.join(directory, f"rank{rank}.json")) as f:
            reports.append(json.load(f))
    return reports
