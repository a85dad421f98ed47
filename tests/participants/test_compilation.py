"""StaticCompile: setup compiles the LightningModule as ``strategy.compile`` says (its training step then runs through
the recorded graphs and computes what eager computes), once; a ``torch.compile``-d model's backend is adopted; the
graphs are compared across the ranks once per compilation; the short last batch is kept, with a graph of its own;
``enabled: auto`` compiles on CUDA only."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_static_dist.callbacks import GraphReport
from lightning_static_dist.compile import is_compiled
from lightning_static_dist.participants.compilation import StaticCompile
from lightning_static_dist.plan.strategy_config import StrategyConfig

from _dist import run_ranks

from ._view import Context, Regression, View

BATCH = (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(4, 1))


def _compiling(**compile: object) -> View:
    config = StrategyConfig.from_dict({"compile": {"enabled": True, "backend": "aot_eager", **compile}})
    return View(Regression(), config)


def test_setup_compiles_the_training_step_which_computes_what_eager_computes() -> None:
    view = _compiling()
    eager = Regression().training_step(BATCH, 0)
    participant = StaticCompile(view)
    context = view.enter(Context())
    participant.setup(context)
    module = view.lightning_module
    assert module is not None and is_compiled(module)
    loss = module.training_step(BATCH, 0)
    torch.testing.assert_close(loss, eager)
    report = participant.report
    assert report is not None and report.graphs, "the compiled step recorded no graph"
    assert [type(c) for c in context.callbacks] == [GraphReport]


@pytest.mark.parametrize(("backend", "says"), [("aot_eager", "off (backend 'aot_eager': CUDA graphs come from inductor)"),
                                                ("inductor", "off (auto: the device is cpu)")])
def test_the_report_says_whether_the_step_replays_cuda_graphs_and_why(backend: str, says: str) -> None:
    view = _compiling(backend=backend)
    participant = StaticCompile(view)
    participant.setup(view.enter(Context()))
    assert participant.report is not None and participant.report.cudagraphs == f"CUDA graphs: {says}"
    assert f"CUDA graphs: {says}" in participant.report.summary()
    assert participant.run_plan().cudagraphs is False  # resolved: what the backend compiles with


def test_a_later_setup_of_the_compiled_model_compiles_nothing_again() -> None:
    view = _compiling()
    participant = StaticCompile(view)
    participant.setup(view.enter(Context()))
    first = participant.report
    again = view.enter(Context())  # a second fit of the same strategy and model
    participant.setup(again)
    assert participant.report is first
    assert again.callbacks == []  # nothing compiled this time: no report callback either


def test_compile_off_leaves_the_model_eager() -> None:
    view = View(Regression())
    participant = StaticCompile(view)
    context = view.enter(Context())
    participant.setup(context)
    assert view.lightning_module is not None and not is_compiled(view.lightning_module)
    assert participant.report is None and context.callbacks == []


def test_a_torch_compiled_model_is_compiled_with_its_own_backend_until_teardown() -> None:
    view = View(Regression())  # strategy.compile.enabled is false: the user's torch.compile asks instead
    participant = StaticCompile(view)
    participant.adopt(torch.compile(Regression(), backend="aot_eager").dynamo_ctx)
    assert (participant.run_plan().enabled, participant.run_plan().backend) == (True, "aot_eager")
    participant.setup(view.enter(Context()))
    assert view.lightning_module is not None and is_compiled(view.lightning_module)
    participant.teardown(failed=False)
    assert participant.run_plan().enabled is False  # a later fit of a plain model is not compiled


def test_the_graphs_are_compared_across_the_ranks_once_per_compilation(one_rank_gloo: None) -> None:
    view = _compiling()
    participant = StaticCompile(view)
    participant.check_graphs_once()  # nothing compiled: nothing to compare
    assert participant.graphs_checked
    participant.setup(view.enter(Context()))
    assert not participant.graphs_checked
    assert view.lightning_module is not None
    view.lightning_module.training_step(BATCH, 0)
    participant.check_graphs_once()  # a collective over the one-rank group
    assert participant.graphs_checked


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(10, 8), torch.randn(10, 1)), batch_size=4)  # 4 + 4 + 2


@pytest.mark.parametrize("dynamic", [False, "auto"])
def test_the_short_last_batch_is_trained_with_a_graph_of_its_own(dynamic: object) -> None:
    torch._dynamo.reset()  # (dynamo's record of the sizes each frame saw is per process: as in a fresh one)
    view = _compiling(dynamic=dynamic)
    participant = StaticCompile(view)
    participant.setup(view.enter(Context()))
    loader = _loader()
    participant.process_dataloader(loader)
    assert [len(x) for x, _ in loader] == [4, 4, 2]  # nothing dropped, the sampler untouched
    assert loader.batch_sampler.drop_last is False
    module, report = view.lightning_module, participant.report
    assert module is not None and report is not None and report.tail_rows == 2
    for _epoch in range(2):
        for i, batch in enumerate(loader):
            torch.testing.assert_close(module.training_step(batch, i), Regression().training_step(batch, i))
    # the full batches' graph and the tail's: static in the batch dimension, no recompile reported
    assert report.graph_count() == 2 and report.graph_count(tail=True) == 1, report.summary()
    assert report.graph_count(dynamic=True) == 0 and report.recompiles == [], report.summary()
    assert "the short last batch (2 rows) runs its own graph" in report.summary()
    validation = _loader()
    view.enter(Context(training=False))  # a validation loader is not the training loader
    participant.process_dataloader(validation)
    assert report.tail_rows == 2


class _CudaView(View):
    """A view whose strategy would run on a GPU (the module stays on the CPU: only the decision is under test)."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cuda", 0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_enabled_auto_compiles_on_cuda_only(device: str) -> None:
    config = StrategyConfig.from_dict({"compile": {"backend": "aot_eager"}})
    assert config.compile.enabled == "auto"  # the default
    view = (_CudaView if device == "cuda" else View)(Regression(), config)
    participant = StaticCompile(view)
    participant.setup(view.enter(Context()))
    assert participant.run_plan().enabled is (device == "cuda")
    assert (participant.report is not None) is (device == "cuda")


def _compiled_after_the_probe_settles(rank: int, world: int, schedule: str) -> dict[str, bool]:
    # sync.schedule measured is pending at the plan's resolution; the probe reads the compile plan (to predict the
    # cut's cost), then settles the schedule: the step compiled afterwards follows the settled plan's cut
    config = StrategyConfig.from_dict({"compile": {"enabled": True, "backend": "aot_eager"},
                                       "sync": {"probe": True, "first_bucket_mb": 0.0001, "bucket_mb": 0.0001}})
    view = View(Regression(), config)
    participant = StaticCompile(view)
    assert view.plan.sync.schedule == "measured" and participant.run_plan().cut is None
    view.settle_schedule(view.plan.settled(schedule, f"sync.schedule measured: {schedule}"))
    participant.setup(view.enter(Context()))
    view.lightning_module.training_step(BATCH, 0).backward()  # (the graph is compiled, and cut, at its first call)
    splitter = participant.report.splitter if participant.report is not None else None
    return {"cut": participant.run_plan().cut == view.plan.compile.cut, "splitter": splitter is not None}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("schedule", "cut"), [("overlap", True), ("after_backward", False)])
def test_the_step_is_cut_as_the_settled_schedule_says(schedule: str, cut: bool) -> None:
    for rank in run_ranks(_compiled_after_the_probe_settles, 2, args=(schedule,)):
        assert rank == {"cut": True, "splitter": cut}  # (the splitter: the backend that cuts the graph at the buckets)
