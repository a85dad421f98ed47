"""``sync.mode: graph``: gradient collectives traced into the compiled backward graph.

Each parameter's post-accumulate-grad hook averages its gradient with a *functional* all-reduce
(``torch.distributed._functional_collectives``), which dynamo can trace. Backward runs under compiled autograd, so
the whole backward pass — gradient kernels and collectives — becomes one graph that the ``inductor_distributed``
backend compiles: inductor buckets the all-reduces and reorders them against the gradient kernels, instead of a
Python reducer choosing bucket boundaries (the trade-off DDPOptimizer makes, pytorch#108966).

Limits (why ``hooks`` stays the default): the graph is static, so every rank must produce a gradient for every
trainable parameter on every step (checked collectively on the first step, which runs the hook synchroniser);
compiled autograd and functional collectives are private torch APIs that differ between versions; the first
backward compiles the whole backward graph, which takes long on large models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn import Parameter


class GraphGradientSync:
    """Averages every gradient with a traceable functional all-reduce inside its post-accumulate-grad hook.

    Example::

        sync = GraphGradientSync(model.parameters(), group=dist.group.WORLD)
        sync.attach()
        with compiled_backward("inductor_distributed"):
            loss.backward()      # gradients averaged inside the compiled backward graph
    """

    def __init__(self, parameters: Iterable[Parameter], group: Optional[dist.ProcessGroup] = None) -> None:
        # tied weights appear once (dicts keep the first-seen order)
        self._params = list({id(p): p for p in parameters if p.requires_grad}.values())
        self._group = group if group is not None else dist.group.WORLD
        self._world = dist.get_world_size(self._group)
        self._handles: list[Any] = []
        self.enabled = True
        self.rounds = 0
        self.bytes_per_round = sum(p.numel() * p.element_size() for p in self._params)

    def attach(self) -> None:
        for param in self._params:
            self._handles.append(param.register_post_accumulate_grad_hook(partial(_average, self)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # a Python flag read inside the hook: compiled autograd guards on it, so accumulation and boundary steps
        # each get a graph of their own (two compilations, then cache hits)
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous


def _average(sync: GraphGradientSync, param: Parameter) -> None:
    if not sync.enabled or param.grad is None:
        return
    import torch.distributed._functional_collectives as funcol

    # divide first (no overflow in low precision); the wait is implicit where copy_ reads the result
    param.grad.copy_(funcol.all_reduce(param.grad / sync._world, "sum", sync._group))


def compiled_backward(backend: Any) -> contextlib.AbstractContextManager[None]:
    """Run ``backward()`` under compiled autograd, compiling the backward graph with ``backend``."""
    from torch._dynamo import compiled_autograd

    enable: Callable[..., Any] = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    return enable(lambda gm: torch.compile(gm, backend=backend, fullgraph=True))
