"""Tests of the scripts in benchmarks/ (their bookkeeping, on hand-made inputs)."""
