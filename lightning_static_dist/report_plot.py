"""``curves.png`` of ``lsd-report``: a run's logged metrics against the step, in sections read top down.

Each section is a grid of small panels under its own title:

1. **loss**: every key with ``loss`` in its name, together in one panel.
2. **static_dist/**: the overlap and communication figures the strategy logs. Fractions first (overlap ratio, hidden
   comm fraction), then times, then bytes, then the rest; the profiler's ``trace_`` figures after the ones measured
   every step. A figure and its ``_max`` twin (mean and maximum over ranks) share a panel.
3. everything else, alphabetically, twins paired the same way.

A constant series (every value equal, up to a relative spread of 1e-9) is not drawn: its value goes into a caption
under the grid, and to the caller. The y axes speak the unit the metric's name gives (``bytes`` -> B/kB/MB/GB, ``_ms``
and ``_s`` -> ms/s, ``frac`` and ``overlap_ratio`` -> %) with as many decimals as the ticks need to differ, never
matplotlib's offset or scientific notation. Why: docs/internals.md, "report_plot.py".

Pure planning (:func:`plan_sections`, :func:`constant_series`, :func:`unit_of`, :func:`format_value`,
:func:`tick_labels`) is separate from drawing (:func:`plot_curves`), so the order and the units are tested without
rendering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_static_dist.overlap.picture import _COMM_COLOUR, _PHASE_COLOURS

Series = Mapping[str, Sequence[tuple[int, float]]]
"""``{metric: [(step, value), ...]}``, as ``cli.read_metrics`` returns it."""

STATIC_DIST_PREFIX = "static_dist/"
_MAX_SUFFIX = "_max"
_REL_SPREAD = 1e-9
"""A series whose (max - min) is at most this fraction of its largest magnitude is constant."""

_UNIT_LADDERS: dict[str, tuple[tuple[float, str], ...]] = {
    # (factor, suffix), largest first: a value is shown in the first unit it reaches at least 1 of
    "bytes": ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")),
    "ms": ((1e3, "s"), (1.0, "ms")),
    "s": ((1.0, "s"), (1e-3, "ms")),
    "fraction": ((0.01, "%"),),
}
_UNIT_ORDER = ("fraction", "ms", "s", "bytes", None)
"""Order of the panels inside the ``static_dist/`` section: the headline ratios, then time, then volume."""

_COLUMNS = 3
_WIDTH_IN = 12.0
_ROW_IN = 1.9
"""Height of one row of panels."""
_TITLE_IN = 0.4
_CAPTION_LINE_IN = 0.18
_CAPTION_CHARS = 170
"""Caption line length at its font size across the figure's width."""
_DPI = 100
_LINE_COLOURS = (_PHASE_COLOURS["forward"], _PHASE_COLOURS["backward"], _PHASE_COLOURS["optimizer"], _COMM_COLOUR)
_GRID_COLOUR = "#EEEEEE"
_CAPTION_COLOUR = "#555555"


@dataclass(frozen=True)
class Panel:
    """One axes: the series drawn in it, their legend labels, and the unit of its y axis."""

    title: str
    keys: tuple[str, ...]
    labels: tuple[str, ...]
    unit: Optional[str]


@dataclass(frozen=True)
class Section:
    """A titled grid of panels."""

    title: str
    panels: tuple[Panel, ...]
    shared_labels: tuple[str, ...] = ()
    """Labels that mean the same in every panel (mean / max over ranks): one legend for the section says them."""


@dataclass(frozen=True)
class CurvesPlot:
    """What :func:`plot_curves` wrote: the PNG, its sections in drawing order, and the series it left out.

    Example::

        curves = plot_curves(read_metrics(f"{log_dir}/metrics.csv"), f"{log_dir}/curves.png")
        print(f"plot: {curves.path}")
        if curves.caption:
            print(curves.caption)  # constant, not plotted: static_dist/bytes_sent = 3.37 MB, ...
    """

    path: str
    sections: tuple[Section, ...]
    constant: dict[str, float]
    """Constant series, ``{metric: value}``; listed in :attr:`caption`, not drawn."""
    caption: str
    """``"constant, not plotted: key = value, ..."``; empty when every series is drawn."""


def unit_of(key: str) -> Optional[str]:
    """The unit a metric's name gives: ``"bytes"``, ``"ms"``, ``"s"``, ``"fraction"``, or None for a plain number.

    ``compression_ratio`` stays plain: it is a multiple (dense bytes over sent bytes, >= 1), not a part of a whole.
    """
    name = key.rsplit("/", 1)[-1].removesuffix(_MAX_SUFFIX)
    if "bytes" in name:
        return "bytes"
    if name.endswith("_ms"):
        return "ms"
    if name.endswith("_s") and not name.endswith("per_s"):
        return "s"
    if "frac" in name or name.endswith("overlap_ratio"):
        return "fraction"
    return None


def format_value(value: float, unit: Optional[str], decimals: Optional[int] = None) -> str:
    """``3.37 MB``, ``1.5 s``, ``91%``: the value in the largest unit it reaches 1 of.

    Three significant figures, trailing zeros dropped, unless ``decimals`` fixes the digits after the point.
    """
    factor, suffix = _scale(abs(value), unit)
    return _with_suffix(_digits(value / factor, decimals), suffix)


def tick_labels(locs: Sequence[float], unit: Optional[str]) -> list[str]:
    """The labels of a y axis's ticks: one unit for all of them, and the fewest decimals that show every tick exactly.

    The unit is chosen by the largest tick, so ``0``, ``0.5 MB``, ``1 MB`` rather than ``0 B``, ``500 kB``, ``1 MB``.
    """
    finite = [v for v in locs if math.isfinite(v)]
    if len(finite) < 2:
        return [format_value(v, unit) for v in locs]
    factor, suffix = _scale(max(abs(v) for v in finite), unit)
    scaled = [v / factor for v in finite]
    step = min(abs(b - a) for a, b in zip(scaled, scaled[1:])) or 1.0
    decimals = max(0, math.ceil(-math.log10(step)))
    # 0.25-steps need two decimals where their spacing suggests one: widen until rounding loses nothing
    while decimals < 9 and any(abs(round(v, decimals) - v) > step * 1e-6 for v in scaled):
        decimals += 1
    return [_with_suffix(_digits(v / factor, decimals), suffix) for v in locs]


def constant_series(series: Series) -> dict[str, float]:
    """``{metric: value}`` of the series whose finite values are all equal (relative spread < 1e-9), in key order.

    A series with no finite value at all (a ratio that is NaN without collectives) counts as constant NaN.
    """
    constant: dict[str, float] = {}
    for key in sorted(series):
        values = [v for _, v in series[key] if math.isfinite(v)]
        if not values:
            constant[key] = float("nan")
        elif max(values) - min(values) <= _REL_SPREAD * max(abs(max(values)), abs(min(values))):
            constant[key] = values[-1]
    return constant


def plan_sections(series: Series) -> tuple[tuple[Section, ...], dict[str, float]]:
    """The panels to draw, in order (see the module docstring), and the constant series left out of them."""
    constant = constant_series(series)
    shown = [key for key in sorted(series) if key not in constant]
    losses = tuple(key for key in shown if "loss" in key)
    dist = [key for key in shown if key.startswith(STATIC_DIST_PREFIX) and key not in losses]
    rest = [key for key in shown if key not in losses and key not in dist]

    sections = []
    if losses:
        sections.append(Section("loss", (Panel("loss", losses, losses, unit_of(losses[0])),)))
    if dist:
        twins = ("mean over ranks", "max over ranks")
        panels = _twin_panels(dist, _dist_order, twins)
        sections.append(Section("static_dist/: overlap and communication", panels, shared_labels=twins))
    if rest:
        sections.append(Section("other metrics", _twin_panels(rest, lambda name: name, None)))
    return tuple(sections), constant


def plot_curves(series: Series, path: str) -> CurvesPlot:
    """Draw ``series`` into a PNG at ``path``, a grid of panels per section, constant series named in a caption.

    Args:
        series: ``{metric: [(step, value), ...]}``, as ``cli.read_metrics`` returns it.
        path: where the PNG goes; its directory must exist.

    Returns:
        What was drawn and what was left out; see :class:`CurvesPlot`.
    """
    sections, constant = plan_sections(series)
    caption = ""
    if constant:
        caption = "constant, not plotted: " + ", ".join(_constant_item(key, value, len(series[key]))
                                                     for key, value in constant.items())
    caption_lines = _wrap_items(caption, _CAPTION_CHARS)

    import matplotlib

    # selected here rather than at import time so importing the package never changes the caller's backend
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = [math.ceil(len(section.panels) / _COLUMNS) for section in sections]
    heights = [_TITLE_IN + n * _ROW_IN for n in rows] + [_CAPTION_LINE_IN * (len(caption_lines) + 1)] * bool(caption)
    fig = plt.figure(figsize=(_WIDTH_IN, max(sum(heights), 1.0)), layout="constrained")
    try:
        if heights:
            subfigs = fig.subfigures(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]
            for subfig, section, n_rows in zip(subfigs, sections, rows):
                subfig.suptitle(section.title, x=0.005, ha="left", fontsize=10, fontweight="bold")
                if section.shared_labels:
                    handles = [Line2D([], [], color=c, label=label)
                               for label, c in zip(section.shared_labels, _LINE_COLOURS)]
                    subfig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
                axes = subfig.subplots(n_rows, _COLUMNS, squeeze=False)
                for index, ax in enumerate(axes.ravel()):
                    if index >= len(section.panels):
                        ax.set_visible(False)
                        continue
                    _draw_panel(ax, section.panels[index], series, section.shared_labels)
                    # the step axis is labelled once per column: under the lowest panel that holds one
                    if index + _COLUMNS >= len(section.panels):
                        ax.set_xlabel("step", fontsize=8)
            if caption:
                subfigs[-1].text(0.005, 0.5, "\n".join(caption_lines), ha="left", va="center", fontsize=8,
                                 color=_CAPTION_COLOUR)
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)
    return CurvesPlot(path=path, sections=sections, constant=constant, caption=caption)


def _draw_panel(ax, panel: Panel, series: Series, shared_labels: tuple[str, ...]) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    for key, label, colour in zip(panel.keys, panel.labels, _LINE_COLOURS * len(panel.keys)):
        steps, values = zip(*series[key])
        # twins draw the maximum lighter, behind the mean
        dimmed = key.endswith(_MAX_SUFFIX) and len(panel.keys) > 1
        ax.plot(steps, values, color=colour, linewidth=1.0 if dimmed else 1.4, alpha=0.7 if dimmed else 1.0,
                zorder=1.5 if dimmed else 2.0, marker="." if len(values) < 50 else None, markersize=4, label=label)
    ax.set_title(panel.title, fontsize=9)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
    # the formatter sees the tick positions first (set_locs), so every label can share one unit and precision
    def label(value: float, index: Optional[int]) -> str:
        if index is None or index >= len(formatter.locs):  # the cursor's read-out, not a tick
            return format_value(value, panel.unit)
        return tick_labels(formatter.locs, panel.unit)[index]

    formatter = FuncFormatter(label)
    ax.yaxis.set_major_formatter(formatter)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.tick_params(labelsize=7)
    ax.grid(color=_GRID_COLOUR, linewidth=0.6)
    ax.set_axisbelow(True)
    if len(panel.keys) > 1 and panel.labels != shared_labels:
        ax.legend(fontsize=7, frameon=False)


def _twin_panels(
    keys: Iterable[str], order: Callable[[str], object], twin_labels: Optional[tuple[str, str]]
) -> tuple[Panel, ...]:
    """One panel per metric, its ``_max`` twin beside it; ``order`` sorts by the name without the section prefix."""
    keys = list(keys)
    bases = {key.removesuffix(_MAX_SUFFIX) if key.removesuffix(_MAX_SUFFIX) in keys else key for key in keys}
    panels = []
    for base in sorted(bases, key=lambda b: order(b.removeprefix(STATIC_DIST_PREFIX))):
        members = tuple(k for k in (base, base + _MAX_SUFFIX) if k in keys)
        title = base.removeprefix(STATIC_DIST_PREFIX)
        labels = tuple(m.removeprefix(STATIC_DIST_PREFIX) for m in members)
        if twin_labels and len(members) == 2:
            labels = twin_labels
        panels.append(Panel(title, members, labels, unit_of(base)))
    return tuple(panels)


def _dist_order(name: str) -> tuple[bool, int, str]:
    return name.startswith("trace_"), _UNIT_ORDER.index(unit_of(name)), name


def _constant_item(key: str, value: float, n_points: int) -> str:
    item = f"{key} = {format_value(value, unit_of(key))}"
    return item + " (1 point)" if n_points == 1 else item


def _wrap_items(text: str, width: int) -> list[str]:
    """``text``'s comma-separated items packed into lines of at most ``width`` characters, never split inside one."""
    lines: list[str] = []
    for item in text.split(", ") if text else []:
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += ", " + item
        else:
            lines.append(item)
    return lines


def _scale(magnitude: float, unit: Optional[str]) -> tuple[float, str]:
    if unit is None:
        return 1.0, ""
    ladder = _UNIT_LADDERS[unit]
    return next(((f, s) for f, s in ladder if magnitude >= f), ladder[-1])


def _digits(value: float, decimals: Optional[int]) -> str:
    if not math.isfinite(value):
        return str(value)
    if decimals is not None:
        return f"{value:.{decimals}f}"
    # three significant figures in fixed notation: 81920 stays 81920, never 8.19e+04
    places = max(0, 2 - math.floor(math.log10(abs(value)))) if value else 0
    text = f"{value:.{places}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _with_suffix(number: str, suffix: str) -> str:
    if not suffix or number in ("nan", "inf", "-inf"):
        return number
    return number + suffix if suffix == "%" else f"{number} {suffix}"
