"""The critical-point sweep's table and plot, shared by ``benchmarks/critical_point.py`` (which runs the sweep) and
``lsd-report <record>.json`` (which shows a recorded one again).

A *row* is one setting of the sweep: :data:`~lightning_static_dist.compression.critical.ROW_KEYS` plus the
benchmark's figures (``bytes_per_step``, ``compression_ratio``, ``step_ms_median`` ...); ``points`` maps each
compressor family to the setting at its critical point
(:func:`~lightning_static_dist.compression.critical.critical_points`).
A row whose bytes were not counted (a reference run outside the synchroniser, such as PyTorch's own PowerSGD hook)
has ``None`` there and is drawn as a horizontal line at its loss ratio.

Example::

    print(format_table(record["rows"], record["summary"]["critical_points"]))
    plot_sweep(record["rows"], points, tolerance=1.03, path="sweep.png", title="cpu2-critical-point")
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

Row = Mapping[str, Any]

#: the families with a curve on the plot, each in its colour, and how a setting of each is labelled
_FAMILIES = {
    "qsgd": ("tab:blue", lambda r: f"{r['bits']}b"),
    "topk": ("tab:orange", lambda r: f"{100 * r['compression']['density']:g}%"),
    "powersgd": ("tab:green", lambda r: f"r{r['compression']['rank']}"),
}


def _step(row: Row, key: str) -> str:
    if row.get("diverged_step") is not None:
        return f"div@{row['diverged_step']}"
    return "-" if row[key] is None else str(row[key])


def _num(value: Optional[float], fmt: str) -> str:
    """``value`` in ``fmt`` (``"7.3f"``), or ``-`` padded to the same width."""
    return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))


def sweep_title(scenario: str, settings: Mapping[str, Any]) -> str:
    """The plot's title: scenario, model shape, steps and warm-up (from a record's ``settings``)."""
    model = settings["model"]
    return (f"{scenario}: CharGPT d={model['n_embd']}, {model['n_layer']} layers, {settings['steps']} steps "
            f"(exact for the first {settings['start_step']})")


def format_table(rows: Sequence[Row], points: Mapping[str, Optional[str]]) -> str:
    """One line per setting: bytes per step, compression ratio, final train / validation loss ratio to exact, the
    steps where it first fell 3 % and 10 % behind (or diverged), the guard's gradient error, the step time; ``*``
    marks each family's critical point."""
    lines = [f"{'setting':<18} {'bytes/step':>11} {'ratio':>7} {'loss x':>7} {'val x':>7} {'>3%':>7} {'>10%':>7} "
             f"{'rel err':>8} {'max':>6} {'ms/step':>8}"]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['setting']:<18} failed: {r['failed']}")
            continue
        mark = " *" if points.get(r["family"]) == r["setting"] else ""
        nbytes = "-" if r["bytes_per_step"] is None else f"{r['bytes_per_step']:,}"
        ratio = "-" if r["compression_ratio"] is None else f"{r['compression_ratio']:.1f}x"
        lines.append(
            f"{r['setting']:<18} {nbytes:>11} {ratio:>7} {_num(r['final_loss_ratio'], '7.3f')} "
            f"{_num(r['val_loss_ratio'], '7.3f')} {_step(r, 'behind_3pct_step'):>7} {_step(r, 'behind_10pct_step'):>7} "
            f"{_num(r['rel_error_median'], '8.3f')} {_num(r['rel_error_max'], '6.3f')} "
            f"{_num(r.get('step_ms_median'), '8.1f')}{mark}")
    lines.append("* the family's critical point")
    return "\n".join(lines)


def plot_sweep(rows: Sequence[Row], points: Mapping[str, Optional[str]], tolerance: float, path: str,
               title: str) -> str:
    """Final loss ratio against compression ratio (log x), one curve per family, the critical point ringed, rows
    without a byte count as horizontal lines; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.2))
    ok = [r for r in rows if "failed" not in r]
    finite = [r["final_loss_ratio"] for r in ok if r["final_loss_ratio"] is not None]
    ceiling = max(finite + [tolerance]) * 1.05
    for family, (color, label) in _FAMILIES.items():
        members = sorted((r for r in ok if r["family"] == family), key=lambda r: r["level"])
        if not members:
            continue
        xs = [r["compression_ratio"] for r in members]
        ys = [r["final_loss_ratio"] if r["final_loss_ratio"] is not None else ceiling for r in members]
        ax.plot(xs, ys, "-o", color=color, label=family)
        for r, x, y in zip(members, xs, ys):
            diverged = r["final_loss_ratio"] is None
            ax.annotate(label(r) + (" (diverged)" if diverged else ""), (x, y), textcoords="offset points",
                        xytext=(9, 5), fontsize=8, color=color)
            if r["setting"] == points.get(family):
                ax.plot([x], [y], "o", ms=16, mfc="none", mec=color, mew=2)
        if family == "qsgd":
            packed = [r["packed_compression_ratio_estimate"] for r in members]
            ax.plot(packed, ys, "--o", color=color, mfc="none", alpha=0.6, label="qsgd if bit-packed (estimate)")
    for r in ok:
        if r["compression_ratio"] is None and r["final_loss_ratio"] is not None:
            ax.axhline(r["final_loss_ratio"], color="tab:purple", ls="--", lw=1,
                       label=f"{r['setting']} (bytes not counted)")
    ax.plot([1.0], [1.0], "ks", label="exact fp32")
    ax.axhline(tolerance, color="grey", ls=":", lw=1, label=f"tolerance {tolerance}x")
    ax.set_xscale("log")
    ax.set_xlabel("compression ratio (uncompressed bytes / bytes sent per step, log scale)")
    ax.set_ylabel("final training loss / exact's")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: what a critical-point record holds (``benchmarks/critical_point.py``'s ``write_record`` call)
_RECORD_KEYS = ("scenario", "settings", "rows", "summary")


def is_sweep_record(path: str) -> bool:
    """Whether ``path`` names a critical-point record (``*-critical-point[-tag]-<date>.json``): a JSON file whose
    first key, ``scenario``, says so. Only the file's first bytes are read."""
    if not (path.endswith(".json") and os.path.isfile(path)):
        return False
    with open(path, "rb") as f:
        head = f.read(256).decode("utf-8", errors="replace")
    return bool(re.match(r'\s*\{\s*"scenario"\s*:\s*"[^"]*-critical-point', head))


def report_sweep(path: str, plot_to: Optional[str] = None) -> str:
    """``lsd-report <record>.json``: the recorded sweep's settings, table and critical points (and those of any
    earlier run the record carries, ``run_*`` blocks), and, with ``plot_to``, its plot drawn again there."""
    try:
        with open(path) as f:
            record = json.load(f)
    except ValueError as err:
        raise ValueError(f"{path}: not a readable critical-point record ({err})") from err
    missing = [key for key in _RECORD_KEYS if key not in record]
    if missing:
        raise ValueError(f"{path}: not a critical-point record (no {', '.join(missing)})")
    settings, summary = record["settings"], record["summary"]
    points, tolerance = summary["critical_points"], summary["tolerance"]
    title = sweep_title(record["scenario"], settings)
    lines = [f"record: {path} ({record.get('date', '?')}, torch {record.get('versions', {}).get('torch', '?')})",
             title, format_table(record["rows"], points),
             f"critical points (final loss <= {tolerance}x exact): {points}"]
    for key, run in record.items():
        if key.startswith("run_") and isinstance(run, dict) and "rows" in run:
            lines += [f"{key}: {sweep_title(record['scenario'], run['settings'])}",
                      format_table(run["rows"], run["summary"]["critical_points"])]
    if plot_to is not None:
        lines.append(f"plot: {plot_sweep(record['rows'], points, tolerance, plot_to, title)}")
    return "\n".join(lines)
