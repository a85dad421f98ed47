"""The launch environment, checked in the launching process before any rank starts: a variable that cannot work
(``MASTER_PORT``, ``WORLD_SIZE``, the ranks) is refused with one line naming it.

Example::

    check_launch_environment(os.environ, hosts_store=True)   # MASTER_PORT='http': must be a TCP port number ...
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping

from lightning_static_dist.config import ConfigError

#: the launch variables read as integers, and the least value each may take
_INTEGER_VARIABLES = {"WORLD_SIZE": (1, "the number of processes in the job"), "RANK": (0, "this process's rank"),
                      "LOCAL_RANK": (0, "this process's rank on its node"), "NODE_RANK": (0, "this node's rank")}


def check_launch_environment(environ: Mapping[str, str], hosts_store: bool) -> None:
    """Refuse a launch variable that cannot work, with one line naming it, before any process starts: ``MASTER_PORT``
    not a port number, or (``hosts_store``: this process will open the rendezvous store on it) a port some other
    process already listens on; ``WORLD_SIZE`` below 1; a rank that is not an integer >= 0 (what each
    would do otherwise: docs/internals.md, "processes/environment.py")."""
    port = environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"MASTER_PORT={port!r}: must be a TCP port number (an integer 1-65535), or unset to let"
                          " Lightning pick a free one")
    for name, (least, meaning) in _INTEGER_VARIABLES.items():
        value = environ.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) >= least):
            raise ConfigError(f"{name}={value!r}: must be an integer >= {least} ({meaning}), or unset")
    if port is not None and hosts_store and _port_in_use(int(port)):
        raise ConfigError(f"MASTER_PORT={port}: the port is already in use on this machine (another job's"
                          " rendezvous?); set MASTER_PORT to a free port, or unset it to let Lightning pick one")


def _port_in_use(port: int) -> bool:
    """Whether a process listens on ``port`` here (bound as torch's TCP store binds it: every interface, reusing a
    port that only lingers from a closed connection)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE  # (EACCES, a port below 1024 without root: torch's own error says so)
    return False
