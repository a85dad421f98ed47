"""A :class:`~lightning_static_dist.config.ConfigError` under LightningCLI: one line on stderr, no traceback.

jsonargparse's documented global instantiator (``jsonargparse.add_instantiator``, from 4.49) builds the package's
classes — the strategies, the callbacks and every configuration section jsonargparse builds on its own
(``SyncConfig`` ...) — and turns a ``ConfigError`` into what jsonargparse makes of a parse error: ``<prog>: error:
<the line>`` on stderr and exit status 2. Every other exception, and every other class, is left to jsonargparse. Why:
docs/internals.md, "config/lightning_cli.py".

Some values can only be checked once the ``Trainer`` gives the world (a mesh that does not divide it): an object
built here reports those the same way (:func:`parse_errors_of`), while one built in the user's own code raises.

Example::

    report_config_errors_under_jsonargparse(StaticDistStrategy, OverlapMonitor)  # the package's __init__ does this
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from typing import Any, NoReturn

from lightning_static_dist.config.check import ConfigError

#: the mark an object jsonargparse built through :func:`build_or_exit` carries: its later ``ConfigError``s are parse
#: errors too. An attribute of the object, not a registry of objects: a spawned rank gets the strategy pickled, a new
#: object, and must still know where it came from
_BUILT_BY_CLI = "_static_dist_built_by_cli"


def report_config_errors_under_jsonargparse(*classes: type) -> None:
    """Build ``classes`` (and their subclasses), and every configuration dataclass their dataclass sections hold,
    through :func:`build_or_exit` whenever jsonargparse instantiates them. Without jsonargparse, or with one older
    than 4.49 (no global instantiators), nothing changes."""
    if find_spec("jsonargparse") is None:
        return
    import jsonargparse

    add_instantiator = getattr(jsonargparse, "add_instantiator", None)
    if add_instantiator is None:
        return
    for cls in classes:
        add_instantiator(build_or_exit, cls, subclasses=True)


def sections_of(root: type) -> list[type]:
    """The dataclasses ``root``'s fields hold, however deep (``StrategyConfig`` -> ``SimulateConfig`` ->
    ``LinkConfig``): jsonargparse builds each of them itself from a nested key, so each needs the instantiator."""
    found: list[type] = []

    def visit(annotation: Any) -> None:
        for inner in typing.get_args(annotation):  # Optional[LinkConfig], Union[SyncConfig, dict] ...
            visit(inner)
        if dataclasses.is_dataclass(annotation) and isinstance(annotation, type) and annotation not in found:
            found.append(annotation)
            for hint in typing.get_type_hints(annotation).values():
                visit(hint)

    for hint in typing.get_type_hints(root).values():
        visit(hint)
    return found


def build_or_exit(class_type: type, *args: Any, **kwargs: Any) -> Any:
    """``class_type(*args, **kwargs)``; a ``ConfigError`` ends the command as a parse error does, in one line."""
    try:
        built = class_type(*args, **kwargs)
    except ConfigError as err:
        exit_as_parse_error(err)
    if not dataclasses.is_dataclass(built):  # (a section is checked when built, and never again)
        setattr(built, _BUILT_BY_CLI, True)
    return built


def exit_as_parse_error(err: ConfigError) -> NoReturn:
    """``<prog>: error: <err>`` on stderr and exit status 2, as jsonargparse ends a command line it cannot parse. Once
    the ranks run (a check that needs the Trainer's callbacks), every rank exits and rank 0 alone says why."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank == 0:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "error"
        sys.stderr.write(f"{prog}: error: {err}\n")
    raise SystemExit(2) from None


@contextmanager
def parse_errors_of(owner: Any) -> Iterator[None]:
    """A ``ConfigError`` raised inside ends the command as a parse error when jsonargparse built ``owner`` (a value
    of the command line, found wrong once the ``Trainer`` gave the world); otherwise it propagates, as in a user's
    own script.

    Example::

        with parse_errors_of(self):
            resolve_mesh_shape(self.config.mesh, world_size)
    """
    try:
        yield
    except ConfigError as err:
        if not getattr(owner, _BUILT_BY_CLI, False):
            raise
        exit_as_parse_error(err)
