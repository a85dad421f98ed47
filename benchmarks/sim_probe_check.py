"""The link probe of ``sync.schedule: measured`` against the emulated links it should recover.

For each ``--link`` and each world of ``--worlds``, ``--repeats`` times: :func:`probe_link` over the simulated world
(GPT-2 small's bucket, 100 MiB, its width, 768, and the strategy's GEMM rows, ``PROBE_ROWS``), then the measured
idle and busy rates against the link's configured ones (``|measured / configured - 1|``), the slowdown and the
probe's seconds. The configured busy rate is the link's ``gbps`` at the probe's SM budget (the link's own).

    python benchmarks/sim_probe_check.py --link tr=237,12.5,57,317,65 --link one70=70,5,8 \
        --link pcie25=25,5,16 --link net12=12.5,20,16 --worlds 2,8 --out benchmarks/results/sim-probe-check-<date>.json

Simulated on one GPU: the emulation's figures, not a multi-GPU one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (the package, from a checkout)

NBYTES = 100 * 2**20
WIDTH = 768


def one_world(world: int, links: list[str], repeats: int) -> list[dict[str, Any]]:
    """Every link's probes in this process's simulated world of ``world`` ranks."""
    from datetime import timedelta

    import torch

    from _simulated import parse_link
    from lightning_static_dist.participants.schedule_probe import PROBE_ROWS
    from lightning_static_dist.simulate import init_simulated_world, set_link
    from lightning_static_dist.sync.link_probe import probe_link

    init_simulated_world(world, timedelta(seconds=120))
    rows = []
    for text in links:
        link = parse_link(text)
        config = link.config()
        set_link(config)
        busy_cfg, idle_cfg = config.rates(config.sms)
        probes = []
        for _ in range(repeats):
            m = probe_link(None, torch.device("cuda"), NBYTES, WIDTH, rows=PROBE_ROWS)
            probes.append({"idle_gbps": round(m.rates.idle_gbps, 2), "busy_gbps": round(m.rates.busy_gbps, 2),
                           "latency_us": round(m.rates.latency_us, 2), "slowdown": round(m.rates.slowdown, 4),
                           "probe_s": round(m.probe_s, 3), "nbytes": m.nbytes, "gemms": m.gemms,
                           "error_idle": round(abs(m.rates.idle_gbps / idle_cfg - 1), 4),
                           "error_busy": round(abs(m.rates.busy_gbps / busy_cfg - 1), 4)})
        set_link(None)
        slowdowns = [p["slowdown"] for p in probes]
        rows.append({"link": link.name, "spec": text, "world": world,
                     "configured": {"busy_gbps": busy_cfg, "idle_gbps": idle_cfg}, "probes": probes,
                     "slowdown_spread": round(max(slowdowns) - min(slowdowns), 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", action="append", required=True, help="as gpuN_gpt2s.py --link (not free)")
    parser.add_argument("--worlds", default="2,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--one-world", type=int, help=argparse.SUPPRESS)  # (a child: one world per process)
    args = parser.parse_args()
    if args.one_world:
        print(json.dumps(one_world(args.one_world, args.link, args.repeats)))
        return
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.worlds.split(",")):
        cmd = [sys.executable, __file__, "--one-world", str(world), "--repeats", str(args.repeats)]
        cmd += [f"--link={text}" for text in args.link]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    probes = [p for r in rows for p in r["probes"]]
    for r in rows:
        worst = max(r["probes"], key=lambda p: max(p["error_idle"], p["error_busy"]))
        print(f"{r['link']:<8} world {r['world']}: idle {worst['idle_gbps']} busy {worst['busy_gbps']} "
              f"(configured {r['configured']}), slowdown {[p['slowdown'] for p in r['probes']]}, "
              f"probe {max(p['probe_s'] for p in r['probes'])} s")
    import torch

    record = {
        "scenario": "sim-probe-check", "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/sim_probe_check.py " + " ".join(f"--link {t}" for t in args.link)
        + f" --worlds {args.worlds} --repeats {args.repeats}",
        "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": {"torch": torch.__version__},
        "simulated": {"note": "simulated on one GPU: the emulated link's figures, not a multi-GPU one"},
        "rows": rows,
        "summary": {"probe_error_idle": max(p["error_idle"] for p in probes),
                    "probe_error_busy": max(p["error_busy"] for p in probes),
                    "probe_s": max(p["probe_s"] for p in probes),
                    "slowdown_spread_max": max(r["slowdown_spread"] for r in rows),
                    "median_error_busy": round(statistics.median(p["error_busy"] for p in probes), 4),
                    "targets": {"probe_error_idle": "<= 0.10", "probe_error_busy": "<= 0.10", "probe_s": "<= 0.5"}},
    }
    print(json.dumps(record["summary"]))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
