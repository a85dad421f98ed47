"""An emulated link on one GPU: a kernel that holds SMs for as long as a collective would take.

:func:`hold_sms` launches ``sms`` blocks on the given stream, each asking for all the shared memory a block may have
(so that a GEMM's block cannot fit beside it, as beside NCCL's CTAs), each spinning on the GPU's timer for the ring's
latency and then moving its bytes at the busy or the idle rate, read from a device counter (:class:`IdleFlag`). The
kernel is compiled once per process with CuPy's ``RawKernel`` (CuPy is needed only for link emulation, a measuring
tool); :func:`ring_traffic` is what it is told to move. The model: docs/simulated-link.md.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from lightning_static_dist.config.check import ConfigError

_SOURCE = r"""
extern "C" __global__ void hold_sms(unsigned long long latency_ns, double nbytes, double busy_bytes_per_ns,
                                    double idle_bytes_per_ns, unsigned long long idle_flag) {
    extern __shared__ unsigned char reserved[];
    if (threadIdx.x != 0) return;           // one thread spins; the block's shared memory stays held
    const volatile int* waiting = (const volatile int*)idle_flag;   // (volatile: another stream writes it)
    unsigned long long start, now, last;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    reserved[0] = 1;
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < latency_ns);
    double moved = 0.0;
    last = now;
    while (moved < nbytes) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        bool idle = waiting != 0 && *waiting > 0;
        moved += (double)(now - last) * (idle ? idle_bytes_per_ns : busy_bytes_per_ns);
        last = now;
    }
}
"""

#: the collectives a link emulates, with the factor of (N-1)/N * bytes / B and of latency steps per (N-1)
RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def ring_traffic(kind: str, nbytes: int, world: int, latency_us: float) -> tuple[float, float]:
    """(bytes an N-rank ring moves per rank, as bus bandwidth counts them; its latency in seconds): all-reduce
    2(N-1)/N * bytes and 2(N-1) latencies; all-gather and reduce-scatter half of both; a broadcast (a pipelined
    chain) the bytes and one latency. At B GB/s the ring takes ``moved / B`` more than its latency.

    Example::

        >>> ring_traffic("all_reduce", 1000, 2, 5.0)
        (1000.0, 1e-05)
    """
    if world < 2:
        return 0.0, 0.0
    if kind == "broadcast":
        return float(nbytes), latency_us * 1e-6
    steps = RING_STEPS.get(kind, 1)
    return steps * (world - 1) / world * nbytes, steps * (world - 1) * latency_us * 1e-6


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int) -> tuple[Any, int]:
    try:
        import cupy
    except ImportError as err:
        raise ConfigError(f"strategy.simulate.link: emulating a link needs CuPy (pip install cupy-cuda12x): {err}"
                          " ; allowed without it: strategy.simulate.link=null (free links)") from None
    with cupy.cuda.Device(device_index):
        kernel = cupy.RawKernel(_SOURCE, "hold_sms")
        shared = int(cupy.cuda.Device(device_index).attributes["MaxSharedMemoryPerBlockOptin"])
        kernel.max_dynamic_shared_size_bytes = shared
    return kernel, shared


def check_available(device: torch.device) -> None:
    """Raise the one-line :class:`ConfigError` now, not at the first collective, where a link cannot be emulated."""
    if device.type != "cuda":
        raise ConfigError(f"strategy.simulate.link: an emulated link holds GPU SMs; this run's device is {device.type}"
                          "; allowed on CPU: strategy.simulate.link=null (free links)")
    _kernel(device.index if device.index is not None else torch.cuda.current_device())


class IdleFlag:
    """The device counter the link's kernel reads: how many collectives the compute stream is blocked on now.

    The compute stream raises it just before it waits for a collective and lowers it once the wait is over
    (``SimulatedWork.wait()``); a consumer that waits through the work's future (DDP's reducer) cannot be seen
    waiting, so the simulated group raises it on the compute stream when that backward ends and lowers it on the
    link's stream after the backward's last collective (``SimulatedGroup._idle_after_backward``).
    """

    def __init__(self, device: torch.device) -> None:
        self.counter = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def address(self) -> int:
        return self.counter.data_ptr()

    def raise_(self) -> None:
        self.counter.add_(1)  # (on the current stream: takes effect when that stream gets here)

    def lower(self) -> None:
        self.counter.sub_(1)


def hold_sms(stream: torch.cuda.Stream, sms: int, latency_s: float, nbytes: float, rates_gbps: tuple[float, float],
             idle: Optional[IdleFlag]) -> None:
    """Queue on ``stream`` a kernel of ``sms`` one-per-SM blocks that each spin for ``latency_s``, then for as long
    as ``nbytes`` take at ``rates_gbps`` (busy, idle), the rate chosen step by step by ``idle`` (busy without one)."""
    import cupy
    import numpy

    index = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
    kernel, shared = _kernel(index)
    # (never more blocks than SMs: a second wave would double the time the link was told to take)
    blocks = max(1, min(sms, torch.cuda.get_device_properties(index).multi_processor_count))
    busy, idle_rate = rates_gbps
    args = (numpy.uint64(max(0, int(latency_s * 1e9))), numpy.float64(nbytes), numpy.float64(busy),
            numpy.float64(idle_rate), numpy.uint64(idle.address if idle is not None else 0))
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        kernel((blocks,), (32,), args, shared_mem=shared)
