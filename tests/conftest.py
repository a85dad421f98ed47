"""Each test starts from the environment pytest started with, and with no process group in this process.

Lightning writes launch variables (LOCAL_RANK, MASTER_PORT, WORLD_SIZE, PL_GLOBAL_SEED ...) into ``os.environ``
while it sets up a job; left there, they change how the next test's Trainer, or a job it starts, launches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from _dist import LAUNCH_VARIABLES


@pytest.fixture(autouse=True)
def _environment_as_pytest_found_it() -> Iterator[None]:
    # what a launch writes: a module-scoped fixture's job (which runs before this fixture saves the environment)
    # would otherwise hand its MASTER_PORT to every later test of the session
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    # a one-device Trainer fit (ours, or Lightning's `ddp`) keeps its one-rank group after `fit`, as DDP does; left
    # there, it would be the next test's default group, whichever test runs next
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank_gloo() -> Iterator[None]:
    """A one-rank Gloo process group for the test (in this process; no store to share, no port)."""
    assert not dist.is_initialized(), "a test before this one left a process group initialised"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
