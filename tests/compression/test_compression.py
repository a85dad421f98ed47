"""Gradient compression on 2 real Gloo ranks: each compressor's reconstruction error on known tensors, bytes
counted == bytes handed to the collectives, convergence of a small GPT, per-rank state through a Lightning
checkpoint, TopK's indices under compile, the non-finite path and the config errors."""

from __future__ import annotations

import glob
import math
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning as L
from _dist import RankPool
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_static_dist.compression import (
    CompressingReducer,
    CompressionGuard,
    LowPrecisionCompressor,
    PowerSGDCompressor,
    QSGDCompressor,
    TopKCompressor,
    build_compressor,
)
from lightning_static_dist.trial import Candidate, StepTrial, choose
from lightning_static_dist.compression.base import PerParameterState, all_reduce, flat_float, scatter_into
from lightning_static_dist.compression.config import CompressionConfig
from lightning_static_dist.config import ConfigError
from lightning_static_dist.offer import offer_of

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """Two Gloo ranks shared by the cases whose functions leave the default group as they found it (one start-up)."""
    with RankPool(2) as pool:
        yield pool


def _run_phases(compressor: Any, grads: list[torch.Tensor]) -> int:
    """Drive a compressor's phases to the end; return the bytes they reported."""
    sent = 0
    for collective, nbytes in compressor.phases(list(range(len(grads))), grads, dist.get_world_size()):
        sent += nbytes
        collective(None).wait()
    return sent


def _reconstruction(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # each rank its own gradient
    out: dict[str, Any] = {}
    # a rank-1 matrix per rank: PowerSGD rank 2 recovers their average (rank <= 2) exactly
    u, v = torch.randn(64, 1), torch.randn(1, 48)
    g = u @ v
    everyone = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(everyone, g)
    exact = torch.stack(everyone).mean(0)
    out["exact_norm"] = exact.norm().item()

    def rel(approx: torch.Tensor) -> float:
        return ((approx - exact).norm() / exact.norm()).item()

    for name, compressor in [
        ("powersgd_r2", PowerSGDCompressor(rank=2, min_numel=1, error_feedback=False)),
        ("bf16", LowPrecisionCompressor(torch.bfloat16)),
        ("fp16", LowPrecisionCompressor(torch.float16)),
        ("topk_full", TopKCompressor(density=1.0, min_numel=1, error_feedback=False)),
        ("qsgd", QSGDCompressor(levels=127, min_numel=1)),
    ]:
        grad = g.clone()
        sent = _run_phases(compressor, [grad])
        out[name] = (rel(grad), sent, compressor.payload_bytes([g.shape]))
    # TopK at 10 %: the average of each rank's 10 % largest entries, and the residual keeps the rest
    topk = TopKCompressor(density=0.1, min_numel=1)
    grad = g.clone()
    _run_phases(topk, [grad])
    k = math.ceil(0.1 * g.numel())
    mine = torch.zeros(g.numel())
    idx = g.reshape(-1).abs().topk(k).indices
    mine[idx] = g.reshape(-1)[idx]
    everyone_sparse = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone_sparse, mine)
    out["topk_10"] = (grad.reshape(-1) - torch.stack(everyone_sparse).mean(0)).abs().max().item()
    out["topk_residual"] = (topk.residuals[0] - (g.reshape(-1) - mine)).abs().max().item()
    # QSGD is unbiased: the mean of 200 independent quantisations approaches the exact average
    qsgd = QSGDCompressor(levels=4, min_numel=1, seed=rank)
    draws = []
    for _ in range(200):
        grad = g.clone()
        _run_phases(qsgd, [grad])
        draws.append(grad)
    out["qsgd_single_l4"] = rel(draws[0])
    out["qsgd_mean_l4"] = rel(torch.stack(draws).mean(0))
    return out


def test_each_compressor_reconstructs_within_its_bound_and_counts_its_bytes(ranks: RankPool) -> None:
    for r in ranks.run(_reconstruction):
        assert r["powersgd_r2"][0] < 1e-4, r  # rank <= 2: exact up to fp32 round-off
        assert r["bf16"][0] < 2**-7 and r["fp16"][0] < 2**-10, r  # one rounding to 8 / 11 significant bits
        assert r["topk_full"][0] < 1e-6, r
        # QSGD's variance bound per rank, chunks of d=512 at s=127 levels: d/s^2 |g|^2; averaged over 2 ranks
        assert r["qsgd"][0] < math.sqrt(512 / 127**2 / 2), r
        assert r["topk_10"] < 1e-6 and r["topk_residual"] == 0.0, r
        assert r["qsgd_mean_l4"] < r["qsgd_single_l4"] / 5, r  # unbiased: averaging draws shrinks the error
        for name in ("powersgd_r2", "bf16", "fp16", "topk_full", "qsgd"):
            _, sent, predicted = r[name]
            assert sent == predicted, (name, sent, predicted)
        # PowerSGD r2 on 64x48: (64 + 48) * 2 fp32 = 896 bytes instead of 12288
        assert r["powersgd_r2"][1] == (64 + 48) * 2 * 4
        assert r["bf16"][1] == 64 * 48 * 2


def _tiny_gpt() -> Any:
    from lightning_static_dist.examples.charlm import CharGPT

    torch.manual_seed(0)
    return CharGPT(n_layer=2, n_embd=64, n_head=2, block_size=32, warmup_steps=0)


def _train(rank: int, world: int, names: list[str], steps: int) -> dict[str, Any]:
    """Train the same tiny GPT once per compressor with the synchroniser alone; rank r gets its own data."""
    from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer

    text = torch.tensor(list(open(os.__file__, "rb").read()[:40_000]), dtype=torch.long)
    results: dict[str, Any] = {}
    for name in names:
        model = _tiny_gpt()
        sync = GradientSynchronizer(model.named_parameters(), capacity=BucketCapacity.from_mib(0.05, 0.2))
        compressor = build_compressor(CompressionConfig(name=name, rank=4, density=0.01, min_numel=256))
        if compressor is not None:
            sync.reducer = CompressingReducer(compressor, [p.shape for p in sync.parameters])
        sync.attach()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(steps):
            starts = torch.randint(0, text.numel() - 33, (16,), generator=g)
            batch = torch.stack([text[s : s + 33] for s in starts.tolist()])
            loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            sync.finish_if_pending()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        sync.detach()
        results[name] = {
            "first": sum(losses[:5]) / 5,
            "last": sum(losses[-10:]) / 10,
            "bytes": sync.stats.last_round_bytes,
            "dense": sync.stats.last_round_dense_bytes,
        }
    return results


def test_the_char_gpt_converges_with_every_compressor_and_sends_fewer_bytes(ranks: RankPool) -> None:
    names = ["none", "bf16", "powersgd", "topk", "qsgd"]
    for r in ranks.run(_train, args=(names, 100), timeout=300):
        base = r["none"]
        assert base["bytes"] == base["dense"]
        for name in names:
            assert r[name]["last"] < r[name]["first"] - 0.5, (name, r[name])  # it learns
            assert r[name]["last"] < base["last"] * 1.15, (name, r[name], base)  # topk 1 % is the slowest early on
        ratios = {name: r[name]["dense"] / r[name]["bytes"] for name in names}
        assert ratios["bf16"] == pytest.approx(2.0, rel=0.01), ratios
        assert ratios["powersgd"] > 5 and ratios["topk"] > 5 and ratios["qsgd"] > 3, ratios


def test_bad_compression_configs_name_the_key() -> None:
    cases = [
        ({"name": "zip"}, "strategy.compression.name='zip': unknown compressor"),
        ({"name": "powersgd", "rank": 0}, "strategy.compression.rank=0"),
        ({"name": "topk", "density": 0.0}, "strategy.compression.density=0.0"),
        ({"name": "topk", "density": 1.5}, "strategy.compression.density=1.5"),
        ({"name": "qsgd", "levels": 1}, "strategy.compression.levels=1"),
        ({"name": "no_such_pkg.Compressor"}, "strategy.compression.name='no_such_pkg.Compressor': cannot import"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=None) as err:
            CompressionConfig(**kwargs)
        assert str(err.value).startswith(message), str(err.value)
    with pytest.raises(ConfigError, match="strategy.compression.name='collections.OrderedDict': OrderedDict does not"):
        build_compressor(CompressionConfig(name="collections.OrderedDict"))


# ------------------------------------------------------------------------------------- inside a Lightning Trainer


class _Probe(L.Callback):
    """Writes what each rank's compressing reducer holds to ``<dir>/rank<r>_<event>.pt``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.indices: list[list[int]] = []

    def _dump(self, trainer: L.Trainer, event: str, payload: Any) -> None:
        torch.save(payload, os.path.join(self.directory, f"rank{trainer.global_rank}_{event}.pt"))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reducer = offer_of(trainer).compressing_reducer
        self._dump(trainer, "start", {"rounds": reducer.rounds, "state": reducer.state_dict()["state"],
                                      "compressor": reducer.compressor.name})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        last = getattr(offer_of(trainer).compressing_reducer.compressor, "last_indices", None)
        if last is not None:
            self.indices.append(sorted(last.tolist()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reducer = offer_of(trainer).compressing_reducer
        guards = [c for c in trainer.callbacks if isinstance(c, CompressionGuard)]
        self._dump(trainer, "end", {"rounds": reducer.rounds, "state": reducer.state_dict()["state"],
                                    "indices": self.indices, "compiled": offer_of(trainer).compile_report is not None,
                                    "compressor": reducer.compressor.name,
                                    "events": guards[0].events if guards else None})


def _joined(rank: int) -> None:
    """This pool rank's Trainer joins the ranks' Gloo group, and compiles as a fresh process would."""
    os.environ["LOCAL_RANK"] = str(rank)  # the process group exists: Lightning joins it instead of launching
    torch._dynamo.reset()  # (nothing cached by an earlier fit on these ranks)


def _fit(ranks: RankPool, tmp: str, compression: dict, steps: int, compile_cfg: Any = None, ckpt_path: Any = None,
         guard: Any = None) -> None:
    """A char-GPT fit on the module's two ranks (the Trainer joins their group), each rank's :class:`_Probe` facts
    and a ``last`` checkpoint in ``tmp``."""
    ranks.run(_fit_on_this_rank, args=(tmp, compression, steps, compile_cfg, ckpt_path, guard), timeout=300)


def _fit_on_this_rank(rank: int, world: int, tmp: str, compression: dict, steps: int, compile_cfg: Any,
                      ckpt_path: Any, guard: Any) -> None:
    from lightning_static_dist.examples.charlm import CharDataModule
    from lightning_static_dist import StaticDistStrategy

    _joined(rank)
    L.seed_everything(0)
    strategy = StaticDistStrategy(compression=compression, compile=compile_cfg,
                                  sync={"first_bucket_mb": 0.05, "bucket_mb": 0.2})
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, default_root_dir=tmp,
        callbacks=([guard] if guard else []) + [_Probe(tmp), ModelCheckpoint(dirpath=tmp, filename="last")],
        enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(_tiny_gpt(), datamodule=CharDataModule(block_size=32, batch_size=8, max_bytes=60_000), ckpt_path=ckpt_path)


def test_each_rank_resumes_with_its_own_residual(ranks: RankPool, tmp_path: Any) -> None:
    compression = {"name": "powersgd", "rank": 2, "min_numel": 256}
    _fit(ranks, str(tmp_path), compression, steps=6)
    (ckpt,) = glob.glob(str(tmp_path / "last*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)["static_dist_compression"]
    assert saved["world_size"] == 2 and [s["rounds"] for s in saved["ranks"]] == [6, 6]
    residuals = [s["state"]["residuals"] for s in saved["ranks"]]
    assert residuals[0].keys() == residuals[1].keys() and residuals[0]
    assert all(isinstance(k, str) and k.endswith(".weight") for k in residuals[0])  # saved under parameter names
    # each rank saw other data, so each has its own residual — the thing PowerSGD's own example loses
    assert any(not torch.equal(residuals[0][k], residuals[1][k]) for k in residuals[0])
    # and the warm-start Q, averaged, is the same on both
    assert all(torch.equal(saved["ranks"][0]["state"]["q"][k], saved["ranks"][1]["state"]["q"][k]) for k in saved["ranks"][0]["state"]["q"])
    _fit(ranks, str(tmp_path), compression, steps=8, ckpt_path=ckpt)
    for rank in (0, 1):
        start = torch.load(str(tmp_path / f"rank{rank}_start.pt"), weights_only=True)
        assert start["rounds"] == 6
        for key, tensor in residuals[rank].items():
            assert torch.equal(start["state"]["residuals"][key], tensor), (rank, key)


def _fit_twice_in_one_process(rank: int, world: int, tmp: str) -> tuple[int, int]:
    """Both fits on one trainer and strategy in this rank's process (as a script under torchrun or Lightning's
    subprocess launcher runs them): the second resumes the first's checkpoint."""
    from lightning_static_dist.examples.charlm import CharDataModule
    from lightning_static_dist import StaticDistStrategy

    _joined(rank)
    L.seed_everything(0)
    strategy = StaticDistStrategy(compression={"name": "topk", "density": 0.25, "min_numel": 256},
                                  sync={"first_bucket_mb": 0.05, "bucket_mb": 0.2})
    probe = _Probe(tmp)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=4, logger=False, default_root_dir=tmp,
        callbacks=[probe, ModelCheckpoint(dirpath=tmp, filename="first")], enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    model, data = _tiny_gpt(), CharDataModule(block_size=32, batch_size=8, max_bytes=60_000)
    trainer.fit(model, datamodule=data)
    saved = strategy.offer.compressing_reducer.rounds
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(model, datamodule=data, ckpt_path=os.path.join(tmp, "first.ckpt"))
    return saved, torch.load(os.path.join(tmp, f"rank{rank}_start.pt"), weights_only=True)["rounds"]


def test_a_second_fit_of_the_same_strategy_resumes_the_checkpoint_s_compressor_state(ranks: RankPool,
                                                                                     tmp_path: Any) -> None:
    # Lightning restores a checkpoint before the strategy's setup: the state must reach the second fit's new
    # reducer, not the first fit's (which it used to, leaving the new one at zero rounds)
    for saved, resumed in ranks.run(_fit_twice_in_one_process, args=(str(tmp_path),), timeout=300):
        assert saved == 4 and resumed == 4, (saved, resumed)


def test_topk_indices_follow_the_gradients_under_compile(ranks: RankPool, tmp_path: Any) -> None:
    _fit(ranks, str(tmp_path), {"name": "topk", "density": 0.01, "min_numel": 256}, steps=6,
         compile_cfg={"enabled": True, "backend": "aot_eager"})
    end = torch.load(str(tmp_path / "rank0_end.pt"), weights_only=True)
    assert end["compiled"] and len(end["indices"]) == 6
    # a graph that froze the selection would send the same entries every step
    assert len({tuple(i) for i in end["indices"]}) == 6


def _nonfinite(rank: int, world: int) -> dict[str, Any]:
    compressor = PowerSGDCompressor(rank=1, min_numel=1)
    reducer = CompressingReducer(compressor, [torch.Size([8, 8])])
    from lightning_static_dist.sync import GradientSynchronizer

    weight = torch.nn.Parameter(torch.ones(8, 8))
    sync = GradientSynchronizer([("w", weight)])
    sync.reducer = reducer
    sync.attach()
    results = {}
    for step, poison in enumerate([False, True, False]):
        torch.manual_seed(step * 10 + rank)
        x = torch.randn(8)
        loss = (weight @ x).sum() * (float("nan") if poison and rank == 1 else 1.0)
        loss.backward()
        sync.finish_if_pending()
        results[step] = {"finite": bool(torch.isfinite(weight.grad).all()), "residual": compressor.residuals[0].clone() if compressor.residuals else None}
        weight.grad = None
    results["nonfinite_buckets"] = reducer.nonfinite_buckets
    return results


def test_a_nonfinite_gradient_reaches_every_rank_and_leaves_the_residual_alone(ranks: RankPool) -> None:
    for r in ranks.run(_nonfinite):
        assert r[0]["finite"] and not r[1]["finite"] and r[2]["finite"]  # NaN reaches Lightning on every rank
        assert r["nonfinite_buckets"] == 1  # both ranks: the rank without a local NaN reached the same verdict
        assert torch.equal(r[1]["residual"], r[0]["residual"])  # step 1 did not touch it
        assert torch.isfinite(r[2]["residual"]).all()


class GarbageCompressor(PerParameterState):
    """A pathological compressor for the guard test: it averages the *negated* gradients (relative error 2)."""

    name = "garbage"
    phases_per_bucket = 1

    def takes(self, shape: torch.Size) -> bool:
        return len(shape) >= 2

    def payload_bytes(self, shapes: Any) -> int:
        return sum(math.prod(s) for s in shapes) * 4

    def phases(self, keys: Any, grads: Any, world: int) -> Any:
        flat = flat_float(grads).neg_().div_(world)
        yield all_reduce(flat), flat.numel() * 4
        scatter_into(flat, grads)

    def safer(self) -> Any:
        return LowPrecisionCompressor(torch.bfloat16)


def test_the_guard_switches_every_rank_on_the_same_step_and_resumes_at_that_level(ranks: RankPool,
                                                                                  tmp_path: Any) -> None:
    compression = {"name": "tests.compression.test_compression.GarbageCompressor", "min_numel": 256}
    _fit(ranks, str(tmp_path), compression, steps=7, guard=CompressionGuard(check_every_n_steps=2, patience=2))
    ends = [torch.load(str(tmp_path / f"rank{r}_end.pt"), weights_only=False) for r in (0, 1)]
    for end in ends:
        assert end["compressor"] == "bf16"
        (event,) = end["events"]
        # checks at steps 2 and 4 (relative error 2 > 0.95 both times): the second one switches
        assert event["step"] == 4 and event["old"] == "garbage" and event["new"] == "bf16", event
        assert event["reason"].startswith("relative gradient error 2.000"), event
    assert ends[0]["events"] == ends[1]["events"]
    (ckpt,) = glob.glob(str(tmp_path / "last*.ckpt"))
    _fit(ranks, str(tmp_path), compression, steps=9, ckpt_path=ckpt, guard=CompressionGuard(check_every_n_steps=2, patience=2))
    for rank in (0, 1):
        assert torch.load(str(tmp_path / f"rank{rank}_start.pt"), weights_only=False)["compressor"] == "bf16"


def test_the_guard_judges_each_compressor_by_its_own_measured_threshold() -> None:
    guard = CompressionGuard()
    assert guard.threshold(PowerSGDCompressor(rank=4)) == PowerSGDCompressor.guard_max_rel_error == 0.4
    assert guard.threshold(QSGDCompressor(levels=7)) == 1.3 and guard.threshold(TopKCompressor()) == 0.15
    # a compressor that names none (the test's GarbageCompressor, bf16) gets the general default
    assert guard.threshold(GarbageCompressor()) == guard.threshold(LowPrecisionCompressor(torch.bfloat16)) == 0.95
    # a threshold given wins for every compressor
    assert CompressionGuard(max_rel_error=0.7).threshold(PowerSGDCompressor()) == 0.7


class _Lenient:
    name, guard_max_rel_error = "lenient", 3.0

    def safer(self) -> Any:
        return _Strict()


class _Strict:
    name, guard_max_rel_error = "strict", 1.0

    def safer(self) -> Any:
        return _Lenient()


class _MeasuredReducer:
    """What the guard reads of a compressing reducer: the compressor in use and the error measured on a check."""

    def __init__(self, compressor: Any, rel_error: float) -> None:
        self.compressor, self.rel_error = compressor, rel_error

    def take_relative_error(self) -> float:
        return self.rel_error

    def switch_to(self, compressor: Any) -> None:
        self.compressor = compressor


def test_the_guard_reads_the_threshold_of_the_compressor_in_use_at_every_check() -> None:
    from types import SimpleNamespace

    reducer = _MeasuredReducer(_Lenient(), rel_error=2.0)
    # the offer as the guard reads it (tests/test_callbacks.py checks the strategy's own offer on real ranks)
    offer = SimpleNamespace(compression_trial=None, compressing_reducer=reducer, swap_reducer=reducer.switch_to)
    strategy = SimpleNamespace(offer=offer, broadcast=lambda obj, src=0: obj)
    trainer, module = SimpleNamespace(strategy=strategy), SimpleNamespace(log=lambda *args, **kwargs: None)
    guard = CompressionGuard(patience=2)

    def checks(n: int) -> None:
        for _ in range(n):
            guard.on_train_batch_end(trainer, module, {"loss": torch.tensor(1.0)}, None, 0)

    checks(3)  # error 2 < the lenient compressor's 3: never bad
    assert guard.events == []
    reducer.compressor = _Strict()  # error 2 > 1: bad twice, then stepped down to the lenient one ...
    checks(2)
    assert [(e["old"], e["new"]) for e in guard.events] == [("strict", "lenient")]
    assert guard.events[0]["reason"].startswith("relative gradient error 2.000 > 1.0")
    checks(3)  # ... whose threshold applies from the next check on
    assert len(guard.events) == 1 and reducer.compressor.name == "lenient"


class _TimedPowerSGD(PowerSGDCompressor):
    """PowerSGD that notes when each of its collectives is issued: (bucket's first key, phase, time)."""

    def __init__(self) -> None:
        super().__init__(rank=2, min_numel=1)
        self.issued: list[tuple[int, int, float]] = []

    def phases(self, keys: Any, grads: Any, world: int) -> Any:
        for phase, (collective, nbytes) in enumerate(super().phases(keys, grads, world)):
            yield self._timed(collective, keys[0], phase), nbytes

    def _timed(self, collective: Any, key: int, phase: int) -> Any:
        def issue(group: Any) -> Any:
            self.issued.append((key, phase, time.perf_counter()))
            return collective(group)

        return issue


def _phase_timing(rank: int, world: int) -> list[float]:
    from lightning_static_dist.sync import BucketCapacity, GradientSynchronizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(12)])
    # one block per bucket
    sync = GradientSynchronizer(model.named_parameters(), capacity=BucketCapacity.from_mib(0.3, 0.3))
    compressor = _TimedPowerSGD()
    sync.reducer = CompressingReducer(compressor, [p.shape for p in sync.parameters])
    sync.attach()
    fractions = []
    for _ in range(6):
        x = torch.randn(512, 256)
        compressor.issued.clear()
        loss = model(x).square().mean()
        start = time.perf_counter()
        loss.backward()  # the round finishes inside, from autograd's end-of-backward callback
        end = time.perf_counter()
        second = [t for _, phase, t in compressor.issued if phase == 1]
        fractions.append((min(second) - start) / (end - start))
        for p in model.parameters():
            p.grad = None
    return fractions[2:]


def test_powersgd_second_phase_starts_while_backward_is_still_running(ranks: RankPool) -> None:
    for fractions in ranks.run(_phase_timing):
        # the first bucket's Q all-reduce goes out from a later gradient hook, well before backward ends
        assert statistics.median(fractions) < 0.6, fractions


def test_consecutive_slots_are_averaged_where_they_lie() -> None:
    # the exact remainder of a bucket, or a low-precision payload covering it: one view, no concatenation
    from lightning_static_dist.compression.base import averaged, contiguous_span

    flat = torch.arange(12.0)
    slots = [flat[0:6].view(2, 3), flat[6:8], flat[8:12]]
    span = contiguous_span(slots)
    assert span is not None and span.data_ptr() == flat.data_ptr() and span.numel() == 12
    assert contiguous_span([flat[0:3], flat[4:6]]) is None  # a gap
    assert contiguous_span([flat[4:6], flat[0:4]]) is None  # out of order
    assert contiguous_span([flat[0:3], torch.zeros(3)]) is None  # another storage
    assert contiguous_span([flat[0:3], flat.double()[3:6]]) is None  # another dtype
    assert contiguous_span([flat[0:8].view(2, 4)[:, :2]]) is None  # not contiguous
    # one phase, world 4: fp32 in place (the collective's tensor is the bucket itself), bf16 through one payload
    phases = averaged(slots, 4)
    (collective, nbytes) = next(phases)
    assert nbytes == 48 and torch.equal(flat, torch.arange(12.0) / 4)
    with pytest.raises(StopIteration):
        next(phases)  # (no collective issued here: the payload is written back as it is, i.e. the mean of 1 rank)
    flat = torch.arange(12.0)
    phases = averaged([flat[0:6], flat[6:12]], 4, torch.bfloat16)
    (collective, nbytes) = next(phases)
    assert nbytes == 24 and torch.equal(flat, torch.arange(12.0))  # the bucket untouched until the write-back
    with pytest.raises(StopIteration):
        next(phases)
    assert torch.equal(flat, (torch.arange(12.0) / 4).bfloat16().float())


# ------------------------------------------------------------------------------------------ compression.name: auto


def test_auto_keeps_exact_unless_a_compressor_saves_enough_time() -> None:
    assert choose({"none": 40.0, "bf16": 39.0, "powersgd(rank=4)": 45.0}) == "none"  # 2.5 % is not enough
    assert choose({"none": 40.0, "bf16": 36.0, "powersgd(rank=4)": 45.0}) == "bf16"
    assert choose({"none": 40.0, "bf16": 30.0, "powersgd(rank=4)": 20.0}) == "powersgd(rank=4)"
    assert choose({"none": 20.0, "bf16": 30.0, "powersgd(rank=4)": 25.0}) == "none"


class _FakeClockTrial(StepTrial):
    """The trial with a clock that runs ``per_step[candidate]`` seconds per step (what a slow or fast link would
    make the measured windows say); the real measurement is tested on a real group below."""

    clock = 0.0

    def _now(self) -> float:
        return self.clock


def _run_trial(per_step: dict[str, float]) -> tuple[str, list[tuple[int, str]]]:
    trial = _FakeClockTrial([Candidate(name, lambda: None) for name in per_step], start_step=3, trial_steps=3,
                            device=torch.device("cpu"))
    switches, active = [], None
    for step in range(20):
        for _ in range(2):  # gradient accumulation: two batches per optimizer step, only the first counts
            picked = trial.before_step(step)
            if picked != "keep":
                switches.append((step, picked.name))
                active = picked.name
        if active is not None:
            trial.clock += per_step[active]
        picked = trial.after_step()  # (the choice: at the end of the trial's last step, for the next one on)
        if picked != "keep":
            switches.append((step + 1, picked.name))
            active = picked.name
        trial.clock += 1.0  # validation, a checkpoint: after the optimizer step, not the candidate's
    return trial.choice, switches


def test_auto_picks_by_the_measured_step_times_of_each_candidate() -> None:
    fast_link = {"none": 0.030, "bf16": 0.034, "powersgd": 0.040}  # encoding costs more than the bytes it saves
    slow_link = {"none": 0.090, "bf16": 0.060, "powersgd": 0.040}
    choice, switches = _run_trial(fast_link)
    # exact from step 3, bf16 from 6, PowerSGD from 9; at 12 every window is timed and exact is back
    assert choice == "none" and switches == [(3, "none"), (6, "bf16"), (9, "powersgd"), (12, "none")]
    choice, switches = _run_trial(slow_link)
    assert choice == "powersgd" and switches == [(3, "none"), (6, "bf16"), (9, "powersgd")]  # it simply goes on


class _AutoProbe(L.Callback):
    """Writes each rank's trial (choice, times) and the reducer's compressor at the end to ``<dir>/auto_rank<r>.pt``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        offer = offer_of(trainer)
        trial, reducer = offer.compression_trial, offer.compressing_reducer
        torch.save({"state": trial.state_dict(), "compressor": reducer.compressor.name if reducer else "none"},
                   os.path.join(self.directory, f"auto_rank{trainer.global_rank}.pt"))


def _fit_auto(ranks: RankPool, tmp: str, steps: int, ckpt_path: Any = None) -> None:
    ranks.run(_fit_auto_on_this_rank, args=(tmp, steps, ckpt_path), timeout=300)


def _fit_auto_on_this_rank(rank: int, world: int, tmp: str, steps: int, ckpt_path: Any) -> None:
    from lightning_static_dist.examples.charlm import CharDataModule
    from lightning_static_dist import StaticDistStrategy

    _joined(rank)
    L.seed_everything(0)
    strategy = StaticDistStrategy(sync={"first_bucket_mb": 0.05, "bucket_mb": 0.2},
                                  compression={"name": "auto", "rank": 2, "start_step": 1, "trial_steps": 2,
                                               "min_numel": 256})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        default_root_dir=tmp, callbacks=[_AutoProbe(tmp), ModelCheckpoint(dirpath=tmp, filename="last")],
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(_tiny_gpt(), datamodule=CharDataModule(block_size=32, batch_size=8, max_bytes=60_000),
                ckpt_path=ckpt_path)


def test_auto_times_every_candidate_on_the_real_group_and_every_rank_keeps_the_same(ranks: RankPool,
                                                                                    tmp_path: Any) -> None:
    _fit_auto(ranks, str(tmp_path), steps=9)  # exact at step 0, then 2 steps each of exact, bf16, PowerSGD; chosen at 7
    ends = [torch.load(str(tmp_path / f"auto_rank{r}.pt"), weights_only=False) for r in (0, 1)]
    assert ends[0] == ends[1]  # the slowest rank's times: the same on both, and so the same choice
    state = ends[0]["state"]
    assert list(state["step_s"]) == ["none", "bf16", "powersgd(rank=2)"] and all(s > 0 for s in state["step_s"].values())
    assert state["choice"] == choose(state["step_s"])
    assert ends[0]["compressor"] == {"none": "none", "bf16": "bf16", "powersgd(rank=2)": "powersgd"}[state["choice"]]
    # resumed: the saved choice is kept, with no second trial
    (ckpt,) = glob.glob(str(tmp_path / "last*.ckpt"))
    assert torch.load(ckpt, weights_only=False)["static_dist_compression_auto"] == state
    _fit_auto(ranks, str(tmp_path), steps=12, ckpt_path=ckpt)
    assert torch.load(str(tmp_path / "auto_rank0.pt"), weights_only=False) == ends[0]
