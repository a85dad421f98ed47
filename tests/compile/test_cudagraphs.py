"""``strategy.compile.cudagraphs`` without a GPU: how ``auto`` is resolved, what inductor is told, and that a graph
inductor leaves without CUDA graphs reaches the compile report and one warning. The CUDA graphs themselves are
``tests/compile/test_gpu_cudagraphs.py``'s (GPU)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.config import ConfigError
from lightning_static_dist.compile.cudagraphs import capture_skips, choose_cudagraphs, inductor_options

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(("compile", "device", "sync_mode", "gathers", "on", "why"), [
    ({}, CUDA, "hooks", False, True, "auto: CUDA, inductor, gradients synchronised by hooks"),
    ({}, CPU, "hooks", False, False, "auto: the device is cpu"),
    ({}, CUDA, "graph", False, False, "auto: sync.mode=graph traces the collectives into the graphs"),
    ({}, CUDA, "hooks", True, False, "auto: sharded embeddings or reduce_scatter gather parameters between steps"),
    ({"backend": "aot_eager"}, CUDA, "hooks", False, False, "backend 'aot_eager': CUDA graphs come from inductor"),
    ({"mode": "reduce-overhead"}, CUDA, "hooks", True, True, "compile.mode=reduce-overhead"),
    ({"mode": "max-autotune-no-cudagraphs"}, CUDA, "hooks", False, False, "compile.mode=max-autotune-no-cudagraphs"),
    ({"cudagraphs": True}, CUDA, "hooks", False, True, "compile.cudagraphs=true"),
    ({"cudagraphs": True}, CPU, "hooks", False, False, "compile.cudagraphs=true, but the device is cpu"),
    ({"cudagraphs": False}, CUDA, "hooks", False, False, "compile.cudagraphs=false"),
], ids=["auto-cuda", "auto-cpu", "auto-graph-mode", "auto-gathers", "not-inductor", "mode-on", "mode-off",
        "forced-on", "forced-on-cpu", "forced-off"])
def test_auto_and_the_explicit_choices_resolve_with_their_reason(compile: dict[str, Any], device: torch.device,
                                                                  sync_mode: str, gathers: bool, on: bool,
                                                                  why: str) -> None:
    choice = choose_cudagraphs(CompileConfig(enabled=True, **compile), device, sync_mode, gathers)
    assert (choice.on, choice.why) == (on, why)
    assert choice.describe() == f"CUDA graphs: {'on' if on else 'off'} ({why})"


@pytest.mark.parametrize(("compile", "facts", "why"), [
    ({"regional": True}, {}, "compile.regional=true makes each block a graph of its own"),
    ({"dynamic": True}, {}, "compile.dynamic=true records a graph for each input shape"),
    ({}, {"automatic_optimization": False}, "manual optimization steps the optimizer inside the compiled step"),
    ({}, {"micro_batches": 4}, "trainer.accumulate_grad_batches=4: a micro-batch's gradients would stay"),
    ({}, {"micro_batches": None}, "the loop may accumulate gradients in no_backward_sync"),
], ids=["blocks", "dynamic", "manual-optimization", "accumulation", "fabric"])
def test_auto_is_off_where_a_tensor_must_outlive_a_replay(compile: dict[str, Any], facts: dict[str, Any],
                                                           why: str) -> None:
    choice = choose_cudagraphs(CompileConfig(enabled=True, **compile), CUDA, "hooks", False, **facts)
    assert not choice.on and choice.why.startswith(f"auto: {why}"), choice


@pytest.mark.parametrize(("compile", "facts"), [
    ({"regional": True}, {}), ({}, {"automatic_optimization": False}), ({}, {"micro_batches": 2}),
], ids=["blocks", "manual-optimization", "accumulation"])
def test_forced_cuda_graphs_with_such_a_hazard_are_one_line(compile: dict[str, Any], facts: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        choose_cudagraphs(CompileConfig(enabled=True, cudagraphs=True, **compile), CUDA, "hooks", False, **facts)
    message = str(excinfo.value)
    assert message.startswith("strategy.compile.cudagraphs=True: ") and "allowed with it: auto" in message
    assert "\n" not in message
    # where the loop decides step by step (Fabric), asking for them is the script's promise that it does not accumulate
    assert choose_cudagraphs(CompileConfig(enabled=True, cudagraphs=True), CUDA, "hooks", False, micro_batches=None).on


def test_a_kept_tensor_a_replay_overwrote_is_named_not_taken_for_a_compile_failure() -> None:
    # what dynamo raises when it re-traces a step that reads such a tensor: the graphs' own error, wrapped
    from lightning_static_dist.compile.regions import kept_graph_output

    graphs = RuntimeError("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent"
                          " run. Stack trace: ...")
    wrapped = torch._dynamo.exc.InternalTorchDynamoError("RuntimeError: ...")
    wrapped.__cause__ = graphs
    kept = kept_graph_output(wrapped)
    assert kept is not None and str(kept).startswith("static_dist: a tensor kept from an earlier step")
    assert "strategy.compile.cudagraphs=false" in str(kept)
    other = torch._dynamo.exc.InternalTorchDynamoError("something else")
    other.__cause__ = RuntimeError("a real compile failure")
    assert kept_graph_output(other) is None


def test_inductor_is_told_only_a_resolved_choice_that_the_mode_leaves_open() -> None:
    assert inductor_options(CompileConfig(cudagraphs=True)) == {"triton.cudagraphs": True}
    assert inductor_options(CompileConfig(cudagraphs=False)) == {"triton.cudagraphs": False}
    assert inductor_options(CompileConfig()) == {}  # auto, unresolved: inductor's own default
    assert inductor_options(CompileConfig(mode="reduce-overhead", cudagraphs=True)) == {}  # the mode's own setting


def test_a_graph_left_without_cuda_graphs_reaches_the_report_and_one_warning(caplog: Any) -> None:
    # inductor's own skip path (the function it calls for every graph it does not capture), twice, then another
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    skips: list[str] = []
    capture_skips(skips)
    with caplog.at_level(logging.WARNING, logger="lightning_static_dist.compile.cudagraphs"):
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to cpu device (arg0_1)")
    assert skips == ["skipping cudagraphs due to mutated inputs (2 instances)",
                     "skipping cudagraphs due to cpu device (arg0_1)"]
    warned = [r.getMessage() for r in caplog.records if r.name == "lightning_static_dist.compile.cudagraphs"]
    assert len(warned) == 1 and "mutated inputs" in warned[0] and "compile report" in warned[0], warned
