"""Tests of lightning_static_dist/fabric/ (the folder mirrors the package)."""
