"""Tests of lightning_static_dist/processes/ (the folder mirrors the package)."""
