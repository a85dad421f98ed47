"""Tests of lightning_static_dist/config/ (the folder mirrors the package)."""
