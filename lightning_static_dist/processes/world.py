"""How a data-parallel world starts, for both front ends (the Trainer's
:class:`~lightning_static_dist.processes.data_parallel.DataParallelProcesses` and Fabric's ``FabricProcesses``): the
launch environment and a simulated world checked before any rank starts, the default process group started (bound to
the rank's device where that helps, with ``sync.comm_sms``'s NCCL options), and the config resolved for the world
that started.

Example::

    backend = start_process_group(environment, "gloo", torch.device("cpu"), config, run_dir)
    resolve_for_world(strategy)   # strategy.plan: the step plan of this world
"""

from __future__ import annotations

import dataclasses
import errno
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.compat import destroy_process_groups_at_exit
from lightning_static_dist.config import ConfigError
from lightning_static_dist.config.lightning_cli import parse_errors_of
from lightning_static_dist.ddp_arguments import device_backend
from lightning_static_dist.processes.faults import record_nccl_flight
from lightning_static_dist.simulate import BACKEND as SIMULATED_BACKEND
from lightning_static_dist.simulate import init_simulated_world, is_simulated, set_link
from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.simulate.link import check_available as check_link_available
from lightning_static_dist.step_plan import resolve_plan, start_up_timeout
from lightning_static_dist.strategy_config import StrategyConfig

#: backends whose communicator is created eagerly on the rank's device when the process group is bound to it
_DEVICE_BOUND_BACKENDS = ("nccl", "xccl", "hccl")

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
    """Either front end's step plan for this setup's world (:func:`~lightning_static_dist.step_plan.resolve_plan`),
    from the config as asked, so that a strategy reused in another world resolves again: ``strategy._plan``, and
    ``strategy._config`` with ``sync.schedule: by_topology`` made concrete; the line saying what it became printed on
    rank 0, and a refusal in one line (``parse_errors_of``). At setup, once the mesh is built."""
    asked = strategy.__dict__.setdefault("_asked_config", strategy._config)
    with parse_errors_of(strategy):
        plan = resolve_plan(asked, world_size=strategy.world_size, device_type=strategy.root_device.type,
                            num_nodes=strategy.num_nodes, mesh=strategy.device_mesh)
    if plan.schedule_line is not None:
        rank_zero_info(f"static_dist: {plan.schedule_line}")
    strategy._config = asked if plan.sync is asked.sync else dataclasses.replace(asked, sync=plan.sync)
    strategy._plan = plan


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
