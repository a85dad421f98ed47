"""Sharded checkpoints (:mod:`lightning_static_dist.checkpoint`, ``sync.reduce: reduce_scatter``) on real Gloo
ranks: written without gathering, resumed on another world size and mesh, and consolidated into the file an unsharded
run writes, at the end of fit or on request."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from _dist import RankPool
from _mesh_fit import assert_same, fit, fit_in, static, tiny_gpt
from lightning_static_dist.checkpoint import consolidate, is_sharded_checkpoint, parse_key, stored_tensors


@pytest.mark.multiprocess
def test_sharded_checkpoint_two_ranks_resumes_on_four(tmp_path: Any) -> None:
    # 2 ranks (1 x 2) write a sharded checkpoint at step 6 (kept sharded: no consolidation at the end)
    fit(str(tmp_path / "two"), 2, static(1, 2, checkpoint={"consolidate_at_end": False}), steps=6, save_at=6)
    ckpt = str(tmp_path / "two" / "stepstep=6.ckpt")
    assert is_sharded_checkpoint(ckpt)
    ranges: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for name in stored_tensors(ckpt):
        if name.startswith("optim/"):
            index, key, span = parse_key(name)
            if span is not None:
                ranges.setdefault((index, key), []).append(span)
    # nothing was gathered: some parameter's state is split between the two ranks' pieces
    assert any(len(spans) > 1 for spans in ranges.values())
    # resumed on 4 ranks, 2 x 2 (each reads the ranges its pieces overlap) == 4 ranks all_reduce (reads them all)
    with RankPool(4) as ranks:  # (both resumed fits on the same 4 ranks: one start-up)
        resharded, records = fit_in(ranks, str(tmp_path / "to4"), (2, 2, "auto"), ckpt_path=ckpt)
        plain, _ = fit_in(ranks, str(tmp_path / "to4_plain"), (4, 1, "all_reduce"), ckpt_path=ckpt)
    assert records[0]["sharded"]
    assert_same(resharded, plain)
    # consolidated on request: the file an unsharded run writes, which a plain optimizer loads
    out = str(tmp_path / "plain.ckpt")
    consolidate(ckpt, out)
    checkpoint = torch.load(out, weights_only=False)
    model = tiny_gpt()
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    for param in (p for g in optimizer.param_groups for p in g["params"]):
        assert optimizer.state[param]["exp_avg"].shape == param.shape
    model.load_state_dict(checkpoint["state_dict"])
    assert checkpoint["global_step"] == 6


@pytest.mark.multiprocess
@pytest.mark.slow  # (its mirror, 2 -> 4 ranks, stays in the default run)
def test_four_ranks_checkpoint_consolidated_at_end_resumes_on_two(tmp_path: Any) -> None:
    # 4 ranks (2 x 2) save at step 6, the last checkpoint is consolidated in place at the end of fit
    fit(str(tmp_path / "four"), 4, static(2, 2), steps=6, save_at=6)
    ckpt = str(tmp_path / "four" / "stepstep=6.ckpt")
    assert os.path.isfile(ckpt) and not is_sharded_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    model = tiny_gpt()
    assert len(saved["state"]) == len(list(model.parameters()))  # full form: one entry per original parameter
    for index, param in enumerate(p for g in model.configure_optimizers().param_groups for p in g["params"]):
        assert saved["state"][index]["exp_avg"].shape == param.shape
    resharded, _ = fit(str(tmp_path / "to2"), 2, static(1, 2), ckpt_path=ckpt)
    plain, _ = fit(str(tmp_path / "to2_plain"), 2, static(2, 1, reduce="all_reduce"), ckpt_path=ckpt)
    assert_same(resharded, plain)
