"""What the benchmarks share: running one contender as a fresh job, and writing the dated record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: for every GPU worker, so that nothing NCCL or symmetric memory might touch tries NVLink multicast
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def worker_env(cache_dir: Optional[str]) -> dict[str, str]:
    """A benchmark job's environment: this one, the repository on PYTHONPATH, NVLink multicast off, and the
    inductor/Triton caches under ``cache_dir`` (``None``: wherever they are by default)."""
    env = {**os.environ, **SAFE_ENV, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if cache_dir is not None:
        env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    return env


def run_job(name: str, cmd: list[str], env: dict[str, str], timeout_s: float,
            log_path: Optional[str] = None) -> Optional[str]:
    """Run one benchmark job (and every rank it starts) in its own process session; None when it succeeded, else
    one line saying why (and its whole stderr in ``log_path``, if given). A job past ``timeout_s`` is killed with
    all its ranks, so a hung collective costs one row."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks Lightning started are in the same session
        _, stderr = proc.communicate()
        _keep_log(log_path, stderr)
        print(f"--- {name} timed out after {timeout_s:.0f} s; stderr tail:\n{stderr[-2500:]}\n---", flush=True)
        return f"timed out after {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    _keep_log(log_path, stderr)
    # torch.distributed prefixes each rank's traceback lines with "[rankN]: "
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in stderr.splitlines() if line.strip()]
    # the exception line ("ConfigError: ..."), not the hint some libraries print after it
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Failure|Unsupported)\b", line)]
    print(f"--- {name} failed (exit {proc.returncode}); stderr tail:\n{stderr[-2500:]}\n---", flush=True)
    return (raised or lines or [f"exit {proc.returncode}"])[-1][:300]


def _keep_log(path: Optional[str], text: str) -> None:
    if path is not None:
        with open(path, "w") as f:
            f.write(text)


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


def run_rounds(script: str, contenders: tuple[str, ...], rounds: int, *args: str) -> dict[str, list[dict[str, Any]]]:
    """Run every contender once per round, interleaved (A B A B), each a fresh job; print each one's median step."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for r in range(rounds):
        for contender in contenders:
            runs[contender].append(run_worker(script, contender, *args))
            print(f"round {r + 1}/{rounds} {contender:<23} median step "
                  f"{1e3 * statistics.median(runs[contender][-1]['step_s']):.1f} ms", flush=True)
    return runs


def step_ms(recs: list[dict[str, Any]], digits: int = 1) -> dict[str, Any]:
    """A contender's median step over every timed step of every round, and each round's own median (ms)."""
    return {
        "step_ms_median": round(1e3 * statistics.median(s for rec in recs for s in rec["step_s"]), digits),
        "step_ms_per_round": [round(1e3 * statistics.median(rec["step_s"]), digits) for rec in recs],
    }


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


def free_port() -> int:
    """A TCP port of this machine free now (for ``MASTER_PORT``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target: Any, world: int, *args: Any, timeout_s: float = 1800) -> Any:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` spawned processes of this machine (``port``: a
    free one for ``MASTER_PORT``) and return what rank 0 put on ``queue``."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, world, port, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout_s)
    for p in procs:
        p.join()
    return result
