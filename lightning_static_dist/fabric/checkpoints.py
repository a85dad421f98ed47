"""The Fabric strategy's checkpoints: ``fabric.save`` and ``fabric.load`` go through each set-up model's step
participants, as the Trainer strategy's checkpoints do (the ranks' last steps checked, the participants' entries
added and taken out, the state dicts in the forms the participants save and load).

Example (what ``fabric.save(path, {"model": model, "optimizer": optimizer})`` runs, on every rank)::

    strategy.save_checkpoint(path, state)   # check_in_step; model_state_dict; optimizer_state; state_dict entries
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.utilities.types import _PATH

from lightning_static_dist.fabric.model import SynchronisedModel
from lightning_static_dist.fabric.processes import FabricProcesses


class FabricCheckpoints(FabricProcesses):
    """Checkpoints through the participants of the models set up (:attr:`_models`, one per trainable module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._models: list[SynchronisedModel] = []

    def _model_of(self, module: Optional[Module]) -> Optional[SynchronisedModel]:
        return next((m for m in self._models if m.module is module), None)

    def _model_stepped_by(self, optimizer: Optimizer) -> Optional[SynchronisedModel]:
        return next((m for m in self._models if m.owns(optimizer)), None)

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        entries: dict[str, Any] = {}
        for model in self._models:
            model.each("check_in_step")  # no checkpoint of a step whose ranks were out of step
            entries.update(model.parts.state_dict())  # every rank gets here (fabric.save); rank 0 writes
        super().save_checkpoint(path, {**state, **entries}, storage_options=storage_options, filter=filter)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        model = self._model_of(module)
        if model is None:
            return super().get_module_state_dict(module)
        model.each("before_reading_parameters")
        return model.parts.model_state_dict(module.state_dict())

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        model = self._model_of(module)
        if model is None:
            return super().load_module_state_dict(module, state_dict, strict)
        module.load_state_dict(model.parts.model_state_to_load(state_dict), strict=strict)
        model.each("after_model_loaded")

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        model = self._model_stepped_by(optimizer)
        if model is None:
            return super().get_optimizer_state(optimizer)
        return model.parts.optimizer_state(optimizer, super().get_optimizer_state)

    @override
    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        for model in self._models:
            model.each("load_state_dict", remainder)  # each takes its own entries out
        return remainder
