"""Tests of lightning_static_dist/simulate/ (the folder mirrors the package)."""
