"""A :class:`~lightning_static_dist.config.ConfigError` under LightningCLI: one line on stderr, no traceback.

LightningCLI parses the command line first and builds the classes afterwards (``parser.instantiate_classes``),
outside jsonargparse's error handling: a constructor's ``ConfigError`` (``--trainer.strategy.sync.bucket_mbb=5``)
reached the user as jsonargparse's report of every ``Union`` member it tried, about 50 lines with the one line that
matters near the end. jsonargparse's documented global instantiator (``jsonargparse.add_instantiator``, from 4.49)
builds the package's classes instead, and turns a ``ConfigError`` into what jsonargparse makes of a parse error:
``<prog>: error: <the line>`` on stderr and exit status 2. Every other exception, and every other class, is left to
jsonargparse as before.

Example::

    report_config_errors_under_jsonargparse(StaticDistStrategy, OverlapMonitor)  # the package's __init__ does this
"""

from __future__ import annotations

import os
import sys
from importlib.util import find_spec
from typing import Any

from lightning_static_dist.config.check import ConfigError


def report_config_errors_under_jsonargparse(*classes: type) -> None:
    """Build ``classes`` (and their subclasses) through :func:`build_or_exit` whenever jsonargparse instantiates them.
    Without jsonargparse, or with one older than 4.49 (no global instantiators), nothing changes."""
    if find_spec("jsonargparse") is None:
        return
    import jsonargparse

    add_instantiator = getattr(jsonargparse, "add_instantiator", None)
    if add_instantiator is None:
        return
    for cls in classes:
        add_instantiator(build_or_exit, cls, subclasses=True)


def build_or_exit(class_type: type, *args: Any, **kwargs: Any) -> Any:
    """``class_type(*args, **kwargs)``; a ``ConfigError`` ends the command as a parse error does, in one line."""
    try:
        return class_type(*args, **kwargs)
    except ConfigError as err:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "error"
        sys.stderr.write(f"{prog}: error: {err}\n")
        raise SystemExit(2) from None
