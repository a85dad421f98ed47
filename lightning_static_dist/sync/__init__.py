"""Gradient synchronisation: bucket planning (pure), the pluggable collective, and the hook-driven synchroniser."""

from lightning_static_dist.sync.plan import BucketPlan, GradBucket, ParamSpec, plan_buckets
from lightning_static_dist.sync.reducer import BucketReducer, MeanAllReduce, PendingReduction
from lightning_static_dist.sync.synchronizer import GradientSynchronizer, SyncStats

__all__ = [
    "BucketPlan",
    "BucketReducer",
    "GradBucket",
    "GradientSynchronizer",
    "MeanAllReduce",
    "ParamSpec",
    "PendingReduction",
    "SyncStats",
    "plan_buckets",
]
