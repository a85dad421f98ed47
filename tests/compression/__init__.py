"""Tests of lightning_static_dist/compression/ (the folder mirrors the package)."""
