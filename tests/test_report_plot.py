"""``curves.png`` as ``lsd-report`` draws it: losses first, constant series named not drawn, human units, one grid.

Pure planning and formatting are checked against exact values; the pictures are real PNGs (matplotlib Agg) whose
pixel size is read back. No processes.
"""

import csv
from pathlib import Path

import pytest
from matplotlib.image import imread

from lightning_static_dist.cli import report
from lightning_static_dist.report_plot import (
    format_value,
    plan_sections,
    plot_curves,
    tick_labels,
    unit_of,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = range(0, 60, 10)

OVERLAP_NAMES = [
    "bytes_sent", "comm_ms", "comm_start_frac", "compression_ratio", "compute_ms", "exposed_comm_ms",
    "hidden_comm_fraction", "overlap_ratio", "trigger_delay_ms",
]


def main_job_series() -> dict[str, list[tuple[int, float]]]:
    """The 22 metrics of the main job's ``metrics.csv``: overlap figures with ``_max`` twins, losses, perplexity.

    As there, the bytes sent and the compression ratio never change and validation ran once.
    """
    series: dict[str, list[tuple[int, float]]] = {}
    for name in OVERLAP_NAMES:
        for key in (f"static_dist/{name}", f"static_dist/{name}_max"):
            if name == "bytes_sent":
                series[key] = [(s, 3_370_192.0) for s in STEPS]
            elif name == "compression_ratio":
                series[key] = [(s, 1.0) for s in STEPS]
            else:
                series[key] = [(s, 0.1 + 0.01 * ((s // 10) % 3)) for s in STEPS]
    series["static_dist/trigger_delay_worst_bucket_ms"] = [(s, 2.0 + s / 100) for s in STEPS]
    series["train_loss"] = [(s + 9, 4.0 - s / 30) for s in STEPS]
    series["val_loss"] = [(49, 2.59)]
    series["val_ppl"] = [(49, 13.3)]
    assert len(series) == 22
    return series


def panel_keys(series: dict[str, list[tuple[int, float]]]) -> list[tuple[str, ...]]:
    sections, _ = plan_sections(series)
    return [panel.keys for section in sections for panel in section.panels]


# ------------------------------------------------------------------------------------ panel order


def test_losses_come_first_then_the_overlap_figures_then_the_rest() -> None:
    series = main_job_series()
    series["val_loss"] = [(49, 2.59), (99, 2.41)]
    series["val_ppl"] = [(49, 13.3), (99, 11.1)]
    series["lr"] = [(s, 1e-3 / (1 + s)) for s in STEPS]
    sections, _ = plan_sections(series)
    assert [s.title for s in sections] == ["loss", "static_dist/: overlap and communication", "other metrics"]
    keys = panel_keys(series)
    # train and validation loss share the first panel, to be read against each other
    assert keys[0] == ("train_loss", "val_loss")
    # fractions, then milliseconds, then plain numbers; each figure with its maximum over ranks
    assert [k[0].removeprefix("static_dist/") for k in keys[1:-2]] == [
        "comm_start_frac", "hidden_comm_fraction", "overlap_ratio",
        "comm_ms", "compute_ms", "exposed_comm_ms", "trigger_delay_ms", "trigger_delay_worst_bucket_ms",
    ]
    assert keys[1] == ("static_dist/comm_start_frac", "static_dist/comm_start_frac_max")
    assert keys[-2:] == [("lr",), ("val_ppl",)]


def test_profiler_figures_follow_the_per_step_ones() -> None:
    series = {
        "static_dist/trace_overlap_ratio": [(0, 0.1), (10, 0.2)],
        "static_dist/overlap_ratio": [(0, 0.1), (10, 0.2)],
        "static_dist/bytes_sent": [(0, 3_370_190.0), (10, 3_370_194.0)],
        "static_dist/trace_comm_ms": [(0, 3.0), (10, 4.0)],
    }
    assert [k[0] for k in panel_keys(series)] == [
        "static_dist/overlap_ratio", "static_dist/bytes_sent",
        "static_dist/trace_overlap_ratio", "static_dist/trace_comm_ms",
    ]


# ------------------------------------------------------------------------------------ constant series


def test_constant_series_are_listed_not_plotted(tmp_path: Path) -> None:
    curves = plot_curves(main_job_series(), str(tmp_path / "curves.png"))
    drawn = {key for section in curves.sections for panel in section.panels for key in panel.keys}
    assert set(curves.constant) == {
        "static_dist/bytes_sent", "static_dist/bytes_sent_max",
        "static_dist/compression_ratio", "static_dist/compression_ratio_max", "val_loss", "val_ppl",
    }
    assert not drawn & set(curves.constant)
    assert len(drawn) == 22 - 6
    assert curves.caption.startswith("constant, not plotted: static_dist/bytes_sent = 3.37 MB, ")
    assert "static_dist/compression_ratio = 1, " in curves.caption
    assert curves.caption.endswith("val_loss = 2.59 (1 point), val_ppl = 13.3 (1 point)")


def test_only_a_relative_spread_below_1e_9_counts_as_constant() -> None:
    series = {
        "static_dist/bytes_sent": [(0, 3_370_192.0), (10, 3_370_192.000001)],  # float noise
        "static_dist/bytes_sent_max": [(0, 3_370_192.0), (10, 3_370_196.0)],  # a real 4-byte change
        "static_dist/overlap_ratio": [(0, float("nan")), (10, float("nan"))],  # no collectives: nothing to hide
    }
    sections, constant = plan_sections(series)
    assert constant["static_dist/bytes_sent"] == 3_370_192.000001
    assert constant["static_dist/overlap_ratio"] != constant["static_dist/overlap_ratio"]
    assert panel_keys(series) == [("static_dist/bytes_sent_max",)]


def test_report_names_the_constant_series(tmp_path: Path) -> None:
    log_dir = tmp_path / "lightning_logs" / "version_0"
    log_dir.mkdir(parents=True)
    rows = [{"epoch": 0, "step": s, "train_loss": 4 - s / 30, "static_dist/bytes_sent": 3_370_192.0} for s in STEPS]
    with open(log_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = report(str(tmp_path))
    assert f"plot: {log_dir / 'curves.png'}\nconstant, not plotted: static_dist/bytes_sent = 3.37 MB" in text


def test_a_run_of_only_constant_series_still_gets_its_picture(tmp_path: Path) -> None:
    curves = plot_curves({"val_loss": [(49, 2.59)]}, str(tmp_path / "curves.png"))
    assert curves.sections == ()
    assert curves.caption == "constant, not plotted: val_loss = 2.59 (1 point)"
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG_MAGIC


# ------------------------------------------------------------------------------------ units


def test_bytes_read_in_decimal_units() -> None:
    assert format_value(512, "bytes") == "512 B"
    assert format_value(1_500, "bytes") == "1.5 kB"
    assert format_value(3_370_192, "bytes") == "3.37 MB"
    assert format_value(2.5e9, "bytes") == "2.5 GB"
    assert format_value(0, "bytes") == "0 B"


def test_milliseconds_turn_into_seconds_from_1000() -> None:
    assert format_value(0.25, "ms") == "0.25 ms"
    assert format_value(12.5, "ms") == "12.5 ms"
    assert format_value(466.2246, "ms") == "466 ms"
    assert format_value(1_500, "ms") == "1.5 s"
    assert format_value(0.5, "s") == "500 ms"


def test_fractions_read_as_percent() -> None:
    assert format_value(0.91, "fraction") == "91%"
    assert format_value(0.0336, "fraction") == "3.36%"
    assert format_value(1.0, "fraction") == "100%"
    assert format_value(float("nan"), "fraction") == "nan"


def test_plain_numbers_never_use_scientific_notation() -> None:
    assert format_value(81_920, None) == "81920"
    assert format_value(13.33, None) == "13.3"
    assert format_value(0.0003, None) == "0.0003"


def test_the_unit_is_read_from_the_metric_name() -> None:
    assert unit_of("static_dist/bytes_sent_max") == "bytes"
    assert unit_of("static_dist/trigger_delay_worst_bucket_ms") == "ms"
    assert unit_of("static_dist/compile_s") == "s"
    assert unit_of("static_dist/hidden_comm_fraction") == "fraction"
    assert unit_of("static_dist/comm_start_frac") == "fraction"
    assert unit_of("static_dist/trace_overlap_ratio_max") == "fraction"
    # a multiple, not a part of a whole
    assert unit_of("static_dist/compression_ratio") is None
    assert unit_of("tokens_per_s") is None
    assert unit_of("train_loss") is None


def test_tick_labels_share_a_unit_and_show_a_tiny_wiggle_without_an_offset() -> None:
    assert tick_labels([3_370_190.0, 3_370_192.0, 3_370_194.0], "bytes") == [
        "3.370190 MB", "3.370192 MB", "3.370194 MB",
    ]
    assert tick_labels([0.0, 500_000.0, 1_000_000.0], "bytes") == ["0.0 MB", "0.5 MB", "1.0 MB"]
    assert tick_labels([0.0, 0.25, 0.5], "fraction") == ["0%", "25%", "50%"]
    assert tick_labels([0.0, 0.025, 0.05], "fraction") == ["0.0%", "2.5%", "5.0%"]
    assert tick_labels([500.0, 1_000.0, 1_500.0], "ms") == ["0.5 s", "1.0 s", "1.5 s"]
    assert tick_labels([2.0, 2.25, 2.5], None) == ["2.00", "2.25", "2.50"]


# ------------------------------------------------------------------------------------ the picture


@pytest.mark.parametrize("shape", ["main job", "22 unrelated metrics"])
def test_the_picture_of_22_metrics_is_a_compact_grid(tmp_path: Path, shape: str) -> None:
    if shape == "main job":
        series = main_job_series()
    else:  # the worst case: nothing constant, no twins to share a panel
        series = {f"metric_{i:02d}": [(s, float(i + s)) for s in STEPS] for i in range(22)}
    path = tmp_path / "curves.png"
    curves = plot_curves(series, str(path))
    assert curves.path == str(path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = imread(str(path)).shape
    assert width == 1200
    assert height < 2000, f"{height} px tall for 22 metrics"
    if shape == "main job":
        assert height < 1000
