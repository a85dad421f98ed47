"""A plain Trainer script of 2 CPU ranks with ``strategy="static_dist"``, for launch variables set in its environment.

    MASTER_PORT=abc python tests/_env_script.py ROOT_DIR
"""

from __future__ import annotations

import sys

import lightning as L

import lightning_static_dist  # noqa: F401  (registers "static_dist")
from lightning_static_dist.examples.charlm import CharDataModule, CharGPT

if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="static_dist", max_steps=2, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=sys.argv[1])
    trainer.fit(CharGPT(block_size=16, n_layer=1, n_head=2, n_embd=16),
                datamodule=CharDataModule(block_size=16, batch_size=4, max_bytes=20000))
