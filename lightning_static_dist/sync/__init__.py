"""Gradient synchronisation: bucket planning (pure), the pluggable collective, the hook-driven synchroniser, and the
contracts the synchronisers share (:mod:`~lightning_static_dist.sync.contracts`)."""

from lightning_static_dist.sync.contracts import BucketLayout, GradientSync, RoundSync, SyncObserver, SyncStats
from lightning_static_dist.sync.plan import BucketCapacity, BucketPlan, GradBucket, ParamSpec, plan_buckets
from lightning_static_dist.sync.reducer import BucketReducer, MeanAllReduce, PendingReduction
from lightning_static_dist.sync.synchronizer import GradientSynchronizer

__all__ = [
    "BucketCapacity",
    "BucketLayout",
    "BucketPlan",
    "BucketReducer",
    "GradBucket",
    "GradientSync",
    "GradientSynchronizer",
    "MeanAllReduce",
    "ParamSpec",
    "PendingReduction",
    "RoundSync",
    "SyncObserver",
    "SyncStats",
    "plan_buckets",
]
