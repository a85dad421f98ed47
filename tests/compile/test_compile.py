"""Static compilation: compiled training equals eager, gradients stay early when the whole step is cut at the buckets
and under regional compile, no recompiles, eager fallback, fullgraph errors, the new default and graph mode against
Lightning's ``ddp``, and ``trainer.fit(torch.compile(model))``. Graph mode's own checks are in test_graph.py; the
cross-rank comparison that stops ranks with different models is in test_fingerprint.py."""

from __future__ import annotations

import copy
import functools
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning as L
from _dist import fit_on_ranks
from tests._parts import synchronizer_of
from lightning.pytorch.strategies import DDPStrategy
from lightning_static_dist.examples.charlm import Block, CharDataModule, CharGPT
from lightning_static_dist import StaticDistStrategy
from lightning_static_dist.compile import CompileFailure, compile_regions, find_regions
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.config import ConfigError
from lightning_static_dist.offer import offer_of
from lightning_static_dist.sync.plan import param_specs, plan_buckets


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


def test_regions_are_the_whole_step_or_the_repeated_blocks() -> None:
    assert [name for name, _ in find_regions(tiny_gpt(4), True)] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert [name for name, _ in find_regions(tiny_gpt(), "auto")] == ["<training_step>"]
    assert [name for name, _ in find_regions(tiny_gpt(), False)] == ["<training_step>"]
    flat = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # no repeated class: nothing to split
    assert [name for name, _ in find_regions(flat, "auto")] == ["<forward>"]
    with pytest.raises(ConfigError, match="strategy.compile.regional=True"):
        find_regions(flat, True)


# inductor's C++ build, on a fresh machine, with `-m slow`; the default run's inductor case is the 2-rank one vs ddp
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_blocks_train_like_eager(backend: str) -> None:
    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    report = compile_regions(compiled, CompileConfig(enabled=True, backend=backend, regional=True))
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
    plain = compile_regions(blocks_only, CompileConfig(enabled=True, backend="aot_eager", regional=True))
    # compiled second: dynamo's log records go to the latest report
    report = compile_regions(around, CompileConfig(enabled=True, backend="aot_eager", regional=True, around_blocks=True))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randint(0, 256, (4, 17), generator=g)
        for model in (eager, around, blocks_only):
            model.zero_grad()
            model.training_step((x[:, :-1], x[:, 1:]), step).backward()
    for (name, a), b in zip(eager.named_parameters(), around.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
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
    compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", regional=True, around_blocks=True))
    assert not is_param_in_hook_signature(model.training_step, "batch_idx", min_args=2)
    x = torch.randint(0, 256, (2, 17))
    model.training_step((x[:, :-1], x[:, 1:])).backward()


def test_zero_recompiles_over_twenty_steps() -> None:
    model = tiny_gpt()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", regional=True))
    train_losses(model, steps=20)
    assert len(report.graphs) == 1 and report.recompiles == []
    # and a recompile is seen when one happens (static shapes: another sequence length compiles again)
    model(torch.randint(0, 256, (4, 9)))
    assert len(report.recompiles) == 1 and "blocks.0" in report.recompiles[0], report.recompiles


class Stack(nn.Module):
    """Six Linear+GELU blocks, for hook timing."""

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


def test_a_cut_graph_and_regional_compile_keep_gradients_ready_through_backward() -> None:
    torch.manual_seed(0)
    eager = Stack()
    regional, cut, whole = copy.deepcopy(eager), copy.deepcopy(eager), copy.deepcopy(eager)
    compile_regions(regional, CompileConfig(enabled=True, backend="aot_eager", regional=True))
    one_block = (256 * 256 + 256) * 4  # bytes of one block's parameters: one piece per block
    report = compile_regions(cut, CompileConfig(enabled=True, backend="aot_eager"), split=(one_block, one_block))
    compile_regions(whole, CompileConfig(enabled=True, backend="aot_eager", regional=False))
    variants = [("eager", eager), ("regional", regional), ("cut", cut), ("whole", whole)]
    first = {name: hook_firing_fractions(m)[0] for name, m in variants}
    # whole-model compile: one autograd node, every gradient at the very end; regional and the graph cut at the
    # buckets: the first gradient is ready well before backward ends, like eager
    # (measured here: eager 0.16, regional 0.28, whole 0.85 — the rest of "whole" is the 12 AccumulateGrad nodes)
    assert report.splitter is not None and report.splitter.pieces == 6, report.summary()
    assert first["whole"] > 0.7, first
    for name in ("eager", "regional", "cut"):
        assert first[name] < first["whole"] - 0.3, first


class Trunk(nn.Module):
    """Embeddings and blocks, the blocks looped inside this nested module's ``forward`` (nanoGPT's shape)."""

    def __init__(self, vocab: int, d: int, n_layer: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(16, d)
        self.h = nn.ModuleList([Block(d, 2, 0.0, False) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class NestedGPT(L.LightningModule):
    """Tied input/output weights, the blocks looped inside a nested ``forward``, the loss computed in ``forward``,
    and a branch no rank ever uses (its gradient stays ``None``: the optimizer's weight decay must not touch it).
    SGD with momentum, not AdamW: AdamW divides by the gradient's own magnitude, so a near-zero gradient (rounding
    noise, which differs between kernels) would take a full-size step."""

    def __init__(self, n_layer: int = 3, d: int = 32, vocab: int = 256) -> None:
        super().__init__()
        self.trunk = Trunk(vocab, d, n_layer)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.trunk.wte.weight
        self.unused = nn.Linear(d, d)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.trunk(idx)).flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)

    def train_dataloader(self) -> Any:
        tokens = torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(5))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def nested_gpt() -> NestedGPT:
    torch.manual_seed(0)
    return NestedGPT()


#: bucket sizes that cut the NestedGPT step into about one piece per block (a block holds ~50 KB of parameters)
SMALL_BUCKETS = {"first_bucket_mb": 0.01, "bucket_mb": 0.04}


def test_the_whole_step_cut_at_the_buckets_trains_like_eager_with_nothing_left_eager() -> None:
    eager = nested_gpt()
    cut = copy.deepcopy(eager)
    report = compile_regions(cut, CompileConfig(enabled=True, backend="aot_eager"),
                             split=(int(0.01 * 2**20), int(0.04 * 2**20)))
    loader = eager.train_dataloader()
    for model in (eager, cut):
        optimizer = model.configure_optimizers()
        for step, batch in zip(range(3), loader):
            model.training_step(batch, step).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(eager.named_parameters(), cut.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # the nested forward, its loop over the blocks and the loss: one graph, nothing eager, cut into pieces
    assert report.regions == ["<training_step>"] and report.graph_breaks == [] and report.recompiles == []
    assert report.fallbacks == {} and report.splitter is not None and report.splitter.pieces >= 4
    assert f"cut into {report.splitter.pieces} pieces" in report.summary()
    # the tied weight is read by the first piece (embedding) and the last (output layer): it belongs to the first,
    # whose backward — the last to run — completes its gradient
    groups = report.splitter.ready_groups
    assert groups[id(cut.trunk.wte.weight)] == min(groups.values()) == groups[id(cut.trunk.wpe.weight)]
    assert id(cut.unused.weight) not in groups


def test_blocks_compiled_one_by_one_report_what_stays_eager() -> None:
    # regional: true compiles the blocks only: the embeddings, the final norm and the loss run eagerly — said, not
    # silent
    model = nested_gpt()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", regional=True))
    model.training_step(next(iter(model.train_dataloader())), 0).backward()
    assert report.outside_blocks == ["trunk.ln_f", "trunk.wpe", "trunk.wte", "unused"]
    assert "runs eagerly, outside the compiled blocks: trunk.ln_f, trunk.wpe, trunk.wte, unused" in report.summary()


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
    report = compile_regions(fallback, CompileConfig(enabled=True, backend="lsd_test_failing", regional=True))
    x = torch.randn(3, 4)
    torch.testing.assert_close(fallback(x), eager(x))
    assert set(report.fallbacks) == {"blocks.0", "blocks.1"}
    assert "cannot compile anything" in report.fallbacks["blocks.0"]
    erroring = copy.deepcopy(eager)
    compile_regions(erroring, CompileConfig(enabled=True, backend="lsd_test_failing", fallback="error", regional=True))
    with pytest.raises(CompileFailure, match="region 'blocks.0' failed to compile"):
        erroring(x)


def test_graph_breaks_are_reported_and_fullgraph_names_the_location() -> None:
    model = Net()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", regional=True))
    model(torch.randn(3, 4))
    assert len(report.graph_breaks) >= 1
    reason, where = report.graph_breaks[0]
    assert "test_compile.py" in where and "ata-dependent" in reason
    strict = Net()
    compile_regions(strict, CompileConfig(enabled=True, backend="aot_eager", fullgraph=True, regional=True))
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


# ---------------------------------------------------------------------------------------------- 2 ranks


def _fit_charlm(tmp: str, compile_cfg: Any, user_compiled: bool = False, steps: int = 8) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    model = tiny_gpt()
    if user_compiled:
        model = torch.compile(model, backend="aot_eager")
    strategy = StaticDistStrategy(compile=compile_cfg)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=50_000))
    module = model._orig_mod if hasattr(model, "_orig_mod") else model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.multiprocess
def test_static_dist_accepts_torch_compile(tmp_path: Any) -> None:
    eager = fit_on_ranks(_fit_charlm, str(tmp_path), None)
    user = fit_on_ranks(_fit_charlm, str(tmp_path), None, True)
    for key in eager:
        torch.testing.assert_close(user[key], eager[key], atol=1e-4, rtol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.slow  # the default run's compiled steps end with ddp's weights (below), and ddp's with eager's
def test_static_dist_compiled_equals_eager(tmp_path: Any) -> None:
    eager = fit_on_ranks(_fit_charlm, str(tmp_path), None)
    compiled = fit_on_ranks(_fit_charlm, str(tmp_path), {"enabled": True, "backend": "aot_eager"})
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ the default compile and graph mode vs ddp


class CompileFacts(L.Callback):
    """Rank 0 writes what compilation and the bucket plan came to, at the end of fit."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        report, sync = offer_of(trainer).compile_report, synchronizer_of(trainer.strategy)
        names = sync.parameter_names if sync is not None else []
        figures = offer_of(trainer).sync_figures()
        facts = {
            "graph_breaks": len(report.graph_breaks), "recompiles": report.recompiles, "fallbacks": report.fallbacks,
            "pieces": report.splitter.pieces if report.splitter is not None else None,
            "buckets": [[names[i] for i in b.param_indices] for b in sync.plan.buckets] if sync is not None else None,
            "graph_rounds": figures.rounds if figures is not None and figures.mode == "graph" else None,
            "summary": report.summary(),
        }
        with open(self.path, "w") as f:
            json.dump(facts, f)


def _fit_nested(make_strategy: Callable[[], Any], facts: Optional[str] = None) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    model = nested_gpt()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=make_strategy(), max_steps=4, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CompileFacts(facts)] if facts else [],
    )
    trainer.fit(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ddp_nested() -> dict[str, torch.Tensor]:
    """Lightning's ddp on the nested GPT: the one reference every mode and backend below is compared with."""
    return fit_on_ranks(_fit_nested, functools.partial(DDPStrategy, find_unused_parameters=True))


# inductor fuses and reorders floating-point work: 1e-4 over 4 SGD steps (aot_eager runs eager's kernels: 1e-5)
TOLERANCE = {"aot_eager": 1e-5, "inductor": 1e-4}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode,backend", [pytest.param("hooks", "aot_eager", marks=pytest.mark.slow), ("hooks", "inductor"),
                                          ("graph", "aot_eager"), pytest.param("graph", "inductor", marks=pytest.mark.slow)])
def test_the_compiled_step_trains_to_lightning_ddp_weights(ddp_nested: dict[str, torch.Tensor], tmp_path: Any,
                                                           mode: str, backend: str) -> None:
    # tied weights, an unused branch, accumulation over 2 micro-batches and blocks looped inside a nested forward;
    # hooks: the default compile (the whole step cut at the buckets); graph: the collectives inside the graph
    facts_path = str(tmp_path / "facts.json")
    ours = fit_on_ranks(_fit_nested, functools.partial(StaticDistStrategy, compile={"enabled": True, "backend": backend},
                                                       sync={"mode": mode, **SMALL_BUCKETS}), facts_path)
    theirs = ddp_nested
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], atol=TOLERANCE[backend], rtol=TOLERANCE[backend],
                                   msg=lambda m, key=key: f"{key}: {m}")
    with open(facts_path) as f:
        facts = json.load(f)
    # steady state: no recompile over 4 steps x 2 micro-batches, nothing eager, nothing split by dynamo
    assert facts["recompiles"] == [] and facts["graph_breaks"] == 0 and facts["fallbacks"] == {}, facts["summary"]
    if mode == "hooks":
        # one bucket per piece that holds parameters; the tied weight, completed by the last backward piece, last
        assert facts["pieces"] >= 4 and len(facts["buckets"]) >= 3, facts
        assert "trunk.wte.weight" in facts["buckets"][-1] and all("unused" not in n for b in facts["buckets"] for n in b)
    else:
        # every micro-batch averaged inside its own backward: 4 steps x 2; inductor buckets the traced all-reduces
        assert facts["graph_rounds"] == 8, facts
        assert ("bucket_all_reduces_fx" in facts["summary"]) == (backend == "inductor"), facts["summary"]


@pytest.mark.parametrize("regional", [True, "auto"])
def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights(regional: Any) -> None:
    # SWA / EMA callbacks deep-copy the module after the strategy compiled it (blocks, or the whole step)
    model = tiny_gpt()
    compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", regional=regional))
    x = torch.randint(0, 256, (2, 17))
    batch = (x[:, :-1], x[:, 1:])
    original = model.training_step(batch, 0).detach()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.zero_()
    assert not torch.allclose(twin.training_step(batch, 0), original)
    torch.testing.assert_close(model.training_step(batch, 0).detach(), original)


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


def test_the_short_last_batch_is_trained_and_the_validation_schedule_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from _dist import free_port

    # one rank, in this process: its TCP store outlives the test, so it gets a port of its own, not the one the
    # spawned ranks of other tests share through MASTER_PORT
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch._dynamo.reset()  # (dynamo's record of the sizes each frame saw is per process: as in a fresh one)
    model = Short()
    strategy = StaticDistStrategy(compile={"enabled": True, "backend": "aot_eager"})
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    try:
        trainer.fit(model)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trainer.global_step == 6  # 4 + 4 + 2 samples per epoch: nothing dropped
    assert model.val_steps == 2  # validation still ran at the end of each epoch
    report = strategy.offer.compile_report
    assert report is not None and report.recompiles == [] and report.graph_count(tail=True) == 1, report.summary()


def test_one_piece_and_one_bucket_are_said_in_the_singular() -> None:
    # a model small enough for one gradient bucket: the graph is one piece, and the report claims no overlap
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager"), split=(1 << 30, 1 << 30))
    model(torch.randn(2, 4)).sum().backward()
    assert report.splitter is not None and report.splitter.pieces == 1, report.summary()
    assert "not cut at the gradient buckets: the parameters of the graph fit one bucket" in report.summary()
    assert "overlap backward" not in report.summary(), report.summary()
    params = list(model.parameters())
    plan = plan_buckets(param_specs(params, range(len(params))), first_bucket_bytes=1 << 20, bucket_bytes=1 << 20)
    assert plan.describe().startswith("1 bucket [") and "/4p]" in plan.describe(), plan.describe()


class _WithAMetric(L.LightningModule):
    """A user's model keeping a running mean with torchmetrics inside the compiled step (the metric's own ``reset``
    and ``forward`` move its states with ``.to(device)``: library code, not the user's)."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.layer = nn.Linear(4, 1)
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).square().mean()
        self.mean_loss(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


def test_library_moves_that_stay_on_their_device_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # torchmetrics' .to(self.device) calls traced into the compiled step move a state to the device it is on: no copy,
    # so no notice (it printed on every rank, even on CPU) and no report line
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=StaticDistStrategy(compile={"enabled": True, "backend": "aot_eager"}))
    with caplog.at_level(logging.WARNING, logger="lightning_static_dist"):
        trainer.fit(_WithAMetric())
    warned = [r.getMessage() for r in caplog.records if "device transfer" in r.getMessage()]
    report = trainer.strategy.offer.compile_report
    assert warned == [] and report.library_transfers == [] and report.placement == [], (warned, report.summary())
    assert "device transfer" not in report.summary() and len(report.graphs) >= 1, report.summary()


def _to_cuda(x: torch.Tensor) -> torch.Tensor:
    return x.to("cuda")


def test_a_library_move_to_another_device_is_one_place_in_the_report() -> None:
    # a graph as dynamo hands it over (example values on their devices, the stack that made each node), faked on CPU
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_static_dist.compile.report import _device_transfers, library_transfers_line

    gm = torch.fx.symbolic_trace(_to_cuda)
    source, move = list(gm.graph.nodes)[:2]
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_cpu, on_cuda = torch.empty(2), torch.empty(2, device="cuda")
    move.meta["stack_trace"] = ('  File "/work/train.py", line 14, in training_step\n    self.metric(loss)\n'
                                '  File "/env/site-packages/torchmetrics/metric.py", line 767, in _apply\n'
                                '    state.to(device)\n')
    source.meta["example_value"], move.meta["example_value"] = on_cpu, on_cuda
    assert _device_transfers(gm) == [("torchmetrics/metric.py:767 (from /work/train.py:14)", True)]
    assert library_transfers_line(["torchmetrics/metric.py:767"]).startswith(
        "device transfers inside graphs from library code: 1 place (torchmetrics/metric.py:767)")
    move.meta["example_value"] = on_cpu  # the same move where the tensor already is: no copy, not reported
    assert _device_transfers(gm) == []
