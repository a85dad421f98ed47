"""How a data-parallel world starts, for both front ends (the Trainer's
:class:`~lightning_static_dist.processes.data_parallel.DataParallelProcesses` and Fabric's ``FabricProcesses``): a
simulated world checked before any rank starts (the launch environment is ``processes/environment.py``'s), the
default process group started (bound to the rank's device where that helps, with ``sync.comm_sms``'s NCCL options),
and the mesh and the config resolved for the world that started, held by one :class:`DataParallelWorld` per front end.

Example::

    world = DataParallelWorld(config, started="in or after `setup`")
    backend = world.start(environment, "gloo", torch.device("cpu"), run_dir)
    world.build(strategy, torch.device("cpu"), world_size=2, num_nodes=1)   # world.plan: this world's step plan
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed
from torch.distributed.device_mesh import DeviceMesh
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.distributed import group as _group
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.compat import destroy_process_groups_at_exit
from lightning_static_dist.config import ConfigError
from lightning_static_dist.config.lightning_cli import parse_errors_of
from lightning_static_dist.ddp_arguments import device_backend
from lightning_static_dist.mesh import build_dp_mesh, reduces_by_scatter, resolve_mesh_shape
from lightning_static_dist.agreement.faults import record_nccl_flight, waiting_in
from lightning_static_dist.simulate import BACKEND as SIMULATED_BACKEND
from lightning_static_dist.simulate import init_simulated_world, is_simulated, set_link
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.simulate.link import check_available as check_link_available
from lightning_static_dist.plan.step_plan import StepPlan, resolve_plan, start_up_timeout
from lightning_static_dist.plan.strategy_config import StrategyConfig

#: backends whose communicator is created eagerly on the rank's device when the process group is bound to it
_DEVICE_BOUND_BACKENDS = ("nccl", "xccl", "hccl")

def binds_device(backend: str, device: torch.device) -> bool:
    """Whether the process group starts bound to the rank's device (``device_id``): for the accelerator's own
    collective library (NCCL, XCCL, HCCL), so that the mesh's groups are split from one eagerly created
    communicator. Any other backend is not bound (Gloo carrying CUDA tensors in particular; why: docs/internals.md,
    "plan/world.py"). ``backend`` was checked by ``ddp_arguments.check_process_group_backend``."""
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


class DataParallelWorld:
    """The one owner of what both front ends' processes know of their world (the Trainer's
    :class:`~lightning_static_dist.processes.data_parallel.DataParallelProcesses`, Fabric's ``FabricProcesses``; each
    holds one and answers from it, as Lightning's two strategies share ``_setup_device_mesh``): the ``strategy``
    block as asked, read here once; the checks before any rank starts; the default group started; the data-parallel
    mesh over it and the step plan resolved for that world, again at each setup (a strategy reused in another world).

    Example::

        world = DataParallelWorld(config, started="after `fabric.launch()`")
        world.check_before_launch(num_processes=2, num_nodes=1, devices=None, front_end="Fabric(devices=1)")
        backend = world.start(environment, "gloo", torch.device("cpu"), run_dir)
        world.build(strategy, torch.device("cpu"), world_size=2, num_nodes=1)
        world.plan.sync.schedule, world.device_mesh, world.reduce_scatter(2)
    """

    def __init__(self, config: StrategyConfig, started: str) -> None:
        self._asked = config
        self._started = started  # when the mesh and plan exist, in the front end's words
        self.simulation: Optional[SimulateConfig] = config.simulate if config.simulate.enabled else None
        """``strategy.simulate`` when this run simulates a world (``None`` otherwise)."""
        self._mesh: Optional[DeviceMesh] = None
        self._plan: Optional[StepPlan] = None

    @property
    def plan(self) -> StepPlan:
        """The step plan of the world that started."""
        if self._plan is None:
            raise RuntimeError(f"The step plan is resolved when the processes start: access it {self._started}.")
        return self._plan

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh, built from the world that actually started."""
        if self._mesh is None:
            raise RuntimeError(f"The device mesh is built when the processes start: access it {self._started}.")
        return self._mesh

    @property
    def config(self) -> StrategyConfig:
        """The validated ``strategy`` block, as asked (what it became in this world: :attr:`plan`)."""
        return self._asked

    @property
    def has_mesh(self) -> bool:
        return self._mesh is not None

    @property
    def dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """Every data-parallel rank (the mesh covers the world); ``None`` before the mesh is built."""
        return _group.WORLD if self._mesh is not None else None

    def world_size(self, started: Callable[[], int]) -> int:
        """The simulated world's ranks, else ``started()``'s (asked only then: a cluster environment outside its
        cluster, given to a simulated run, has no world to report)."""
        return self.simulation.world_size if self.simulation is not None else started()

    def ranks(self, num_nodes: int, num_processes: int) -> int:
        """The world's size before any process starts (:func:`ranks_in_world`)."""
        return ranks_in_world(self.simulation, num_nodes, num_processes)

    def reduce_scatter(self, world_size: int) -> bool:
        """``sync.reduce`` resolved against the mesh (the plan's ``reduce_by_scatter`` once the processes started;
        before, from the config and whatever mesh exists, as it was answered before the plan)."""
        if self._plan is None:
            return reduces_by_scatter(self._asked.sync.reduce, self._mesh, world_size)
        return self._plan.sync.reduce_by_scatter

    def check_before_launch(self, num_processes: int, num_nodes: int, devices: Optional[list[torch.device]],
                            front_end: str) -> None:
        """In the launching process, before any rank starts: a simulation the launch cannot hold
        (:func:`check_simulation`), or a mesh that cannot fit the world, is a config error."""
        check_simulation(self.simulation, num_processes, num_nodes, devices, front_end)
        resolve_mesh_shape(self._asked.mesh, self.ranks(num_nodes, num_processes))

    def start(self, environment: ClusterEnvironment, backend: str, device: torch.device, run_dir: str) -> str:
        """The default process group (:func:`start_process_group`); returns the backend that runs."""
        return start_process_group(environment, backend, device, self._asked, run_dir)

    def build(self, owner: Any, device: torch.device, world_size: int, num_nodes: int) -> None:
        """The mesh over the started group, and the step plan for it (:func:`~lightning_static_dist.plan.step_plan.
        resolve_plan`) from the config as asked: the line saying what ``measured`` became printed on rank 0 where no
        probe decides it, a refusal in one line (``parse_errors_of(owner)``). At setup, once the group is up."""
        self._mesh = build_dp_mesh(device.type, self._asked.mesh)
        free_links = self.simulation is not None and self.simulation.link is None
        with parse_errors_of(owner):
            plan = resolve_plan(self._asked, world_size=world_size, device_type=device.type, num_nodes=num_nodes,
                                mesh=self._mesh, free_links=free_links)
        if plan.sync.schedule_line is not None:
            rank_zero_info(f"static_dist: {plan.sync.schedule_line}")
        self._plan = plan

    def settle_schedule(self, plan: StepPlan) -> None:
        """The plan with ``sync.schedule: measured`` settled (:meth:`~lightning_static_dist.plan.step_plan.StepPlan.settled`,
        by the probe at setup) replaces the pending one."""
        if self._plan is None or self._plan.sync.schedule != "measured" or plan.sync.schedule == "measured":
            raise RuntimeError("settle_schedule: only a pending sync.schedule measured is settled, once")
        self._plan = plan


class WorldFacts:
    """What either front end's processes answer from the :class:`DataParallelWorld` they hold as ``self._world``
    (mixed in before Lightning's strategy class; ``world_size``, ``num_nodes`` and ``num_processes`` are the
    strategy's).

    Example::

        class FabricProcesses(WorldFacts, DDPStrategy): ...
        strategy.plan.sync.schedule, strategy.device_mesh, strategy.reduce_scatter()
    """

    _world: DataParallelWorld
    world_size: int
    root_device: torch.device
    host_group: Optional[torch.distributed.ProcessGroup]
    num_nodes: int
    num_processes: int

    @property
    def config(self) -> StrategyConfig:
        """The validated strategy configuration (``strategy.config.sync.bucket_mb`` ...)."""
        return self._world.config

    @property
    def plan(self) -> StepPlan:
        """The step plan of the world that started (resolved when the processes start)."""
        return self._world.plan

    @property
    def simulation(self) -> Optional[SimulateConfig]:
        """``strategy.simulate`` when this run simulates a world (``None`` otherwise)."""
        return self._world.simulation

    def settle_schedule(self, plan: StepPlan) -> None:
        """The step plan with ``sync.schedule: measured`` settled (:meth:`DataParallelWorld.settle_schedule`)."""
        self._world.settle_schedule(plan)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh, built when the processes start from the world that actually started."""
        return self._world.device_mesh

    @property
    def dp_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """Every data-parallel rank: the mesh covers the world."""
        return self._world.dp_group

    def reduce_scatter(self) -> bool:
        """``sync.reduce`` resolved against the mesh (:meth:`DataParallelWorld.reduce_scatter`)."""
        return self._world.reduce_scatter(self.world_size)

    def host_max(self, values: Sequence[float]) -> list[float]:
        """The maximum over ranks of figures held on the host, through ``host_group`` on :attr:`host_device`. The
        Trainer's is a Gloo group: no device tensor, so no GPU synchronisation (a device all-reduce read back with
        ``.item()`` waits for the GPU's queue); Fabric's is the device's. A collective: every rank calls it."""
        if self.world_size == 1:
            return [float(v) for v in values]
        flat = torch.tensor(values, dtype=torch.float64, device=self.host_device)
        with waiting_in("the maximum over ranks of host figures (strategy.host_max)"):
            torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=self.host_group)
        return flat.tolist()

    @property
    def host_device(self) -> torch.device:
        """Where :meth:`host_max`'s tensor lives: the CPU when ``host_group`` is a Gloo group, else the root device."""
        return self.root_device

    def _ranks_in_world(self) -> int:
        return self._world.ranks(self.num_nodes, self.num_processes)


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
