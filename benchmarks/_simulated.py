"""``gpuN_gpt2s.py --simulate N``: the world-size-N path on one GPU, over free or emulated links.

Each contender is a one-GPU job. A static_dist contender runs ``StaticDistStrategy(simulate={"world_size": N})``;
the plain DDP contenders wrap the model in ``DistributedDataParallel`` over the same simulated process group; the
ceiling trains alone. The links (``--link``, any number) are a property of the simulated group, not of the compiled
step, so one job measures every link: its timed windows take the links in turn (A B C A B C ...), each window
between two device synchronisations, and every window's mean step is filed under its link.

    --link free                       collectives cost nothing but their arithmetic
    --link nvlink=308,5,16            name=GB/s,latency_us,SMs held (an unnamed spec is named by its numbers)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Link:
    name: str
    spec: Optional[tuple[float, float, int]]
    """(GB/s, latency in microseconds, SMs held); ``None``: free."""

    def config(self) -> Any:
        from lightning_static_dist.simulate import LinkConfig

        if self.spec is None:
            return None
        gbps, latency_us, sms = self.spec
        return LinkConfig(gbps=gbps, latency_us=latency_us, sms=sms)

    def describe(self) -> dict[str, Any]:
        if self.spec is None:
            return {"name": self.name, "free": True}
        gbps, latency_us, sms = self.spec
        return {"name": self.name, "gbps": gbps, "latency_us": latency_us, "sms": sms}


def parse_link(text: str) -> Link:
    """``free``, ``GBPS,LAT_US,SMS`` or ``NAME=GBPS,LAT_US,SMS``."""
    name, _, spec = text.rpartition("=")
    if spec == "free":
        return Link(name or "free", None)
    parts = spec.split(",")
    if len(parts) != 3:
        raise ValueError(f"--link {text!r}: expected free, GBPS,LATENCY_US,SMS or NAME=GBPS,LATENCY_US,SMS")
    gbps, latency_us, sms = float(parts[0]), float(parts[1]), int(parts[2])
    return Link(name or f"{gbps:g}GBps-{latency_us:g}us-{sms}sm", (gbps, latency_us, sms))


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


def sim_rows(runs: dict[str, list[dict]], links: list[Link], tokens_fallback: int) -> list[dict]:
    """One row per contender, world size and link: the median window step at that link over every round."""
    rows = []
    ceiling = [s for r in runs.get("ceiling@1", []) if "error" not in r for s in r["step_s"]]
    ceiling_s = statistics.median(ceiling) if ceiling else None
    for key, recs in runs.items():
        name, where = key.rsplit("@", 1)
        ok = [r for r in recs if "error" not in r]
        failed = [r for r in recs if "error" in r]
        status = f"failed: {failed[0]['error']}" if failed else "ok"
        per_link = links if where.startswith("sim") else [None]
        for link in per_link:
            row: dict[str, Any] = {"contender": name, "world": int(where[3:]) if where.startswith("sim") else 1,
                                   "link": link.name if link is not None else None, "status": status}
            windows = [[s for s, n in zip(r["step_s"], r.get("window_links") or [None] * len(r["step_s"]))
                        if link is None or n == link.name] for r in ok]
            flat = [s for w in windows for s in w]
            if flat:
                median_s = statistics.median(flat)
                tokens = ok[0].get("tokens_per_step", tokens_fallback)
                row.update({
                    "step_ms_median": round(1e3 * median_s, 3),
                    "step_ms_per_round": [round(1e3 * statistics.median(w), 3) for w in windows if w],
                    "tokens_per_s_per_gpu": round(tokens / median_s),
                    "vs_ceiling": round(ceiling_s / median_s, 4) if ceiling_s else None,
                    "rounds": len([w for w in windows if w]),
                    "timed_steps": len(flat) * ok[0].get("window", 1),
                    "peak_mem_gib": max((r["peak_mem_gib"] for r in ok if r.get("peak_mem_gib") is not None),
                                        default=None),
                    "bytes_per_step": ok[-1].get("bytes_per_step"),
                    # (the monitored tail runs at the last link only)
                    "overlap_tail": ok[-1].get("overlap") if link is None or link is links[-1] else None,
                })
            rows.append(row)
    return rows


#: the 2-GPU record the emulation is calibrated against (benchmarks/results/gpu2-gpt2s-nanogpt-2026-12-01.json):
#: step ms of the ceiling, of static_dist's defaults and of plain DDP + compile, on 2 x H200 over NVLink
RECORDED_2GPU = {"ceiling": 33.34, "static_dist": 36.88, "plain_ddp_compile": 36.80}


def sim_summary(rows: list[dict], links: list[Link], calibrated: Optional[str]) -> dict[str, Any]:
    """``sim_free_vs_ceiling`` (and ``_8``), ``sim_nvlink_vs_ceiling`` (and ``_8``) for the defaults, and the
    calibration error against the 2-GPU record: |simulated - recorded| / recorded of the step time scaled to the
    record's ceiling (this run's ceiling differs from that day's), for static_dist's defaults and, as the second
    point, plain DDP + compile."""
    by = {(r["contender"], r["world"], r["link"]): r for r in rows if r.get("step_ms_median")}
    free_links = {link.name for link in links if link.spec is None}
    out: dict[str, Any] = {"calibrated_link": calibrated}
    ceiling = by.get(("ceiling", 1, None))
    for world, suffix in ((2, ""), (8, "_8")):
        free = next((by[k] for k in by if k[:2] == ("static_dist", world) and k[2] in free_links), None)
        out[f"sim_free_vs_ceiling{suffix}"] = free["vs_ceiling"] if free else None
        nv = by.get(("static_dist", world, calibrated)) if calibrated else None
        out[f"sim_nvlink_vs_ceiling{suffix}"] = nv["vs_ceiling"] if nv else None
    if ceiling and calibrated:
        scale = RECORDED_2GPU["ceiling"] / ceiling["step_ms_median"]
        for name, key in (("static_dist", "sim_calibration_error"), ("plain_ddp_compile", "sim_calibration_error_ddp")):
            row = by.get((name, 2, calibrated))
            if row:
                predicted = row["step_ms_median"] * scale
                out[key] = round(abs(predicted - RECORDED_2GPU[name]) / RECORDED_2GPU[name], 4)
                out[f"{key}_predicted_ms"] = round(predicted, 2)
    out["targets"] = {"sim_free_vs_ceiling": ">= 0.995", "sim_nvlink_vs_ceiling": ">= 0.95",
                      "sim_calibration_error": "<= 0.03"}
    return out
