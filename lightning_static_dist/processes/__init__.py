"""The processes of a data-parallel job: how the ranks start, stop, agree and fail, below the step the front ends
run. Each module owns one concern:

    data_parallel   ``DataParallelProcesses``, the Trainer strategy's base: launchers, the process group, the
                    data-parallel mesh, the host group, Lightning's collectives, a failed rank's diagnosis
    launcher        Lightning's launchers, with a grace period when a rank dies, and spawned ranks that leave
                    without the interpreter's native teardown
    sigterm         a SIGTERM (or SLURM's SIGUSR1) agreed on by every rank over the host group, and the stop at an
                    accumulation window's end with a checkpoint on every rank
    watchdog        the peer watchdog: a dead peer's line where no error reaches the survivor
    ending          how the processes end: one line or one traceback per failure, and the launching process's
                    wait for the ranks it started, with the worst status of all
    faults          a dead or stuck peer as one line naming the rank and the collective in flight
    fingerprint     cross-rank agreement checks (the same parameters, the same compiled graphs)

``faults`` and ``fingerprint`` are leaves the features below the strategy use too (``sync/`` marks its collectives
with ``faults.waiting_in``); this ``__init__`` imports nothing, so reaching them loads nothing above them
(``tests/test_architecture.py`` holds each module's layer).

Example::

    from lightning_static_dist.processes.faults import waiting_in

    with waiting_in("all-reduce of bucket 2"):
        work.wait()
"""
