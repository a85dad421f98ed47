"""The step picture: it renders real PNGs for the shapes a run produces. Pure; no processes."""

from pathlib import Path

import pytest

from lightning_static_dist.overlap.picture import _assign_sub_rows, _human_bytes, render_timeline
from lightning_static_dist.overlap.timeline import CommRecord, StepTimeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MiB = 1 << 20


def overlapping_rank(rank: int = 0) -> StepTimeline:
    """Per-bucket hooks: collectives launch during backward, two of them at once (as Gloo does)."""
    t = StepTimeline(step=5, rank=rank)
    t.compute += [("forward", 0.000, 0.010), ("backward", 0.010, 0.034), ("optimizer", 0.036, 0.040)]
    t.comm += [
        CommRecord(bucket=0, nbytes=1 * MiB, ready_s=0.013, issued_s=0.013, done_s=0.017),
        CommRecord(bucket=1, nbytes=25 * MiB, ready_s=0.019, issued_s=0.020, done_s=0.028),
        CommRecord(bucket=2, nbytes=25 * MiB, ready_s=0.024, issued_s=0.024, done_s=0.032),
        CommRecord(bucket=3, nbytes=12 * MiB, ready_s=0.031, issued_s=0.031, done_s=0.035),
    ]
    return t


def exposed_rank(rank: int = 1) -> StepTimeline:
    """Whole-model compile: every gradient is handed over when backward returns, so all comm follows it."""
    t = StepTimeline(step=5, rank=rank)
    t.compute += [("forward", 0.000, 0.008), ("backward", 0.008, 0.026), ("optimizer", 0.047, 0.051)]
    t.comm += [
        CommRecord(bucket=b, nbytes=n, ready_s=0.012 + 0.004 * b, issued_s=0.026 + 0.005 * b, done_s=0.031 + 0.005 * b)
        for b, n in enumerate([1 * MiB, 25 * MiB, 25 * MiB, 12 * MiB])
    ]
    return t


def assert_png(path: Path, min_bytes: int = 10_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes


def test_two_ranks_overlapping_and_exposed_render(tmp_path: Path) -> None:
    out = tmp_path / "two_ranks.png"
    assert render_timeline([exposed_rank(1), overlapping_rank(0)], str(out), title="two ranks") == str(out)
    assert_png(out)


def test_parent_directory_is_created(tmp_path: Path) -> None:
    out = tmp_path / "timeline" / "step_5.png"
    render_timeline([overlapping_rank(0), exposed_rank(1)], str(out))
    assert_png(out)


def test_world_size_one_without_comm_renders(tmp_path: Path) -> None:
    t = StepTimeline(step=0, rank=0)
    t.compute += [("forward", 0.0, 0.004), ("backward", 0.004, 0.011), ("optimizer", 0.011, 0.012)]
    out = tmp_path / "single.png"
    render_timeline([t], str(out))
    assert_png(out, min_bytes=5_000)


def test_sixty_buckets_and_zero_length_intervals_render(tmp_path: Path) -> None:
    t = StepTimeline(step=7, rank=0)
    t.compute += [("forward", 0.0, 0.02), ("backward", 0.02, 0.08), ("optimizer", 0.08, 0.08)]  # empty optimizer
    t.comm += [
        CommRecord(bucket=b, nbytes=4 * MiB, ready_s=start, issued_s=start, done_s=start + 0.003)
        for b, start in ((b, 0.021 + 0.001 * b) for b in range(59))
    ]
    t.comm.append(CommRecord(bucket=59, nbytes=0, ready_s=0.08, issued_s=0.08, done_s=0.08))
    out = tmp_path / "many.png"
    render_timeline([t, exposed_rank(1)], str(out))
    assert_png(out)


def test_an_empty_step_is_refused() -> None:
    with pytest.raises(ValueError, match="timelines"):
        render_timeline([], "unused.png")


def test_concurrent_collectives_get_separate_sub_rows() -> None:
    rows, n_rows = _assign_sub_rows(overlapping_rank().comm)
    # bucket 1 (20-28 ms) and bucket 2 (24-32 ms) run at once; bucket 3 (from 31 ms) fits under bucket 1's row again
    assert rows == [0, 0, 1, 0]
    assert n_rows == 2
    assert _assign_sub_rows([]) == ([], 1)


def test_sizes_are_in_human_units() -> None:
    assert [_human_bytes(n) for n in (0, 512, 4096, int(2.4 * MiB), 25 * MiB, 3 << 30)] == [
        "0B",
        "512B",
        "4.0KiB",
        "2.4MiB",
        "25MiB",
        "3.0GiB",
    ]
