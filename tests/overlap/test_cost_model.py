"""The communication cost model against hand-computed numbers (lightning_static_dist/overlap/cost_model.py)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_static_dist.compression import build_compressor
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.overlap.cost_model import (
    Link,
    Sample,
    Wire,
    bucket_wire,
    critical_bandwidth,
    fit_link,
    predict_step,
    ring_terms,
)


def test_ring_collectives_cost_what_the_alpha_beta_model_says() -> None:
    # 4 ranks, 1000 bytes: an all-reduce is a reduce-scatter then an all-gather of quarters
    assert ring_terms("all_reduce", 1000, 4) == (6, 1500.0)
    assert ring_terms("reduce_scatter", 1000, 4) == (3, 750.0)
    assert ring_terms("all_gather", 1000, 4) == (3, 3000.0)  # 1000 bytes per rank: every rank receives 3 of them
    assert ring_terms("all_reduce", 1000, 1) == (0, 0.0)
    link = Link(latency_s=1e-5, bandwidth_Bps=1e9)
    assert link.seconds("all_reduce", 1e9, 2) == pytest.approx(2e-5 + 1.0)
    with pytest.raises(ValueError, match="kind='broadcast': allowed: all_reduce, reduce_scatter, all_gather"):
        ring_terms("broadcast", 1, 2)


def test_the_fit_recovers_latency_and_bandwidth_across_ring_lengths() -> None:
    truth = Link(latency_s=20e-6, bandwidth_Bps=3e9)
    samples = [Sample(kind, n, p, truth.seconds(kind, n, p)) for kind in ("all_reduce", "all_gather")
               for p in (2, 4, 8) for n in (4096, 1 << 20, 64 << 20)]
    link, error = fit_link(samples)
    assert link.latency_s == pytest.approx(20e-6, rel=1e-6) and link.bandwidth_Bps == pytest.approx(3e9, rel=1e-6)
    assert error < 1e-6
    # 10 % noise on every other sample: the fit stays close and says how far off it is
    noisy = [Sample(s.kind, s.nbytes, s.world, s.seconds * (1.1 if i % 2 else 1.0)) for i, s in enumerate(samples)]
    link, error = fit_link(noisy)
    assert 0.9 < link.bandwidth_Bps / 3e9 < 1.1 and 0.04 < error < 0.11
    # bandwidth only (no latency in the data): latency 0, not negative
    link, _ = fit_link([Sample("all_reduce", n, 2, n / 1e9) for n in (1e3, 1e6, 1e9)])
    assert link.latency_s == pytest.approx(0.0, abs=1e-12) and link.bandwidth_Bps == pytest.approx(1e9)


def test_a_bucket_puts_on_the_wire_what_its_compressor_sends() -> None:
    shapes = [torch.Size([256, 512]), torch.Size([512])]  # a matrix the compressors take, a bias they leave exact
    flags = 2  # one usage flag per gradient, always exact
    exact_bias = ("all_reduce", (512 + flags) * 4)
    assert bucket_wire(None, shapes).phases == (("all_reduce", (256 * 512 + 512 + flags) * 4),)
    assert bucket_wire(None, shapes, exact_bytes_per_element=2).phases == (("all_reduce", (256 * 512 + 512 + flags) * 2),)
    bf16 = build_compressor(CompressionConfig(name="bf16"))  # it takes the bias too; the flags still travel in fp32
    assert bucket_wire(bf16, shapes).phases == (("all_reduce", (256 * 512 + 512) * 2), ("all_reduce", flags * 4))
    # PowerSGD rank 2: P (256 x 2) then Q (512 x 2), fp32, two all-reduces
    psgd = build_compressor(CompressionConfig(name="powersgd", rank=2))
    assert bucket_wire(psgd, shapes).phases == (("all_reduce", 256 * 2 * 4), ("all_reduce", 512 * 2 * 4), exact_bias)
    # TopK 1 %: k values and k int32 indices per rank, one all-gather
    topk = build_compressor(CompressionConfig(name="topk", density=0.01))
    k = math.ceil(0.01 * 256 * 512)
    assert bucket_wire(topk, shapes, world=8).phases == (("all_gather", k * 8), exact_bias)
    # QSGD: one int8 per value (padded to chunks of 512) and one fp32 norm per chunk, one all-gather
    qsgd = build_compressor(CompressionConfig(name="qsgd", levels=127))
    assert bucket_wire(qsgd, shapes).phases == (("all_gather", 256 * 512 + 256 * 4), exact_bias)
    # what was on the wire agrees with the reducer's own count (the compressor's payload + the exact remainder)
    for c in (bf16, psgd, topk, qsgd):
        taken = [s for s in shapes if c.takes(s)]
        exact = (sum(s.numel() for s in shapes if not c.takes(s)) + flags) * 4
        assert bucket_wire(c, shapes).nbytes == c.payload_bytes(taken) + exact


def test_a_step_exposes_what_runs_past_backward() -> None:
    link = Link(latency_s=0.0, bandwidth_Bps=1.0)  # 1 byte per second, 2 ranks: an all-reduce of n takes n seconds
    wire = Wire((("all_reduce", 1.5),))
    # ready at 1.0 and 2.0, 1.5 s each: the second waits for the first (2.5), ends at 4.0; backward ended at 2.5
    step = predict_step([1.0, 2.0], [wire, wire], backward_end_s=2.5, compute_s=3.0, link=link, world=2)
    assert (step.comm_s, step.exposed_s, step.step_s) == (3.0, 1.5, 4.5)
    # everything hidden: nothing exposed, the step is its compute
    step = predict_step([0.1, 0.2], [Wire((("all_reduce", 0.1),))] * 2, 2.5, 3.0, link, 2)
    assert step.exposed_s == 0.0 and step.step_s == 3.0
    # encoding runs on the compute stream: 0.25 s per bucket delays the collectives and the step
    coded = Wire((("all_reduce", 0.5),), encode_s=0.25)
    step = predict_step([1.0, 2.0], [coded, coded], backward_end_s=2.5, compute_s=3.0, link=link, world=2)
    # bucket 0: 1.25 -> 1.75; bucket 1: ready 2.0 + 0.5 encoded = 2.5 -> 3.0; backward ends at 2.5 + 0.5 = 3.0
    assert (step.exposed_s, step.step_s) == (0.0, 3.5)
    with pytest.raises(ValueError, match="1 ready times for 2 buckets"):
        predict_step([1.0], [wire, wire], 2.5, 3.0, link, 2)


def test_the_critical_bandwidth_is_where_the_compressor_stops_paying() -> None:
    exact = lambda bw: 1.0 + 100e9 / bw  # noqa: E731
    assert critical_bandwidth(lambda bw: 1.5 + 10e9 / bw, exact, min_gain=0.0) == pytest.approx(180e9, rel=1e-6)
    # beating it by 10 %: 0.9 (1 + 100e9/bw) = 1.5 + 10e9/bw  ->  bw = 80e9 / 0.6
    assert critical_bandwidth(lambda bw: 1.5 + 10e9 / bw, exact, min_gain=0.1) == pytest.approx(80e9 / 0.6, rel=1e-6)
    assert critical_bandwidth(lambda bw: 1e6, exact) == 0.0  # never pays (1e6 s: more than exact at 1 MB/s)
    assert critical_bandwidth(lambda bw: 0.5, exact) == math.inf  # always pays
    # pays at both ends but not in between: it pays at every bandwidth below 1 GB/s only, not "always"
    dip = lambda bw: 0.5 if bw < 1e9 or bw > 1e12 else 1e6  # noqa: E731
    assert critical_bandwidth(dip, exact) == pytest.approx(1e9, rel=1e-6)
