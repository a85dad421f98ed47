"""Unit tests of the step participants (``lightning_static_dist/participants/``): each drives one participant through
its phases, over a small real :class:`~lightning_static_dist.participants.StrategyView` (``_view.py``).

A package (this file), so that a test module here may share a basename with one in ``tests/`` (``test_compression``
here is ``participants.test_compression``; without it pytest refuses the second with "import file mismatch").
"""
