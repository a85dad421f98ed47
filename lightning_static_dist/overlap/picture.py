"""A picture of one training step across ranks: where compute ran, where each collective ran, and what waited.

Each rank gets two lanes, rank 0 at the top: ``compute`` (one bar per phase, coloured forward / backward / optimizer)
and ``comm`` (one bar per collective from issue to completion, labelled with its bucket and payload; a thin grey line
in front of it from when the bucket was ready; concurrent collectives stacked in sub-rows). The backward span is
shaded across the comm lane: bars inside it overlap backward, bars to its right are exposed. The x axis is
milliseconds from the step start; the interval math lives in ``intervals.py``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from lightning_static_dist.overlap.timeline import CommRecord, StepTimeline

_PHASE_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868"}
# phases the recorder may add later still get a distinct, stable colour
_SPARE_COLOURS = ("#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
_COMM_COLOUR = "#6A3D9A"
_WAIT_COLOUR = "#555555"

_COMPUTE_LANE = 1.0
"""Height of a compute lane, in y units."""
_SUB_ROW = 0.7
"""Height of one comm sub-row; a comm lane is never shorter than a compute lane."""
_MAX_SUB_ROWS = 6
"""Beyond this many concurrent collectives, new ones share the sub-row that frees up first."""
_INCH_PER_UNIT = 0.42
_LABEL_MIN_FRACTION = 0.04
"""Bars narrower than this fraction of the x axis are never labelled, whatever their text."""
_LABEL_FONTSIZE = 7.0


def render_timeline(timelines: Sequence[StepTimeline], path: str, title: str = "") -> str:
    """Draw one step of every rank into a PNG at ``path`` (its directory is created) and return ``path``.

    Args:
        timelines: one :class:`StepTimeline` per rank, all of the same step; drawn in rank order.
        path: where the PNG goes.
        title: figure title; defaults to ``"step N"``.

    Example::

        timelines = gather_timelines(...)  # one per rank, on rank 0
        render_timeline(timelines, f"{log_dir}/timeline/step_{step}.png", title="whole-model compile, 2 x Gloo")
    """
    if not timelines:
        raise ValueError("render_timeline: `timelines` is empty; pass at least one rank's StepTimeline")

    import matplotlib

    # selected here rather than at import time so importing the package never changes the caller's backend
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    ordered = sorted(timelines, key=lambda t: t.rank)
    rows = [_assign_sub_rows(t.comm) for t in ordered]
    lane_heights = [(_COMPUTE_LANE, max(_COMPUTE_LANE, _SUB_ROW * n_rows)) for _, n_rows in rows]

    start_ms, end_ms = _x_range(ordered)
    span_ms = end_ms - start_ms
    # zero-length intervals are real (an empty bucket, a coarse clock); give them a sliver so they stay visible
    min_width_ms = span_ms * 0.003

    total_units = sum(c + m for c, m in lane_heights)
    width_in, height_in = 12.0, max(3.0, 1.6 + total_units * _INCH_PER_UNIT)
    fig, ax = plt.subplots(figsize=(width_in, height_in), dpi=110)
    try:
        # label text is measured in inches and compared with a bar's width converted to inches
        axes_width_in = width_in * (ax.get_position().x1 - ax.get_position().x0)
        ms_per_inch = span_ms / axes_width_in
        phase_colours = dict(_PHASE_COLOURS)
        ticks: list[float] = []
        tick_labels: list[str] = []
        y = 0.0  # top of the current lane; the y axis is inverted so rank 0 is at the top

        for timeline, (sub_row, n_rows), (compute_h, comm_h) in zip(ordered, rows, lane_heights):
            # compute lane
            for phase, begin, end in timeline.compute:
                colour = phase_colours.setdefault(phase, _SPARE_COLOURS[len(phase_colours) % len(_SPARE_COLOURS)])
                width_ms = max((end - begin) * 1e3, min_width_ms)
                ax.add_patch(
                    Rectangle(
                        (begin * 1e3, y + 0.15 * compute_h),
                        width_ms,
                        0.7 * compute_h,
                        facecolor=colour,
                        edgecolor="white",
                        # the white edge separates adjacent phases but would swallow a sliver
                        linewidth=0.5 if width_ms > 4 * min_width_ms else 0.0,
                    )
                )
            ticks.append(y + compute_h / 2)
            tick_labels.append(f"rank {timeline.rank} compute")
            ax.axhline(y + compute_h, color="#DDDDDD", linewidth=0.6, linestyle=":")
            y += compute_h

            # comm lane: backward shading first, underneath everything
            for phase, begin, end in timeline.compute:
                if phase == "backward":
                    ax.add_patch(
                        Rectangle(
                            (begin * 1e3, y),
                            max((end - begin) * 1e3, min_width_ms),
                            comm_h,
                            facecolor=_PHASE_COLOURS["backward"],
                            alpha=0.15,
                            linewidth=0,
                            zorder=0,
                        )
                    )
            row_h = comm_h / max(n_rows, 1)
            for record, row in zip(timeline.comm, sub_row):
                top = y + row * row_h
                centre = top + row_h / 2
                if record.trigger_delay_s > 0:
                    ax.plot(
                        [record.ready_s * 1e3, record.issued_s * 1e3],
                        [centre, centre],
                        color=_WAIT_COLOUR,
                        linewidth=0.9,
                        solid_capstyle="butt",
                    )
                    ax.plot([record.ready_s * 1e3], [centre], marker="|", markersize=5, color=_WAIT_COLOUR)
                width_ms = max((record.done_s - record.issued_s) * 1e3, min_width_ms)
                ax.add_patch(
                    Rectangle(
                        (record.issued_s * 1e3, top + 0.12 * row_h),
                        width_ms,
                        0.76 * row_h,
                        facecolor=_COMM_COLOUR,
                        edgecolor="white",
                        linewidth=0.5 if width_ms > 4 * min_width_ms else 0.0,
                        zorder=2,
                    )
                )
                label = f"b{record.bucket} {_human_bytes(record.nbytes)}"
                # rough width of the text: ~0.6 em per character
                text_ms = len(label) * 0.6 * _LABEL_FONTSIZE / 72 * ms_per_inch
                if width_ms >= max(text_ms * 1.2, _LABEL_MIN_FRACTION * span_ms):
                    ax.text(
                        record.issued_s * 1e3 + width_ms / 2,
                        centre,
                        label,
                        ha="center",
                        va="center",
                        fontsize=_LABEL_FONTSIZE,
                        color="white",
                        zorder=3,
                        clip_on=True,
                    )
            ticks.append(y + comm_h / 2)
            tick_labels.append(f"rank {timeline.rank} comm")
            y += comm_h
            ax.axhline(y, color="#888888", linewidth=0.8)

        ax.set_xlim(start_ms, end_ms)
        ax.set_ylim(y, 0.0)
        ax.set_yticks(ticks, tick_labels)
        ax.tick_params(axis="y", length=0)
        ax.set_xlabel("time since step start (ms)")
        ax.grid(axis="x", color="#EEEEEE", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.set_title(title or f"step {ordered[0].step}", pad=28)

        handles = [Patch(facecolor=c, label=p) for p, c in phase_colours.items()]
        if any(t.comm for t in ordered):
            handles += [
                Patch(facecolor=_COMM_COLOUR, label="collective (issued → done)"),
                Line2D([], [], color=_WAIT_COLOUR, marker="|", label="wait (ready → issued)"),
            ]
        handles.append(Patch(facecolor=_PHASE_COLOURS["backward"], alpha=0.15, label="backward span"))
        ax.legend(
            handles=handles,
            loc="lower center",
            bbox_to_anchor=(0.5, 1.0),
            ncol=len(handles),
            fontsize=8,
            frameon=False,
            handlelength=1.5,
        )

        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _assign_sub_rows(comm: Sequence[CommRecord]) -> tuple[list[int], int]:
    """Sub-row of each collective (in input order) and the number of sub-rows used.

    Greedy interval partitioning over ``[min(ready, issued), done]``: the wait line belongs to its bar, so it must not
    run under another bar. Collectives are taken by start time and each goes into the lowest sub-row that is free by
    then. Past ``_MAX_SUB_ROWS`` one goes into the sub-row that frees up first, accepting some overdraw rather than a
    lane as tall as the bucket count.
    """
    order = sorted(range(len(comm)), key=lambda i: (min(comm[i].ready_s, comm[i].issued_s), comm[i].done_s))
    row_end: list[float] = []
    assigned = [0] * len(comm)
    for i in order:
        begin, end = min(comm[i].ready_s, comm[i].issued_s), max(comm[i].done_s, comm[i].issued_s)
        free = next((r for r, last in enumerate(row_end) if last <= begin), None)
        if free is None and len(row_end) < _MAX_SUB_ROWS:
            row_end.append(end)
            free = len(row_end) - 1
        elif free is None:
            free = min(range(len(row_end)), key=row_end.__getitem__)
        row_end[free] = max(row_end[free], end)
        assigned[i] = free
    return assigned, max(len(row_end), 1)


def _x_range(timelines: Sequence[StepTimeline]) -> tuple[float, float]:
    """(start, end) of the x axis in ms: from the step start (or earlier, if something is) to the last event."""
    times = [0.0]
    for t in timelines:
        times += [x for _, begin, end in t.compute for x in (begin, end)]
        times += [x for r in t.comm for x in (r.ready_s, r.issued_s, r.done_s)]
    start, end = min(times) * 1e3, max(times) * 1e3
    if end - start <= 0:
        return start, start + 1.0
    return start, end + 0.02 * (end - start)


def _human_bytes(nbytes: int) -> str:
    """``2.4MiB``-style size: binary units, as bucket sizes are configured in MiB."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    if unit == "B":
        return f"{int(size)}B"
    return f"{size:.1f}{unit}" if size < 10 else f"{size:.0f}{unit}"
