"""A small real :class:`~lightning_static_dist.participants.StrategyView` and
:class:`~lightning_static_dist.participants.StepContext` for driving one participant through its phases.

The view's ranks and groups are the process group's own (a one-rank Gloo group in this process, or the ranks
``tests/_dist.py`` starts); its model and optimizers are real ones. Nothing in it stands in for a collective.

Example::

    view = View(Regression(), StrategyConfig.from_dict({"compile": {"enabled": True}}))
    participant = StaticCompile(view)
    participant.setup(view.enter(Context()))
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import lightning as L

from lightning_static_dist.simulate.config import SimulateConfig
from lightning_static_dist.plan.step_plan import StepPlan, resolve_plan
from lightning_static_dist.plan.strategy_config import StrategyConfig


class Context:
    """A :class:`~lightning_static_dist.participants.StepContext` as a front end would give it: a fit (or not) at
    ``global_step``, its callbacks collected in :attr:`callbacks`, and Lightning's ``Trainer`` only where a test hands
    one in (``trainer_loop``; Fabric's context has none)."""

    def __init__(self, fitting: bool = True, training: bool = True, global_step: int = 0,
                 trainer_loop: Any = None, micro_batches: Optional[int] = 1,
                 gradient_readers: Optional[tuple[str, ...]] = ()) -> None:
        self._fitting, self._training, self.step = fitting, training, global_step
        self._gradient_readers = None if gradient_readers is None else list(gradient_readers)  # (None: Fabric's)
        self._trainer_loop = trainer_loop
        self._micro_batches = micro_batches
        self.callbacks: list[Any] = []

    @property
    def fitting(self) -> bool:
        return self._fitting

    @property
    def global_step(self) -> int:
        return self.step

    @property
    def training(self) -> bool:
        return self._training

    def add_callback(self, callback: Any) -> None:
        if not any(isinstance(c, type(callback)) for c in self.callbacks):
            self.callbacks.append(callback)

    @property
    def trainer_loop(self) -> Any:
        return self._trainer_loop

    @property
    def micro_batches(self) -> Optional[int]:
        return self._micro_batches

    @property
    def gradient_readers(self) -> Optional[list[str]]:
        return self._gradient_readers


class View:
    """A :class:`~lightning_static_dist.participants.StrategyView` over a real module, its optimizers and the default
    process group (world size 1 without one); ``mesh``, where a test builds one (``build_dp_mesh``, as the strategy does),
    is its data-parallel mesh."""

    def __init__(self, module: Optional[nn.Module], config: Optional[StrategyConfig] = None,
                 optimizers: Optional[list[Any]] = None,
                 simulation: Optional[SimulateConfig] = None, mesh: Optional[DeviceMesh] = None) -> None:
        self._module = module
        self._mesh = mesh
        self._plan: Optional[StepPlan] = None
        self._config = config if config is not None else StrategyConfig()
        self._optimizers = list(optimizers or [])
        self._simulation = simulation
        self._context: Optional[Context] = None

    def enter(self, context: Context) -> Context:
        """A stage's setup begins with ``context`` (what the strategy's ``setup`` does before the phases)."""
        self._context = context
        return context

    @property
    def config(self) -> StrategyConfig:
        return self._config

    @property
    def plan(self) -> StepPlan:
        # resolved once, as the front ends' processes resolve it, for the world of this process group and the mesh
        if self._plan is None:
            self._plan = resolve_plan(self._config, world_size=self.world_size, device_type=self.root_device.type,
                                      num_nodes=1, mesh=self._mesh)
        return self._plan

    def settle_schedule(self, plan: StepPlan) -> None:
        self._plan = plan  # (as the world does: the probe's settled plan replaces the pending one)

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def device_mesh(self) -> Optional[DeviceMesh]:
        return self._mesh

    @property
    def simulation(self) -> Optional[SimulateConfig]:
        return self._simulation

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return dist.group.WORLD if dist.is_initialized() else None

    @property
    def host_group(self) -> Optional[dist.ProcessGroup]:
        return dist.group.WORLD if dist.is_initialized() else None

    @property
    def preempted(self) -> bool:
        return False

    @property
    def context(self) -> Optional[Context]:
        return self._context

    @property
    def lightning_module(self) -> Optional[L.LightningModule]:
        return self._module if isinstance(self._module, L.LightningModule) else None

    @property
    def model(self) -> Optional[nn.Module]:
        return self._module

    @property
    def optimizers(self) -> list[Any]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Any]) -> None:
        self._optimizers = optimizers

    @property
    def precision_plugin(self) -> Any:
        return None

    def reduce_scatter(self) -> bool:
        return self.plan.sync.reduce_by_scatter  # (without a mesh ``auto`` never shards)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            dist.barrier()


class Regression(L.LightningModule):
    """Two linear layers with a GELU between them, trained to a squared error (no repeated blocks: one region)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def gradient_participant(strategy: dict[str, Any], optimizer: Optional[type] = torch.optim.SGD
                         ) -> tuple[Regression, View, Any]:
    """A :class:`Regression` model, a view of it with the ``strategy`` block and one ``optimizer`` (lr 0.1; ``None``:
    none) over its parameters, and the real gradient participant on it, compile and embeddings as the strategy builds
    them (off here): not set up."""
    from lightning_static_dist.participants.compilation import StaticCompile
    from lightning_static_dist.participants.embeddings import EmbeddingShards
    from lightning_static_dist.participants.gradients import GradientAveraging
    from lightning_static_dist.participants.recording import PhaseRecording

    model = Regression()
    view = View(model, StrategyConfig.from_dict(strategy),
                optimizers=[optimizer(model.parameters(), lr=0.1)] if optimizer is not None else None)
    recording = PhaseRecording()
    return model, view, GradientAveraging(view, StaticCompile(view), EmbeddingShards(view, recording), recording)
