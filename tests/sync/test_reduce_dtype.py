"""``sync.reduce_dtype: bf16`` in the hook synchroniser: the gradients stay views of an fp32 bucket, and each round
casts a bucket with one kernel each way (not one per parameter); the average is the bf16-rounded mean of the ranks'
gradients (2 real Gloo ranks, each its own data), and the reduce dtype can be switched between rounds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from _dist import run_ranks
from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer

LAYERS = 12  # 24 parameters


class CastCount(TorchDispatchMode):
    """Counts the dtype-changing copies dispatched: a ``_foreach_copy_`` counts each mixed-dtype pair (torch copies
    those one tensor, one kernel, at a time), ``copy_`` and ``_to_copy`` one each when the dtype changes."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_foreach_copy_":
            self.casts += sum(d.dtype != s.dtype for d, s in zip(args[0], args[1]))
        elif name == "copy_":
            self.casts += int(args[0].dtype != args[1].dtype)
        elif name == "_to_copy":
            self.casts += int(kwargs.get("dtype", args[0].dtype) != args[0].dtype)
        return func(*args, **kwargs)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(LAYERS)])


def test_a_bf16_round_casts_once_per_bucket_each_way_not_once_per_parameter(one_rank_gloo: None) -> None:
    model = _model()
    for buckets_mib in (64.0, 0.0005):  # one bucket; several (a few parameters each)
        sync = GradientSynchronizer(model.named_parameters(), reduce_dtype=torch.bfloat16,
                                    capacity=BucketCapacity.from_mib(buckets_mib, buckets_mib))
        sync.attach()
        counts = []
        for _ in range(3):
            with CastCount() as count:
                model(torch.randn(3, 4)).sum().backward()
                sync.finish_if_pending()
            counts.append(count.casts)
            model.zero_grad()
        buckets = len(sync.buffers)
        assert (buckets == 1) == (buckets_mib == 64.0) and buckets < 2 * LAYERS
        assert counts[1:] == [2 * buckets, 2 * buckets], counts  # seal: fp32 -> bf16; unpack: bf16 -> fp32
        for buffer in sync.buffers:  # the gradients are the fp32 bucket's views; the bf16 buffer is what travels
            assert buffer.flat.dtype == torch.float32 and buffer.wire is not None
            assert buffer.wire.dtype == torch.bfloat16 and buffer.wire.numel() == buffer.flat.numel()
        for p in model.parameters():
            assert p.grad is None  # (zero_grad)
        sync.detach()


def _bf16_mean(grads: list[torch.Tensor], world: int) -> torch.Tensor:
    """What the bf16 path averages: each rank's gradient cast to bf16, divided by the world (Gloo has no AVG), summed
    in bf16, cast back."""
    total = torch.zeros_like(grads[0], dtype=torch.bfloat16)
    for g in grads:
        total += g.to(torch.bfloat16).div_(world)
    return total.float()


def _on_ranks(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    sync = GradientSynchronizer(model.named_parameters(), reduce_dtype=torch.bfloat16,
                                capacity=BucketCapacity.from_mib(0.0005, 0.0005))
    sync.attach()
    seen: dict[str, Any] = {"local": [], "averaged": [], "views": []}
    for step, dtype in enumerate((torch.bfloat16, torch.bfloat16, None, torch.bfloat16)):
        sync.use_reduce_dtype(dtype)  # between rounds
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data
        x = torch.randn(5, 4, generator=g) * (1 + rank)
        loss = model(x).square().sum()
        local = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        sync.finish_if_pending()
        seen["local"].append([t.clone() for t in local])
        seen["averaged"].append([p.grad.clone() for p in model.parameters()])
        flats = [b.flat for b in sync.buffers]
        seen["views"].append(all(any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                                     for f in flats) for p in model.parameters()))
        model.zero_grad()
    dist.barrier()
    return seen


@pytest.mark.multiprocess
def test_bf16_averages_are_the_bf16_rounded_mean_and_the_dtype_switches_between_rounds() -> None:
    ranks = run_ranks(_on_ranks, world_size=2, timeout=120)
    for step, bf16 in enumerate((True, True, False, True)):
        for i in range(2 * LAYERS):
            grads = [r["local"][step][i] for r in ranks]
            expected = _bf16_mean(grads, 2) if bf16 else (grads[0] + grads[1]) / 2
            for r in ranks:
                if bf16:
                    torch.testing.assert_close(r["averaged"][step][i], expected, atol=0, rtol=0)
                else:  # fp32: exact up to the order of the sum
                    torch.testing.assert_close(r["averaged"][step][i], expected)
        for r in ranks:  # every gradient is a view of its fp32 bucket, in both dtypes (the first round's: of a
            assert r["views"][step] == (step > 0)  # one-off bucket, before the plan is made)
    assert any(not torch.equal(ranks[0]["averaged"][1][i], (ranks[0]["local"][1][i] + ranks[1]["local"][1][i]) / 2)
               for i in range(2 * LAYERS))  # the rounding is real
