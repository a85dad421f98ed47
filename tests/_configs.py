"""What the configuration tests share: the shipped run files, and the contract every ``ConfigError`` keeps."""

from __future__ import annotations

from pathlib import Path

from lightning_static_dist.config import ConfigError


REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = str(REPO / "configs" / "charlm_cpu.yaml")
GPU_CONFIG = str(REPO / "configs" / "charlm_gpu.yaml")


def assert_one_line_naming(err: ConfigError, key: str, shown: str) -> None:
    """The contract of every ConfigError: one line, the full key, the bad value (or the bad key itself)."""
    message = str(err)
    assert message, "empty ConfigError message"
    assert "\n" not in message, f"message is not one line: {message!r}"
    assert key in message, f"{key!r} not named in {message!r}"
    assert shown in message, f"{shown!r} not shown in {message!r}"
