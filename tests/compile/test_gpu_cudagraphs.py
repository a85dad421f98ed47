"""GPU tests of ``strategy.compile.cudagraphs`` (one GPU): the compiled step cut at the gradient buckets, replayed
as CUDA graphs, with the hooks issuing the bucket collectives between the pieces. Skipped without CUDA.

The step is cut only at world size > 1, so these run in a simulated world of 2 on the one GPU: the simulated group
stands for the transport, and everything on this side of it — the cut, the pieces' CUDA graphs, the gradient hooks,
the buckets and their copies — runs for real. Gradient averaging over real ranks is ``tests/test_gpu.py``'s 2-GPU
tests (the default compile there now replays CUDA graphs too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FIT = """
import json, sys
import torch, lightning as L
from torch.profiler import ProfilerActivity, profile
from lightning_static_dist import StaticDistStrategy
from tests.compile.test_compile import SMALL_BUCKETS, NestedGPT

class LoggingGPT(NestedGPT):
    # self.log inside the CUDA-graphed step: a graph output that the next replay overwrites, unless copied
    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("lr", 0.5)
        return loss

class Launches(L.Callback):
    # how the fourth step reached the GPU: CUDA graph launches, and kernels launched one by one
    def __init__(self):
        self.prof, self.counts = None, {}
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 3:
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]).__enter__()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is not None:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            names = [e.name for e in self.prof.events()]
            self.counts = {"graph_launches": sum(n.startswith("cudaGraphLaunch") for n in names),
                           "kernel_launches": sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
                                                  for n in names)}
            self.prof = None

out = {}
for cudagraphs in ("auto", False):
    torch.manual_seed(0)
    model = LoggingGPT()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strategy = StaticDistStrategy(compile={"enabled": True, "cudagraphs": cudagraphs}, sync={**SMALL_BUCKETS, "schedule": "overlap"},
                                  simulate={"world_size": 2})
    launches = Launches()
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="32-true", max_steps=6,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[launches])
    trainer.fit(model)
    report = strategy.offer.compile_report
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}  # read after the last step's replay
    out[str(cudagraphs)] = {
        "weights": {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()},
        "moved": any(not torch.equal(v.detach(), initial[k]) for k, v in model.state_dict().items()),
        "cudagraphs": report.cudagraphs, "skips": report.cudagraph_skips, "pieces": report.splitter.pieces,
        "graph_breaks": len(report.graph_breaks), "logged": logged, **launches.counts}
print(json.dumps(out))
"""


def _run(code: str) -> dict:
    """``code`` in a fresh process (a simulated world is that process's default group); its last line is JSON."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.path.join(ROOT, "tests")},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_cut_step_replays_cuda_graphs_by_default_and_trains_as_it_does_launched_kernel_by_kernel() -> None:
    runs = _run(_FIT)
    graphed, plain = runs["auto"], runs["False"]
    assert graphed["cudagraphs"].startswith("CUDA graphs: on (auto"), graphed["cudagraphs"]
    assert graphed["skips"] == [] and graphed["pieces"] > 2 and graphed["graph_breaks"] == 0, graphed
    assert plain["cudagraphs"] == "CUDA graphs: off (compile.cudagraphs=false)", plain["cudagraphs"]
    # a steady step: each piece's forward and backward is one graph launch, not its kernels one by one
    assert graphed["graph_launches"] >= 2 * graphed["pieces"], graphed
    assert plain["graph_launches"] == 0 and plain["kernel_launches"] > graphed["kernel_launches"], (plain, graphed)
    assert graphed["moved"] and plain["moved"]
    # the logged values (the last step's, and the epoch's mean over every step) are the same either way
    assert {"train_loss_step", "lr"} <= set(graphed["logged"]) == set(plain["logged"]), (graphed, plain)
    for name, value in graphed["logged"].items():
        assert abs(value - plain["logged"][name]) <= 1e-5 * max(1.0, abs(value)), (name, graphed["logged"], plain["logged"])
    for name, weight in graphed["weights"].items():
        torch.testing.assert_close(torch.tensor(weight), torch.tensor(plain["weights"][name]), rtol=1e-5, atol=1e-6,
                                   msg=name)


_SYNCS = """
import json, sys, tempfile
import torch
from _gpu_sync_check import count_syncs
from lightning_static_dist import StaticDistStrategy
from tests.compile.test_compile import SMALL_BUCKETS
from tests.test_host_syncs import EveryParameterUsed

strategy = StaticDistStrategy(compile={"enabled": True}, sync={**SMALL_BUCKETS, "schedule": "overlap"}, simulate={"world_size": 2})
(report,) = count_syncs(tempfile.mkdtemp(), strategy, EveryParameterUsed(), devices=1)
print(json.dumps({**report, "cudagraphs": strategy.offer.compile_report.cudagraphs}))
"""


def test_a_steady_cuda_graphed_step_makes_the_host_wait_for_nothing() -> None:
    # a host that waits for its GPU loses the lead the CUDA graphs gave it (tests/_gpu_sync_check.py); the 2-GPU
    # version over NCCL is tests/test_gpu.py's
    report = _run(_SYNCS)
    assert report["cudagraphs"].startswith("CUDA graphs: on"), report
    assert report["warned"] == [] and report["runtime"] == [], report


_ACCUMULATING = """
import json
import torch, lightning as L
from lightning_static_dist import StaticDistStrategy
from tests.compile.test_compile import SMALL_BUCKETS, nested_gpt

model = nested_gpt()
strategy = StaticDistStrategy(compile={"enabled": True}, sync={**SMALL_BUCKETS, "schedule": "overlap"}, simulate={"world_size": 2})
trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="32-true", max_steps=4,
                    accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model)
print(json.dumps({"cudagraphs": strategy.offer.compile_report.cudagraphs, "steps": trainer.global_step}))
"""


def test_accumulating_gradients_leaves_cuda_graphs_off_and_says_why() -> None:
    # an accumulated gradient would live in the graphs' pool, which the next micro-batch's replay overwrites
    report = _run(_ACCUMULATING)
    assert report["steps"] == 4, report
    assert report["cudagraphs"].startswith("CUDA graphs: off (auto: trainer.accumulate_grad_batches=2"), report
