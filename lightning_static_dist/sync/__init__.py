"""Gradient synchronisation: bucket planning (pure), the pluggable collective, the hook-driven synchroniser, and the
contracts the synchronisers share (:mod:`~lightning_static_dist.sync.contracts`)."""

from lightning_static_dist.sync.contracts import BucketLayout, Synchronizer, RoundSynchronizer, SyncObserver, SyncStats
from lightning_static_dist.sync.plan import BucketCapacity, BucketPlan, GradBucket, ParamSpec, plan_buckets
from lightning_static_dist.sync.bucket_reducer import BucketReducer, MeanAllReduce, PendingReduction
from lightning_static_dist.sync.synchronizer import GradientSynchronizer

__all__ = [
    "BucketCapacity",
    "BucketLayout",
    "BucketPlan",
    "BucketReducer",
    "GradBucket",
    "Synchronizer",
    "GradientSynchronizer",
    "MeanAllReduce",
    "ParamSpec",
    "PendingReduction",
    "RoundSynchronizer",
    "SyncObserver",
    "SyncStats",
    "plan_buckets",
]
