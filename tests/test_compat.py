"""The private Lightning and torch touchpoints (``lightning_static_dist/compat.py``) against the installed versions.

An upgrade that renames or removes one of them fails here first, and the message names the touchpoint, the file
that uses it and why. The other tests would instead fail somewhere inside a training run. The shims are exercised
for real: the collective names on a 1-rank Gloo group, the optimizer unwrap on Lightning's and Fabric's wrappers,
and the exit teardown in a fresh interpreter whose exit status and output are checked.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch

from lightning_static_dist import compat

COMPAT_FILE = compat.__file__

# ------------------------------------------------------------------------------------------ collective names


def test_the_collective_shims_gather_and_scatter_on_a_one_rank_gloo_group(one_rank_gloo: None) -> None:
    data = torch.arange(6, dtype=torch.float32)
    gathered, scattered = torch.empty_like(data), torch.empty_like(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated name would warn on every call
        compat.all_gather_single(gathered, data, async_op=True).wait()
        compat.reduce_scatter_single(scattered, data)
    assert torch.equal(gathered, data)  # one rank: its own tensor, once
    assert torch.equal(scattered, data)  # one rank: the sum over one rank


# -------------------------------------------------------------------------------------- the optimizer unwrap


def test_unwrap_optimizer_finds_the_torch_optimizer_behind_lightnings_and_fabrics_wrappers() -> None:
    from lightning.fabric.strategies import SingleDeviceStrategy
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for wrapper in (LightningOptimizer(sgd), _FabricOptimizer(sgd, SingleDeviceStrategy())):
        assert isinstance(wrapper, torch.optim.SGD)  # the wrappers imitate the class: isinstance cannot tell them apart
        assert compat.unwrap_optimizer(wrapper) is sgd, f"{type(wrapper).__name__} no longer keeps it in `_optimizer`"
        assert wrapper.optimizer is sgd  # the public property agrees (what retires the private read)
    assert compat.unwrap_optimizer(sgd) is sgd


# ---------------------------------------------------------------------------------------- the exit teardown


def _exit_in_fresh_interpreter(body: str) -> subprocess.CompletedProcess:
    """Run ``body`` with ``compat`` loaded and a 1-rank Gloo group up, in a new interpreter (the exit ends it).

    ``compat`` is loaded from its file, not through the package, whose ``__init__`` imports all of Lightning: compat
    imports only torch, and the test stays quick."""
    script = textwrap.dedent(f"""
        import atexit, importlib.util, sys
        import torch.distributed as dist
        spec = importlib.util.spec_from_file_location("compat", {COMPAT_FILE!r})
        compat = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compat)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(lambda: print("exit handler ran; group still up:", dist.is_initialized()))
        print("before the exit")  # buffered (stdout is a pipe): only a flush before os._exit brings it out
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})


def test_exit_without_native_teardown_destroys_the_group_runs_exit_handlers_and_keeps_the_status() -> None:
    done = _exit_in_fresh_interpreter("compat.exit_without_native_teardown(3)\nprint('not reached')")
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["before the exit", "exit handler ran; group still up: False"], done.stdout


def test_exit_after_failure_flushes_and_leaves_without_teardown_or_exit_handlers() -> None:
    done = _exit_in_fresh_interpreter("compat.exit_after_failure(1)\nprint('not reached')")
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == ["before the exit"], done.stdout


@pytest.mark.parametrize("failed", [False, True], ids=["after a run", "after a failed run"])
def test_process_groups_are_destroyed_at_exit_unless_the_run_failed(failed: bool) -> None:
    # atexit runs its handlers last registered first: the test's handler (registered before) sees what destroy did
    body = "compat.destroy_process_groups_at_exit()\ncompat.destroy_process_groups_at_exit()\n"
    done = _exit_in_fresh_interpreter(body + ("compat.mark_run_failed()\n" if failed else ""))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["before the exit", f"exit handler ran; group still up: {failed}"], done.stdout


# ------------------------------------------------------------------------ the private names the package reads

#: (module, dotted attribute, where the package uses it and why): the inventory in compat.py's docstring
PRIVATE_NAMES: list[tuple[str, str, str]] = [
    # Lightning
    ("lightning.fabric.strategies", "_StrategyRegistry", "strategy.py: register_strategies' registry type"),
    ("lightning.fabric.strategies.registry", "_StrategyRegistry", "processes/launcher.py, fabric/strategy.py: the registry type"),
    ("lightning.fabric.utilities.distributed", "_init_dist_connection", "plan/world.py: DDPStrategy's group setup"),
    ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device",
     "processes/data_parallel.py: the default backend"),
    ("lightning.fabric.utilities.distributed", "_distributed_is_initialized", "processes/data_parallel.py: guard clauses"),
    ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available", "processes/data_parallel.py: reduce as DDPStrategy does"),
    ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed", "processes/launcher.py: launch as Lightning does"),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device", "strategy.py, participants/parameter_shards.py: optimizer state follows the model"),
    ("lightning.fabric.utilities.types", "_PATH", "strategy.py, fabric/checkpoints.py: a type alias"),
    ("lightning.fabric.strategies.strategy", "_BackwardSyncControl", "fabric/model.py: no_backward_sync"),
    ("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher._call_children_scripts",
     "processes/launcher.py: StaticDistLauncher.launch re-implements Lightning's"),
    ("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher.kill",
     "processes/data_parallel.py: on_exception kills the ranks"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver._run",
     "processes/launcher.py: the patient observer's grace period"),
    ("lightning.pytorch.strategies.launchers", "_MultiProcessingLauncher._wrapping_function",
     "processes/launcher.py: spawned ranks leave without the native teardown"),
    ("lightning.fabric.strategies.launchers.multiprocessing", "_MultiProcessingLauncher._wrapping_function",
     "processes/launcher.py: Fabric's spawned ranks leave without the native teardown"),
    ("lightning.pytorch.strategies.parallel", "ParallelStrategy._configure_launcher", "processes/data_parallel.py: our launchers"),
    ("lightning.fabric.strategies.parallel", "ParallelStrategy._configure_launcher", "fabric/processes.py: our launchers"),
    ("lightning.fabric.strategies.ddp", "DDPStrategy._setup_distributed",
     "fabric/processes.py: the process group started as the Trainer strategy starts it"),
    ("lightning.fabric.strategies.ddp", "DDPStrategy._set_world_ranks", "fabric/processes.py: the ranks, as DDPStrategy sets them"),
    ("lightning.fabric.strategies.ddp", "DDPStrategy._get_process_group_backend",
     "fabric/processes.py: the backend given, or the device's default"),
    ("lightning.pytorch.trainer.trainer", "_verify_strategy_supports_compile",
     "compat.py: allow_compiled_models_in_trainer replaces it"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor",
     "processes/sigterm.py: the per-step device broadcast it replaces (if gone, the patch is inert: retire or re-target it)"),
    ("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector._sigterm_notifier_fn",
     "processes/sigterm.py: the handler the connector's subclass overrides"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint._monitor_candidates",
     "compat.py: save_step_as_at_interval, the end of fit's save of its last step"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint._save_topk_checkpoint", "compat.py: save_step_as_at_interval"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint._save_last_checkpoint", "compat.py: save_step_as_at_interval"),
    ("lightning.pytorch.callbacks", "ModelCheckpoint._save_checkpoint", "compat.py: save_step_as_at_interval"),
    # torch
    ("torch.distributed.distributed_c10d", "_get_default_store", "agreement/faults.py: the rendezvous store for the roll call"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout",
     "compat.py: set_collective_timeout, strategy.timeout_s from the first step on"),
    ("torch.autograd", "Variable._execution_engine.queue_callback", "sync/synchronizer.py: finish at end of backward"),
    ("torch", "_foreach_norm", "participants/gradients.py: the non-finite check in one launch"),
    ("torch", "_foreach_mul_", "sync/sharded_synchronizer.py: clipping in one launch"),
    ("torch", "_foreach_copy_", "compression/compressors.py: copies in one launch"),
    ("torch.distributed._functional_collectives", "all_reduce", "sync/graph.py: traceable collectives"),
    ("torch._dynamo", "lookup_backend", "compile/backends.py: the user's backend by name"),
    ("torch._dynamo", "list_backends", "compile/config.py, compile/backends.py: backend names"),
    ("torch._dynamo", "register_backend", "compile/backends.py: inductor_distributed"),
    ("torch._dynamo", "disable", "compile/regions.py: boundary regions"),
    ("torch._dynamo.exc", "TorchDynamoException", "compile/regions.py: eager fallback"),
    ("torch._dynamo.exc", "Unsupported", "compile/regions.py: fullgraph breaks"),
    ("torch._dynamo.backends.distributed", "DDPOptimizer", "compile/split.py: the graph splitter"),
    ("torch._guards", "CompileContext.current_compile_id", "compile/backends.py: recompiles counted"),
    ("torch._inductor.compile_fx", "compile_fx", "compile/backends.py: inductor with config patches"),
    ("torch._inductor", "list_mode_options", "compile/backends.py: compile.mode"),
    ("torch._logging._internal", "log_registry.artifact_log_qnames", "compile/report.py: dynamo's artifact loggers"),
    ("torch._dynamo.utils", "guard_failures", "compile/report.py: every recompile names its guard"),
    ("torch._inductor", "cudagraph_utils", "compile/cudagraphs.py: its logger names each graph left without CUDA graphs"),
    # Python
    ("atexit", "_run_exitfuncs", "compat.py: exit handlers before os._exit"),
    ("sys", "_current_frames", "processes/watchdog.py: where the main thread is"),
]


@pytest.mark.parametrize("module, name, used", PRIVATE_NAMES, ids=[f"{m}:{n}" for m, n, _ in PRIVATE_NAMES])
def test_a_private_name_the_package_uses_still_exists(module: str, name: str, used: str) -> None:
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(obj, part), (f"{module}.{name} is gone from the installed version ({used}); see the inventory in"
                                    " lightning_static_dist/compat.py for what it works around")
        obj = getattr(obj, part)


@pytest.mark.parametrize("module, name, used", PRIVATE_NAMES, ids=[f"{m}:{n}" for m, n, _ in PRIVATE_NAMES])
def code_names(path: str) -> set[str]:
    """Every name a source file uses in code, and every word of its strings (``getattr(x, "_name")``); comments and
    docstrings' prose count too only as strings do, so a name merely mentioned in a comment does not."""
    import io
    import re
    import tokenize

    names: set[str] = set()
    for token in tokenize.generate_tokens(io.StringIO(open(path).read()).readline):
        if token.type == tokenize.NAME:
            names.add(token.string)
        elif token.type == tokenize.STRING:
            names.update(re.findall(r"[A-Za-z_]\w*", token.string))
    return names


def inventory_sections() -> dict[str, str]:
    """compat.py's list of touchpoints left in other modules: each file's heading (``processes/sigterm.py``, ``compile/``) -> the
    text under it."""
    import re

    doc = compat.__doc__
    sections: dict[str, str] = {}
    current = None
    for line in doc[doc.index("Left where they are"):].splitlines()[2:]:
        heading = re.match(r"``([\w/.]+)``", line)
        if heading:
            current = heading.group(1)
            sections[current] = line
        elif current is not None:
            sections[current] += "\n" + line
    return sections


def listed_under(path: str, names: tuple[str, ...], sections: dict[str, str]) -> bool:
    """Whether the inventory lists one of ``names`` under ``path``'s heading (or its folder's), or, where ``path``
    has no heading of its own, beside a mention of ``path`` ("``participants/parameter_shards.py`` too")."""
    own = [text for heading, text in sections.items() if heading == path or (heading.endswith("/")
                                                                              and path.startswith(heading))]
    if own:
        return any(n in text for n in names for text in own)
    return any(n in text and f"``{path}``" in text for n in names for text in sections.values())


@pytest.mark.parametrize("module, name, used", PRIVATE_NAMES, ids=[f"{m}:{n}" for m, n, _ in PRIVATE_NAMES])
def test_the_inventory_names_the_files_that_use_each_private_name(module: str, name: str, used: str) -> None:
    # the files listed for a name exist and use it in code, and compat.py's docstring lists it under each of them: a
    # name that moved between modules moves in the inventory too
    package = os.path.dirname(COMPAT_FILE)
    leaf = name.split(".")[-1]  # what the file calls, reads or overrides
    # the inventory names the attribute, or the innermost private module or class it is read from
    # (torch.distributed._functional_collectives.all_reduce: _functional_collectives)
    private = [part for part in f"{module}.{name}".split(".") if part.startswith("_")]
    sections = inventory_sections()
    for path in used.split(":")[0].split(", "):
        source = os.path.join(package, path)
        assert os.path.isfile(source), f"{path} (listed for {name}) is not a file of the package"
        assert leaf in code_names(source), f"{path} no longer uses {leaf}: the inventory places {name} there"
        if path != "compat.py":  # (the shims compat.py defines are listed under "Defined here")
            assert listed_under(path, (leaf, *private[-1:]), sections), (f"compat.py's inventory does not list {leaf} under"
                                                        f" ``{path}`` ({used})")


def test_the_lightning_module_attributes_the_package_sets_and_reads_still_exist() -> None:
    from lightning.pytorch import LightningModule

    module = LightningModule()
    # strategy.py sets _device_mesh (ModelParallelStrategy's hand-over); compile/regions.py reads _compiler_ctx
    for name in ("_device_mesh", "_compiler_ctx"):
        assert name in vars(module), f"LightningModule no longer has {name}: see lightning_static_dist/compat.py"
    assert LightningModule.device_mesh.fget(module) is None  # the property still reads what the strategy sets


def test_the_launcher_overrides_match_lightnings_signatures() -> None:
    # Lightning calls these positionally in the spawned rank: a changed signature would fail only there
    from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher as FabricSpawn
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    from lightning_static_dist.fabric import _SpawnLauncher
    from lightning_static_dist.processes.launcher import StaticDistSpawnLauncher

    def names(fn: Any) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert names(StaticDistSpawnLauncher._wrapping_function) == names(_MultiProcessingLauncher._wrapping_function)
    assert names(_SpawnLauncher._wrapping_function) == names(FabricSpawn._wrapping_function)
    # processes/launcher.py's observer passes these by keyword
    assert {"main_pid", "child_processes", "sleep_period"} <= set(names(_ChildProcessObserver.__init__))


def test_the_trainer_holds_the_loop_and_connector_that_loop_py_patches() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer._signal_connector, _SignalConnector), "Trainer._signal_connector moved (processes/sigterm.py)"
    assert isinstance(trainer.fit_loop.epoch_loop, _TrainingEpochLoop), "the epoch loop moved (processes/sigterm.py)"


def test_a_modelcheckpoint_keeps_its_last_saved_step_where_compat_reads_it() -> None:
    # save_step_as_at_interval reads these two attributes after the save (set in ModelCheckpoint.__init__ and
    # _save_checkpoint); a rename would make the end-of-fit save write last.ckpt every time
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint()
    assert callback._last_global_step_saved == 0 and not callback._last_checkpoint_saved


def test_the_log_step_is_lightning_s_count_of_optimizer_steps_taken() -> None:
    import lightning as L

    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert compat.lightning_log_step(trainer) == 0  # an instance attribute of the epoch loop: checked on a trainer


def test_the_training_loaders_are_read_where_lightning_keeps_them_flat() -> None:
    import lightning as L

    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert compat.train_loaders(trainer) == []  # the fit loop's attribute exists before setup (None until then)
