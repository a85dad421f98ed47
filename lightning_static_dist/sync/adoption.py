"""Which parameters the bucket plan holds: decided with every rank, and rebuilt alike on every rank.

Parameters that no rank used in the first round are left out of the plan. While it leaves out trainable parameters,
each round all-reduces their usage; when one of them gets a gradient on any rank, the plan is rebuilt identically on
every rank, following rank 0's observation of the gradient-ready order. A parameter no rank used keeps
``grad = None``, so an optimizer with weight decay or momentum treats it as it would without data parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn import Parameter

from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.sync.plan import BucketCapacity, BucketPlan, param_specs, plan_buckets
from lightning_static_dist.sync.bucket_reducer import all_reduce_sum


class PlanMembership:
    """The synchronised parameters (tied ones once) and the bucket plan that holds the ones in use.

    Example::

        members = PlanMembership(model.named_parameters(), BucketCapacity.from_mib(1, 25))
        newcomers, nbytes = members.reduce_usage(group)          # after a round: unplanned parameters any rank used
        members.rebuild(newcomers, observed_order=[3, 1], group=group)
    """

    def __init__(self, named_parameters: Iterable[tuple[str, Parameter]], capacity: BucketCapacity) -> None:
        seen: set[int] = set()
        self.names: list[str] = []
        self.params: list[Parameter] = []
        for name, param in named_parameters:
            if id(param) not in seen:
                seen.add(id(param))
                self.names.append(name)
                self.params.append(param)
        self.capacity = capacity
        self.plan = BucketPlan(buckets=(), location={})
        self.planned = False
        """Whether a plan has been made (by the first synchronised round, or fixed up front)."""
        self.ready_order: list[int] = []
        """Gradient-ready order the plan follows: rank 0's observation of the first synchronised backward."""
        self.ready_groups: Optional[Mapping[int, int]] = None
        """``id(parameter)`` -> the compiled graph piece that makes its gradient ready: each piece gets own buckets."""
        self.usage_counts: dict[str, int] = {}
        """Ranks that produced a gradient, per parameter outside the plan, from the latest usage check."""

    def fix(self, plan: BucketPlan) -> None:
        self.plan = plan
        self.planned = True

    def unplanned(self) -> list[int]:
        """Trainable parameters the plan leaves out."""
        return [i for i, p in enumerate(self.params) if i not in self.plan.location and p.requires_grad]

    def describe(self) -> str:
        """The plan, and the trainable parameters it leaves out (unused so far)."""
        skipped = [self.names[i] for i in self.unplanned()]
        return self.plan.describe() + (f"; unused so far: {', '.join(skipped)}" if skipped else "")

    def reduce_usage(self, group: Optional[dist.ProcessGroup]) -> tuple[list[int], int]:
        """The unplanned parameters that got a gradient on any rank this round (the same list on every rank) and the
        bytes the all-reduce sent; no collective (0 bytes) while the plan leaves out no trainable parameter."""
        unplanned = self.unplanned()
        if not unplanned:
            return [], 0
        device = self.params[unplanned[0]].device
        used = torch.tensor([self.params[i].grad is not None for i in unplanned], dtype=torch.float32, device=device)
        with waiting_in("the all-reduce of parameter usage"):
            all_reduce_sum(used, group)
        counts = used.tolist()
        self.usage_counts = {self.names[i]: int(count) for i, count in zip(unplanned, counts)}
        return [i for i, count in zip(unplanned, counts) if count > 0], used.numel() * used.element_size()

    def one_off_plan(self, newcomers: list[int]) -> BucketPlan:
        """Buckets that reduce the newcomers' gradients in the round that first finds them used."""
        return plan_buckets(param_specs(self.params, newcomers), self.capacity.bytes, self.capacity.bytes)

    def rebuild(self, newcomers: list[int], observed_order: list[int], group: Optional[dist.ProcessGroup]) -> bool:
        """Make the plan of the planned parameters and ``newcomers`` that every rank agrees on (a collective); whether
        it replaced an earlier plan."""
        members = sorted(set(self.plan.location) | set(newcomers))
        rebuilt, self.planned = self.planned, True
        pieces = self.ready_groups or {}
        mine = (observed_order, {i: pieces[id(p)] for i, p in enumerate(self.params) if id(p) in pieces})
        observed, groups = _from_rank_zero(mine, group)
        self.ready_order = self.ready_order + [i for i in observed if i not in self.ready_order]
        self.plan = plan_buckets(param_specs(self.params, members), self.capacity.first_bytes, self.capacity.bytes,
                                 self.ready_order, groups=groups)
        return rebuilt


def _from_rank_zero(values: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """Rank 0's ``values`` on every rank (ranks may see hooks fire in different orders; plans must agree)."""
    if dist.get_world_size(group) == 1:
        return values
    holder = [values]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return holder[0]
