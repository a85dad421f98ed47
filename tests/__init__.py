"""The test suite: tests/<room>/ holds the tests of lightning_static_dist/<room>/; the helpers (_dist.py ...) sit here."""
