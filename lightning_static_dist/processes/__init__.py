"""The processes of a data-parallel job: how the ranks start, stop, agree and fail, below the step the front ends
run. Each module owns one concern:

    data_parallel   ``DataParallelProcesses``, the Trainer strategy's base: launchers, the process group, the
                    data-parallel mesh, the host group, Lightning's collectives, a failed rank's diagnosis
    environment     the launch environment (``MASTER_PORT``, ``WORLD_SIZE``, the ranks) checked before any rank starts
    launcher        Lightning's launchers, with a grace period when a rank dies, and spawned ranks that leave
                    without the interpreter's native teardown
    sigterm         a SIGTERM (or SLURM's SIGUSR1) agreed on by every rank over the host group, and the stop at an
                    accumulation window's end with a checkpoint on every rank
    watchdog        the peer watchdog: a dead peer's line where no error reaches the survivor
    ending          how the processes end: one line or one traceback per failure, and the launching process's
                    wait for the ranks it started, with the worst status of all

The ranks' agreement on a failure (``faults``) and on what they hold (``fingerprint``) is the leaf folder
``agreement/``, below the features that mark their collectives with it; this ``__init__`` imports nothing.
"""
