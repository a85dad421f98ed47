"""The Fabric strategy's checkpoints: ``fabric.save`` and ``fabric.load`` go through each set-up model's step
participants, as the Trainer strategy's checkpoints do (the ranks' last steps checked, the participants' entries
added and taken out, the model and optimizer states in the forms the participants save and load: a ``reduce_scatter``
run's optimizer state is gathered into the file, and each rank cuts its own ranges out of it when loading).

Example (what ``fabric.save(path, {"model": model, "optimizer": optimizer})`` runs, on every rank)::

    strategy.save_checkpoint(path, state)   # check_in_step; model_state_dict; optimizer_state; state_dict entries
    strategy.load_checkpoint(path, state)   # model_state_to_load; load_optimizer_states / optimizer_state_to_load

Each model's participants' entries are its own (:func:`entries_as_saved`): the first model's under the names the
Trainer strategy saves them with, the ``i``-th's under ``static_dist_model{i}/``. Entries read before their model is
set up (``fabric.load`` before ``fabric.setup``) are kept and handed to it when it is.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.utilities.types import _PATH

from lightning_static_dist.config import ConfigError
from lightning_static_dist.fabric.model import FabricModel
from lightning_static_dist.fabric.processes import FabricProcesses
from lightning_static_dist.plan.strategy_config import StrategyConfig


def one_file_checkpoints(config: StrategyConfig) -> StrategyConfig:
    """``fabric.save`` writes one file, from rank 0 (Fabric's ``DDPStrategy``): the optimizer state ``reduce_scatter``
    splits between the ranks is gathered into it (``checkpoint.format: auto`` reads ``full`` here); ``sharded``, each
    rank writing its own ranges, is refused in one line."""
    fmt = config.checkpoint.format
    if fmt == "sharded":
        raise ConfigError("strategy.checkpoint.format='sharded': fabric.save writes one file from rank 0, which cannot"
                          " hold each rank's own optimizer ranges; allowed under Fabric: 'auto' or 'full' (gathered)")
    if fmt == "auto":
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, format="full"))
    return config


ENTRY_PREFIX = "static_dist_"  # the participants' checkpoint entries (compression, the auto trials, the simulated mark)


def entries_as_saved(index: int, entries: dict[str, Any]) -> dict[str, Any]:
    """Model ``index``'s participants' entries as ``fabric.save`` writes them: the first model's as they are (the
    Trainer strategy's names), model ``i``'s (``i >= 1``) under ``static_dist_model{i}/`` (``metrics()``'s naming).

    Example::

        entries_as_saved(1, {"static_dist_compression": state})   # {"static_dist_model1/static_dist_compression": ...}
    """
    return entries if index == 0 else {f"{ENTRY_PREFIX}model{index}/{name}": value for name, value in entries.items()}


def take_entries(checkpoint: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The participants' entries taken out of a loaded checkpoint, by model index, under their own names (the
    inverse of :func:`entries_as_saved`)."""
    taken: dict[int, dict[str, Any]] = {}
    for name in [n for n in checkpoint if isinstance(n, str) and n.startswith(ENTRY_PREFIX)]:
        later = re.fullmatch(rf"{ENTRY_PREFIX}model(\d+)/(.+)", name)
        index, own = (int(later[1]), later[2]) if later else (0, name)
        taken.setdefault(index, {})[own] = checkpoint.pop(name)
    return taken


class FabricCheckpoints(FabricProcesses):
    """Checkpoints through the participants of the models set up (:attr:`_models`, one per trainable module)."""

    def __init__(self, config: StrategyConfig, **kwargs: Any) -> None:
        super().__init__(one_file_checkpoints(config), **kwargs)
        self._models: list[FabricModel] = []
        self._unclaimed: dict[int, dict[str, Any]] = {}  # entries loaded for models not set up yet, by index

    def _add_model(self, model: FabricModel) -> None:
        """A trainable model set up: it takes the entries a checkpoint loaded before held for it (its participants
        keep them until their setup restores them, as under the Trainer: ``CompressionState.load_state_dict``)."""
        self._models.append(model)
        entries = self._unclaimed.pop(len(self._models) - 1, None)
        if entries:
            model.phases.load_state_dict(entries)

    @override
    def _steps_taken(self) -> int:
        return self._models[0].context.steps if self._models else 0

    def _model_of(self, module: Optional[Module]) -> Optional[FabricModel]:
        return next((m for m in self._models if m.module is module), None)

    def _model_stepped_by(self, optimizer: Optimizer) -> Optional[FabricModel]:
        return next((m for m in self._models if m.owns(optimizer)), None)

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        entries: dict[str, Any] = {}
        for index, model in enumerate(self._models):
            model.phases.check_in_step()  # no checkpoint of a step whose ranks were out of step
            entries.update(entries_as_saved(index, model.parts.state_dict()))  # every rank is here; rank 0 writes
        super().save_checkpoint(path, {**state, **entries}, storage_options=storage_options, filter=filter)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        model = self._model_of(module)
        if model is None:
            return super().get_module_state_dict(module)
        return model.phases.model_state_dict(module.state_dict)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        model = self._model_of(module)
        if model is None:
            return super().load_module_state_dict(module, state_dict, strict)
        module.load_state_dict(model.parts.model_state_to_load(state_dict), strict=strict)
        model.phases.after_model_loaded()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        model = self._model_stepped_by(optimizer)
        if model is None:
            return super().get_optimizer_state(optimizer)
        return model.parts.optimizer_state(optimizer, super().get_optimizer_state)

    @override
    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if isinstance(state, Optimizer) and self._model_stepped_by(state) is not None:  # fabric.load(path, optimizer)
            self._load_optimizer_state(state, self.checkpoint_io.load_checkpoint(path, weights_only=weights_only))
            return {}
        # Fabric's own load would call optimizer.load_state_dict: the participants' optimizers are taken out of the
        # (unwrapped) state for it, and loaded here once the models are, as the Trainer strategy loads them
        ours = {name: obj for name, obj in state.items() if isinstance(obj, Optimizer)
                and self._model_stepped_by(obj) is not None} if isinstance(state, dict) else {}
        for name in ours:
            del state[name]
        try:
            remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        finally:
            if ours:
                state.update(ours)
        missing = [name for name in ours if name not in remainder]
        if strict and missing:
            raise KeyError(f"The requested state contains a key {missing[0]!r} that does not exist in the loaded"
                           " checkpoint.")
        for name, optimizer in ours.items():
            if name in remainder:
                self._load_optimizer_state(optimizer, remainder.pop(name))
        self._unclaimed.update(take_entries(remainder))
        for index, model in enumerate(self._models):
            entries = self._unclaimed.pop(index, {})
            model.phases.load_state_dict(entries)  # each participant takes its own out
            remainder.update(entries_as_saved(index, entries))  # (what none took is the caller's)
        return remainder

    def _load_optimizer_state(self, optimizer: Optimizer, saved: dict[str, Any]) -> None:
        model = self._model_stepped_by(optimizer)
        assert model is not None
        if not model.parts.load_optimizer_states({"optimizer_states": [saved]}):  # (the sharded state: its own form)
            optimizer.load_state_dict(model.parts.optimizer_state_to_load(optimizer, saved))
