"""What the compile report says about what is left of a compiled step: every recompile names its guard, a remaining
graph break names the model's line."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import textwrap
from typing import Any

import torch
from torch import nn

from lightning_static_dist.compile import compile_regions
from lightning_static_dist.compile.config import CompileConfig
from lightning_static_dist.compile.report import is_library_path
from lightning_static_dist.examples import charlm



class Branchy(nn.Module):
    def forward(self, x: torch.Tensor, every: int) -> torch.Tensor:
        return x * 2 if every % 2 == 0 else x - 1


def test_every_recompile_names_its_guard() -> None:
    # without TORCH_LOGS: dynamo writes its "recompiles" log only when asked, but the report still names the guard
    assert "recompiles" not in os.environ.get("TORCH_LOGS", "")
    model = Branchy()
    # static: under dynamic=auto the int becomes dynamic after its second value, and the guard reads `every % 2`
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", dynamic=False))
    for every in (0, 1, 2):
        model(torch.ones(2), every)
    assert len(report.recompiles) == 2, report.summary()
    first, second = report.recompiles
    assert "every == 0" in first and "in region '<forward>'" in first, first
    assert "every == 1" in second and "and 1 older graph of this frame" in second, second
    assert "not logged" not in report.summary(), report.summary()


_INSTALLED_MODEL = '''
    import lightning as L
    import torch


    class Installed(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            loss = self.net(batch).sum()
            torch._dynamo.graph_break()
            return loss
'''


def test_a_remaining_break_names_the_models_line_also_in_an_installed_package(tmp_path: Any) -> None:
    # a model installed as a package (site-packages) and the shipped example are the user's model: a break in their
    # step is named at their line, not at the script that started the run
    assert not is_library_path(charlm.__file__)
    folder = tmp_path / "site-packages"
    folder.mkdir()
    (folder / "installed_model.py").write_text(textwrap.dedent(_INSTALLED_MODEL))
    spec = importlib.util.spec_from_file_location("installed_model", folder / "installed_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["installed_model"] = module
    try:
        spec.loader.exec_module(module)
        model = module.Installed()
        report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager"))
        model.training_step(torch.ones(1, 2), 0)
    finally:
        del sys.modules["installed_model"]
    assert len(report.graph_breaks) == 1, report.summary()
    assert report.graph_breaks[0][1] == f"{folder / 'installed_model.py'}:13", report.summary()


class _Lengths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum()


def test_reaching_the_recompile_limit_is_one_line_naming_the_guard_and_the_fix(caplog: Any) -> None:
    # static shapes pinned (dynamic: false) and a sequence length that takes a new value every call: past dynamo's
    # limit (lowered to 3 here, 8 by default) the calls that match no graph run eagerly, and the user is told once
    torch._dynamo.reset()
    model = _Lengths()
    report = compile_regions(model, CompileConfig(enabled=True, backend="aot_eager", dynamic=False))
    with torch._dynamo.config.patch(recompile_limit=3), caplog.at_level(logging.WARNING):
        for length in (2, 3, 4, 5, 6, 3):
            x = torch.randn(2, length, 4)
            torch.testing.assert_close(model(x), model.proj(x).sum())  # eager or compiled: the same result
    said = [r.getMessage() for r in caplog.records if "recompile" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said  # one line; torch's own six are not printed
    assert "size mismatch at index 1" in said[0] and "strategy.compile.dynamic=true" in said[0], said[0]
    assert report.graph_count() == 3 and report.eager_calls == {"<forward>": [4, 5]}, report.summary()
    assert "RECOMPILE LIMIT" in report.summary() and "calls 4, 5" in report.summary(), report.summary()


def test_the_pieces_are_said_per_graph_and_overlap_only_where_cut() -> None:
    from lightning_static_dist.compile.split import BucketGraphSplitter

    splitter = BucketGraphSplitter(lambda gm, inputs: gm, 1 << 20, 1 << 20)
    splitter.cuts = [4, 4]  # a graph and its recompile, each cut into 4: not "8 pieces"
    assert "each of its 2 graphs cut into 4 pieces" in splitter.describe() and "overlap" in splitter.describe()
    splitter.cuts = [1, 1, 1]
    assert "not cut" in splitter.describe() and "overlap" not in splitter.describe(), splitter.describe()
    splitter.cuts = [4, 1]
    assert "its 2 graphs cut into 4, 1 pieces" in splitter.describe(), splitter.describe()
