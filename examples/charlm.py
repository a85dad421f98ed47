"""Train the char-level GPT with the static_dist strategy from your own script: the main job without a run file.

The model and its data module live in the package (``lightning_static_dist.examples.charlm``), so a pip install
carries them and the shipped run files (``lsd-train charlm_cpu``) name them; this is what a user's training script
looks like around them: one import, one strategy argument, the usual Trainer.

    python examples/charlm.py                      # 2 CPU ranks over Gloo, 300 steps (CPU only: see configs/ for GPUs)
    python examples/charlm.py --steps 50 --compile --compression powersgd
"""

from __future__ import annotations

import argparse

import lightning as L

from lightning_static_dist import OverlapMonitor, StaticDistStrategy  # (strategy="static_dist" works as well)
from lightning_static_dist.examples.charlm import CharDataModule, CharGPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="strategy.compile.enabled (inductor)")
    parser.add_argument("--compression", default="none", help="strategy.compression.name: none, bf16, powersgd ...")
    args = parser.parse_args()

    L.seed_everything(1234, workers=True)
    model = CharGPT(block_size=128, n_layer=4, n_head=4, n_embd=128, lr=3e-3, warmup_steps=30)
    data = CharDataModule(block_size=128, batch_size=16, max_bytes=2_000_000)
    strategy = StaticDistStrategy(compile={"enabled": args.compile}, compression={"name": args.compression})
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        val_check_interval=100, limit_val_batches=10, check_val_every_n_epoch=None,
                        gradient_clip_val=1.0, callbacks=[OverlapMonitor(every_n_steps=10)],
                        default_root_dir="runs/charlm_example", enable_progress_bar=False)
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
