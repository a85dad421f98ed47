"""``strategy.embedding``: large ``nn.Embedding`` weights sharded by rows over the ranks; the full weight is
all-gathered for each step's forward and backward and released after them.

Its part of a step: shard before the optimizer is built (it must hold the shards), prefetch, wait before the
forward, release after the synchronised backward and after the optimizer step, and full weights in checkpoints.

Example (the strategy builds it in its ``__init__``)::

    embeddings = EmbeddingShards(strategy, recording)
    embeddings.before_forward()     # the only wait for the gather issued earlier
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_static_dist.compat import unwrap_optimizer
from lightning_static_dist.embedding import EmbeddingSharder
from lightning_static_dist.agreement.faults import waiting_in
from lightning_static_dist.participants.base import ModelWorldView, StepContext, StepParticipant
from lightning_static_dist.participants.recording import PhaseRecording


class EmbeddingShards(StepParticipant):
    """The sharded embeddings of a fit (none when ``strategy.embedding.shard`` is off, at world size 1, or with
    ``reduce_scatter``, which shards every parameter's optimizer state already)."""

    def __init__(self, view: ModelWorldView, recording: PhaseRecording) -> None:
        self._view = view
        self._recording = recording
        self.sharder: Optional[EmbeddingSharder] = None

    def before_optimizers(self, context: StepContext) -> None:
        if not context.fitting:
            return
        view = self._view
        plan = view.plan
        config = plan.embedding
        if config.shard is False or self.sharder is not None:
            return
        if not config.on:
            rank_zero_info("static_dist: reduce_scatter shards every parameter's optimizer state; strategy.embedding"
                           " sharding is off" if plan.sync.reduce_by_scatter else
                           "static_dist: world size 1, strategy.embedding.shard has nothing to shard across")
            return
        assert view.lightning_module is not None
        sharder = EmbeddingSharder(view.lightning_module, config, view.dp_group)
        weights = sharder.shard()
        if not weights:
            rank_zero_warn(
                f"static_dist: strategy.embedding.shard={config.shard!r} found no nn.Embedding"
                + (f" with at least min_rows={config.min_rows} rows" if config.shard == "auto" else "")
                + "; nothing is sharded"
            )
            return
        self.sharder = sharder
        for w in weights:
            rank_zero_info(f"static_dist: sharded {' = '.join(w.names)} ({w.rows} rows): {w.shard_rows} rows per rank")

    # -------------------------------------------------------------------------------------------- a step

    def on_train_batch_start(self) -> None:
        if self.sharder is not None and self._view.plan.embedding.prefetch == "batch_start":
            self.sharder.prefetch()

    def before_forward(self) -> None:
        if self.sharder is not None:
            with waiting_in("the all-gather of the sharded embeddings"):
                self.sharder.materialize()  # the only wait for the gather issued earlier

    def finish_gradients(self, accumulating: bool) -> None:
        sharder = self.sharder
        if sharder is None or (accumulating and self._view.plan.embedding.gather_once_per_step):
            return
        sharder.release()  # the full weight lives from the gather to the end of the (synchronised) backward
        recorder = self._recording.recorder
        if recorder is not None:
            recorder.note("embed_gather_ms", 1e3 * sharder.timing.gather_s)
            recorder.note("embed_gather_exposed_ms", 1e3 * sharder.timing.exposed_s)

    def after_optimizer_step(self) -> None:
        if self.sharder is not None:
            self.sharder.release()  # the shards changed: any gathered weight is stale
            if self._view.plan.embedding.prefetch == "after_optimizer":
                self.sharder.prefetch()

    # ------------------------------------------------------------------------------------------ checkpoints

    def model_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        if self.sharder is None:
            return state
        return self.sharder.full_state_dict(state)  # collective: every rank gets here

    def model_state_to_load(self, state: dict[str, Any]) -> dict[str, Any]:
        return self.sharder.shard_state_dict(state) if self.sharder is not None else state

    def optimizer_state_to_save(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        if self.sharder is None:
            return state
        return self.sharder.full_optimizer_state(unwrap_optimizer(optimizer), state)  # collective

    def optimizer_state_to_load(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        return self.sharder.shard_optimizer_state(optimizer, state) if self.sharder is not None else state

    # -------------------------------------------------------------------------------------------- teardown

    def teardown(self, failed: bool) -> None:
        if self.sharder is None:
            return
        if failed:
            rank_zero_warn("static_dist: training failed; the sharded embeddings stay sharded in this process")
        else:
            self.sharder.unshard()  # a usable model after fit (collective: every rank tears down)
        self.sharder = None
