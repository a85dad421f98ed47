"""The simulated world: a ``torch.distributed`` backend in which this process is rank 0 of N identical ranks.

Registered with ``torch.distributed.Backend.register_backend`` under :data:`BACKEND`, so that the package, Lightning
and torch reach it through their ordinary calls (``dist.all_reduce``, ``new_group``, ``DeviceMesh``,
``broadcast_object_list`` ...); nothing of torch is patched. Every collective returns what N ranks holding this
rank's values would produce:

=====================================  ==========================================================================
all-reduce, reduce                     SUM: N x; PRODUCT: x ** N; AVG, MAX, MIN and the bitwise ops: x
all-gather (list or into a tensor)     N copies of the input — except where the input *is* this rank's chunk of
                                       the output (an in-place gather of shards): identical ranks' chunks are this
                                       buffer's own, so the output keeps them
reduce-scatter (list or tensor)        rank 0's chunk reduced over N identical ranks (SUM: N x chunk, AVG: chunk)
broadcast, barrier                     nothing changes
gather, scatter                        copies of this rank's input; this rank's element of the root's list
=====================================  ==========================================================================

Averages are native (``ReduceOp.AVG``), as on NCCL (why: docs/simulated-link.md, "Native averages").

Free links (``link=None``): a collective costs nothing but the arithmetic above, on the caller's stream. An emulated
link runs it on the group's own stream after holding the link's SMs for the ring time; ``wait()`` and the work's
future both make the caller's stream wait, so neither our synchroniser nor DDP's reducer can hide it by accident
(docs/simulated-link.md: The model).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_static_dist.simulate.config import LinkConfig
from lightning_static_dist.simulate.link import IdleFlag, hold_sms, ring_traffic

BACKEND = "static_dist_simulated"
"""The backend's name in ``torch.distributed`` (``dist.get_backend()`` reports it in a simulated run)."""

_SAME = ("AVG", "MAX", "MIN", "BAND", "BOR", "BXOR")


class _World:
    """What every simulated group of this process shares: the link, how many SMs a collective holds, and the
    counters of the link's two regimes (one per device)."""

    def __init__(self) -> None:
        self.link: Optional[LinkConfig] = None
        self.sms: Optional[int] = None
        self.idle: dict[int, IdleFlag] = {}

    def idle_flag(self, device: torch.device) -> Optional[IdleFlag]:
        """The device's idle counter, where the link has two regimes (else ``None``: one pace, nothing to mark)."""
        if self.link is None or not self.link.two_regimes:
            return None
        flag = self.idle.get(device.index)
        if flag is None:
            flag = self.idle[device.index] = IdleFlag(device)
        return flag


WORLD = _World()


def set_link(link: Optional[LinkConfig], sms: Optional[int] = None) -> None:
    """The link every simulated group emulates from now on (``None``: free); ``sms`` replaces ``link.sms``
    (``strategy.sync.comm_sms``). Between steps: collectives in flight keep the link they started with."""
    WORLD.link, WORLD.sms = link, sms


def _reduce_(tensor: Tensor, op: Any, world: int) -> None:
    """``tensor`` becomes what ``op`` over ``world`` ranks holding it gives (in place)."""
    R = dist.ReduceOp
    if op == R.SUM:
        if tensor.dtype != torch.bool:  # (a logical or of identical flags: the flags)
            tensor.mul_(world)
    elif op == R.PRODUCT:
        if tensor.dtype != torch.bool:
            tensor.pow_(world)
    elif not any(op == getattr(R, name) for name in _SAME):
        raise NotImplementedError(f"static_dist: the simulated world has no reduction {op!r}")


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _op_of(opts: Any) -> Any:
    return getattr(opts, "reduceOp", dist.ReduceOp.SUM)


class SimulatedWork(dist._Work):
    """A simulated collective's work handle: done at once (free links), or when its kernel on the group's stream is
    (an emulated link). ``get_duration()`` gives the emulated time in ms, as NCCL's timing does."""

    def __init__(self, result: list[Tensor], done: Optional[torch.cuda.Event] = None,
                 started: Optional[torch.cuda.Event] = None, stream: Optional[torch.cuda.Stream] = None,
                 idle: Optional[IdleFlag] = None, on_future: Optional[Any] = None) -> None:
        super().__init__()
        self._result = result
        self._done = done
        self._started = started
        self._stream = stream
        self._idle = idle
        self._on_future = on_future
        self._future: Optional[Future] = None
        if stream is not None:  # made now, on the link's stream (the caller's _run): it completes where the kernel does
            self._future = Future(devices=[stream.device])
            self._future.set_result(result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._done is not None and self._stream is not None:
            if self._idle is not None:
                self._idle.raise_()  # (the compute stream is blocked from here: the link's idle pace)
            torch.cuda.current_stream(self._stream.device).wait_event(self._done)
            if self._idle is not None:
                self._idle.lower()
        return True

    def is_completed(self) -> bool:
        return self._done is None or self._done.query()

    def is_success(self) -> bool:
        return True

    def result(self) -> list[Tensor]:
        return self._result

    def get_future(self) -> Future:
        """The future a consumer waits on (DDP's reducer): taken during a backward, the link counts the compute stream
        as blocked from that backward's end until the link drains (:class:`~.link.IdleFlag`)."""
        if self._on_future is not None:
            self._on_future()
        return self.timing_future()

    def timing_future(self) -> Future:
        """The same future, for a reader that only notes when it completes (the overlap recorder): no waiter."""
        if self._future is None:  # (free links: done at once)
            self._future = Future()
            self._future.set_result(self._result)
        return self._future

    def get_duration(self) -> float:
        """The emulated collective's time on its stream, in ms (once it has completed)."""
        if self._done is None or self._started is None:
            return 0.0
        return self._started.elapsed_time(self._done)


class SimulatedGroup(dist.ProcessGroup):
    """One process as ``rank`` of ``size`` identical ranks (this module's docstring lists what each collective
    returns). Made by ``torch.distributed`` through :func:`register`; not built by hand.

    Example::

        register()
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=4)
        t = torch.ones(2); dist.all_reduce(t)      # tensor([4., 4.])
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._marked_backward = -1
        """The backward (autograd graph task) whose end already raises the idle counter for futures' waiters."""
        self._name = ""
        self._desc = ""

    # --------------------------------------------------------------------------------------------- identity

    def getBackendName(self) -> str:  # noqa: N802 (torch's names)
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    @property
    def sms(self) -> Optional[int]:
        """The SMs an emulated collective holds (``strategy.sync.comm_sms``, else the link's), ``None`` when free."""
        if WORLD.link is None:
            return None
        return WORLD.sms if WORLD.sms is not None else WORLD.link.sms

    # --------------------------------------------------------------------------------------- the collectives

    def _run(self, kind: str, tensors: Sequence[Tensor], nbytes: int, compute: Any, result: list[Tensor]) -> SimulatedWork:
        """Do ``compute()`` now (free links), or on the link's stream after holding SMs for the ring time."""
        link = WORLD.link
        device = next((t.device for t in tensors if t.is_cuda), None)
        if link is None or device is None or self._size < 2:
            with torch.no_grad():  # (a collective is not an autograd op: NCCL's in-place results carry no graph)
                compute()
            return SimulatedWork(result)
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sms = self.sms or 1
        moved, latency_s = ring_traffic(kind, nbytes, self._size, link.latency_us)
        idle = WORLD.idle_flag(device)
        with torch.cuda.stream(stream):
            started.record(stream)
            hold_sms(stream, sms, latency_s, moved, link.rates(sms), idle)
            with torch.no_grad():
                compute()
            done.record(stream)
            on_future = (lambda: self._idle_after_backward(idle, device)) if idle is not None else None
            work = SimulatedWork(result, done, started, stream, idle, on_future)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(stream)  # the caching allocator must not hand the memory out before the link is done
        return work

    def _idle_after_backward(self, idle: IdleFlag, device: torch.device) -> None:
        """A future taken during a backward: its waiter (DDP's reducer) blocks the compute stream once the backward
        ends. Raise the idle counter there and lower it on the link's stream after everything issued by then."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._marked_backward:
            return
        self._marked_backward = task
        stream = self._streams[device.index]

        def at_backward_end() -> None:
            self._marked_backward = -1
            idle.raise_()  # (queued first, so it runs before DDP's own end-of-backward waits are queued)
            # the lower after the raise, and after everything issued by then (else a link done before backward ends
            # would take the counter below zero until the raise, for any other collective in flight on the device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                idle.lower()

        torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> SimulatedWork:
        op = _op_of(opts)
        return self._run("all_reduce", tensors, _nbytes(tensors), lambda: [_reduce_(t, op, self._size) for t in tensors],
                         tensors)

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> SimulatedWork:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[Tensor], opts: Any = None) -> SimulatedWork:
        if getattr(opts, "rootRank", 0) != self._rank:  # only the destination's buffer changes
            return self._run("all_reduce", tensors, _nbytes(tensors), lambda: None, tensors)
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> SimulatedWork:
        return self._run("broadcast", tensors, _nbytes(tensors), lambda: None, tensors)

    def barrier(self, opts: Any = None) -> SimulatedWork:
        return SimulatedWork([])

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> SimulatedWork:
        def compute() -> None:
            for out, inp in zip(outputs, inputs):
                for o in out:
                    if o.data_ptr() != inp.data_ptr():
                        o.copy_(inp)

        flat = [o for out in outputs for o in out]
        return self._run("all_gather", flat + list(inputs), _nbytes(flat), compute, flat)

    def _allgather_base(self, output: Tensor, inp: Tensor, opts: Any = None) -> SimulatedWork:
        chunks = output.view(self._size, -1)
        mine = chunks[self._rank]
        in_place = inp.data_ptr() == mine.data_ptr() and inp.numel() == mine.numel()

        def compute() -> None:
            if not in_place:  # (in place: identical ranks' chunks are this buffer's own, already there)
                chunks.copy_(inp.reshape(1, -1).expand_as(chunks))

        return self._run("all_gather", [output, inp], _nbytes([output]), compute, [output])

    all_gather_single = _allgather_base  # (torch >= 2.13's name)

    def allgather_into_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> SimulatedWork:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else SimulatedWork([])

    def _reduce_scatter_base(self, output: Tensor, inp: Tensor, opts: Any = None) -> SimulatedWork:
        op = _op_of(opts)

        def compute() -> None:
            output.copy_(inp.view(self._size, -1)[self._rank].view_as(output))
            _reduce_(output, op, self._size)

        return self._run("reduce_scatter", [output, inp], _nbytes([inp]), compute, [output])

    reduce_scatter_single = _reduce_scatter_base  # (torch >= 2.13's name)

    def reduce_scatter_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> SimulatedWork:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else SimulatedWork([])

    def reduce_scatter(self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: Any = None) -> SimulatedWork:
        op = _op_of(opts)

        def compute() -> None:
            for out, parts in zip(outputs, inputs):
                out.copy_(parts[self._rank])
                _reduce_(out, op, self._size)

        tensors = outputs + [p for parts in inputs for p in parts]
        return self._run("reduce_scatter", tensors, _nbytes([p for parts in inputs for p in parts]), compute, outputs)

    def gather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: Any = None) -> SimulatedWork:
        for out, inp in zip(outputs, inputs):
            for o in out:
                o.copy_(inp)
        return SimulatedWork([o for out in outputs for o in out])

    def scatter(self, outputs: list[Tensor], inputs: list[list[Tensor]], opts: Any = None) -> SimulatedWork:
        for out, parts in zip(outputs, inputs):
            if parts:
                out.copy_(parts[self._rank])
        return SimulatedWork(outputs)


# dynamo must not trace into the Python collectives (DDP's buffer broadcast runs inside a compiled forward): each is
# a call it leaves to Python, as a real backend's collective is a call into C++
for _name in ("allreduce", "allreduce_coalesced", "reduce", "broadcast", "barrier", "allgather", "_allgather_base",
              "all_gather_single", "allgather_into_tensor_coalesced", "_reduce_scatter_base", "reduce_scatter_single",
              "reduce_scatter_tensor_coalesced", "reduce_scatter", "gather", "scatter"):
    setattr(SimulatedGroup, _name, torch._dynamo.disable(getattr(SimulatedGroup, _name)))


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SimulatedGroup:
    return SimulatedGroup(store, rank, size, timeout)


def register() -> None:
    """Make :data:`BACKEND` known to ``torch.distributed`` (once per process)."""
    if BACKEND.upper() not in dist.Backend.backend_list and BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def is_simulated(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group`` (default: the world) belongs to a simulated world."""
    return dist.is_initialized() and dist.get_backend(group) == BACKEND


def init_simulated_world(world_size: int, timeout: timedelta) -> None:
    """Start the default process group as rank 0 of ``world_size`` simulated ranks (an in-memory store: nothing
    listens for the other ranks, which never come)."""
    register()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=world_size, timeout=timeout)
