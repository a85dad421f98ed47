"""The bookkeeping of ``gpuN_gpt2s.py --simulate``'s persistent rounds (``benchmarks/_rounds.py``,
``benchmarks/_simulated.py``) on rounds written by hand: every figure checked against numbers worked out here."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from _rounds import RoundTimer, rotated, steps_needed  # noqa: E402
from _simulated import parse_link, sim_rows, sim_summary, split_key  # noqa: E402

LINKS = [parse_link("free"), parse_link("nvlink=70,5,8")]


def _round(r: int, windows: list[float], host: list[float]) -> dict:
    return {"round": r, "window_s": windows, "host_s": host}


#: window seconds; static_dist's windows alternate free, nvlink (its two links)
RUNS = {
    "ceiling@1": [_round(0, [0.030, 0.030], [0.020, 0.020]), _round(1, [0.032, 0.032], [0.021, 0.021])],
    "static_dist@sim2": [_round(0, [0.030, 0.040], [0.005, 0.005]), _round(1, [0.031, 0.041], [0.006, 0.006])],
    "ceiling@1+busy": [_round(0, [0.045, 0.045], [0.045, 0.045]), _round(1, [0.047, 0.047], [0.047, 0.047])],
    "static_dist@sim2+busy": [_round(0, [0.030, 0.040], [0.009, 0.009]), _round(1, [0.030, 0.041], [0.009, 0.009])],
}
WORKERS = {"ceiling@1": {"peak_mem_gib": 8.0, "tokens_per_step": 16384, "window": 10},
           "static_dist@sim2": {"peak_mem_gib": 8.4, "tokens_per_step": 16384, "window": 10}}


def test_keys_name_the_contender_the_world_and_the_host() -> None:
    assert split_key("static_dist@sim8+busy") == ("static_dist", 8, "busy")
    assert split_key("ceiling@1") == ("ceiling", 1, "quiet")


def test_each_round_is_paired_with_the_ceilings_same_round_under_the_same_load() -> None:
    rows = {(r["contender"], r["link"], r["host"]): r for r in sim_rows(RUNS, LINKS, WORKERS)}
    free = rows[("static_dist", "free", "quiet")]
    assert free["step_ms_per_round"] == [30.0, 31.0]
    assert free["vs_ceiling_per_round"] == [1.0, round(0.032 / 0.031, 4)]
    assert free["vs_ceiling_min"] == 1.0
    assert free["vs_ceiling_paired"] == round((1.0 + round(0.032 / 0.031, 4)) / 2, 4)
    assert free["paired_spread"] == round((round(0.032 / 0.031, 4) - 1.0) / free["vs_ceiling_paired"], 4)
    assert free["vs_ceiling"] == round(0.031 / 0.0305, 4)  # the medians: ceiling 31 ms, static_dist 30.5 ms
    assert free["spread"] == round(1.0 / 30.5, 4)
    assert free["host_ms_median"] == 5.5
    assert free["peak_mem_gib"] == 8.4 and free["tokens_per_s_per_gpu"] == round(16384 / 0.0305)
    nvlink = rows[("static_dist", "nvlink", "quiet")]
    assert nvlink["step_ms_per_round"] == [40.0, 41.0]
    busy = rows[("static_dist", "free", "busy")]
    assert busy["vs_ceiling_per_round"] == [1.5, round(0.047 / 0.030, 4)]  # against the loaded ceiling
    assert busy["overlap_tail"] is None  # (the monitored tail ran unloaded)


def test_the_summary_names_the_issues_figures() -> None:
    rows = sim_rows(RUNS, LINKS, WORKERS)
    summary = sim_summary(rows, LINKS, "nvlink")
    assert summary["sim_free_vs_ceiling_min"] == 1.0
    assert summary["sim_free_spread"] == round(1.0 / 30.5, 4)
    assert summary["sim_free_busy_host_vs_ceiling"] == round(0.046 / 0.030, 4)  # (the medians' ratio)
    assert summary["sim_free_busy_host_vs_ceiling_paired"] == round((1.5 + round(0.047 / 0.030, 4)) / 2, 4)
    assert summary["busy_host_ceiling_vs_quiet"] == round(31.0 / 46.0, 4)
    assert summary["peak_gib_vs_ceiling"] == round(8.4 / 8.0, 4)
    assert summary["sim_nvlink_vs_ceiling"] == round(0.031 / 0.0405, 4)
    assert summary["sim_free_vs_ceiling_8"] is None  # no world of 8 in these runs


@pytest.mark.parametrize(("r", "order"), [(0, "ABC"), (1, "BCA"), (2, "CAB"), (3, "ABC")])
def test_the_order_is_rotated_every_round(r: int, order: str) -> None:
    assert "".join(rotated(list("ABC"), r)) == order


def test_a_worker_runs_exactly_the_steps_the_drivers_commands_ask_for() -> None:
    # 12 warm-up steps, 10 rounds (5 quiet, 5 busy) of 3 + 3 x 10, a profile of 3 + 3, a tail of 6
    assert steps_needed(12, 10, 3, 10, 3, 3, 6) == 12 + 10 * 33 + 6 + 6
    assert steps_needed(12, 10, 3, 10, 3, 0, 6) == 12 + 10 * 33 + 6


class _Gate:
    """The driver's side of a worker's pipes, in this process: the commands queued, the replies kept."""

    def __init__(self, commands: list[str]) -> None:
        self.commands, self.sent = [{"cmd": c} for c in commands], []

    def receive(self) -> dict:
        return self.commands.pop(0)

    def send(self, message: dict) -> None:
        self.sent.append(message)


def test_a_worker_times_each_window_of_a_round_and_switches_links_at_each() -> None:
    import torch

    gate, links = _Gate(["round", "round", "finish"]), []
    timer = RoundTimer(False, gate, warmup=2, pre=1, window=2, windows=2, profile_steps=0, tail=1, trace_prefix="-",
                       on_window=lambda window, last: links.append((window, last)))
    for _ in range(steps_needed(2, 2, 1, 2, 2, 0, 1)):
        timer.start()
        timer.end(torch.zeros(()))
    assert gate.commands == [] and gate.sent[0] == {"ready": True}
    rounds = gate.sent[1:]
    assert len(rounds) == 2 and all(len(r["window_s"]) == len(r["host_s"]) == 2 for r in rounds), rounds
    assert all(0 < h <= w for r in rounds for h, w in zip(r["host_s"], r["window_s"])), rounds
    # each round: window 0 at its first mark, window 1 after the first window; the tail at the last link
    assert links == [(0, False), (1, False), (0, False), (1, False), (0, True)]
    assert timer.timings()["rounds_run"] == 2


def test_a_two_regime_link_spec_names_its_idle_pace_and_its_per_sm_bandwidth() -> None:
    link = parse_link("nv2=70,5,16,308,65")
    assert link.describe() == {"name": "nv2", "gbps": 70.0, "latency_us": 5.0, "sms": 16, "idle_gbps": 308.0,
                               "sm_gbps": 65.0}
    assert link.config().rates(2) == pytest.approx((70 * 130 / 308, 130.0))
    assert parse_link("70,5,8,-,40").spec == {"gbps": 70.0, "latency_us": 5.0, "sms": 8, "sm_gbps": 40.0}
    with pytest.raises(ValueError, match="IDLE_GBPS"):
        parse_link("70,5")


@pytest.mark.parametrize(("spec", "field"), [("-,5,8", "GBPS"), ("nv=70,-,8", "LATENCY_US"), ("70,5,-,308", "SMS")])
def test_a_dash_in_a_required_field_is_refused_naming_the_field(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=f": {field} is required"):
        parse_link(spec)


def test_the_calibration_scales_each_links_step_to_the_records_ceiling_and_prefers_the_records_own_config() -> None:
    """Recorded (12-01, 2 GPUs): ceiling 33.34 ms, static_dist 36.88, plain DDP 36.80. Here the ceiling runs 30 ms, so
    a simulated step of 33.0 ms stands for 33.0 * 33.34 / 30 = 36.674 ms: error |36.674 - 36.88| / 36.88 = 0.0056.
    static_dist_nocg (what that day's defaults ran) is preferred over static_dist."""
    links = [parse_link("free"), parse_link("cal=70,5,16,308,65")]
    runs = {"ceiling@1": [_round(0, [0.030, 0.030], [0.02, 0.02])],
            "static_dist_nocg@sim2": [_round(0, [0.031, 0.033], [0.01, 0.01])],
            "static_dist@sim2": [_round(0, [0.030, 0.031], [0.01, 0.01])],
            "plain_ddp_compile@sim2": [_round(0, [0.031, 0.034], [0.03, 0.03])]}
    summary = sim_summary(sim_rows(runs, links, {}), links, "cal")
    fit = summary["calibration_by_link"]["cal"]
    assert fit["static_dist"]["contender"] == "static_dist_nocg"
    assert fit["static_dist"]["predicted_ms"] == pytest.approx(36.67, abs=0.01)
    assert summary["sim_calibration_error"] == pytest.approx(0.0056, abs=1e-4)
    assert fit["plain_ddp_compile"]["predicted_ms"] == pytest.approx(34 * 33.34 / 30, abs=0.01)
    assert "free" not in summary["calibration_by_link"]
