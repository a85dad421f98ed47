"""``gpuN_gpt2s.py --simulate N``: the world-size-N path on one GPU, over free or emulated links.

Each contender is a one-GPU job. A static_dist contender runs ``StaticDistStrategy(simulate={"world_size": N})``;
the plain DDP contenders wrap the model in ``DistributedDataParallel`` over the same simulated process group; the
ceiling trains alone. The links (``--link``, any number) are a property of the simulated group, not of the compiled
step, so one job measures every link: its timed windows take the links in turn (A B C A B C ...), each window
between two device synchronisations, and every window's mean step is filed under its link.

    --link free                       collectives cost nothing but their arithmetic
    --link nvlink=308,5,16            name=GB/s,latency_us,SMs held (an unnamed spec is named by its numbers)
    --link nv2=70,5,16,308,65         ... and two regimes: GB/s while the GPU is otherwise idle, GB/s per SM held
                                      (``strategy.simulate.link``'s ``idle_gbps`` and ``sm_gbps``; ``-``: unset)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Link:
    name: str
    spec: Optional[dict[str, Any]]
    """``strategy.simulate.link``'s fields (gbps, latency_us, sms, idle_gbps, sm_gbps); ``None``: free."""

    def config(self) -> Any:
        from lightning_static_dist.simulate import LinkConfig

        return None if self.spec is None else LinkConfig(**self.spec)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "free": True} if self.spec is None else {"name": self.name, **self.spec}


_FIELDS = ("gbps", "latency_us", "sms", "idle_gbps", "sm_gbps")
_REQUIRED = {"gbps": "GBPS", "latency_us": "LATENCY_US", "sms": "SMS"}
"""The fields a link spec must give (``-`` is refused there: it leaves only an optional field unset)."""


def parse_link(text: str) -> Link:
    """``free``, or ``[NAME=]GBPS,LAT_US,SMS[,IDLE_GBPS[,SM_GBPS]]`` (``-`` leaves an optional field unset; in a
    required one it is a ``ValueError`` naming the field)."""
    name, _, spec = text.rpartition("=")
    if spec == "free":
        return Link(name or "free", None)
    parts = spec.split(",")
    if not 3 <= len(parts) <= 5:
        raise ValueError(f"--link {text!r}: expected free or [NAME=]GBPS,LATENCY_US,SMS[,IDLE_GBPS[,SM_GBPS]]")
    values: dict[str, Any] = {}
    for field, part in zip(_FIELDS, parts):
        if part == "-" and field in _REQUIRED:
            raise ValueError(f"--link {text!r}: {_REQUIRED[field]} is required ('-' leaves only IDLE_GBPS or SM_GBPS"
                             " unset)")
        if part != "-":
            values[field] = int(part) if field == "sms" else float(part)
    return Link(name or spec.replace(",", "-"), values)


class WindowLinks:
    """The worker's links, switched at each timed window's start (the tail after the timed windows keeps the last)."""

    def __init__(self, links: list[Link]) -> None:
        self.links = links

    def prepare(self, device: Any) -> None:
        """Compile the emulation's kernel before any timed window (its first use would land in one)."""
        if any(link.spec is not None for link in self.links) and device.type == "cuda":
            from lightning_static_dist.simulate.link import check_available

            check_available(device)

    def switch(self, window: int, last: bool) -> None:
        from lightning_static_dist.simulate.group import WORLD, set_link

        link = self.links[-1] if last else self.links[window % len(self.links)]
        set_link(link.config(), WORLD.sms)  # (the contender's own sync.comm_sms stays)

    def window_names(self, windows: int) -> list[str]:
        return [self.links[i % len(self.links)].name for i in range(windows)]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def split_key(run_key: str) -> tuple[str, int, str]:
    """``"static_dist@sim2+busy"`` -> ``("static_dist", 2, "busy")``; ``"ceiling@1"`` -> ``("ceiling", 1, "quiet")``."""
    key, _, host = run_key.partition("+")
    name, where = key.rsplit("@", 1)
    return name, int(where[3:]) if where.startswith("sim") else int(where), host or "quiet"


def sim_rows(runs: dict[str, list[dict]], links: list[Link], workers: dict[str, dict]) -> list[dict]:
    """One row per contender, world size, link and host load, from the persistent workers' rounds.

    A round's figure is the median of its windows at that link; ``step_ms_median`` is the median over every window
    of every round. ``vs_ceiling_per_round`` pairs each round with the ceiling's same round under the same host load
    (the two ran seconds apart), ``vs_ceiling`` compares the medians, ``spread`` is (slowest round - fastest) /
    median; ``vs_ceiling_paired`` and ``paired_spread`` are the median and the spread of the paired ratios (the GPU's
    own drift over a run cancels in them). ``host_ms_median``: how long the host took to issue a step (``_rounds.py``). ``workers``: each job's own
    record (peak memory, compile figures, the monitored tail)."""
    names = [link.name for link in links]

    def windows_of(rec: dict, link: Optional[str], field: str = "window_s") -> list[float]:
        return [s for i, s in enumerate(rec[field]) if link is None or names[i % len(names)] == link]

    ceilings = {host: {rec["round"]: _median(rec["window_s"]) for rec in recs}
                for run_key, recs in runs.items() for name, _, host in [split_key(run_key)] if name == "ceiling"}
    ceiling_all = {host: _median([s for run_key, recs in runs.items() if split_key(run_key)[0] == "ceiling"
                                  and split_key(run_key)[2] == host for rec in recs for s in rec["window_s"]])
                   for host in ceilings}
    rows = []
    for run_key, recs in runs.items():
        name, world, host = split_key(run_key)
        name, _, pinned = name.partition("~")  # ("static_dist~cal": every window at the link cal, set from setup)
        job = workers.get(run_key.partition("+")[0], {})
        for link in ([pinned] if pinned else names) if world > 1 else [None]:  # (a world of 1 crosses no link)
            window_link = None if pinned else link
            per_round = {rec["round"]: _median(windows_of(rec, window_link)) for rec in recs
                         if windows_of(rec, window_link)}
            if not per_round:
                continue
            every = [s for rec in recs for s in windows_of(rec, window_link)]
            median_s = _median(every)
            ceiling_rounds, ceiling_s = ceilings.get(host, {}), ceiling_all.get(host)
            paired = [round(ceiling_rounds[r] / s, 4) for r, s in sorted(per_round.items()) if r in ceiling_rounds]
            round_ms = [round(1e3 * s, 3) for _, s in sorted(per_round.items())]
            rows.append({
                "contender": name, "world": world, "link": link, "host": host, "status": "ok",
                "step_ms_median": round(1e3 * median_s, 3),
                "step_ms_per_round": round_ms,
                "spread": round((max(round_ms) - min(round_ms)) / (1e3 * median_s), 4),
                "host_ms_median": round(1e3 * _median([h for rec in recs for h in windows_of(rec, window_link,
                                                                                        "host_s")]), 3),
                "pinned": bool(pinned),
                "measured": job.get("measured"),
                "tokens_per_s_per_gpu": round(job.get("tokens_per_step", 0) / median_s) if job else None,
                "vs_ceiling": round(ceiling_s / median_s, 4) if ceiling_s else None,
                "vs_ceiling_per_round": paired,
                "vs_ceiling_paired": round(_median(paired), 4) if paired else None,
                "vs_ceiling_min": min(paired) if paired else None,
                "paired_spread": round((max(paired) - min(paired)) / _median(paired), 4) if paired else None,
                "rounds": len(per_round),
                "timed_steps": len(every) * job.get("window", 1) if job else None,
                "peak_mem_gib": job.get("peak_mem_gib"),
                "bytes_per_step": job.get("bytes_per_step"),
                "compile": job.get("compile"),
                "schedule_choice": job.get("schedule_choice"),
                # (the monitored tail runs at the last link, unloaded)
                "overlap_tail": job.get("overlap") if host == "quiet" and (link is None or link == names[-1]) else None,
            })
    return rows


#: the 2-GPU record the emulation is calibrated against (benchmarks/results/gpu2-gpt2s-nanogpt-2026-12-01.json):
#: step ms of the ceiling, of static_dist's defaults and of plain DDP + compile, on 2 x H200 over NVLink
RECORDED_2GPU = {"ceiling": 33.34, "static_dist": 36.88, "plain_ddp_compile": 36.80}
#: the contender that runs what the record's row ran: static_dist's defaults of that day were ``schedule: overlap``
#: with the compiled step launched kernel by kernel (``static_dist_nocg``; else ``static_dist_overlap``, the same
#: with CUDA graphs); plain DDP + compile is unchanged
RECORDED_AS = {"static_dist": ("static_dist_nocg", "static_dist_overlap"), "plain_ddp_compile": ("plain_ddp_compile",)}


def calibration(rows: list[dict], links: list[Link]) -> dict[str, dict[str, Any]]:
    """Per emulated link: each recorded row's simulated step time, scaled to the record's ceiling (this run's ceiling
    differs from that day's), and its error |simulated - recorded| / recorded."""
    by = {(r["contender"], r["world"], r["link"], r["host"]): r for r in rows if r.get("step_ms_median")}
    ceiling = by.get(("ceiling", 1, None, "quiet"))
    if not ceiling:
        return {}
    scale = RECORDED_2GPU["ceiling"] / ceiling["step_ms_median"]
    out: dict[str, dict[str, Any]] = {}
    for link in links:
        if link.spec is None:
            continue
        for recorded, candidates in RECORDED_AS.items():
            row = next((by[(c, 2, link.name, "quiet")] for c in candidates if (c, 2, link.name, "quiet") in by), None)
            if row:
                predicted = row["step_ms_median"] * scale
                out.setdefault(link.name, {})[recorded] = {
                    "contender": row["contender"], "predicted_ms": round(predicted, 2),
                    "recorded_ms": RECORDED_2GPU[recorded],
                    "error": round(abs(predicted - RECORDED_2GPU[recorded]) / RECORDED_2GPU[recorded], 4)}
    return out


def sim_summary(rows: list[dict], links: list[Link], calibrated: Optional[str]) -> dict[str, Any]:
    """The headline figures of the static_dist defaults (issue 33's and 34's keys).

    ``sim_free_vs_ceiling`` (and ``_8``): median ratio at free links, quiet host; ``sim_free_vs_ceiling_min`` (and
    ``_8``): the worst round's paired ratio; ``sim_free_spread`` (and ``_8``); ``sim_free_busy_host_vs_ceiling``: world
    2 against the ceiling under the same load, with the anchors ``busy_host_ceiling_vs_quiet`` and
    ``busy_host_plain_ddp_compile_vs_ceiling``; ``sim_nvlink_vs_ceiling`` (and ``_8``) at the ``--calibrated`` link,
    and the calibration error against the 2-GPU record: |simulated - recorded| / recorded of the step time scaled to
    the record's ceiling (this run's ceiling differs from that day's), for static_dist's defaults and, as the second
    point, plain DDP + compile. ``peak_gib_vs_ceiling``: the defaults' peak memory at world 2 over the ceiling's, over
    the whole job (CUDA graphs allocate their pool when a graph is recorded, in the warm-up)."""
    by = {(r["contender"], r["world"], r["link"], r["host"]): r for r in rows if r.get("step_ms_median")}
    free = next((link.name for link in links if link.spec is None), None)
    out: dict[str, Any] = {"calibrated_link": calibrated}
    ceiling = by.get(("ceiling", 1, None, "quiet"))
    for world, suffix in ((2, ""), (8, "_8")):
        row = by.get(("static_dist", world, free, "quiet")) if free else None
        out[f"sim_free_vs_ceiling{suffix}"] = row["vs_ceiling"] if row else None
        out[f"sim_free_vs_ceiling_min{suffix}"] = row["vs_ceiling_min"] if row else None
        out[f"sim_free_spread{suffix}"] = row["spread"] if row else None
        out[f"sim_free_vs_ceiling_paired{suffix}"] = row["vs_ceiling_paired"] if row else None
        out[f"sim_free_paired_spread{suffix}"] = row["paired_spread"] if row else None
        nv = by.get(("static_dist", world, calibrated, "quiet")) if calibrated else None
        out[f"sim_nvlink_vs_ceiling{suffix}"] = nv["vs_ceiling"] if nv else None
    busy = by.get(("static_dist", 2, free, "busy")) if free else None
    out["sim_free_busy_host_vs_ceiling"] = busy["vs_ceiling"] if busy else None
    out["sim_free_busy_host_vs_ceiling_paired"] = busy["vs_ceiling_paired"] if busy else None
    out["sim_free_busy_host_vs_ceiling_min"] = busy["vs_ceiling_min"] if busy else None
    busy_ceiling = by.get(("ceiling", 1, None, "busy"))
    out["busy_host_ceiling_vs_quiet"] = (round(ceiling["step_ms_median"] / busy_ceiling["step_ms_median"], 4)
                                         if ceiling and busy_ceiling else None)
    busy_ddp = by.get(("plain_ddp_compile", 2, free, "busy")) if free else None
    out["busy_host_plain_ddp_compile_vs_ceiling"] = busy_ddp["vs_ceiling"] if busy_ddp else None
    ours = by.get(("static_dist", 2, free, "quiet")) if free else None
    out["peak_gib_vs_ceiling"] = (round(ours["peak_mem_gib"] / ceiling["peak_mem_gib"], 4) if ours and ceiling
                                  and ours.get("peak_mem_gib") and ceiling.get("peak_mem_gib") else None)
    fits = calibration(rows, links)
    out["calibration_by_link"] = fits
    for name, key in (("static_dist", "sim_calibration_error"), ("plain_ddp_compile", "sim_calibration_error_ddp")):
        fit = fits.get(calibrated or "", {}).get(name)
        if fit:
            out[key] = fit["error"]
            out[f"{key}_predicted_ms"] = fit["predicted_ms"]
    out["targets"] = {"sim_free_vs_ceiling_min": ">= 0.995", "sim_free_spread": "<= 0.01",
                      "sim_free_busy_host_vs_ceiling": ">= 0.98", "peak_gib_vs_ceiling": "<= 1.10",
                      "sim_nvlink_vs_ceiling": ">= 0.95", "sim_calibration_error": "<= 0.03"}
    return out
