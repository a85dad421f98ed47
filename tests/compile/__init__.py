"""Tests of lightning_static_dist/compile/ (the folder mirrors the package)."""
