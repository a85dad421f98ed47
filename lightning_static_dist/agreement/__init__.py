"""How the ranks agree, below every feature that runs a collective: a dead or stuck peer said as one line naming the
rank and the collective in flight (``faults``), and cross-rank checks that every rank holds the same parameters and
compiled graphs (``fingerprint``). A leaf: this ``__init__`` imports nothing, and neither module imports a feature.

Example::

    from lightning_static_dist.agreement.faults import waiting_in

    with waiting_in("all-reduce of bucket 2"):
        work.wait()
"""
