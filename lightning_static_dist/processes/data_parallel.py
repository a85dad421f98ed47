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

import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_static_dist.processes import sigterm as loop_patches
from lightning_static_dist.checkpoint import CheckpointError
from lightning_static_dist.compat import destroy_process_groups_at_exit, mark_run_failed
from lightning_static_dist.config import ConfigError
from lightning_static_dist.config.lightning_cli import parse_errors_of
from lightning_static_dist.strategy_config import StrategyConfig
from lightning_static_dist.ddp_arguments import check_process_group_backend, device_backend
from lightning_static_dist.processes.ending import in_chain, install_excepthook
from lightning_static_dist.processes.faults import (diagnose, is_collective_failure, post_own_failure,
                                                    record_nccl_flight, waiting_in)
from lightning_static_dist.processes.launcher import StaticDistLauncher, StaticDistSpawnLauncher
from lightning_static_dist.mesh import build_dp_mesh, reduces_by_scatter, resolve_mesh_shape
from lightning_static_dist.simulate import BACKEND as SIMULATED_BACKEND
from lightning_static_dist.simulate import init_simulated_world, is_simulated, set_link
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.simulate.link import check_available as check_link_available

log = logging.getLogger(__name__)

#: backends whose communicator is created eagerly on the rank's device when the process group is bound to it
_DEVICE_BOUND_BACKENDS = ("nccl", "xccl", "hccl")

START_UP_S = 600.0
"""Seconds the collectives may wait until the first optimizer step is over, when ``strategy.timeout_s`` is shorter:
the ranks of a job start seconds apart (each imports torch and Lightning), and setup and the first step (a rank's
data preparation, a compilation) keep one rank waiting for another far longer than a collective of a running job
should. ``participants/runtime.py``'s ``CollectiveTimeout`` sets ``strategy.timeout_s`` then."""


def start_up_timeout(config: StrategyConfig) -> timedelta:
    """The collectives' timeout from the start until the first optimizer step is over (:data:`START_UP_S`)."""
    return timedelta(seconds=max(config.timeout_s, START_UP_S))


def binds_device(backend: str, device: torch.device) -> bool:
    """Whether the process group starts bound to the rank's device (``device_id``): for the accelerator's own
    collective library (NCCL, XCCL, HCCL), so that the mesh's groups are split from one eagerly created
    communicator. Any other backend is not bound — Gloo carrying CUDA tensors in particular: ``DeviceMesh`` would
    then split its groups, and ``split_group`` cannot copy Gloo's options (``TypeError: cannot pickle ...
    _Options`` on torch 2.11). ``backend`` was checked by ``ddp_arguments.check_process_group_backend``."""
    return device.type != "cpu" and device_backend(backend, device.type) in _DEVICE_BOUND_BACKENDS


def nccl_options(backend: str, comm_sms: Optional[int], setting: Optional[str] = None) -> dict[str, Any]:
    """``init_process_group`` keywords for ``strategy.sync.comm_sms``: NCCL's options with ``config.max_ctas`` (the
    CTAs, hence SMs, one collective may use); nothing for another backend, or where this torch has no such field
    (warned, naming ``setting``: by default ``strategy.sync.comm_sms=N``). Only for ``backend == "nccl"``: options for
    one backend cannot be given to a ``device:backend`` list."""
    if comm_sms is None or "nccl" not in backend:
        return {}
    setting = setting or f"strategy.sync.comm_sms={comm_sms}"
    if backend != "nccl":
        rank_zero_warn(f"static_dist: {setting} is applied with process_group_backend='nccl'"
                       f" only (options of one backend cannot go to {backend!r}); not applied")
        return {}
    options_type = getattr(torch.distributed, "ProcessGroupNCCL", None)
    options = options_type.Options() if options_type is not None else None
    if options is None or not hasattr(getattr(options, "config", None), "max_ctas"):
        rank_zero_warn(f"static_dist: {setting}: this torch's NCCL options have no max_ctas; not applied")
        return {}
    options.config.max_ctas = comm_sms
    least = getattr(options.config, "min_ctas", None)
    if isinstance(least, int) and least > comm_sms:  # (unset, it reads as a negative sentinel: left alone)
        options.config.min_ctas = comm_sms
    return {"pg_options": options}


def start_process_group(environment: ClusterEnvironment, backend: str, device: torch.device, config: StrategyConfig,
                        run_dir: str) -> str:
    """Start this process's default process group as both front ends do (the Trainer's :class:`DataParallelProcesses`
    and Fabric's ``FabricProcesses``): under ``strategy.simulate``, as rank 0 of the simulated world; otherwise with
    Lightning's ``_init_dist_connection`` (``DDPStrategy``'s environment variables and messages), bound to ``device``
    where :func:`binds_device` says so, with ``sync.comm_sms``'s NCCL options, and an NCCL flight record under
    ``run_dir``. The groups are destroyed at exit. Returns the backend that runs (the simulated world's own). The
    group starts with :func:`start_up_timeout`: the rendezvous itself waits that long for the last rank."""
    timeout = start_up_timeout(config)
    if config.simulate.enabled:
        start_simulated_world(config.simulate, config.sync.comm_sms, device, timeout)
        backend = SIMULATED_BACKEND
    else:
        record_nccl_flight(backend, device, run_dir)
        _init_dist_connection(environment, backend, timeout=timeout,
                              device_id=device if binds_device(backend, device) else None,
                              **nccl_options(backend, config.sync.comm_sms))
    destroy_process_groups_at_exit()  # at exit, while the interpreter is whole; not after a failure
    return backend


def start_simulated_world(simulation: SimulateConfig, comm_sms: Optional[int], device: torch.device,
                          timeout: timedelta) -> None:
    """The default group as rank 0 of the simulated world (its backend registered with torch.distributed)."""
    if simulation.link is not None:
        check_link_available(device)
    if not torch.distributed.is_initialized():  # (a later stage of the same process finds it there)
        init_simulated_world(simulation.world_size, timeout)
    elif not is_simulated() or torch.distributed.get_world_size() != simulation.world_size:
        raise ConfigError(f"strategy.simulate.world_size={simulation.world_size}: this process already has a"
                          f" {torch.distributed.get_backend()} process group of {torch.distributed.get_world_size()}"
                          " ranks; allowed: a simulated world in a process without one")
    set_link(simulation.link, comm_sms)
    rank_zero_info(f"static_dist: simulated world of {simulation.world_size} identical ranks in this one process"
                   f" ({'link: ' + simulation.link.describe() if simulation.link else 'free links'}); no data"
                   " crosses a link")


def resolve_for_world(strategy: Any) -> None:
    """Either front end's config, what in it depends on the world (``sync.schedule: by_topology``) made concrete for
    this setup's world (:meth:`StrategyConfig.resolved`), from the config as asked, so that a strategy reused in another
    world resolves again; its line printed on rank 0, and a refusal in one line (``parse_errors_of``). At setup, once
    the mesh is built."""
    asked = strategy.__dict__.setdefault("_asked_config", strategy._config)
    with parse_errors_of(strategy):
        config, line = asked.resolved(device_type=strategy.root_device.type, num_nodes=strategy.num_nodes,
                                      sharded=strategy.reduce_scatter())
    if line is not None:
        rank_zero_info(f"static_dist: {line}")
    strategy._config = config


def ranks_in_world(simulation: Optional[SimulateConfig], num_nodes: int, num_processes: int) -> int:
    """The world's size, before any process starts: every node's processes, or the simulated world's ranks."""
    return simulation.world_size if simulation is not None else num_nodes * num_processes


def check_simulation(simulation: Optional[SimulateConfig], num_processes: int, num_nodes: int,
                     devices: Optional[list[torch.device]], front_end: str) -> None:
    """A simulated world is one process on one device: anything else is refused before the run starts
    (``front_end``: how the user asks for one process, e.g. ``"Trainer(devices=1, num_nodes=1)"``)."""
    if simulation is None:
        return
    if num_processes > 1 or num_nodes > 1:
        raise ConfigError(f"strategy.simulate.world_size={simulation.world_size}: one process stands for every rank;"
                          f" allowed: {front_end} (got devices={num_processes}, num_nodes={num_nodes})")
    if simulation.link is not None and devices:
        check_link_available(devices[0])  # (a link on CPU, or CuPy missing: one line, now)


#: the launch variables read as integers, and the least value each may take
_INTEGER_VARIABLES = {"WORLD_SIZE": (1, "the number of processes in the job"), "RANK": (0, "this process's rank"),
                      "LOCAL_RANK": (0, "this process's rank on its node"), "NODE_RANK": (0, "this node's rank")}


def check_launch_environment(environ: Mapping[str, str], hosts_store: bool) -> None:
    """Refuse a launch variable that cannot work, with one line naming it, before any process starts: ``MASTER_PORT``
    not a port number, or (``hosts_store``: this process will open the rendezvous store on it) a port some other
    process already listens on; ``WORLD_SIZE`` below 1; a rank that is not an integer >= 0. Otherwise each would fail
    later: a ``ValueError`` from deep inside Lightning, a store that never binds, or ranks waiting for a world of 0."""
    port = environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"MASTER_PORT={port!r}: must be a TCP port number (an integer 1-65535), or unset to let"
                          " Lightning pick a free one")
    for name, (least, meaning) in _INTEGER_VARIABLES.items():
        value = environ.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) >= least):
            raise ConfigError(f"{name}={value!r}: must be an integer >= {least} ({meaning}), or unset")
    if port is not None and hosts_store and _port_in_use(int(port)):
        raise ConfigError(f"MASTER_PORT={port}: the port is already in use on this machine (another job's"
                          " rendezvous?); set MASTER_PORT to a free port, or unset it to let Lightning pick one")


def _port_in_use(port: int) -> bool:
    """Whether a process listens on ``port`` here (bound as torch's TCP store binds it: every interface, reusing a
    port that only lingers from a closed connection)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE  # (EACCES, a port below 1024 without root: torch's own error says so)
    return False


class DataParallelProcesses(ParallelStrategy):
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
        self._config = config
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = num_nodes
        self._mesh: Optional[DeviceMesh] = None
        self._host_group: Optional[torch.distributed.ProcessGroup] = None
        self._failed = False
        self._preempted = False  # the ranks' agreed SIGTERM stop (processes/sigterm.py): every rank saved, none failed
        self._reported: Optional[BaseException] = None  # the exception whose one line this rank printed
        self.failure: Optional[str] = None
        """One line saying which rank stopped participating, and where, after a communication failure; or which
        checkpoint could not be written or read, and why (every rank prints the same one)."""

    @property
    def config(self) -> StrategyConfig:
        """The validated strategy configuration (``strategy.config.sync.bucket_mb`` ...)."""
        return self._config

    @property
    def simulation(self) -> Optional[SimulateConfig]:
        """``strategy.simulate`` when this run simulates a world (``None`` otherwise)."""
        return self._config.simulate if self._config.simulate.enabled else None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh, built in :meth:`setup_environment` from the world that actually started."""
        if self._mesh is None:
            raise RuntimeError("The device mesh is built when the processes start: access it in or after `setup`.")
        return self._mesh

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
        simulation = self.simulation
        return simulation.world_size if simulation is not None else super().world_size

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

    def _ranks_in_world(self) -> int:
        return ranks_in_world(self.simulation, self.num_nodes, self.num_processes)

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
    def dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """Every data-parallel rank: the mesh covers the world."""
        return _group.WORLD if self._mesh is not None else None

    @property
    def host_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """A Gloo group over every rank for figures held on the host (``None`` on one rank, or where none could be
        made)."""
        return self._host_group

    def reduce_scatter(self) -> bool:
        """``strategy.sync.reduce`` resolved against the mesh that started (``auto``: reduce_scatter if dp_shard > 1)."""
        return reduces_by_scatter(self._config.sync.reduce, self._mesh, self.world_size)

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
            check_simulation(self.simulation, self.num_processes, self.num_nodes, self.parallel_devices,
                             "Trainer(devices=1, num_nodes=1)")
            # in the launching process, before any rank starts: a mesh that cannot fit the world is a config error
            resolve_mesh_shape(self._config.mesh, self._ranks_in_world())
        if self._start_method == "popen":
            self._launcher = StaticDistLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = StaticDistSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()
        if self.lightning_module is not None:
            # the same hand-over ModelParallelStrategy uses: `self.device_mesh` inside the LightningModule
            self.lightning_module._device_mesh = self._mesh

    def setup_distributed(self) -> None:
        """Initialise the process group and build the data-parallel mesh over it."""
        log.debug(f"{self.__class__.__name__}: setting up distributed...")
        reset_seed()
        self.set_world_ranks()
        check_process_group_backend(self._process_group_backend)  # against the backends torch knows now
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._process_group_backend = start_process_group(
            self.cluster_environment, backend, self.root_device, self._config,
            trainer.default_root_dir if trainer is not None else os.getcwd())
        self._mesh = build_dp_mesh(self.root_device.type, self._config.mesh)
        resolve_for_world(self)
        if self.world_size > 1 and self._host_group is None:  # once per strategy: every later stage reuses it
            self._host_group = loop_patches.host_group(start_up_timeout(self._config))
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
        mesh = self._mesh
        if mesh is None or self._failed or self.simulation is not None or not torch.distributed.is_initialized():
            return
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

    def host_max(self, values: Sequence[float]) -> list[float]:
        """The maximum over ranks of figures held on the host, through the host (Gloo) group: no device tensor, so
        no GPU synchronisation (a device all-reduce read back with ``.item()`` waits for the GPU's queue). A
        collective: every rank calls it."""
        if self.world_size == 1:
            return [float(v) for v in values]
        # where no Gloo group could be made (loop.host_group warned), through the default group and the device
        device = torch.device("cpu") if self._host_group is not None else self.root_device
        flat = torch.tensor(values, dtype=torch.float64, device=device)
        with waiting_in("the maximum over ranks of host figures (strategy.host_max)"):
            torch.distributed.all_reduce(flat, op=ReduceOp.MAX, group=self._host_group)
        return flat.tolist()

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
