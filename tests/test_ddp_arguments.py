"""Lightning ``DDPStrategy``'s keyword arguments given to ``StaticDistStrategy`` (:mod:`lightning_static_dist.
ddp_arguments`): those that stand for a ``strategy`` key, the ones refused by name, and how they meet a run file's
``strategy`` block in ``from_config``. No process is started here."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from _configs import CPU_CONFIG, assert_one_line_naming
from lightning_static_dist import ConfigError, StaticDistStrategy, load_run_config
from lightning_static_dist.ddp_arguments import check_process_group_backend


@pytest.mark.parametrize("backend", ["gloo", "NCCL", "cpu:gloo,cuda:nccl"])
def test_registered_process_group_backends_are_accepted(backend: str) -> None:
    assert StaticDistStrategy(process_group_backend=backend)._process_group_backend == backend


@pytest.mark.parametrize(("backend", "shown"), [("", "''"), ("glooo", "'gloo', 'nccl'"),
                                               ("cpu:gloo,cuda:ncl", "'cpu:gloo,cuda:ncl'")],
                         ids=["empty", "typo", "typo-in-a-pair"])
def test_an_unknown_process_group_backend_is_one_line_naming_it(backend: str, shown: str) -> None:
    # checked when the process group starts (tests/test_strategy.py: ..._registered_after_the_strategy_is_built...)
    StaticDistStrategy(process_group_backend=backend)  # built: a backend may be registered after this
    with pytest.raises(ConfigError) as excinfo:
        check_process_group_backend(backend)
    assert_one_line_naming(excinfo.value, "process_group_backend", shown)


def test_any_mapping_is_a_sync_section_beside_ddps_bucket_arguments() -> None:
    from types import MappingProxyType

    strategy = StaticDistStrategy(sync=MappingProxyType({"first_bucket_mb": 2}), bucket_cap_mb=5,
                                  broadcast_buffers=False)
    assert (strategy.config.sync.first_bucket_mb, strategy.config.sync.bucket_mb) == (2.0, 5.0)
    assert strategy.config.sync.broadcast_buffers is False


def test_other_ddp_arguments_are_a_type_error_naming_them() -> None:
    with pytest.raises(TypeError, match="init_sync"):
        StaticDistStrategy(init_sync=False)


def test_from_config_keyword_arguments_win_over_the_run_file() -> None:
    config = load_run_config(CPU_CONFIG, ["strategy.sync.first_bucket_mb=2"]).strategy  # timeout_s 600, bucket_mb 25
    strategy = StaticDistStrategy.from_config(config, timeout=timedelta(seconds=30), bucket_cap_mb=5,
                                              start_method="spawn")
    assert strategy.config.timeout_s == 30.0
    assert (strategy.config.sync.bucket_mb, strategy.config.sync.first_bucket_mb) == (5.0, 2.0)  # the rest kept
    assert strategy.config.compile == config.compile and strategy._start_method == "spawn"
    assert StaticDistStrategy.from_config(config, timeout_s=60).config.timeout_s == 60.0
    assert StaticDistStrategy.from_config(config, sync={"bucket_mb": 7}).config.sync.first_bucket_mb == 1.0
    assert StaticDistStrategy.from_config(config).config == config


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"timeout": timedelta(seconds=30), "timeout_s": 60}, "timeout"),
    ({"bucket_cap_mb": 5, "sync": {"bucket_mb": 10}}, "bucket_cap_mb"),
])
def test_from_config_refuses_one_key_given_twice_in_its_arguments(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        StaticDistStrategy.from_config(load_run_config(CPU_CONFIG).strategy, **kwargs)
    assert_one_line_naming(excinfo.value, key, "given twice")


def test_a_num_nodes_given_to_the_strategy_that_the_trainer_replaces_is_warned_about() -> None:
    # as with DDPStrategy, Trainer(num_nodes=...) is the value that counts: a different one on the strategy is lost
    import lightning as L

    with pytest.warns(UserWarning, match="num_nodes=2 given to the strategy is replaced by the Trainer's num_nodes=1"):
        L.Trainer(accelerator="cpu", devices=1, strategy=StaticDistStrategy(num_nodes=2), logger=False)


def test_both_front_ends_build_one_block_from_the_same_keywords() -> None:
    from lightning_static_dist.fabric import StaticDistFabricStrategy

    keywords: dict[str, Any] = dict(sync={"first_bucket_mb": 2.0}, compression={"name": "bf16"}, bucket_cap_mb=5,
                                    timeout=timedelta(seconds=30), start_method="spawn")
    trainer, fabric = StaticDistStrategy(**keywords).config, StaticDistFabricStrategy(**keywords).config
    # (Fabric writes one file: its checkpoint.format auto reads full, fabric/checkpoints.py)
    assert trainer == dataclasses.replace(fabric, checkpoint=trainer.checkpoint)
    assert fabric.sync.bucket_mb == 5.0 and fabric.sync.first_bucket_mb == 2.0 and fabric.timeout_s == 30.0
    config = load_run_config(CPU_CONFIG).strategy
    trainer = StaticDistStrategy.from_config(config, timeout_s=60, bucket_cap_mb=3).config
    fabric = StaticDistFabricStrategy.from_config(config, timeout_s=60, bucket_cap_mb=3).config
    assert trainer == dataclasses.replace(fabric, checkpoint=trainer.checkpoint) and trainer.sync.bucket_mb == 3.0
