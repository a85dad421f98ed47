"""A char-level GPT whose rank 0 raises once at a given step (a marker file remembers it did): for the tests of a
restarted job resuming by itself. Each rank says the step its fit starts at ("rank 1 starts at step 10")."""

from __future__ import annotations

import os
import sys

from lightning_static_dist.examples.charlm import CharGPT


class CrashOnceGPT(CharGPT):
    def __init__(self, crash_at: int = 15, marker: str = "crashed", **kwargs) -> None:
        super().__init__(**kwargs)
        self._crash_at, self._marker = crash_at, marker

    def on_train_start(self) -> None:
        print(f"rank {self.global_rank} starts at step {self.global_step}", file=sys.stderr, flush=True)

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        if self.global_step == self._crash_at and self.global_rank == 0 and not os.path.exists(self._marker):
            open(self._marker, "w").close()
            raise RuntimeError(f"planted failure at step {self._crash_at}")
        return super().training_step(batch, batch_idx)
