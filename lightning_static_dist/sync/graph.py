"""``sync.mode: graph``: gradient collectives traced into the compiled backward graph.

Every trainable parameter is read in the forward through an identity whose backward is a functional all-reduce of
its gradient, so AOTAutograd places each collective in the backward graph and inductor buckets and schedules them
at compile time: no hooks, no compiled autograd. The identity is put in by swapping each module's class for one in
which the parameter's name is a property; parameters, ``state_dict()`` keys and the optimizer are untouched. What a
user notices while attached, and the limits: docs/how-it-works.md, "Graph sync mode".
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_static_dist.sync.bucket_reducer import supports_avg


class _AverageGrad(torch.autograd.Function):
    """Identity forward; the backward averages the incoming gradient over the group (functional all-reduce)."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, group_name: str, world: int, native_avg: bool,
                reduce_dtype: Optional[torch.dtype]) -> Tensor:
        ctx.group_name, ctx.world, ctx.native_avg, ctx.reduce_dtype = group_name, world, native_avg, reduce_dtype
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        import torch.distributed._functional_collectives as funcol

        sent = grad if ctx.reduce_dtype is None else grad.to(ctx.reduce_dtype)
        if ctx.native_avg:
            reduced = funcol.all_reduce(sent, "avg", ctx.group_name)
        else:  # Gloo has no AVG: divide first (no overflow in low precision), then sum
            reduced = funcol.all_reduce(sent / ctx.world, "sum", ctx.group_name)
        averaged = funcol.wait_tensor(reduced)
        return averaged.to(grad.dtype), None, None, None, None


class GraphSynchronizer:
    """Averages every gradient inside the (compiled) backward: parameters are read through an averaging identity.

    Args:
        module: the model; every submodule holding trainable parameters is switched to read them through the identity.
        group: the data-parallel process group.
        reduce_dtype: the dtype gradients travel in (``torch.bfloat16``); ``None``: their own.

    Example::

        sync = GraphSynchronizer(model, group=dist.group.WORLD)
        sync.attach()
        step = torch.compile(model.training_step, backend="inductor_distributed")
        step(batch, 0).backward()      # gradients averaged inside the compiled backward graph
        sync.detach()                  # the modules' own classes again
    """

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self._module = module
        group = group if group is not None else dist.group.WORLD
        self._group_name: str = group.group_name  # a string: what the functional collectives (and dynamo) take
        self._world = dist.get_world_size(group)
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._native_avg = supports_avg(group, device)
        self._reduce_dtype = reduce_dtype
        self._swapped: list[tuple[nn.Module, type]] = []
        self._classes: dict[tuple[type, tuple[str, ...]], type] = {}
        """One subclass per (class, parameter names): identical blocks keep one type, so dynamo compiles them once."""
        self._trainable = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
        self.rounds = 0
        """Backward passes averaged (every micro-batch of an accumulation is one)."""
        params = {id(p): p for p in module.parameters() if p.requires_grad}.values()
        element = torch.empty((), dtype=reduce_dtype).element_size() if reduce_dtype is not None else None
        self.bytes_per_round = sum(p.numel() * (element or p.element_size()) for p in params)
        """Payload bytes of one synchronised round (each parameter once, as if read once)."""

    def read(self, param: Tensor) -> Tensor:
        """``param`` as the forward should see it: through the averaging identity."""
        return _AverageGrad.apply(param, self._group_name, self._world, self._native_avg, self._reduce_dtype)

    def attach(self) -> None:
        """Give each module holding trainable parameters a class whose parameter names read through :meth:`read`."""
        if self._swapped:
            return
        for module in self._module.modules():
            names = [n for n, p in module._parameters.items() if p is not None and p.requires_grad]
            if not names:
                continue
            cls = type(module)
            key = (cls, tuple(names))
            if key not in self._classes:
                reading = {name: property(_reader(name, self)) for name in names}
                self._classes[key] = type(cls.__name__, (cls,), {**reading, "__module__": cls.__module__,
                                                                 "_static_dist_graph_sync": True})
            module.__class__ = self._classes[key]
            self._swapped.append((module, cls))

    def detach(self) -> None:
        """Give every module its own class back (before the model is pickled or saved whole)."""
        for module, cls in self._swapped:
            module.__class__ = cls
        self._swapped = []

    def check_trainable(self) -> None:
        """Raise, naming the parameter, if ``requires_grad`` changed since :meth:`attach` (its reads are fixed)."""
        for name, param in self._module.named_parameters():
            if param.requires_grad != (id(param) in self._trainable):
                state = "unfrozen" if param.requires_grad else "frozen"
                raise RuntimeError(f"static_dist: {name!r} was {state} during fit; strategy.sync.mode=graph reads the"
                                   " trainable parameters through its averaging identity from the first step on."
                                   " Freeze or unfreeze before fit, or use strategy.sync.mode=hooks")


def _reader(name: str, sync: GraphSynchronizer) -> Any:
    def read(module: nn.Module) -> Tensor:
        return sync.read(module._parameters[name])

    return read
