"""The critical-point bookkeeping (``compression/critical.py``) on hand-made loss curves with exact answers, and the
sweep harness (``benchmarks/critical_point.py``) on a tiny real 2-rank run: the table it writes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

from _dist import fresh_job_env
from lightning_static_dist.compression.critical import (
    ROW_KEYS,
    compare_curves,
    critical_point,
    critical_points,
    smoothed,
    sweep_row,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoothing_is_a_trailing_mean_over_what_is_there() -> None:
    assert smoothed([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothed([4.0, 2.0, 0.0], window=10) == [4.0, 3.0, 2.0]
    with pytest.raises(ValueError, match="window=0"):
        smoothed([1.0], window=0)


def _steps(*pieces: tuple[int, float]) -> list[float]:
    return [value for length, value in pieces for _ in range(length)]


def test_the_critical_steps_are_where_the_smoothed_gap_first_crosses_3_and_10_percent() -> None:
    reference = [2.0] * 300
    # 4 % behind from step 100, 15 % from step 200; the 10-step trailing mean lags each jump:
    # 2.0 + 0.08 k / 10 > 2.06 first at k = 8 (step 107); 2.08 + 0.22 k / 10 > 2.2 first at k = 6 (step 205)
    curve = _steps((100, 2.0), (100, 2.08), (100, 2.3))
    comparison = compare_curves(curve, reference, window=10)
    assert comparison.behind_steps == {0.03: 107, 0.10: 205}
    assert comparison.diverged_step is None
    assert comparison.final_loss_ratio == pytest.approx(1.15)  # the last 30 steps: 2.3 / 2.0


def test_no_step_before_compression_starts_counts_as_behind() -> None:
    reference = [5.0 - 0.01 * i for i in range(200)]
    curve = [1.2 * x for x in reference]  # 20 % behind throughout (a different warm-up, say)
    comparison = compare_curves(curve, reference, start=50)
    assert comparison.behind_steps == {0.03: 50, 0.10: 50}
    assert compare_curves(reference, reference, start=50).behind_steps == {0.03: None, 0.10: None}


def test_a_non_finite_or_runaway_loss_is_divergence() -> None:
    reference = [5.5 - 0.01 * i for i in range(100)]
    nan_at_60 = reference[:60] + [math.nan] * 40
    comparison = compare_curves(nan_at_60, reference)
    assert comparison.diverged_step == 60 and comparison.final_loss_ratio == math.inf
    assert comparison.behind_steps == {0.03: 60, 0.10: 60}
    # finite, but the smoothed loss goes above 1.2 x the untrained one (6.6): at step 40 the 5-step mean holds one
    # 9.0 (5.9), at step 41 two (6.67)
    runaway = reference[:40] + [9.0] * 60
    assert compare_curves(runaway, reference, window=5).diverged_step == 41


def test_a_row_has_the_table_keys_and_no_non_finite_numbers() -> None:
    reference = [3.0] * 50
    row = sweep_row("topk_1pct", "topk", 1, [3.3] * 50, reference, val_loss=3.2, reference_val_loss=3.0,
                    rel_errors=[0.5, 0.9, 0.7], start=5)
    assert tuple(row) == ROW_KEYS
    assert row["final_loss_ratio"] == pytest.approx(1.1) and row["val_loss_ratio"] == pytest.approx(1.0667)
    assert (row["behind_3pct_step"], row["behind_10pct_step"]) == (5, None)  # 1.1 is not more than 10 % behind
    assert (row["rel_error_median"], row["rel_error_max"]) == (0.7, 0.9)
    diverged = sweep_row("topk_0.1pct", "topk", 2, [3.0] * 10 + [math.inf] * 40, reference, val_loss=math.nan,
                         reference_val_loss=3.0)
    assert diverged["diverged_step"] == 10
    assert diverged["final_loss_ratio"] is None and diverged["val_loss_ratio"] is None
    assert diverged["rel_error_median"] is None  # nothing measured
    json.dumps(diverged, allow_nan=False)


def _row(setting: str, family: str, level: int, ratio: float, diverged: Any = None) -> dict[str, Any]:
    return {"setting": setting, "family": family, "level": level, "final_loss_ratio": ratio, "diverged_step": diverged}


def test_the_critical_point_is_the_last_setting_before_the_first_that_falls_behind() -> None:
    powersgd = [_row("r16", "powersgd", 0, 1.00), _row("r4", "powersgd", 2, 1.02), _row("r8", "powersgd", 1, 1.01),
                _row("r2", "powersgd", 3, 1.06), _row("r1", "powersgd", 4, 1.02)]  # r1's pass is luck past r2's fail
    assert critical_point(powersgd, tolerance=1.03)["setting"] == "r4"
    assert critical_point(powersgd, tolerance=1.10)["setting"] == "r1"
    assert critical_point(powersgd, tolerance=1.005)["setting"] == "r16"
    topk = [_row("10%", "topk", 0, 1.04), _row("1%", "topk", 1, 1.01)]
    assert critical_point(topk, tolerance=1.03) is None  # even the mildest falls behind
    qsgd = [_row("8b", "qsgd", 0, 1.0), _row("2b", "qsgd", 1, None, diverged=12)]
    rows = [_row("exact", "exact", 0, 1.0), *powersgd, *topk, *qsgd]
    assert critical_points(rows, tolerance=1.03) == {"powersgd": "r4", "topk": None, "qsgd": "8b"}


@pytest.mark.multiprocess
@pytest.mark.slow  # a real 2-rank sweep (the bookkeeping it feeds is tested above on curves with known answers)
def test_a_tiny_sweep_writes_every_row_of_its_table(tmp_path: Any) -> None:
    out = tmp_path / "sweep.json"
    tiny = ["model.n_layer=1", "model.n_embd=64", "model.block_size=32", "data.block_size=32", "data.batch_size=8",
            "data.max_bytes=100000", "trainer.limit_val_batches=2"]
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "critical_point.py"), "--steps", "5", "--start-step", "2",
           "--check-every", "2", "--compile", "off", "--settings", "exact,powersgd_r2,qsgd_2bit,torch_powersgd_r4", "--no-record",
           "--rows-json", str(out), "--set", *tiny]
    proc = subprocess.run(cmd, cwd=ROOT, env=fresh_job_env(), capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = json.loads(out.read_text())
    rows = {r["setting"]: r for r in sweep["rows"]}
    assert list(rows) == ["exact", "powersgd_r2", "qsgd_2bit", "torch_powersgd_r4"]
    reference = rows.pop("torch_powersgd_r4")  # PyTorch's own PowerSGD under Lightning's ddp: no byte count
    assert reference["compression_ratio"] is None and reference["bytes_per_step"] is None
    assert reference["final_loss_ratio"] is not None and reference["rel_error_median"] is None
    assert reference["hook_iterations"] > reference["hook_start"] == 2  # the hook ran, and compressed from step 2
    for row in rows.values():
        assert set(ROW_KEYS) | {"bytes_per_step", "compression_ratio", "compression", "rel_errors"} <= set(row)
    assert rows["exact"]["compression_ratio"] == 1.0 and rows["exact"]["rel_error_median"] == 0.0
    assert rows["powersgd_r2"]["bytes_per_step"] < rows["exact"]["bytes_per_step"] / 4
    # the guard's measurement, on the check steps after the warm-up (2 and 4), not switching anything
    assert [step for step, _ in rows["powersgd_r2"]["rel_errors"]] == [2, 4]
    assert 0 < rows["powersgd_r2"]["rel_error_median"] < 1
    assert rows["qsgd_2bit"]["bits"] == 2 and rows["qsgd_2bit"]["packed_compression_ratio_estimate"] > 3 * rows[
        "qsgd_2bit"]["compression_ratio"]
    # the warm-up is exact: the same losses as the reference up to (and with) the first compressed step's
    curves = sweep["curves"]
    assert curves["powersgd_r2"][:3] == curves["exact"][:3] and curves["powersgd_r2"][3:] != curves["exact"][3:]
    assert set(sweep["summary"]["critical_points"]) == {"powersgd", "qsgd"}


def test_lsd_report_shows_a_recorded_sweep_again(tmp_path: Any, capsys: Any, monkeypatch: Any) -> None:
    from lightning_static_dist.cli import report_main

    monkeypatch.chdir(tmp_path)  # the plot is drawn in the working directory
    record = tmp_path / "record" / "cpu2-critical-point-2026-12-01.json"
    record.parent.mkdir()
    with open(os.path.join(ROOT, "benchmarks", "results", record.name)) as f:
        recorded = json.load(f)
    record.write_text(json.dumps(recorded))
    report_main([str(record)])
    out = capsys.readouterr().out
    for row in recorded["rows"]:
        assert f"\n{row['setting']} " in out
    points = recorded["summary"]["critical_points"]
    assert f"critical points (final loss <= 1.03x exact): {points}" in out
    assert sum(line.endswith(" *") for line in out.splitlines()) == sum(p is not None for p in points.values())
    assert (tmp_path / "cpu2-critical-point-2026-12-01.png").stat().st_size > 10_000


def test_lsd_report_prints_an_earlier_run_a_record_carries_and_refuses_what_is_not_a_record(
        tmp_path: Any, capsys: Any) -> None:
    from lightning_static_dist.cli import report_main

    with open(os.path.join(ROOT, "benchmarks", "results", "gpu1-critical-point-2026-12-01.json")) as f:
        recorded = json.load(f)
    report_main([os.path.join(ROOT, "benchmarks", "results", "gpu1-critical-point-2026-12-01.json"), "--no-plot"])
    out = capsys.readouterr().out
    assert "run_600_steps: gpu1-critical-point: CharGPT d=768, 12 layers, 600 steps" in out
    for row in recorded["run_600_steps"]["rows"]:
        assert f"\n{row['setting']} " in out
    binary = tmp_path / "x-critical-point-2026-12-01.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    not_a_record = tmp_path / "other.json"
    not_a_record.write_text('{"scenario": "cpu2-charlm"}')
    for path in (binary, not_a_record):  # neither is a sweep record: read as a run directory, which it is not
        with pytest.raises(SystemExit) as stopped:
            report_main([str(path), "--no-plot"])
        assert stopped.value.code == 2
