"""Tests of lightning_static_dist/overlap/ (the folder mirrors the package)."""
