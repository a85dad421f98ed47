"""Tests of lightning_static_dist/sync/ (the folder mirrors the package)."""
