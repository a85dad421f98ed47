"""Static compilation: compiled training equals eager, gradients stay early under regional compile, no recompiles,
eager fallback, fullgraph errors, cross-rank checks, and ``trainer.fit(torch.compile(model))``."""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import pytest
import torch
from torch import nn

import lightning as L
from _dist import run_ranks
from examples.charlm import CharDataModule, CharGPT
from lightning_static_dist import StaticDistStrategy
from lightning_static_dist.compile import CompileFailure, compile_regions, find_regions
from lightning_static_dist.config import CompileConfig, ConfigError
from lightning_static_dist.fingerprint import first_difference


def tiny_gpt(n_layer: int = 3) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(n_layer=n_layer, n_embd=32, n_head=2, block_size=16, warmup_steps=0)


def train_losses(model: nn.Module, steps: int = 4) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 17), generator=g)
        loss = model.loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------------- single process


def test_regions_are_the_repeated_blocks() -> None:
    assert [name for name, _ in find_regions(tiny_gpt(4), "auto")] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert [name for name, _ in find_regions(tiny_gpt(), False)] == ["<training_step>"]
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # no repeated class: nothing to split
    assert [name for name, _ in find_regions(flat, "auto")] == ["<forward>"]
    with pytest.raises(ConfigError, match="strategy.compile.regional=True"):
        find_regions(flat, True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_matches_eager(backend: str) -> None:
    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    report = compile_regions(compiled, CompileConfig(enabled=True, backend=backend))
    torch.testing.assert_close(train_losses(compiled), train_losses(eager), atol=1e-4, rtol=1e-4)
    # three identical blocks, one compiled artefact; no break, no recompile across steps
    assert report.regions == ["blocks.0", "blocks.1", "blocks.2"]
    assert len(report.graphs) == 1
    assert report.graph_breaks == [] and report.recompiles == []


def test_training_step_is_compiled_around_the_blocks() -> None:
    # the loss (cross-entropy over the vocabulary) gets a graph of its own; each block call is a boundary of that
    # graph, not a reported graph break, and the gradients are eager's
    eager = tiny_gpt()
    around, blocks_only = copy.deepcopy(eager), copy.deepcopy(eager)
    plain = compile_regions(blocks_only, CompileConfig(enabled=True, backend="aot_eager"))
    # compiled second: dynamo's log records go to the latest report
    report = compile_regions(around, CompileConfig(enabled=True, backend="aot_eager", around_blocks=True))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randint(0, 256, (4, 17), generator=g)
        for model in (eager, around, blocks_only):
            model.zero_grad()
            model.training_step((x[:, :-1], x[:, 1:]), step).backward()
    for (name, a), b in zip(eager.named_parameters(), around.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert len(plain.graphs) == 1 and len(report.graphs) == 2
    assert report.regions[-1] == "<training_step around the blocks>"
    assert report.block_boundaries >= 1 and report.recompiles == []
    assert not any("RegionForward" in reason and "eager" not in reason for reason, _ in report.graph_breaks)
    # rank-dependent code around the blocks changes only the graphs the cross-rank check leaves out
    assert report.structure_lines()[:-1] == plain.structure_lines() and report.graphs[-1].region == report.regions[-1]


class BatchOnly(CharGPT):
    def training_step(self, batch):  # type: ignore[override]  # no batch_idx: Lightning must not pass one
        x, y = batch
        return self.loss(self(x), y)


def test_the_compiled_training_step_keeps_its_signature() -> None:
    # Lightning decides from the signature whether to pass batch_idx (and whether it is a dataloader_iter step)
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    torch.manual_seed(0)
    model = BatchOnly(n_layer=2, n_embd=32, n_head=2, block_size=16, warmup_steps=0)
    compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", around_blocks=True))
    assert not is_param_in_hook_signature(model.training_step, "batch_idx", min_args=2)
    x = torch.randint(0, 256, (2, 17))
    model.training_step((x[:, :-1], x[:, 1:])).backward()


def test_zero_recompiles_over_twenty_steps() -> None:
    model = tiny_gpt()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager"))
    train_losses(model, steps=20)
    assert len(report.graphs) == 1 and report.recompiles == []
    # and a recompile is seen when one happens (static shapes: another sequence length compiles again)
    model(torch.randint(0, 256, (4, 9)))
    assert len(report.recompiles) == 1 and "blocks.0" in report.recompiles[0], report.recompiles


class Stack(nn.Module):
    """Six Linear+GELU blocks (the DESIGN.md measurement) for hook timing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def hook_firing_fractions(model: nn.Module) -> list[float]:
    """When each post-accumulate-grad hook fired, as a fraction of the backward pass (median of 5 passes)."""
    fired: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: fired.append(time.perf_counter()))
    x = torch.randn(512, 256)
    runs = []
    for _ in range(7):
        fired.clear()
        loss = model(x).square().mean()
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        runs.append(sorted((t - start) / (end - start) for t in fired))
    return [statistics.median(r[i] for r in runs[2:]) for i in range(len(runs[0]))]


def test_regional_compile_keeps_gradients_ready_through_backward() -> None:
    torch.manual_seed(0)
    eager = Stack()
    regional, whole = copy.deepcopy(eager), copy.deepcopy(eager)
    compile_regions(regional, CompileConfig(enabled=True, backend="aot_eager", regional="auto"))
    compile_regions(whole, CompileConfig(enabled=True, backend="aot_eager", regional=False))
    first = {name: hook_firing_fractions(m)[0] for name, m in [("eager", eager), ("regional", regional), ("whole", whole)]}
    # whole-model compile: one autograd node, every gradient at the very end; regional: the first gradient is
    # ready well before backward ends, like eager
    # (measured here: eager 0.16, regional 0.28, whole 0.85 — the rest of "whole" is the 12 AccumulateGrad nodes)
    assert first["whole"] > 0.7, first
    assert first["regional"] < first["whole"] - 0.3, first
    assert first["eager"] < first["whole"] - 0.3, first


class Uncompilable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > -1e9:  # data-dependent branch: a graph break
            y = y * 2
        return y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Uncompilable(), Uncompilable()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def failing_backend(gm: Any, example_inputs: Any) -> Any:
    raise RuntimeError("this backend cannot compile anything")


torch._dynamo.register_backend(failing_backend, name="lsd_test_failing")


def test_a_region_that_fails_to_compile_runs_eagerly_with_equal_results() -> None:
    torch.manual_seed(0)
    eager = Net()
    fallback = copy.deepcopy(eager)
    report = compile_regions(fallback, CompileConfig(enabled=True, backend="lsd_test_failing"))
    x = torch.randn(3, 4)
    torch.testing.assert_close(fallback(x), eager(x))
    assert set(report.fallbacks) == {"blocks.0", "blocks.1"}
    assert "cannot compile anything" in report.fallbacks["blocks.0"]
    erroring = copy.deepcopy(eager)
    compile_regions(erroring, CompileConfig(enabled=True, backend="lsd_test_failing", fallback="error"))
    with pytest.raises(CompileFailure, match="region 'blocks.0' failed to compile"):
        erroring(x)


def test_graph_breaks_are_reported_and_fullgraph_names_the_location() -> None:
    model = Net()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager"))
    model(torch.randn(3, 4))
    assert len(report.graph_breaks) >= 1
    reason, where = report.graph_breaks[0]
    assert "test_compile.py" in where and "ata-dependent" in reason
    strict = Net()
    compile_regions(strict, CompileConfig(enabled=True, backend="aot_eager", fullgraph=True))
    with pytest.raises(CompileFailure, match=r"fullgraph=true: graph break in region 'blocks.0' at .*test_compile.py"):
        strict(torch.randn(3, 4))


def test_device_transfers_inside_a_graph_are_reported() -> None:
    class Mover(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks[1](self.blocks[0](x).to("cpu"))

    model = Mover()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", regional=False))
    model(torch.randn(1, 2))
    assert len(report.placement) == 1 and "test_compile.py" in report.placement[0]


def test_first_difference() -> None:
    assert first_difference([["a", "b"], ["a", "b"]]) is None
    assert first_difference([["a", "b"], ["a", "c"]]) == "rank 0 has 'b' where rank 1 has 'c' (line 2)"
    assert first_difference([["a"], ["a", "x"]]) == "rank 0 has '<nothing>' where rank 1 has 'x' (line 2)"


# ---------------------------------------------------------------------------------------------- 2 ranks


def _fit_charlm(tmp: str, compile_cfg: Any, user_compiled: bool = False, steps: int = 8) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    model = tiny_gpt()
    if user_compiled:
        model = torch.compile(model, backend="aot_eager")
    strategy = StaticDistStrategy(start_method="spawn", compile=compile_cfg)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=50_000))
    module = model._orig_mod if hasattr(model, "_orig_mod") else model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.multiprocess
def test_static_dist_compiled_equals_eager_and_accepts_torch_compile(tmp_path: Any) -> None:
    eager = _fit_charlm(str(tmp_path), None)
    compiled = _fit_charlm(str(tmp_path), {"enabled": True, "backend": "aot_eager"})
    user = _fit_charlm(str(tmp_path), None, user_compiled=True)
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(user[key], eager[key], atol=1e-4, rtol=1e-4)


def _mismatched_models(rank: int, world: int) -> str:
    from lightning_static_dist.fingerprint import RankMismatchError, check_same_on_all_ranks, describe_parameters

    model = nn.Linear(4, 4 if rank == 0 else 5)  # rank 1 built another model
    started = time.perf_counter()
    try:
        check_same_on_all_ranks("the model's parameters", describe_parameters(model))
    except RankMismatchError as err:
        return f"{time.perf_counter() - started:.1f}s {err}"
    return "no error"


@pytest.mark.multiprocess
def test_ranks_with_different_models_stop_at_once_with_the_difference() -> None:
    for result in run_ranks(_mismatched_models, 2, timeout=60):
        seconds, message = result.split(" ", 1)
        assert float(seconds.rstrip("s")) < 10
        assert "ranks disagree on the model's parameters" in message
        assert "rank 0 has 'param weight (4, 4)" in message and "rank 1 has 'param weight (5, 4)" in message


# ---------------------------------------------------------------------------------------------- sync.mode: graph


def _fit_sync_mode(mode: str, backend: str) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    model = tiny_gpt(n_layer=2)
    strategy = StaticDistStrategy(start_method="spawn", sync={"mode": mode}, compile={"enabled": True, "backend": backend})
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=4, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=50_000))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
def test_graph_mode_gradients_equal_hooks_mode() -> None:
    # steps 2+ run their collectives inside the compiled backward: aot_eager, and inductor_distributed with its
    # bucketing/reordering passes over functional all-reduces on Gloo
    hooks = _fit_sync_mode("hooks", "aot_eager")
    graph = _fit_sync_mode("graph", "aot_eager")
    graph_inductor = _fit_sync_mode("graph", "inductor_distributed")
    for key in hooks:
        torch.testing.assert_close(graph[key], hooks[key], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(graph_inductor[key], hooks[key], atol=1e-4, rtol=1e-4)


class RankBranch(L.LightningModule):
    """Rank 0 uses a branch that rank 1 never touches: fine for hooks, not for a static traced graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        h = self.a(batch[0])
        if self.global_rank == 0:
            h = self.b(h)
        return h.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)


@pytest.mark.multiprocess
def test_graph_mode_refuses_rank_dependent_usage_with_a_clear_error() -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=StaticDistStrategy(start_method="spawn", sync={"mode": "graph"}),
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with pytest.raises(Exception, match=r"sync.mode=graph needs every rank .* b.weight \(1/2 ranks\)"):
        trainer.fit(RankBranch())


class Dense(RankBranch):
    """Both layers on every rank (defined here, so spawned ranks import this module and its test backend)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.b(self.a(batch[0])).square().mean()


@pytest.mark.multiprocess
def test_graph_mode_names_the_key_when_the_compiled_backward_fails() -> None:
    # from the second step the backward runs under compiled autograd with the collectives traced in; a backend
    # that cannot compile it must end the run with one line naming sync.mode, not dynamo's traceback alone
    strategy = StaticDistStrategy(start_method="spawn", sync={"mode": "graph"},
                                  compile={"enabled": True, "backend": "lsd_test_failing"})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(Exception, match=r"sync.mode=graph: the backward .* failed to compile with 'lsd_test_failing' "
                                        r"\(.*cannot compile anything\); strategy.sync.mode=hooks"):
        trainer.fit(Dense())


def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights() -> None:
    # SWA / EMA callbacks deep-copy the module after the strategy compiled it
    model = tiny_gpt()
    compile_regions(model, CompileConfig(enabled=True, backend="aot_eager"))
    x = torch.randint(0, 256, (2, 16))
    original = model(x)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.zero_()
    assert not torch.allclose(twin(x), original)
    torch.testing.assert_close(model(x), original)


class Short(L.LightningModule):
    """10 samples, batch 4: the last batch of each epoch is short."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.val_steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_steps += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(10, 4)), batch_size=4)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=4)


def test_static_shapes_drop_the_short_last_batch_and_keep_the_validation_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    from _dist import free_port

    # one rank, in this process: its TCP store outlives the test, so it gets a port of its own, not the one the
    # spawned ranks of other tests share through MASTER_PORT
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = Short()
    strategy = StaticDistStrategy(compile={"enabled": True, "backend": "aot_eager"})
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    try:
        with pytest.warns(UserWarning, match="last training batch of each epoch would hold 2 samples"):
            trainer.fit(model)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trainer.global_step == 4  # 2 full batches per epoch
    assert model.val_steps == 2  # validation still ran at the end of each epoch
    assert strategy.compile_report is not None and strategy.compile_report.recompiles == []
