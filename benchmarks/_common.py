"""What the CPU benchmarks share: running one contender as a fresh job, and writing the dated record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(script: str, contender: str, *args: str) -> dict[str, Any]:
    """Run ``script --worker contender *args --out FILE`` (a fresh 2-rank job); return its JSON plus ``wall_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(script), "--worker", contender, *args, "--out", out]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{contender} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as f:
            record = json.load(f)
        record["wall_s"] = round(time.perf_counter() - started, 1)
        return record


def write_record(scenario: str, command: str, **fields: Any) -> str:
    """Write ``benchmarks/results/<scenario>-<date>.json`` with the machine and versions; return its path."""
    import lightning
    import torch

    today = datetime.date.today().isoformat()
    record = {
        "scenario": scenario,
        "date": today,
        "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "ranks": 2,
                     "backend": "gloo"},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__},
        "command": command,
        **fields,
    }
    path = os.path.join(ROOT, "benchmarks", "results", f"{scenario}-{today}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"recorded: {os.path.relpath(path, ROOT)}")
    return path
