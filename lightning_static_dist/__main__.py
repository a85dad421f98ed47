"""``python -m lightning_static_dist CONFIG.yaml [dotted.key=value ...]`` is ``lsd-train``."""

from lightning_static_dist.cli import train_main

if __name__ == "__main__":
    train_main()
