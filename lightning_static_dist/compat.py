"""Every place the package leans on private Lightning or torch API, or on a torch version: the shims live here, and
the places that stay in their own modules are listed here.

A Lightning or torch upgrade that breaks the package breaks it at one of these places. ``tests/test_compat.py``
checks each against the installed versions, so that such an upgrade fails there first, with the touchpoint's name.
Each entry says what it works around, why, and what upstream change would retire it. An upstream issue or PR is
named only where one exists.

Defined here
------------
:func:`lightning_log_step` (used by ``callbacks/__init__.py``'s ``GraphReport``)
    Reads ``trainer.fit_loop.epoch_loop._batches_that_stepped``, the step Lightning's own logger connector (and its
    ``LearningRateMonitor``) logs a training step's metrics at, so that figures logged straight to the loggers land in
    the same rows as ``self.log``'s. A public "logging step" on the trainer would retire it.
:func:`train_loaders` (used by ``participants/resume.py``)
    Reads ``trainer.fit_loop._combined_loader.flattened``, the training loaders as Lightning iterates them (after its
    sampler is put in), which are the ones whose ``state_dict`` its checkpoints keep. ``trainer.train_dataloader`` is
    public but gives the user's nesting of them, not the flat list. A public flat list would retire it.
:func:`allow_compiled_models_in_trainer` (called by ``strategy.py``)
    Replaces ``lightning.pytorch.trainer.trainer._verify_strategy_supports_compile``, which accepts
    ``trainer.fit(torch.compile(model))`` only for the strategies it lists by type (SingleDevice, DDP, FSDP). A
    strategy with an ``adopt_compiled_model(dynamo_ctx)`` method passes instead: the patch hands it the user's
    ``torch.compile`` context (``model._compiler_ctx``) and takes the compiled model apart
    (``lightning.pytorch.utilities.compile.to_uncompiled``) before a spawn launcher pickles it. Every other strategy
    gets Lightning's check unchanged. A strategy attribute in Lightning that declares compile support would retire it.
:data:`all_gather_single`, :data:`reduce_scatter_single` (used by ``embedding.py``, ``sync/sharded_synchronizer.py``,
``compression/base.py`` and ``benchmarks/cost_model.py``)
    torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to these names
    (pytorch/pytorch#186123). The old names still work there, but they warn (``FutureWarning``) on every call, and a
    torch older than 2.13 has only the old names. Retired when the oldest supported torch (``pyproject.toml``) is 2.13:
    call ``torch.distributed``'s functions directly.
:func:`unwrap_optimizer` (used by ``participants/parameter_shards.py``, ``participants/embeddings.py`` and
``compile/regions.py``)
    This reads ``LightningOptimizer._optimizer``, which is the torch optimizer that Lightning's step wrapper holds.
    The strategy checks the optimizer's type and re-points it at shards, and the compiled optimizer step replaces the
    real optimizer's ``step``. The check is duck-typed: it also unwraps Fabric's ``_FabricOptimizer``, and it leaves
    alone any optimizer without that attribute. Lightning 2.6 also has a public ``optimizer`` property on both
    wrappers. Reading that property behind an ``isinstance`` check of the two wrapper classes would retire this
    private read. No upstream change is needed for that.
The exit teardown: :func:`destroy_process_groups_at_exit` with :func:`mark_run_failed` (``strategy.py``),
:func:`exit_without_native_teardown` (``processes/launcher.py``, ``fabric/`` through it, ``cli.py``) and
:func:`exit_after_failure` (``cli.py``, ``processes/ending.py``'s excepthook, ``processes/watchdog.py``)
    One problem, two mechanisms. With Gloo, a process that finishes while it still has process groups can abort
    (SIGABRT, ``terminate called without an active exception``). A finished rank is then reported as crashed. There
    are two ways this happens. A Gloo worker thread may still hold an async work's tensors when the interpreter
    finalises. Or a C++ thread of the process-group machinery may still be joinable when its static destructor
    runs. The package's async collectives with completion callbacks make this more likely.

    *Process groups destroyed at exit* is for processes that the package does not end itself: a user's script, the
    ranks that the ``popen`` launcher starts, a notebook. An ``atexit`` handler destroys the groups while the
    interpreter is still whole. It does not do so after ``fit``, so later ``fit`` or ``test`` calls still work.
    It also does not do so after a failure, because a peer that is gone could keep the teardown waiting.
    pytorch/pytorch#179291 proposed the same handler inside ``init_process_group``; it was closed without being
    merged. Such a change in torch would retire this mechanism.

    *Leaving without the native teardown* is for processes whose end the package owns once their work is done: a
    spawned rank after it has handed over its results, and ``lsd-train`` after ``fit``. The rank destroys its
    groups, runs Python's exit handlers (so loggers flush), and then calls ``os._exit``. That skips the C++ static
    destructors, where destroying the groups first did not stop the abort. After a collective failure,
    ``lsd-train`` leaves with status 1 and without either step, because both could wait for a peer that is gone.
    The exit handlers here use the private ``atexit._run_exitfuncs``. A torch whose process-group teardown is safe
    at interpreter and static destruction would retire this mechanism; no upstream issue names that.

    The two mechanisms cannot be merged into one. Only the second is strong enough to prevent the abort. A library
    cannot use it, though, in a program whose end it does not own, because it would skip the rest of the user's
    script. Both exits first run the hooks registered with :func:`before_leaving`: a process that started the other
    local ranks waits for them there and leaves with the worst status (``processes/ending.py``).
:func:`save_step_as_at_interval` (used by ``participants/resume.py``)
    Calls ``ModelCheckpoint``'s ``_monitor_candidates``, ``_save_topk_checkpoint``, ``_save_last_checkpoint`` and
    ``_save_checkpoint``, and reads its ``_last_global_step_saved`` and ``_last_checkpoint_saved``: at the end of a
    fit whose last step no checkpoint holds, the run's ``ModelCheckpoint`` writes that step as it writes one at its
    interval (its file name, its ``save_top_k`` pruning, its ``last`` file and link), so ``ckpt_path=last`` resumes
    from it. Lightning's own ``on_train_end`` does that only with ``save_last`` and only when the callback never
    saved before. A public "save now" on ``ModelCheckpoint`` would retire these.
:func:`set_collective_timeout` (used by ``processes/data_parallel.py`` and ``participants/runtime.py``)
    Calls ``torch.distributed.distributed_c10d._set_pg_timeout``, which changes the timeout of a process group's
    collectives (Gloo and NCCL) after it started: the processes start with a longer timeout than
    ``strategy.timeout_s`` (a rank's start-up and first step take longer than a collective should), which is set once
    the first step is over. Where it is missing (an older torch), the collectives keep the start-up timeout. A public
    setter, or ``init_process_group`` taking a separate rendezvous timeout, would retire it.

Left where they are (so that this list is the whole inventory)
--------------------------------------------------------------
``strategy.py``
    ``_StrategyRegistry`` (the type behind ``register_strategies``), ``_optimizers_to_device`` (optimizer state
    follows the model, as in ``DDPStrategy``; ``participants/parameter_shards.py`` too) and ``_PATH`` (a type alias). A
    public Lightning toolkit for third-party strategies would retire these.
``processes/data_parallel.py`` (the strategy's base: what ``DDPStrategy`` holds beside the step)
    - From ``lightning.fabric.utilities.distributed``: ``_get_default_process_group_backend_for_device``,
      ``_distributed_is_initialized`` and ``_sync_ddp_if_available``. With these, setup and ``reduce`` do what ``DDPStrategy`` does, including its
      environment variables and its rank-zero messages. A public Lightning toolkit for third-party strategies would
      retire these.
    - ``_SubprocessScriptLauncher`` in ``on_exception``: after a collective failure, the launcher that started the
      other local ranks kills them, because Lightning does that only on Ctrl-C. The override of
      ``_configure_launcher``, which Lightning's strategies override too, picks this package's launchers.
    - ``LightningModule._device_mesh``: the same hand-over that ``ModelParallelStrategy`` uses, so that
      ``self.device_mesh`` works inside the module (``mesh.py`` too). A public setter would retire it.
``participants/gradients.py``
    ``torch._foreach_norm``: one multi-tensor launch for the non-finite check. The same private ``_foreach`` ops are
    ``torch._foreach_mul_`` in ``sync/sharded_synchronizer.py`` (clipping), ``torch._foreach_copy_`` in
    ``compression/compressors.py`` and, behind a ``getattr`` guard, in ``sync/buffer.py``. ``torch.optim`` and
    ``clip_grad_norm_`` are built on them. Public multi-tensor ops would retire them.
``processes/launcher.py``
    ``_SubprocessScriptLauncher`` (``launch`` re-implemented around ``_call_children_scripts``), its
    ``_ChildProcessObserver`` (``_run`` overridden, to give a grace period before a dead child takes the job down)
    and ``_set_num_threads_if_needed``. Also ``_MultiProcessingLauncher``, whose ``_wrapping_function`` is
    overridden so that a spawned rank leaves without the native teardown; Fabric's ``_MultiProcessingLauncher`` is
    subclassed in the same way (``FabricSpawnLauncher``). ``_StrategyRegistry`` is the type ``register_names``
    takes. A grace period in Lightning's observer would retire the first group, and a launcher hook that runs when a
    rank finishes would retire the second.
``plan/world.py`` (how both front ends start the process group)
    ``_init_dist_connection`` from ``lightning.fabric.utilities.distributed``: the process group starts with
    ``DDPStrategy``'s environment variables and rank-zero messages. A public Lightning toolkit for third-party
    strategies would retire it.
``fabric/``
    ``_StrategyRegistry`` (``strategy.py``), ``_BackwardSyncControl`` (subclassed in ``model.py``, for
    ``no_backward_sync``), ``_PATH`` (``checkpoints.py``) and the ``_configure_launcher`` override
    (``processes.py``). In ``processes.py`` also Fabric ``DDPStrategy``'s ``_setup_distributed`` (overridden: the
    process group starts as the Trainer strategy's, ``plan/world.py``'s ``start_process_group``, for
    ``simulate`` and ``sync.comm_sms``), with the ``_set_world_ranks`` and ``_get_process_group_backend`` it calls.
    A public hook in Fabric's ``DDPStrategy`` for how the process group starts would retire these.
``processes/sigterm.py``
    Here ``_TrainingEpochLoop._broadcast_sigterm_tensor`` is replaced on one trainer's loop instance, and the class
    of ``Trainer._signal_connector`` (``_SignalConnector``) is swapped for a subclass with its own
    ``_sigterm_notifier_fn`` and ``_slurm_sigusr_handler_fn`` (the requeue deferred to a step every rank agrees on;
    the name of its checkpoint from ``Trainer._checkpoint_connector.hpc_save_path``). Lightning's step-start SIGTERM
    broadcast reads a device tensor on the host, so it synchronises the GPU at every step.
    The module's docstring explains the rest. Lightning-AI/pytorch-lightning#21640, an open PR, would make that
    broadcast run every N steps; that reduces the cost but does not retire the patch. What would retire it is a loop
    that stops reading the flag through the device.
``sync/synchronizer.py``
    ``torch.autograd.Variable._execution_engine.queue_callback`` finishes a round when autograd finishes the
    backward pass, which is what DDP's reducer does. No public callback runs at the end of backward.
``sync/graph.py``
    ``torch.distributed._functional_collectives`` are the collectives that dynamo and AOTAutograd can trace. The
    file also reads ``module._parameters``, because the parameters live there while the attribute is a property.
``agreement/faults.py``
    ``distributed_c10d._get_default_store`` gives the rendezvous store for the roll call after a failure. A public
    accessor for the default store would retire it.
``processes/watchdog.py``
    ``sys._current_frames`` (a documented CPython function) shows where the main thread is. Its ``os._exit(1)``
    comes from a background thread; it is not the exit teardown above.
``compile/config.py``
    ``torch._dynamo.list_backends`` validates ``compile.backend``. The public ``torch.compiler.list_backends`` would
    retire it.
``compile/`` (``torch._dynamo`` and ``torch._inductor`` are its subject, so most of it is private by nature)
    - ``regions.py``: ``torch._dynamo.disable`` and ``torch._dynamo.exc``.
    - ``backends.py``: ``torch._inductor.compile_fx``, ``list_mode_options``, ``config`` and the pass names in
      ``torch._inductor.comms`` (checked with ``hasattr``). Also ``torch._dynamo.lookup_backend``,
      ``list_backends`` and ``register_backend`` (``inductor_distributed`` is registered at import),
      ``torch._guards.CompileContext``, and the ``_torchdynamo_orig_backend`` wrappers.
    - ``report.py``: ``torch._logging._internal.log_registry`` (dynamo's artifact loggers),
      ``InstructionTranslator.current_tx`` (the frame being compiled) and ``torch._dynamo.utils.guard_failures``
      (the guard that failed, per recompile: dynamo writes its ``recompiles`` log only when ``TORCH_LOGS`` asks for
      it, but it always keeps these). A public hook that hands a recompile's reason to the backend would retire it.
    - ``log_calls.py``: no private name, but it shadows Lightning's public ``LightningModule.log`` and ``log_dict``
      on the compiled module's instance, and it relies on what Lightning reads at log time (the hook's name, the
      current batch for its size) still being the step's when the recorded calls are made, right after the compiled
      call and before backward. Lightning's own ``_ResultCollection.log`` is ``torch.compiler.disable``d, which is
      why a traced ``self.log`` breaks the graph. A ``self.log`` that Lightning itself keeps in the graph
      (Lightning-AI/pytorch-lightning#18835, open) would retire it.
    - ``split.py``: ``torch._dynamo.backends.distributed.DDPOptimizer`` (the graph splitter).
    - ``cudagraphs.py``: inductor's ``triton.cudagraphs`` setting (what ``mode="reduce-overhead"`` sets), and the
      ``cudagraphs`` artifact logger of ``torch._inductor.cudagraph_utils`` ("skipping cudagraphs due to ..."),
      read through ``report.py``'s ``log_registry``. A public report of the graphs inductor did not capture would
      retire the logger.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import sys
from datetime import timedelta
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------- collective names

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``torch.distributed.all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor``: same signature."""

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``torch.distributed.reduce_scatter_single`` (torch >= 2.13), else ``reduce_scatter_tensor``: same signature."""

# ------------------------------------------------------------------------------------------ the optimizer unwrap


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` (or Fabric's wrapper); anything else as it is.

    Example::

        inner = unwrap_optimizer(strategy.optimizers[0])   # the real torch.optim.AdamW
    """
    return optimizer._optimizer if hasattr(optimizer, "_optimizer") else optimizer


# --------------------------------------------------------------------------------------------- the exit teardown

_run_failed = False
"""Set when training failed in this process: :func:`destroy_process_groups_at_exit`'s handler does nothing then."""


def mark_run_failed() -> None:
    """Training failed in this process: peers may be gone, so the exit-time teardown must not wait for them."""
    global _run_failed
    _run_failed = True


@functools.cache
def destroy_process_groups_at_exit() -> None:
    """Destroy the process groups while the interpreter is still whole (an ``atexit`` handler, registered once per
    process; it does nothing after :func:`mark_run_failed`)."""

    def destroy() -> None:
        if _run_failed:
            return  # peers may be gone: tearing the groups down could wait for them forever
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
                # the groups' and the store's native objects (and the threads they join) freed now, while the
                # interpreter is whole, not when finalisation or the C++ static destructors get to them
                gc.collect()
            except Exception as err:  # exiting anyway: say why, do not mask the exit status
                log.debug(f"static_dist: destroy_process_group at exit failed: {err}")

    atexit.register(destroy)


_leaving: list[Callable[[int], int]] = []


def before_leaving(hook: Callable[[int], int]) -> None:
    """Run ``hook(status)`` when this process leaves through :func:`exit_without_native_teardown` or
    :func:`exit_after_failure`; it returns the status to leave with (the launcher's: wait for the ranks it started,
    and take the worst of their statuses)."""
    _leaving.append(hook)


def _status_on_leaving(code: int) -> int:
    for hook in _leaving:
        code = hook(code)
    return code


def exit_without_native_teardown(code: int) -> NoReturn:
    """End a process whose work is done. Destroy its process groups, run the :func:`before_leaving` hooks and
    Python's exit handlers (the ``atexit`` hooks of loggers and other libraries), flush, and ``os._exit``. Only the
    C++ static destructors are skipped: that is where Gloo threads sometimes abort a finished process (SIGABRT)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    code = _status_on_leaving(code)
    atexit._run_exitfuncs()
    _flush_and_leave(code)


def exit_after_failure(code: int = 1) -> NoReturn:
    """End a process whose run failed (the failure's line or traceback already printed): the :func:`before_leaving`
    hooks, flush and ``os._exit``. No process-group teardown and no exit handlers run, because either could wait for
    a peer that is gone."""
    _flush_and_leave(_status_on_leaving(code))


def _flush_and_leave(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def set_collective_timeout(timeout: timedelta, group: Optional[Any] = None) -> bool:
    """Set the timeout of ``group``'s collectives (the default group: ``None``) after it started; ``False`` where
    this torch cannot (the group keeps the timeout it started with).

    Example::

        set_collective_timeout(timedelta(seconds=config.timeout_s))   # after the first step
    """
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None or not dist.is_initialized():
        return False
    setter(timeout, group)
    return True


# ----------------------------------------------------------------------------------- ModelCheckpoint's saves


def save_step_as_at_interval(callback: Any, trainer: Any) -> str:
    """Have ``callback`` (a ``ModelCheckpoint``) write the trainer's current step as it writes one at its interval:
    its top-k file (without a ``monitor``, the newest ``save_top_k`` are kept) and its ``last`` file (``save_last``).
    Where that writes nothing (a monitored metric ranks its files, and it has no ``save_last``), its ``last`` file all
    the same. A collective: every rank calls it. Returns the path written.

    Example::

        path = save_step_as_at_interval(trainer.checkpoint_callback, trainer)   # ".../epoch=0-step=150.ckpt"
    """
    candidates = callback._monitor_candidates(trainer)
    if callback.monitor is None:
        callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)
    if callback._last_global_step_saved != trainer.global_step:
        path = callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST)
        callback.last_model_path = path  # (as its own save of `last` sets it before writing: it is in the state)
        callback._save_checkpoint(trainer, path)
    return callback._last_checkpoint_saved


# ------------------------------------------------------------------------------------- Lightning's compile check


def allow_compiled_models_in_trainer() -> None:
    """Let ``trainer.fit(torch.compile(model))`` through Lightning's compile check for a strategy that adopts compiled
    models (one with an ``adopt_compiled_model(dynamo_ctx)`` method); other strategies keep Lightning's check. Once per
    process.

    Example::

        allow_compiled_models_in_trainer()   # in the strategy's constructor
    """
    import lightning.pytorch.trainer.trainer as trainer_module

    original = trainer_module._verify_strategy_supports_compile
    if getattr(original, "_static_dist", False):
        return

    def verify(model: Any, strategy: Any) -> None:
        from lightning.pytorch.utilities.compile import to_uncompiled

        adopt = getattr(strategy, "adopt_compiled_model", None)
        if adopt is None:
            original(model, strategy)
            return
        if model._compiler_ctx is not None:
            # taken apart here, before a spawn launcher pickles the model: its dynamo-wrapped methods do not pickle
            adopt(model._compiler_ctx["dynamo_ctx"])
            to_uncompiled(model)

    verify._static_dist = True  # type: ignore[attr-defined]
    trainer_module._verify_strategy_supports_compile = verify


# ------------------------------------------------------------------------------------------------- log step


def lightning_log_step(trainer: Any) -> int:
    """The step Lightning logs this training step's metrics at (the optimizer steps taken before this batch's).

    Example::

        logger.log_metrics({"static_dist/recompiles": 0.0}, step=lightning_log_step(trainer))
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


# ------------------------------------------------------------------------------------------- training loaders


def train_loaders(trainer: Any) -> list[Any]:
    """The training loaders of the fit, flat, as Lightning iterates them and saves their state (empty before setup).

    Example::

        plain = [loader for loader in train_loaders(trainer) if not hasattr(loader, "state_dict")]
    """
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else list(combined.flattened)
