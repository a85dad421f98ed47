"""Lightning ``DDPStrategy``'s keyword arguments, understood by ``StaticDistStrategy`` with DDP's meaning.

Swapping ``DDPStrategy(...)`` for ``StaticDistStrategy(...)`` should not fail on the constructor. Each DDP argument
below either stands for a ``strategy`` key (:data:`STANDS_FOR`: ``timeout`` -> ``timeout_s``, ``bucket_cap_mb`` ->
``sync.bucket_mb``, ``broadcast_buffers`` -> ``sync.broadcast_buffers``), is accepted with one line saying why it has
nothing to do here
(``find_unused_parameters``: unused parameters are found at the first step anyway; ``static_graph``: the bucket plan
is static already; ``gradient_as_bucket_view``: gradients are views of their bucket already), or is refused with one
line naming what to use instead (a DDP communication hook or post-local-SGD averaging: no DDP reducer runs here).
Any other ``DistributedDataParallel`` argument (``init_sync``, ``mixed_precision`` ...) is not a keyword of
``StaticDistStrategy``: Python's ``TypeError`` names it.

Example::

    sync, timeout_s, notes = translate(DDPArguments(timeout=timedelta(seconds=30), bucket_cap_mb=10), None, None)
    # sync == {"bucket_mb": 10}, timeout_s == 30.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch.distributed

from lightning_static_dist.config import ConfigError

#: the strategy key each DDP argument stands for (``section.field`` inside a section)
STANDS_FOR = {"timeout": "timeout_s", "bucket_cap_mb": "sync.bucket_mb", "broadcast_buffers": "sync.broadcast_buffers"}

#: what an accepted DDP switch means here (said once, at construction)
_NOTHING_TO_DO = {
    "find_unused_parameters": "parameters without a gradient are found collectively at the first step and left out"
                              " of the bucket plan; a change of usage later rebuilds the plan",
    "static_graph": "the bucket plan is static already (built from the first step's gradient order)",
    "gradient_as_bucket_view": "gradients are views of their bucket already",
}


@dataclass
class DDPArguments:
    """The ``DDPStrategy`` / ``DistributedDataParallel`` arguments a user may carry over (``None``: not given)."""

    timeout: Optional[timedelta] = None
    find_unused_parameters: Optional[bool] = None
    static_graph: Optional[bool] = None
    gradient_as_bucket_view: Optional[bool] = None
    bucket_cap_mb: Optional[float] = None
    broadcast_buffers: Optional[bool] = None
    ddp_comm_state: Any = None
    ddp_comm_hook: Any = None
    ddp_comm_wrapper: Any = None
    model_averaging_period: Optional[int] = None


def translate(args: DDPArguments, sync: Any, timeout_s: Optional[float]) -> tuple[Any, Optional[float], list[str]]:
    """``(sync section with DDP's bucket settings merged in, timeout in seconds, one line per argument that has
    nothing to do here)``; a :class:`ConfigError` for an argument with no counterpart, or one given twice."""
    for name, instead in (("ddp_comm_hook", "strategy compression={...} (bf16, powersgd, ...) or sync.reduce_dtype"),
                          ("ddp_comm_wrapper", "strategy compression={...}"),
                          ("ddp_comm_state", "strategy compression={...}"),
                          ("model_averaging_period", "sync.mode hooks with plain averaging")):
        if getattr(args, name) is not None:
            raise ConfigError(f"{name}={getattr(args, name)!r}: DDP's reducer does not run under static_dist;"
                              f" allowed: None (use {instead})")
    if args.bucket_cap_mb is None and args.broadcast_buffers is None:
        merged: Any = sync  # nothing to merge: the section is validated as given
    elif dataclasses.is_dataclass(sync):  # a SyncConfig: its fields that differ from the defaults were given
        defaults = type(sync)()
        merged = {f.name: getattr(sync, f.name) for f in dataclasses.fields(sync)
                  if getattr(sync, f.name) != getattr(defaults, f.name)}
    elif isinstance(sync, Mapping) or sync is None:  # any mapping: a dict, OmegaConf's DictConfig, MappingProxyType
        merged = dict(sync) if sync is not None else {}
    else:
        raise ConfigError(f"strategy.sync={sync!r}: expected a mapping or a SyncConfig")
    for ddp_name in ("bucket_cap_mb", "broadcast_buffers"):
        value, key = getattr(args, ddp_name), STANDS_FOR[ddp_name].removeprefix("sync.")
        if value is None:
            continue
        if key in merged:
            raise ConfigError(f"{ddp_name}={value!r}: given twice (also as strategy.sync.{key}); allowed: one of them")
        merged[key] = value
    if args.timeout is not None:
        if timeout_s is not None:
            raise ConfigError(f"timeout={args.timeout!r}: given twice (also as timeout_s={timeout_s!r}); allowed: one"
                              " of them")
        if not isinstance(args.timeout, timedelta):
            raise ConfigError(f"timeout={args.timeout!r}: expected a datetime.timedelta (or timeout_s in seconds)")
        timeout_s = args.timeout.total_seconds()
    notes = [f"static_dist: {name}={getattr(args, name)!r} has nothing to do here: {why}"
             for name, why in _NOTHING_TO_DO.items() if getattr(args, name) is not None]
    return merged, timeout_s, notes


def yield_to(sections: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``sections`` (a validated ``strategy`` block as keyword arguments) without the keys that the DDP arguments in
    ``overrides`` stand for, so that those arguments replace them rather than count as given twice.

    Example::

        yield_to({"sync": SyncConfig(bucket_mb=10), "timeout_s": 600.0}, {"bucket_cap_mb": 5})
        # {"sync": {... every SyncConfig field but bucket_mb ...}, "timeout_s": 600.0}
    """
    kept = dict(sections)
    for ddp_name, key in STANDS_FOR.items():
        if overrides.get(ddp_name) is None:
            continue
        section, _, field = key.rpartition(".")
        if not section:
            kept[key] = None  # the constructor's "not given"
            continue
        value = kept.get(section)
        fields = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value or {})
        fields.pop(field, None)
        kept[section] = fields
    return kept


def check_process_group_backend(backend: Optional[str]) -> None:
    """A :class:`ConfigError` unless ``backend`` is ``None`` or names backends registered with ``torch.distributed``:
    one (``"gloo"``) or ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``), as ``init_process_group`` reads it.
    Checked when the process group starts, against the backends registered then, as DDP does: a vendor's backend,
    or a test's, may be registered after the strategy was built."""
    if backend is None or not torch.distributed.is_available():
        return
    registered = [name for name in torch.distributed.Backend.backend_list if name != "undefined"]
    names = [part.split(":", 1)[-1].strip().lower() for part in backend.split(",")] if isinstance(backend, str) else []
    if not names or any(name not in registered for name in names):
        raise ConfigError(f"process_group_backend={backend!r}: allowed: None (NCCL on CUDA, Gloo on CPU), a backend"
                          f" registered with torch.distributed ({', '.join(map(repr, registered))}) or device:backend"
                          " pairs ('cpu:gloo,cuda:nccl')")


def device_backend(backend: str, device_type: str) -> Optional[str]:
    """The backend a process group over ``backend`` (``"nccl"``, ``"cpu:gloo,cuda:nccl"`` ...) uses for tensors on
    ``device_type``, as ``torch.distributed`` reads the string (``None``: none for that device)."""
    mapping = torch.distributed.BackendConfig(torch.distributed.Backend(backend)).get_device_backend_map()
    return mapping.get(device_type)


#: How a strategy may start its processes (``start_method``).
START_METHODS = ("popen", "spawn", "fork", "forkserver")
