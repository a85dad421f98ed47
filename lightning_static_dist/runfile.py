"""The ``lsd-train`` run file: YAML plus dotted overrides, validated whole before a single process starts.

The top level is ``seed``, ``model``, ``data``, ``trainer``, ``strategy``, ``callbacks`` and ``ckpt_path``. :func:`load_run_config`
merges the ``dotted.key=value`` overrides over the file with OmegaConf and validates everything with the package's
one checker (:mod:`lightning_static_dist.config.check`): the ``strategy`` block as
:class:`~lightning_static_dist.plan.strategy_config.StrategyConfig`, each ``callbacks.<name>`` block as its callback's ``Config``,
the ``trainer`` block against ``lightning.Trainer``'s signature and the ``model``/``data`` blocks against their
classes' signatures. Every error is one line naming the full key.

This module sits beside the command line (:mod:`lightning_static_dist.cli`): it is the one place that knows the
callbacks a run file can name and the example model a run file gets without a ``model.class_path``.

Example::

    cfg = load_run_config("charlm_cpu", ["trainer.max_steps=50"])  # a shipped config, or a file's path
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_static_dist.callbacks import GraphReport, RunSummary
from lightning_static_dist.compression.guard import CompressionGuard
from lightning_static_dist.config import (ConfigError, check_kwargs_against, check_value, fail, import_object,
                                          section_from_dict)
from lightning_static_dist.config.yaml_file import check_nesting, yaml_error_text
from lightning_static_dist.plan.strategy_config import StrategyConfig
from lightning_static_dist.trainer_context import TrainerSettings, refuse_before_launch
from lightning_static_dist.examples.charlm import CharDataModule, CharGPT
from lightning_static_dist.callbacks.monitor import OverlapMonitor

__all__ = [
    "CALLBACKS",
    "CallbackConfig",
    "ComponentConfig",
    "DEFAULT_DATA",
    "DEFAULT_MODEL",
    "RunConfig",
    "load_run_config",
    "resolve_config_path",
    "shipped_config_names",
    "shipped_configs_dir",
]


def class_path(cls: type) -> str:
    """The import path a run file names ``cls`` by (``model.class_path``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


#: The model and data of a run file that names no ``class_path``: the package's example, the char-level GPT.
DEFAULT_MODEL = class_path(CharGPT)
DEFAULT_DATA = class_path(CharDataModule)


def shipped_configs_dir() -> str:
    """Where the run files shipped with the package lie: inside an installed wheel, or a source checkout's configs/."""
    package = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(package, "configs")
    return installed if os.path.isdir(installed) else os.path.join(os.path.dirname(package), "configs")


def shipped_config_names() -> list[str]:
    folder = shipped_configs_dir()
    return sorted(f[: -len(".yaml")] for f in os.listdir(folder) if f.endswith(".yaml")) if os.path.isdir(folder) else []


def resolve_config_path(name: str) -> str:
    """A run file's path: ``name`` itself when it is a file, else the shipped config called ``name``
    (``charlm_cpu`` or ``charlm_cpu.yaml``)."""
    if os.path.isfile(name) or os.sep in name or "/" in name:
        return name
    shipped = os.path.join(shipped_configs_dir(), name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if os.path.isfile(shipped):
        return shipped
    names = shipped_config_names()
    raise ConfigError(f"config {name!r}: no such file, and no shipped config of that name;"
                      f" shipped: {', '.join(names) or 'none'}")


@dataclass
class ComponentConfig:
    """A ``model`` or ``data`` block: ``class_path`` plus the keyword arguments of that class.

    Example (YAML)::

        model:
          class_path: lightning_static_dist.examples.charlm.CharGPT
          n_layer: 4
    """

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, key: str, data: Any, default_class_path: str) -> ComponentConfig:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            fail(key, data, "expected a mapping with class_path and the class's keyword arguments")
        data = dict(data)
        class_path = data.pop("class_path", default_class_path)
        check_value(f"{key}.class_path", class_path, str)
        target = import_object(f"{key}.class_path", class_path)
        check_kwargs_against(key, target, data)
        return cls(class_path=class_path, init_args=data)

    def instantiate(self, key: str) -> Any:
        """Build the object; a constructor's own ``ValueError``/``TypeError`` becomes a ConfigError naming ``key``."""
        target = import_object(f"{key}.class_path", self.class_path)
        try:
            return target(**self.init_args)
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise ConfigError(f"{key}: {err}") from err


@dataclass
class CallbackConfig:
    """One block under ``callbacks``: ``enabled`` plus the callback's own options (validated by its ``Config``)."""

    enabled: bool = True
    options: dict[str, Any] = field(default_factory=dict)

    def build(self, name: str) -> Any:
        """The callback ``callbacks.<name>`` with these options."""
        return {**CALLBACKS, **LIGHTNING_CALLBACKS}[name](**self.options)


#: The callbacks a run file can configure: ``callbacks.<name>``, where each class's ``Config.KEY`` is
#: ``callbacks.<name>``. A block's options are the fields of that ``Config`` (the class's keyword arguments).
CALLBACKS: dict[str, type] = {
    cls.Config.KEY.removeprefix("callbacks."): cls for cls in (RunSummary, GraphReport, OverlapMonitor, CompressionGuard)
}

#: Lightning's own callbacks a run file can configure, with their constructor's arguments as options
#: (``callbacks.model_checkpoint: {enabled: true, every_n_train_steps: 100, save_last: true}``).
LIGHTNING_CALLBACKS: dict[str, type] = {"model_checkpoint": ModelCheckpoint}

#: Trainer arguments the run file may not set, and why.
_RESERVED_TRAINER_KEYS = {
    "strategy": "use the top-level 'strategy' block",
    "callbacks": "use the top-level 'callbacks' block",
}


@dataclass
class RunConfig:
    """A whole ``lsd-train`` run file, validated.

    Example::

        cfg = load_run_config("charlm_cpu", ["trainer.max_steps=50"])  # a shipped config, or a file's path
    """

    seed: int = 1234
    model: ComponentConfig = field(default_factory=lambda: ComponentConfig(DEFAULT_MODEL))
    data: ComponentConfig = field(default_factory=lambda: ComponentConfig(DEFAULT_DATA))
    trainer: dict[str, Any] = field(default_factory=dict)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    callbacks: dict[str, CallbackConfig] = field(default_factory=dict)
    ckpt_path: Optional[str] = None
    """What ``Trainer.fit(ckpt_path=...)`` resumes from: a checkpoint's path, ``last`` (the newest checkpoint under
    ``trainer.default_root_dir``, in any version folder: :func:`~lightning_static_dist.cli.find_last_checkpoint`), or
    ``None`` (from step 0)."""

    @classmethod
    def from_dict(cls, data: Any) -> RunConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"<top level>={data!r}: expected a mapping with keys {', '.join(TOP_LEVEL)}")
        allowed = TOP_LEVEL
        for name in data:
            if name not in allowed:
                raise ConfigError(f"{name}: unknown top-level key; allowed: {', '.join(allowed)}")
        seed = data.get("seed", 1234)
        check_value("seed", seed, int)
        if seed < 0:
            fail("seed", seed, "must be an integer >= 0")
        trainer = data.get("trainer") or {}
        if not isinstance(trainer, Mapping):
            fail("trainer", trainer, "expected a mapping of lightning.Trainer keyword arguments")
        from lightning import Trainer

        for name, why in _RESERVED_TRAINER_KEYS.items():
            if name in trainer:
                fail(f"trainer.{name}", trainer[name], f"not allowed here: {why}")
        check_kwargs_against("trainer", Trainer, trainer, exclude=tuple(_RESERVED_TRAINER_KEYS))
        _check_trainer_ranges(trainer)
        run = cls(
            seed=seed,
            model=ComponentConfig.from_dict("model", data.get("model"), DEFAULT_MODEL),
            data=ComponentConfig.from_dict("data", data.get("data"), DEFAULT_DATA),
            trainer=dict(trainer),
            strategy=section_from_dict(StrategyConfig, data.get("strategy")),
            callbacks=_callbacks_from_dict(data.get("callbacks")),
            ckpt_path=_ckpt_path(data.get("ckpt_path")),
        )
        checkpoints = run.callbacks.get("model_checkpoint")
        if checkpoints is not None and checkpoints.enabled and checkpoints.options.get("save_on_exception"):
            fail("callbacks.model_checkpoint.save_on_exception", True, "a save is a collective under static_dist and"
                 " an exception reaches one rank, whose save would wait for the others; allowed: false (a SIGTERM"
                 " stop saves a checkpoint by itself)")
        if checkpoints is not None and checkpoints.enabled and run.trainer.get("enable_checkpointing") is False:
            fail("callbacks.model_checkpoint.enabled", True, "trainer.enable_checkpointing is false; allowed: false,"
                 " or trainer.enable_checkpointing=true")
        # what setup would refuse on every rank, where the strategy block and the trainer's arguments decide it alone
        refuse_before_launch(run.strategy, TrainerSettings.from_arguments(
            run.trainer, on_cpu=_accelerator_is_cpu(run.trainer.get("accelerator", "auto"))))
        guard = run.callbacks.get("compression_guard")
        if guard is not None and guard.enabled and run.strategy.compression.name == "none":
            fail("callbacks.compression_guard.enabled", True, "the guard steps a compressor down and"
                  " strategy.compression.name is 'none'; allowed: false, or a compressor")
        return run

    def to_dict(self) -> dict[str, Any]:
        """The run file in the shape :meth:`from_dict` reads back (what ``lsd-train --print-config`` prints): each
        component's ``class_path`` beside its arguments, each callback's ``enabled`` beside its options, and every
        strategy section whole, its defaults included.

        Example::

            cfg = load_run_config("charlm_cpu", ["trainer.max_steps=50"])
            assert RunConfig.from_dict(cfg.to_dict()) == cfg
        """
        return {
            "seed": self.seed,
            "model": {"class_path": self.model.class_path, **self.model.init_args},
            "data": {"class_path": self.data.class_path, **self.data.init_args},
            "trainer": dict(self.trainer),
            "strategy": _plain(self.strategy),
            "callbacks": {name: {"enabled": block.enabled, **block.options} for name, block in self.callbacks.items()},
            "ckpt_path": self.ckpt_path,
        }


def _plain(value: Any) -> Any:
    """A section as YAML can write it: dataclasses as mappings of their public fields (the keys a run file may
    set), tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if not f.name.startswith("_")}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


TOP_LEVEL = ("seed", "model", "data", "trainer", "strategy", "callbacks", "ckpt_path")


def _ckpt_path(value: Any) -> Optional[str]:
    """``ckpt_path`` checked: ``None``, ``last``, or a checkpoint that exists (a file, or a sharded checkpoint's
    directory)."""
    if value is None or value == "last":
        return value
    check_value("ckpt_path", value, str)
    if not os.path.exists(value):
        fail("ckpt_path", value, "no such file or directory; allowed: a checkpoint's path, 'last' (the newest under"
             " trainer.default_root_dir) or null")
    return value


def _check_trainer_ranges(trainer: Mapping[str, Any]) -> None:
    """Range checks Lightning itself would only make after processes start (or never, for some)."""
    positive = ("max_epochs", "accumulate_grad_batches", "log_every_n_steps", "num_nodes")
    for name in positive:
        value = trainer.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1 and not (name == "max_epochs" and value == -1):
            fail(f"trainer.{name}", value, "must be an integer >= 1")
    max_steps = trainer.get("max_steps")
    if isinstance(max_steps, int) and max_steps < -1:
        fail("trainer.max_steps", max_steps, "must be -1 (no limit) or an integer >= 0")
    _check_devices(trainer)


def _check_devices(trainer: Mapping[str, Any]) -> None:
    """``trainer.devices`` as Lightning's accelerator will take it, checked before any process starts: on CPU a number
    of processes (>= 1) or ``auto``; on an accelerator also ``-1`` (every device), a list of device indices or a
    string of them (``"0,1"``)."""
    if "devices" not in trainer:
        return
    devices = trainer["devices"]
    on_cpu = _accelerator_is_cpu(trainer.get("accelerator", "auto"))
    allowed = ("an integer >= 1 (CPU processes) or 'auto'; -1 (every device) needs an accelerator with devices to"
               " count (trainer.accelerator=gpu)" if on_cpu else
               "-1 (all), an integer >= 1, 'auto', a list of device indices or a string of them ('0,1')")
    if isinstance(devices, bool):
        fail("trainer.devices", devices, f"must be {allowed}")
    if isinstance(devices, str):
        text = devices.strip()
        indices = [part.strip() for part in text.split(",") if part.strip()]
        if text == "auto" or (text.isdigit() and int(text) >= 1) or (not on_cpu and (
                text == "-1" or (indices and all(part.isdigit() for part in indices)))):
            return
        fail("trainer.devices", devices, f"must be {allowed}")
    if isinstance(devices, int):
        if devices >= 1 or (devices == -1 and not on_cpu):
            return
        fail("trainer.devices", devices, f"must be {allowed}")
    if isinstance(devices, (list, tuple)) and not on_cpu and devices and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
        return
    fail("trainer.devices", devices, f"must be {allowed}")


def _accelerator_is_cpu(accelerator: Any) -> bool:
    """Whether ``trainer.accelerator`` runs on CPU processes: ``cpu``, or ``auto`` (or unset) on a machine with no
    GPU Lightning would pick."""
    if accelerator == "cpu":
        return True
    if accelerator not in (None, "auto"):
        return False
    import torch

    mps = getattr(torch.backends, "mps", None)
    return not torch.cuda.is_available() and not (mps is not None and mps.is_available())


def _callbacks_from_dict(data: Any) -> dict[str, CallbackConfig]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        fail("callbacks", data, f"expected a mapping of callback blocks; allowed names: {', '.join(CALLBACKS)}")
    out: dict[str, CallbackConfig] = {}
    known = [*CALLBACKS, *LIGHTNING_CALLBACKS]
    for name, block in data.items():
        if name not in known:
            raise ConfigError(f"callbacks.{name}: unknown callback; allowed: {', '.join(known)}")
        block = {} if block is None else block
        if not isinstance(block, Mapping):
            fail(f"callbacks.{name}", block, "expected a mapping with 'enabled' and the callback's options")
        options = dict(block)
        enabled = options.pop("enabled", True)
        check_value(f"callbacks.{name}.enabled", enabled, bool)
        if name in LIGHTNING_CALLBACKS:  # Lightning's own: its constructor's arguments
            check_kwargs_against(f"callbacks.{name}", LIGHTNING_CALLBACKS[name], options, taken=("enabled",))
        else:  # checked before any process
            section_from_dict(CALLBACKS[name].Config, options, key=f"callbacks.{name}", taken=("enabled",))
        out[name] = CallbackConfig(enabled=enabled, options=options)
    return out


def load_run_config(path: Optional[str], overrides: Sequence[str] = ()) -> RunConfig:
    """Load a YAML run file (a path, or the name of a shipped config: :func:`resolve_config_path`), merge
    ``dotted.key=value`` overrides and validate the result.

    Raises:
        ConfigError: one line naming the key, the bad value and what is allowed.
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if path is not None:
        path = resolve_config_path(path)
    try:
        if path is not None:
            check_nesting(path)
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r}: no such file") from None
    except ConfigError:
        raise
    except Exception as err:  # yaml.YAMLError, OmegaConf's own errors: both mean the file is not a valid config
        raise ConfigError(f"config file {path!r}: not valid YAML: {yaml_error_text(err)}") from None
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. trainer.max_steps=100")
    if not isinstance(base, DictConfig):
        raise ConfigError(f"config file {path!r}: the top level must be a mapping with keys {', '.join(TOP_LEVEL)}")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, TypeError, ValueError) as err:  # e.g. a list merged over a mapping
        raise ConfigError(f"overrides {list(overrides)}: {str(err).splitlines()[0]}") from None
    if data is None:
        data = {}
    return RunConfig.from_dict(data)

