"""The ``static_dist`` launchers: Lightning's subprocess launcher with a grace period before a dead child takes the
job down, and Lightning's spawn launcher whose ranks skip the interpreter's teardown once their work is done.

The watcher waits ``grace_s`` after seeing a dead child (why: docs/internals.md, "processes/launcher.py"): long enough
for the strategy's own failure path (a roll call through the rendezvous store, then one line naming the missing rank
and the collective in flight, then exit 1). Only a process that is still around after the grace period is killed, with
Lightning's message. When the launching process itself leaves, it stops watching and waits for its ranks instead
(``processes/ending.py``'s :class:`~lightning_static_dist.processes.ending.LocalRanks`): none outlives it, and their
worst status is its own.

The strategy names both front ends register stand for their start methods (:data:`STRATEGY_NAMES`); Fabric's spawn
launcher gets the same clean exit as the Trainer's (:class:`FabricSpawnLauncher`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher as _FabricMultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_static_dist.compat import exit_without_native_teardown
from lightning_static_dist.processes.ending import LocalRanks, freeze_heap_at_exit


class _PatientObserver(_ChildProcessObserver):
    def __init__(self, main_pid: int, child_processes: list[Any], grace_s: float) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=1)
        self._grace_s = grace_s
        self._failed_at: Optional[float] = None
        self._stopped = False

    def stop(self) -> None:
        """Watch no more: the launching process is leaving, and waits for its ranks itself."""
        self._stopped = True

    @override
    def _run(self) -> bool:
        if self._stopped:
            return True
        for proc in self._child_processes:
            proc.poll()
        codes = [proc.returncode for proc in self._child_processes]
        if all(code == 0 for code in codes):
            return True
        if not any(codes):
            return False  # all still running
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        if time.monotonic() - self._failed_at < self._grace_s:
            return False  # the main process is telling the user what happened
        return super()._run()


class StaticDistLauncher(_SubprocessScriptLauncher):
    """Starts the other local ranks as subprocesses of this script, like Lightning's ``ddp`` launcher."""

    grace_s = 10.0
    """Seconds between seeing a dead child rank and killing the job (the strategy's diagnosis takes ~3 s)."""
    before_launch: Optional[Callable[[pl.Trainer], None]] = None
    """The strategy's refusals that the ``Trainer``'s arguments decide (``fit``'s first act, before any rank starts)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        if trainer is not None and self.before_launch is not None:
            self.before_launch(trainer)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        freeze_heap_at_exit()  # every rank: registered before the process groups' destruction at exit, run after it
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            observer = _PatientObserver(os.getpid(), self.procs, self.grace_s)
            observer.start()
            first_rank = self.cluster_environment.node_rank() * self.num_processes + 1
            LocalRanks(self.procs, first_rank, stop_watching=observer.stop).register()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class StaticDistSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, whose spawned ranks leave with ``os._exit`` once their work is handed over.

    After ``fit`` has returned and rank 0 has written its results to the parent (a synchronous pipe write), there
    is nothing left to do: the rank leaves through :func:`~lightning_static_dist.compat.exit_without_native_teardown`
    with status 0, skipping the native teardown where a finished Gloo rank sometimes aborts (why: the exit teardown
    in ``lightning_static_dist/compat.py``). A rank that raised never gets here (torch's spawn wrapper records its
    traceback and exits 1). Fork children already leave this way.
    """

    before_launch: Optional[Callable[[pl.Trainer], None]] = None
    """As :attr:`StaticDistLauncher.before_launch`."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[pl.Trainer] = None, **kwargs: Any) -> Any:
        from torch.multiprocessing import ProcessExitedException

        if trainer is not None and self.before_launch is not None:
            self.before_launch(trainer)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException as err:
            if err.exit_code != 2:
                raise
            # a rank ended the command as a parse error does (config/lightning_cli.py: rank 0 printed the line): the
            # same status here, with no traceback of the parent's wait under it
            raise SystemExit(2) from None

    @override
    def _wrapping_function(self, process_idx: int, trainer: Optional[pl.Trainer], function: Callable, args: Any,
                           kwargs: Any, return_queue: Any, global_states: Any = None) -> None:
        super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        if self._start_method == "spawn":
            exit_without_native_teardown(0)


class FabricSpawnLauncher(_FabricMultiProcessingLauncher):
    """Fabric's spawn/fork launcher whose spawned ranks leave with ``os._exit`` once rank 0's result is handed over:
    the interpreter's teardown of a finished Gloo rank sometimes aborts it (as :class:`StaticDistSpawnLauncher`)."""

    @override
    def _wrapping_function(self, process_idx: int, function: Callable, args: Any, kwargs: Any, return_queue: Any,
                           global_states: Any = None) -> None:
        super()._wrapping_function(process_idx, function, args, kwargs, return_queue, global_states)
        if self._start_method == "spawn":
            exit_without_native_teardown(0)


#: The names ``import lightning_static_dist`` registers, in Lightning's and in Fabric's registry, with the start
#: method each stands for.
STRATEGY_NAMES = (("static_dist", "popen"), ("static_dist_spawn", "spawn"), ("static_dist_notebook", "fork"))


def register_names(registry: _StrategyRegistry, cls: type, description: str) -> None:
    """Register ``cls`` under :data:`STRATEGY_NAMES` in a Lightning or Fabric strategy registry; a name already
    there is left as it is (registering adds names, it never replaces one)."""
    for name, start_method in STRATEGY_NAMES:
        if name in registry:
            continue
        registry.register(name, cls, description=f"{description}, start method '{start_method}'",
                          start_method=start_method)
