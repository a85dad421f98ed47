"""``sync.schedule: measured``'s model (pure, exact numbers) and its probe over real Gloo ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from lightning_static_dist.sync.link_probe import probe_link
from lightning_static_dist.sync.schedule_choice import (
    Candidate,
    LinkRates,
    MeasuredChoice,
    choose_schedule,
    parse_candidate,
    predict_extra_s,
)

MiB = 2**20
AFTER = Candidate("after_backward", "fp32")
OVERLAP = Candidate("overlap", "fp32")


def test_after_backward_pays_every_bucket_at_the_idle_rate() -> None:
    rates = LinkRates(idle_gbps=100, busy_gbps=10, latency_us=5, slowdown=0.5)
    # world 2: 2 latencies per bucket and 1x the bytes each; 2 buckets of 1 GB at 100 GB/s
    assert predict_extra_s(AFTER, [1e9, 1e9], 2, rates) == pytest.approx(2 * (2 * 5e-6 + 1e9 / 100e9))
    # world 8: 14 latencies and 2 * 7 / 8 of the bytes
    assert predict_extra_s(AFTER, [1e9], 8, rates) == pytest.approx(14 * 5e-6 + 1.75e9 / 100e9)


def test_overlap_with_an_unknown_backward_charges_the_slowdown_and_the_last_bucket() -> None:
    rates = LinkRates(idle_gbps=100, busy_gbps=50, latency_us=0, slowdown=0.2)
    extra = predict_extra_s(OVERLAP, [1e9, 1e9, 1e8], 2, rates, cut_s_per_piece=1e-4)
    # two buckets beside backward at 50 GB/s (40 ms, compute slowed 20 % of it: 8 ms), the last at 100 GB/s (1 ms),
    # two cuts
    assert extra == pytest.approx(0.008 + 0.001 + 2e-4)


def test_overlap_spills_past_a_short_backward_at_the_idle_rate() -> None:
    rates = LinkRates(idle_gbps=100, busy_gbps=50, latency_us=0, slowdown=0.0)
    # backward 10 ms, two buckets of 1 GB: the first ready at 5 ms moves 0.25 GB beside it by 10 ms, the rest at
    # 100 GB/s (7.5 ms); the second, ready at 10 ms, then 10 ms: 17.5 ms past backward's end
    assert predict_extra_s(OVERLAP, [1e9, 1e9], 2, rates, backward_s=0.010) == pytest.approx(0.0175)
    # slowdown 0.5: backward's last 5 ms of work take 10 ms beside the first bucket (ends at 15 ms, 0.5 GB moved);
    # the rest at 100 GB/s by 20 ms; the second bucket 10 ms: 20 ms past the 10 ms of compute
    slowed = LinkRates(idle_gbps=100, busy_gbps=50, latency_us=0, slowdown=0.5)
    assert predict_extra_s(OVERLAP, [1e9, 1e9], 2, slowed, backward_s=0.010) == pytest.approx(0.020)


def test_the_optimizer_step_per_bucket_hides_the_later_buckets_behind_the_earlier_steps() -> None:
    rates = LinkRates(idle_gbps=100, busy_gbps=100, latency_us=0, slowdown=0.0)
    # 2 buckets of 1 GB: 10 ms each on the wire; the step of a bucket (7 GB at 1000 GB/s) 7 ms
    whole = predict_extra_s(AFTER, [1e9, 1e9], 2, rates, mem_gbps=1000)
    stepwise = predict_extra_s(Candidate("after_backward", "fp32", step_per_bucket=True), [1e9, 1e9], 2, rates,
                               mem_gbps=1000)
    assert whole == pytest.approx(0.020)
    assert stepwise == pytest.approx(0.020 + 0.007 - 0.014)  # the first step hidden behind the second bucket


def test_bf16_halves_the_wire_and_pays_its_casts() -> None:
    rates = LinkRates(idle_gbps=100, busy_gbps=100, latency_us=0, slowdown=0.0)
    extra = predict_extra_s(Candidate("after_backward", "bf16"), [1e9], 2, rates, mem_gbps=1000)
    assert extra == pytest.approx(0.005 + 3e9 / 1000e9)


def _gpt2_buckets() -> list[float]:
    total, sizes = 497_904_208, [MiB]
    while sum(sizes) < total:
        sizes.append(min(100 * MiB, total - sum(sizes)))
    return sizes


@pytest.mark.parametrize(("rates", "world", "expected"), [
    # an idle GPU's NVLink many times faster than one beside backward: the exchange after backward
    (LinkRates(idle_gbps=308, busy_gbps=40, latency_us=5, slowdown=0.2), 2, "after_backward"),
    # one rate, beside compute or not (a network, PCIe): hidden under backward
    (LinkRates(idle_gbps=70, busy_gbps=70, latency_us=5, slowdown=0.1), 2, "overlap"),
    (LinkRates(idle_gbps=70, busy_gbps=70, latency_us=5, slowdown=0.1), 8, "overlap"),
    (LinkRates(idle_gbps=25, busy_gbps=25, latency_us=5, slowdown=0.15), 8, "overlap"),
    (LinkRates(idle_gbps=12.5, busy_gbps=12.5, latency_us=20, slowdown=0.15), 2, "overlap"),
])
def test_the_choice_follows_the_link(rates: LinkRates, world: int, expected: str) -> None:
    choice = choose_schedule({None: rates}, _gpt2_buckets(), world, ("fp32",), step_per_bucket=True, mem_gbps=3000,
                             cut_s_per_piece=9e-5, probe_s=0.25)
    assert choice.candidate.schedule == expected
    assert choice.choice == min(choice.predicted_ms, key=lambda name: choice.predicted_ms[name])
    assert set(choice.predicted_ms) == {"overlap/fp32/sms=default", "after_backward/fp32",
                                        "after_backward/fp32+optimizer_overlap"}
    line = choice.describe()
    assert "\n" not in line and line.startswith(choice.choice) and "probe 0.25 s" in line


def test_bf16_and_sms_join_only_when_probed_or_allowed() -> None:
    rates = {None: LinkRates(308, 40, 5, 0.2), 8: LinkRates(308, 40, 5, 0.1, sms=8)}
    choice = choose_schedule(rates, _gpt2_buckets(), 2, ("fp32", "bf16"), step_per_bucket=False)
    assert set(choice.predicted_ms) == {"overlap/fp32/sms=default", "overlap/fp32/sms=8", "after_backward/fp32",
                                        "overlap/bf16/sms=default", "overlap/bf16/sms=8", "after_backward/bf16"}


def test_a_choice_survives_its_dict_and_names_read_back() -> None:
    choice = choose_schedule({None: LinkRates(308, 40, 5, 0.2)}, [MiB, 100 * MiB], 2, ("fp32",), True,
                             mem_gbps=3000, details={"nbytes": 100 * MiB})
    again = MeasuredChoice.from_dict(choice.as_dict())
    assert again == choice
    for name in choice.predicted_ms:
        assert parse_candidate(name).name == name


def _probe(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    measure = probe_link(None, torch.device("cpu"), nbytes=4 * MiB, width=256)
    return {"rates": measure.rates, "mem": measure.mem_gbps, "probe_s": measure.probe_s, "nbytes": measure.nbytes,
            "backend": dist.get_backend()}


@pytest.mark.multiprocess
def test_the_probe_runs_over_gloo_and_every_rank_gets_the_slowest_figures() -> None:
    found = run_ranks(_probe, world_size=2, timeout=120)
    assert found[0]["backend"] == "gloo"
    assert found[0]["rates"] == found[1]["rates"] and found[0]["probe_s"] == found[1]["probe_s"]
    rates = found[0]["rates"]
    for value in (rates.idle_gbps, rates.busy_gbps, rates.latency_us, found[0]["mem"]):
        assert math.isfinite(value) and value > 0
    assert rates.slowdown >= 0 and found[0]["nbytes"] == 4 * MiB
