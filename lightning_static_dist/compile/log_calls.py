"""``self.log`` and ``self.log_dict`` inside a compiled ``training_step``: recorded in the graph, replayed after it.

Lightning's own ``log`` is ``torch.compiler.disable``d, so a traced ``self.log`` would split the step in two. While
the compiled step runs, ``log`` and ``log_dict`` are stand-ins that append the call to a list (the logged tensors
become graph outputs); when it returns the calls are made in order through the real ones, so ``sync_dist``,
``on_step`` / ``on_epoch`` and the batch size happen eagerly, as without compile (docs/how-it-works.md: Compilation).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: the LightningModule methods the compiled step records instead of tracing into
LOGGING_METHODS = ("log", "log_dict")


class LogCalls:
    """The logging calls of one LightningModule's compiled step: recorded while it runs, replayed when it returns.

    Example::

        calls = LogCalls.install(module)    # module.log / module.log_dict are stand-ins from now on
        with calls.recording():             # around the compiled training_step (regions.py does this)
            loss = compiled_training_step(module, batch, batch_idx)
        # the recorded self.log calls have now run through Lightning's own log, in order
    """

    def __init__(self) -> None:
        self.entries: list[tuple[nn.Module, str, tuple[Any, ...], dict[str, Any]]] = []
        """``(module, method, args, kwargs)`` per call of this step, in call order. One list for the module's life:
        dynamo guards on it, and replacing it would recompile."""
        self.depth = 0
        """How many compiled calls of the step are running (more than 1 only when one is nested in another)."""
        self.replayed = 0
        """How many calls the last replay made (for the compile report)."""

    @classmethod
    def install(cls, module: nn.Module) -> LogCalls:
        """Put stand-ins for ``module.log`` and ``module.log_dict`` on the instance (the class keeps the real ones),
        bound with ``types.MethodType`` (why: docs/internals.md, "compile/log_calls.py")."""
        calls = cls()
        for method in LOGGING_METHODS:
            if callable(getattr(type(module), method, None)):
                setattr(module, method, types.MethodType(calls._stand_in(method), module))
        return calls

    def _stand_in(self, method: str) -> Any:
        calls = self

        def record(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            # traced by dynamo inside the compiled step (it guards on depth == 1 and traces only the append)
            if calls.depth:
                # a snapshot, as Lightning's log takes one when called: a parameter logged as it is
                # (self.log("temperature", self.temperature)) and then stepped by a manual optimizer inside the step
                # must be logged with its value at the call
                calls.entries.append((module, method, _owned(args), _owned(kwargs)))
                return None
            return getattr(type(module), method)(module, *args, **kwargs)

        record.__name__ = record.__qualname__ = method
        return record

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the step's logging calls while the block runs; when the outermost block ends, replay them (or, if
        it raised, drop them: the step did not happen)."""
        self.depth += 1
        try:
            yield
        except BaseException:
            if self.depth == 1:
                self.entries.clear()
            raise
        finally:
            self.depth -= 1
        if self.depth == 0:
            self.replay()

    def discard(self) -> None:
        """Forget what was recorded so far in this step: a compiled call that failed half way is run again eagerly
        (``compile.fallback: eager``), and its logging calls with it."""
        self.entries.clear()

    def replay(self) -> None:
        """Make the recorded calls through the modules' real ``log`` / ``log_dict``, in order."""
        entries = list(self.entries)
        self.entries.clear()
        for module, method, args, kwargs in entries:
            try:
                getattr(type(module), method)(module, *_owned(args), **_owned(kwargs))
            except Exception as err:
                # raised here, after the compiled call: the traceback does not reach the user's self.log line
                if hasattr(err, "add_note"):  # (Python 3.11+)
                    named = f"({args[0]!r}, ...)" if args and isinstance(args[0], str) else "(...)"
                    err.add_note(f"static_dist: raised by self.{method}{named}, recorded inside the compiled"
                                 " training_step and made after it; strategy.compile.enabled=false shows its line")
                raise
        self.replayed = len(entries)


def _owned(value: Any) -> Any:
    """``value`` with each tensor in it (in tuples, lists and dicts) cloned: once inside the graph when the call is
    recorded (the value at the call), and once more after the graph when the call is replayed (why twice:
    docs/internals.md, "compile/log_calls.py"). The copy keeps autograd history: ``enable_graph=True`` works.
    """
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) in (tuple, list):
        return type(value)(_owned(v) for v in value)
    if type(value) is dict:
        return {k: _owned(v) for k, v in value.items()}
    return value
