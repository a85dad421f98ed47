"""``CompressionGuard``: back off gradient compression, on every rank together, when it starts to hurt.

Every ``check_every_n_steps`` optimizer steps the compressing reducer also averages that step's gradients exactly,
and the guard reads the relative error |g_hat - g| / |g|; it also keeps a moving average of the loss. A check is bad
when the error exceeds ``max_rel_error`` (by default the compressor's own ``guard_max_rel_error``) or the loss spikes;
after ``patience`` bad checks in a row rank 0 moves every rank to the compressor's next safer level on the same
step, logged and kept in the checkpoint. Where the thresholds come from: docs/how-it-works.md, "Compression".

Example::

    trainer = L.Trainer(strategy=StaticDistStrategy(compression={"name": "powersgd", "rank": 1}),
                        callbacks=[CompressionGuard(check_every_n_steps=25)])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.compression.base import Compressor
from lightning_static_dist.config.check import check_fields, fail
from lightning_static_dist.offer import CompressionCheck, offer_of

log = logging.getLogger(__name__)

DEFAULT_MAX_REL_ERROR = 0.95
"""The threshold for a compressor that names no ``guard_max_rel_error`` of its own."""


def describe(compressor: Optional[Compressor]) -> str:
    """``powersgd(rank=4)``, ``topk(density=0.01)``, ``bf16``, ``none`` ..."""
    if compressor is None:
        return "none"
    for option in ("rank", "density", "levels"):
        if hasattr(compressor, option):
            return f"{compressor.name}({option}={getattr(compressor, option)})"
    return compressor.name


class CompressionGuard(Callback):
    """Switches to a safer compression level when the compressed gradient or the loss goes wrong (module docs).

    Its keyword arguments are the fields of :class:`CompressionGuard.Config`; a bad one raises a one-line
    :class:`~lightning_static_dist.config.check.ConfigError` naming its run-file key
    (``callbacks.compression_guard.patience=0: ...``).

    Example::

        guard = CompressionGuard(check_every_n_steps=25, patience=3)
    """

    @dataclass
    class Config:
        """``callbacks.compression_guard``: the options of :class:`CompressionGuard` (its keyword arguments)."""

        KEY = "callbacks.compression_guard"

        check_every_n_steps: int = 50
        """Measure the compressed gradient's relative error every this many optimizer steps (one extra exact
        collective on those steps)."""
        max_rel_error: Optional[float] = None
        """A check is bad above this relative error; null: the compressor's own ``guard_max_rel_error``."""
        loss_spike: float = 1.5
        """A check is also bad when the loss exceeds this factor x its moving average."""
        patience: int = 2
        """Bad checks in a row before every rank steps down one level."""
        loss_ema: float = 0.9
        """The weight of the past in the loss's moving average, in [0, 1)."""

        def __post_init__(self) -> None:
            check_fields(self)
            if self.check_every_n_steps < 1:
                fail(f"{self.KEY}.check_every_n_steps", self.check_every_n_steps, "must be an integer >= 1")
            if self.max_rel_error is not None and not self.max_rel_error > 0:
                fail(f"{self.KEY}.max_rel_error", self.max_rel_error,
                     "must be a number > 0, or None (the compressor's own)")
            if not self.loss_spike > 1:
                fail(f"{self.KEY}.loss_spike", self.loss_spike, "must be a factor > 1")
            if self.patience < 1:
                fail(f"{self.KEY}.patience", self.patience, "must be an integer >= 1")
            if not 0 <= self.loss_ema < 1:
                fail(f"{self.KEY}.loss_ema", self.loss_ema, "must be in [0, 1)")

    def __init__(self, check_every_n_steps: int = 50, max_rel_error: Optional[float] = None, loss_spike: float = 1.5,
                 patience: int = 2, loss_ema: float = 0.9) -> None:
        self.config = self.Config(check_every_n_steps=check_every_n_steps, max_rel_error=max_rel_error,
                                  loss_spike=loss_spike, patience=patience, loss_ema=loss_ema)
        self.check_every_n_steps = self.config.check_every_n_steps
        self.max_rel_error = self.config.max_rel_error
        self.loss_spike = self.config.loss_spike
        self.patience = self.config.patience
        self.loss_ema = self.config.loss_ema
        self.events: list[dict[str, Any]] = []
        """One entry per switch: step, reason, old and new level."""
        self.last_rel_error: Optional[float] = None
        self._strikes = 0
        self._loss_avg: Optional[float] = None
        self._switches_to_replay = 0
        self._check_step = 0

    @staticmethod
    def _reducer(trainer: pl.Trainer) -> Optional[CompressionCheck]:
        """The compressing reducer to watch; ``None`` also while ``compression.name: auto`` is still timing its
        candidates (the trial decides what runs, and a check step's extra exact average would skew its times)."""
        offer = offer_of(trainer)
        if offer is None:
            return None
        trial = offer.compression_trial
        if trial is not None and not trial.decided:
            return None
        return offer.compressing_reducer

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        offer = offer_of(trainer)
        if offer is None:
            rank_zero_warn(f"CompressionGuard guards the static_dist strategy's compression only; with"
                           f" {type(trainer.strategy).__name__} it does nothing.")
        elif self._reducer(trainer) is None and offer.compression_trial is None:
            rank_zero_warn("CompressionGuard: the strategy compresses nothing (strategy.compression.name is 'none', or"
                           " the world has one rank): the guard does nothing in this run")
        # a resumed run continues at the level it had reached (the strategy restored the compressor's state already)
        for _ in range(self._switches_to_replay):
            self._step_down(trainer)
        self._switches_to_replay = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        reducer = self._reducer(trainer)
        if reducer is not None and trainer.global_step > 0 and trainer.global_step % self.check_every_n_steps == 0:
            reducer.measure = True  # stays set until a synchronised round consumed it (gradient accumulation)
            self._check_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        reducer = self._reducer(trainer)
        if reducer is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss = float(loss.detach()) if loss is not None else None
        rel_error = reducer.take_relative_error()
        previous_avg = self._loss_avg
        if loss is not None and loss == loss:
            self._loss_avg = loss if previous_avg is None else self.loss_ema * previous_avg + (1 - self.loss_ema) * loss
        if rel_error is None:
            return
        reasons = []
        limit = self.threshold(reducer.compressor)
        if rel_error > limit:
            reasons.append(f"relative gradient error {rel_error:.3f} > {limit}")
        if loss is not None and previous_avg is not None and loss > self.loss_spike * previous_avg:
            reasons.append(f"loss {loss:.4f} > {self.loss_spike} x its average {previous_avg:.4f}")
        # rank 0 decides for everyone: the ranks' losses differ, and all of them must switch on the same step
        rel_error, reasons = trainer.strategy.broadcast((rel_error, reasons), src=0)
        self.last_rel_error = rel_error
        pl_module.log("static_dist/compression_rel_error", rel_error, rank_zero_only=True)
        self._strikes = self._strikes + 1 if reasons else 0
        if self._strikes >= self.patience:
            old, new = self._step_down(trainer)
            self._strikes = 0
            event = {"step": self._check_step, "reason": "; ".join(reasons), "old": old, "new": new}
            self.events.append(event)
            rank_zero_info(f"static_dist: compression guard at step {event['step']}: {old} -> {new} ({event['reason']})")

    def threshold(self, compressor: Compressor) -> float:
        """The relative error above which a check of ``compressor`` is bad: ``max_rel_error`` if given, else the
        compressor's measured ``guard_max_rel_error``, else :data:`DEFAULT_MAX_REL_ERROR`."""
        if self.max_rel_error is not None:
            return self.max_rel_error
        return getattr(compressor, "guard_max_rel_error", DEFAULT_MAX_REL_ERROR)

    def _step_down(self, trainer: pl.Trainer) -> tuple[str, str]:
        offer, reducer = offer_of(trainer), self._reducer(trainer)
        if offer is None or reducer is None:
            return "none", "none"
        old = reducer.compressor
        new = old.safer()
        offer.swap_reducer(new)  # (the last level: the exact mean)
        return describe(old), describe(new)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": list(self.events)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict.get("events", []))
        self._switches_to_replay = len(self.events)  # every switch so far: replayed once the strategy is set up
