"""A plain Trainer script (no lsd-train) of 2 CPU ranks, ``strategy="static_dist"``, whose rank 1 gets SIGTERM at step 3.

    python tests/_preempted_script.py ROOT_DIR
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `tests.faulty`, as lsd-train finds it

import lightning as L  # noqa: E402

import lightning_static_dist  # noqa: E402, F401  (registers "static_dist")
from lightning_static_dist.examples.charlm import CharDataModule  # noqa: E402
from tests.faulty import FaultyCharGPT  # noqa: E402

if __name__ == "__main__":
    model = FaultyCharGPT(fault="sigterm", fault_rank=1, fault_step=3, block_size=32, n_layer=1, n_head=2, n_embd=32)
    data = CharDataModule(block_size=32, batch_size=4, max_bytes=100000)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="static_dist", max_steps=12, limit_val_batches=0,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=sys.argv[1])
    trainer.fit(model, datamodule=data)
