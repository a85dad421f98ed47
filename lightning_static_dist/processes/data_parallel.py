"""``DataParallelProcesses``: the processes, ranks, process groups and collectives of a data-parallel Lightning
strategy, below the step lifecycle :class:`~lightning_static_dist.strategy.StaticDistStrategy` adds.

What Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` each hold beside their step: how the ranks start (the
launchers), the process group (bound to the rank's device for NCCL), the data-parallel ``DeviceMesh``, a Gloo group
for figures held on the host, Lightning's collectives (``barrier``, ``broadcast``, ``reduce``) and a failed rank's
one-line diagnosis.

Example (the strategy is the class users meet; this part of it, used from a hook)::

    breaks, recompiles = strategy.host_max([len(report.graph_breaks), len(report.recompiles)])
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Optional, Union

import torch
import torch.distributed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lightning_static_dist.processes import sigterm as loop_patches
from lightning_static_dist.checkpoint import CheckpointError
from lightning_static_dist.compat import mark_run_failed
from lightning_static_dist.config import ConfigError
from lightning_static_dist.config.lightning_cli import parse_errors_of
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.trainer_context import TrainerSettings, refuse_before_launch
from lightning_static_dist.ddp_arguments import check_process_group_backend
from lightning_static_dist.processes.ending import in_chain, install_excepthook
from lightning_static_dist.processes.environment import check_launch_environment
from lightning_static_dist.agreement.faults import (AgreedFailure, diagnose, is_collective_failure,
                                                    post_own_failure, waiting_in)
from lightning_static_dist.processes.launcher import StaticDistLauncher, StaticDistSpawnLauncher
from lightning_static_dist.plan.world import DataParallelWorld, WorldFacts

log = logging.getLogger(__name__)


class DataParallelProcesses(WorldFacts, ParallelStrategy):
    """A Lightning strategy's processes, ranks, groups and collectives, for data parallelism over a ``DeviceMesh``
    that covers the world.

    Args:
        config: the validated ``strategy`` block (its ``timeout_s`` and ``mesh`` are read here).
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"``, ``"fork"``,
            ``"forkserver"``.
        process_group_backend: a backend registered with ``torch.distributed``, or ``device:backend`` pairs;
            ``None``: NCCL on CUDA, Gloo on CPU.
        num_nodes: as with ``DDPStrategy``, replaced by ``Trainer(num_nodes=...)``.
    """

    def __init__(
        self,
        accelerator: Optional[pl.accelerators.Accelerator],
        parallel_devices: Optional[list[torch.device]],
        cluster_environment: Optional[ClusterEnvironment],
        checkpoint_io: Optional[CheckpointIO],
        precision_plugin: Optional[Precision],
        *,
        config: StrategyConfig,
        start_method: str,
        process_group_backend: Optional[str],
        num_nodes: int,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
            raise ConfigError(f"num_nodes={num_nodes!r}: must be an integer >= 1")
        self._world = DataParallelWorld(config, started="in or after `setup`")
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = num_nodes
        self._host_group: Optional[torch.distributed.ProcessGroup] = None
        self._failed = False
        self._preempted = False  # the ranks' agreed SIGTERM stop (processes/sigterm.py): every rank saved, none failed
        self._reported: Optional[BaseException] = None  # the exception whose one line this rank printed
        self.failure: Optional[str] = None
        """One line saying which rank stopped participating, and where, after a communication failure; or which
        checkpoint could not be written or read, and why (every rank prints the same one)."""

    @property
    def is_distributed(self) -> bool:
        # Lightning asks this of strategies it does not know (sampler insertion, `self.log(sync_dist=True)`)
        return True

    # ------------------------------------------------------------------------------------- processes and ranks

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def world_size(self) -> int:
        # a cluster environment (SLURM, torchrun ...) reports its own world of one process: the simulated one counts
        return self._world.world_size(lambda: super(DataParallelProcesses, self).world_size)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # Lightning's connector sets it from Trainer(num_nodes=...); a different constructor value would be lost silently
        if num_nodes != self._num_nodes and self._num_nodes != 1:
            rank_zero_warn(f"static_dist: num_nodes={self._num_nodes} given to the strategy is replaced by the Trainer's"
                           f" num_nodes={num_nodes} (as with DDPStrategy: set it on the Trainer)")
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self._ranks_in_world(), "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        """The backend given, else the default for this rank's device (NCCL on CUDA, Gloo on CPU) once the devices are
        known (``DDPStrategy``'s reads ``None`` until its process group starts)."""
        if self._process_group_backend is None and self.parallel_devices:
            return _get_default_process_group_backend_for_device(self.root_device)
        return self._process_group_backend

    @property
    def host_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """A Gloo group over every rank for figures held on the host (``None`` on one rank, or where none could be
        made)."""
        return self._host_group

    @property
    def host_device(self) -> torch.device:
        # the host group is Gloo (the default group itself when it speaks Gloo, "cpu:gloo,cuda:nccl" included); where
        # none could be made (sigterm.host_group warned), the default group on the device
        return torch.device("cpu") if self._host_group is not None else self.root_device

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        environment = self.cluster_environment
        with parse_errors_of(self):  # (a strategy LightningCLI built: its command line's error, in one line)
            # this process opens the rendezvous store when it starts the ranks itself and is on the first node
            check_launch_environment(os.environ, hosts_store=not environment.creates_processes_externally
                                     and environment.node_rank() == 0)
            # before any rank starts, against the backends torch knows now (again in each rank, at setup_distributed)
            check_process_group_backend(self._process_group_backend)
            self._world.check_before_launch(self.num_processes, self.num_nodes, self.parallel_devices,
                                            "Trainer(devices=1, num_nodes=1)")
        launcher: Union[StaticDistLauncher, StaticDistSpawnLauncher]
        if self._start_method == "popen":
            launcher = StaticDistLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            launcher = StaticDistSpawnLauncher(self, start_method=self._start_method)
        launcher.before_launch = self._refuse_before_launch
        self._launcher = launcher

    def _refuse_before_launch(self, trainer: pl.Trainer) -> None:
        """What setup would refuse on every rank, where the ``strategy`` block and the ``Trainer``'s arguments decide
        it alone (``trainer_context.py``): one ``ConfigError`` from ``fit``, before any rank starts."""
        with parse_errors_of(self):
            refuse_before_launch(self.config, TrainerSettings.of(trainer))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()
        if self.lightning_module is not None:
            # the same hand-over ModelParallelStrategy uses: `self.device_mesh` inside the LightningModule
            self.lightning_module._device_mesh = self._world.device_mesh

    def setup_distributed(self) -> None:
        """Initialise the process group and build the data-parallel mesh over it."""
        log.debug(f"{self.__class__.__name__}: setting up distributed...")
        reset_seed()
        self.set_world_ranks()
        check_process_group_backend(self._process_group_backend)  # against the backends torch knows now
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._process_group_backend = self._world.start(
            self.cluster_environment, backend, self.root_device,
            trainer.default_root_dir if trainer is not None else os.getcwd())
        self._world.build(self, self.root_device, self.world_size, self.num_nodes)
        if self.world_size > 1 and self._host_group is None:  # once per strategy: every later stage reuses it
            self._host_group = loop_patches.host_group(self.plan.start_up_timeout)
        if self.world_size > 1 and self.simulation is None:
            # a script's uncaught exception: no traceback on top of the line on_exception printed for it
            install_excepthook(lambda error: in_chain(error, self._reported))

    @override
    def teardown(self) -> None:
        super().teardown()
        self._release_mesh_groups()

    def _release_mesh_groups(self) -> None:
        """Destroy the groups the mesh made for itself (the default group, and the host group every later stage
        reuses, stay): each stage builds its own mesh, and groups left behind would outlive the fit, into the
        interpreter's teardown. Not after a failure (a peer may be gone; the process ends without teardown anyway),
        and not in a simulated world (its groups are the world)."""
        if not self._world.has_mesh or self._failed or self.simulation is not None:
            return
        if not torch.distributed.is_initialized():
            return
        mesh = self._world.device_mesh
        keep = {id(_group.WORLD), id(self._host_group)}
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            # Gloo's only: what aborted at exit; NCCL's are left to the exit's teardown (not tried on GPUs here)
            if id(group) not in keep and torch.distributed.get_backend(group) == "gloo":
                keep.add(id(group))  # (a group serving two dimensions is destroyed once)
                torch.distributed.destroy_process_group(group)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self._ranks_in_world())
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @property
    def preempted(self) -> bool:
        """Whether ``fit`` ended at the ranks' agreed SIGTERM stop (its checkpoint written on every rank)."""
        return self._preempted

    def has_failed(self) -> bool:
        """Whether this rank is reporting a failure itself (the peer watchdog's thread reads it)."""
        return self._failed

    @override
    def on_exception(self, exception: BaseException) -> None:
        if loop_patches.is_agreed_stop(exception):
            self._preempted = True
            return  # every rank stopped at the step they agreed on (processes/sigterm.py): no failure, every peer is there
        # (Lightning's own per-rank SIGTERM stop, one rank alone, is a failure: its peers may wait in a collective)
        mark_run_failed()  # the exit-time teardown must not wait for peers that may be gone
        self._failed = True
        step = self._global_step()
        if isinstance(exception, CheckpointError):  # the ranks agreed on it: each says so, none waits for another
            self.failure, self._reported = str(exception), exception
            sys.stderr.write(f"{self.failure}\n")  # one write: the other ranks' lines go to the same stream
            sys.stderr.flush()
        elif isinstance(exception, AgreedFailure):  # every rank raised it, told by one collective: one line for all
            self.failure, self._reported = str(exception), exception
            if self.global_rank == 0:
                print(self.failure, file=sys.stderr, flush=True)
        elif self.world_size > 1 and is_collective_failure(exception):
            self.failure, self._reported = diagnose(exception, self.global_rank, self.world_size, step), exception
            print(self.failure, file=sys.stderr, flush=True)
            if isinstance(self._launcher, _SubprocessScriptLauncher):
                # Lightning kills the other ranks only on Ctrl-C; a stuck rank would outlive the job
                self._launcher.kill(signal.SIGKILL)
        elif self.world_size > 1 and self.simulation is None:
            # this rank's own error: its traceback is printed once (by lsd-train, or the script's excepthook), and
            # the others' lines name this rank
            post_own_failure(exception, self.global_rank, step)

    def _global_step(self) -> int:
        """The trainer's step, for a failure's line; -1 where the module has no trainer attached (a spawned rank's
        module, once the launcher's copy of the trainer is gone: reading it would raise over the failure)."""
        try:
            return self.lightning_module.trainer.global_step if self.lightning_module is not None else -1
        except RuntimeError:
            return -1

    # ------------------------------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        with waiting_in(f"Lightning's barrier{f' {name!r}' if name else ''}"):
            if "nccl" in torch.distributed.get_backend() and self.root_device.type == "cuda":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        objects = [obj]
        with waiting_in(f"Lightning's broadcast from rank {src}"):
            torch.distributed.broadcast_object_list(objects, src, group=_group.WORLD)
        return objects[0]

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        """Reduce a tensor over all processes (``"mean"`` by default, ``"sum"``, or a ``ReduceOp``).

        Non-tensors are returned unchanged, as in every Lightning strategy.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        with waiting_in("Lightning's reduce of a value over the ranks"):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
