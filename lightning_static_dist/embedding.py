"""Sharded embeddings: each data-parallel rank keeps 1/N of an embedding's rows; the all-gather is hoisted.

Each rank keeps ``ceil(V / N)`` rows (the last shard padded), so the weight, its gradient and its optimizer state
shrink by the world size. The gather is issued early and waited for once before the forward, its gradient is
reduce-scattered and averaged in backward (:class:`GatherRows`: exactly DDP's average for those rows), and the full
weight is freed after the synchronised backward. Checkpoints hold the full weight under its original names. A step:
docs/how-it-works.md, "Sharded embeddings".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_static_dist.compat import all_gather_single, reduce_scatter_single
from lightning_static_dist.config.check import check_fields, fail

log = logging.getLogger(__name__)


@dataclass
class EmbeddingConfig:
    """``strategy.embedding``: shard embeddings across data-parallel ranks, with the all-gather hoisted.

    Tied uses (``head.weight = wte.weight``) share one gather.

    Example::

        StaticDistStrategy(embedding={"shard": "auto", "min_rows": 8192, "prefetch": "after_optimizer"})
    """

    KEY = "strategy.embedding"

    shard: Union[bool, Literal["auto"]] = False
    """``auto``: embeddings (``nn.Embedding``/``nn.EmbeddingBag``) with at least ``min_rows`` rows; ``true``: every
    embedding; ``false``: none. Ignored at world size 1."""
    min_rows: int = 8192
    """With ``shard: auto``, the smallest embedding that gets sharded."""
    prefetch: Literal["batch_start", "after_optimizer"] = "after_optimizer"
    """When the all-gather is issued: right after the previous optimizer step (default: it then overlaps the end of
    the step, the loader and the batch transfer), or in the batch-start hook (little runs between that hook and the
    forward, so most of the gather is exposed; the embed-shard benchmark measures both). The first step issues it
    before its forward either way."""
    gather_once_per_step: bool = True
    """With gradient accumulation: keep the gathered weight across micro-batches (one gather per step); false
    frees it after every backward and gathers again (less memory, one gather per micro-batch)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.min_rows < 1:
            fail(f"{self.KEY}.min_rows", self.min_rows, "must be an integer >= 1")


class GatherRows(torch.autograd.Function):
    """Forward: the gathered full weight (already in ``full``). Backward: reduce-scatter of its gradient, averaged.

    Example::

        weight = GatherRows.apply(shard, gathered[:rows], group)   # differentiable w.r.t. shard
    """

    @staticmethod
    def forward(ctx: Any, shard: Tensor, full: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:  # type: ignore[override]
        ctx.group = group
        ctx.shard_rows = shard.shape[0]
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[Optional[Tensor], None, None]:  # type: ignore[override]
        world = dist.get_world_size(ctx.group)
        padded = grad_full.new_zeros(ctx.shard_rows * world, grad_full.shape[1])
        padded[: grad_full.shape[0]] = grad_full
        grad_shard = grad_full.new_empty(ctx.shard_rows, grad_full.shape[1])
        reduce_scatter_single(grad_shard, padded, group=ctx.group)
        return grad_shard.div_(world), None, None


@dataclass
class ShardedWeight:
    """One sharded embedding weight and every place the model uses it (several when tied)."""

    names: list[str]
    """The weight's names in the model's state dict (``transformer.wte.weight``, ``lm_head.weight`` ...)."""
    owners: list[tuple[nn.Module, str]]
    """(module, attribute) pairs that read the full weight."""
    shard_name: str
    """Name of the shard parameter in the model (``transformer.wte.weight_shard``)."""
    rows: int
    shard_rows: int
    shard: nn.Parameter
    gathered: Optional[Tensor] = None
    work: Optional[Any] = None
    issued_at: float = 0.0
    done_at: dict[str, float] = field(default_factory=dict)


class EmbeddingChoice(Protocol):
    """Which embeddings get sharded: an :class:`EmbeddingConfig` as written, or the step plan's ``EmbeddingPlan``."""

    @property
    def shard(self) -> Union[bool, Literal["auto"]]: ...
    @property
    def min_rows(self) -> int: ...


@dataclass
class GatherTiming:
    """The last step's gathers: issued -> done (duration) and how long the forward waited for them."""

    gather_s: float = 0.0
    exposed_s: float = 0.0


def find_embeddings(module: nn.Module, config: EmbeddingChoice) -> list[tuple[list[str], list[tuple[nn.Module, str]]]]:
    """Embedding weights to shard: (every name, every (owner, attribute)) per weight, tied uses included."""
    chosen: dict[int, nn.Parameter] = {}
    for child in module.modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and isinstance(child.weight, nn.Parameter):
            if config.shard is True or child.weight.shape[0] >= config.min_rows:
                chosen[id(child.weight)] = child.weight
    found: dict[int, tuple[list[str], list[tuple[nn.Module, str]]]] = {}
    modules = dict(module.named_modules(remove_duplicate=False))
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in chosen:
            owner_name, _, attr = name.rpartition(".")
            names, owners = found.setdefault(id(param), ([], []))
            names.append(name)
            owner = modules[owner_name]
            if all(o is not owner or a != attr for o, a in owners):
                owners.append((owner, attr))
    return list(found.values())


class EmbeddingSharder:
    """Shards the chosen embeddings of ``module`` over ``group`` and runs their gather / release cycle.

    Example::

        sharder = EmbeddingSharder(model, EmbeddingConfig(shard="auto"), group)
        sharder.shard()              # before the optimizer is built: it must hold the shards
        sharder.prefetch()           # after the previous optimizer step, or at batch start
        sharder.materialize()        # right before the forward
        loss.backward()              # reduce-scatters the embedding gradient
        sharder.release()            # after the synchronised backward
    """

    def __init__(self, module: nn.Module, config: EmbeddingChoice, group: Optional[dist.ProcessGroup]) -> None:
        self.module = module
        self.config = config
        # its own process group: the reduce-scatter runs inside backward, where its order against the gradient
        # buckets' collectives may differ between ranks (a bucket launched late on a rank with an unused parameter)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.group = dist.new_group(ranks)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.weights: list[ShardedWeight] = []
        self.timing = GatherTiming()
        self._pending_timing = GatherTiming()
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------------------------------------ setup

    def shard(self) -> list[ShardedWeight]:
        """Replace each chosen weight by this rank's shard parameter (call after parameters were broadcast)."""
        prefixes = {id(m): name for name, m in self.module.named_modules(remove_duplicate=False)}
        for names, owners in find_embeddings(self.module, self.config):
            full = getattr(owners[0][0], owners[0][1])
            rows = full.shape[0]
            shard_rows = -(-rows // self.world)
            padded = full.detach().new_zeros(shard_rows * self.world, *full.shape[1:])
            padded[:rows] = full.detach()
            shard = nn.Parameter(padded[self.rank * shard_rows : (self.rank + 1) * shard_rows].clone(),
                                 requires_grad=full.requires_grad)
            for owner, attr in owners:
                delattr(owner, attr)  # unregisters the parameter; a plain attribute takes its place
                setattr(owner, attr, None)
            home, attr = owners[0]
            home.register_parameter(f"{attr}_shard", shard)
            prefix = prefixes[id(home)]
            shard_name = f"{prefix}.{attr}_shard" if prefix else f"{attr}_shard"
            self.weights.append(ShardedWeight(names, owners, shard_name, rows, shard_rows, shard))
            for owner, _ in owners:
                self._hooks.append(owner.register_forward_pre_hook(self._ensure_materialized))
            log.debug(f"sharded {names} ({rows} rows): {shard_rows} rows per rank")
        return self.weights

    def shard_parameters(self) -> set[int]:
        """``id()`` of every shard parameter: the synchroniser leaves these alone."""
        return {id(w.shard) for w in self.weights}

    # ------------------------------------------------------------------------------------------------ a step

    def prefetch(self) -> None:
        """Issue the asynchronous all-gather of every shard that is not gathered yet."""
        for w in self.weights:
            if w.gathered is not None or w.work is not None:
                continue
            w.gathered = torch.empty(w.shard_rows * self.world, *w.shard.shape[1:], dtype=w.shard.dtype,
                                     device=w.shard.device)
            w.issued_at = time.perf_counter()
            w.done_at = {}
            w.work = all_gather_single(w.gathered, w.shard.detach(), group=self.group, async_op=True)
            if w.shard.device.type == "cpu":
                # Gloo completes the future on its own thread the moment the gather is done
                w.work.get_future().add_done_callback(lambda _, d=w.done_at: d.setdefault("t", time.perf_counter()))

    def materialize(self) -> None:
        """Wait for the gathers (issuing them first if nobody did) and hand the full weight to every owner."""
        self.prefetch()
        for w in self.weights:
            if w.work is not None:
                waited = time.perf_counter()
                w.work.wait()
                done = time.perf_counter()
                self._pending_timing.exposed_s += done - waited
                self._pending_timing.gather_s += min(w.done_at.get("t", done), done) - w.issued_at
                w.work = None
            assert w.gathered is not None
            full = GatherRows.apply(w.shard, w.gathered[: w.rows], self.group)
            for owner, attr in w.owners:
                setattr(owner, attr, full)

    def _ensure_materialized(self, module: nn.Module, args: Any) -> None:
        # a forward the strategy did not prepare (validation, a user's generate() in a callback): gather now
        if any(getattr(owner, attr) is None for w in self.weights for owner, attr in w.owners):
            self.materialize()

    def release(self) -> None:
        """Drop the full weights (after the synchronised backward, or when the shards changed)."""
        for w in self.weights:
            if w.work is not None:
                w.work.wait()
                w.work = None
            w.gathered = None
            for owner, attr in w.owners:
                setattr(owner, attr, None)
        if self._pending_timing.gather_s or self._pending_timing.exposed_s:
            self.timing, self._pending_timing = self._pending_timing, GatherTiming()

    # ------------------------------------------------------------------------------------------------ checkpoints

    def _gather_rows(self, tensor: Tensor, rows: int) -> Tensor:
        out = tensor.new_empty(tensor.shape[0] * self.world, *tensor.shape[1:])
        all_gather_single(out, tensor.contiguous(), group=self.group)
        return out[:rows]

    def _my_rows(self, full: Tensor, w: ShardedWeight) -> Tensor:
        padded = full.new_zeros(w.shard_rows * self.world, *full.shape[1:])
        padded[: min(full.shape[0], w.rows)] = full[: w.rows]
        return padded[self.rank * w.shard_rows : (self.rank + 1) * w.shard_rows].clone()

    def full_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """The model's state dict with each shard replaced by the full weight under every original name (collective)."""
        for w in self.weights:
            shard = state.pop(w.shard_name)
            full = self._gather_rows(shard, w.rows)
            for name in w.names:
                state[name] = full
        return state

    def shard_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """A full (plain Lightning) state dict made loadable into the sharded model: this rank's rows."""
        state = dict(state)
        for w in self.weights:
            present = [name for name in w.names if name in state]
            if not present:
                continue
            full = state[present[0]]
            for name in present:
                del state[name]
            state[w.shard_name] = self._my_rows(full, w).to(w.shard.device)
        return state

    def _optimizer_slots(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, ShardedWeight]]:
        """(index in the optimizer's state dict, sharded weight) for every shard the optimizer holds."""
        index = 0
        by_id = {id(w.shard): w for w in self.weights}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in by_id:
                    yield index, by_id[id(param)]
                index += 1

    def _map_row_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                       rows_of: Callable[[ShardedWeight], int],
                       transform: Callable[[Tensor, ShardedWeight], Tensor]) -> dict[str, Any]:
        """``state`` with ``transform`` applied to each shard's per-row tensors (first dimension ``rows_of(w)``).

        New dicts throughout: ``optimizer.state_dict()["state"][i]`` *is* ``optimizer.state[param]``.
        """
        state = {**state, "state": dict(state["state"])}
        for index, w in self._optimizer_slots(optimizer):
            if index not in state["state"]:
                continue
            slot = dict(state["state"][index])
            for key, value in slot.items():
                if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == rows_of(w):
                    slot[key] = transform(value, w)
            state["state"][index] = slot
        return state

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """Optimizer state with each shard's row-shaped tensors gathered to full size (collective)."""
        return self._map_row_state(optimizer, state, lambda w: w.shard_rows, lambda v, w: self._gather_rows(v, w.rows))

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """Full-size optimizer state (from any world size, or plain Lightning) cut to this rank's rows."""
        return self._map_row_state(optimizer, state, lambda w: w.rows, self._my_rows)

    # ------------------------------------------------------------------------------------------------ teardown

    def unshard(self) -> None:
        """Put full ``nn.Parameter`` weights back (collective), so the model is usable after ``fit``."""
        self.release()  # waits for a gather still in flight (prefetch: after_optimizer issues one after the last step)
        for w in self.weights:
            full = nn.Parameter(self._gather_rows(w.shard.detach(), w.rows).clone(), requires_grad=w.shard.requires_grad)
            home, attr = w.owners[0]
            delattr(home, f"{attr}_shard")
            for owner, owner_attr in w.owners:
                if owner_attr in owner.__dict__:
                    del owner.__dict__[owner_attr]
                owner.register_parameter(owner_attr, full)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.weights = []
