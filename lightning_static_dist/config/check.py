"""The one checker of every configuration: a value against a type annotation, a dataclass against its fields.

Every configuration of the package is a dataclass with a docstring on each field and a class attribute ``KEY``, its
full key in a run file (``strategy.sync``, ``callbacks.run_summary``). Its ``__post_init__`` calls
:func:`check_fields` and then checks ranges with :func:`fail`; either raises :class:`ConfigError` with one line naming
the *full* key, the bad value and what is allowed. Mappings become dataclasses through :func:`section_from_dict`,
which rejects unknown keys the same way, so a typo never disappears into a ``**kwargs``.

Example::

    @dataclass
    class Config:
        KEY = "callbacks.my_callback"

        every_n_steps: int = 1  # (a docstring on the next line in real code)

        def __post_init__(self) -> None:
            check_fields(self)
            if self.every_n_steps < 1:
                fail(f"{self.KEY}.every_n_steps", self.every_n_steps, "must be an integer >= 1")

    section_from_dict(Config, {"every_n_step": 2})  # ConfigError: callbacks.my_callback.every_n_step: unknown key; ...
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NoReturn, Optional, TypeVar, Union


class ConfigError(ValueError):
    """A configuration value that is unknown, of the wrong type or out of range. The message is one line."""


# --------------------------------------------------------------------------------------------------------------
# Generic checks: one value against one annotation.
# --------------------------------------------------------------------------------------------------------------


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(annotation, "__name__", str(annotation))


def _matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits ``annotation``; annotations this checker does not understand accept anything."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        # bool is an int: ``True == 1`` must not satisfy Literal[1], nor 1 satisfy Literal[True]
        return any(value == a and type(value) is type(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, Sequence, tuple) or annotation in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin in (dict, Mapping) or annotation is dict:
        return isinstance(value, Mapping)
    # anything else (an Accelerator instance, a Logger ...) cannot come from YAML and is the user's business
    return True


def check_value(key: str, value: Any, annotation: Any) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``value`` fits ``annotation``."""
    if not _matches(value, annotation):
        raise ConfigError(f"{key}={value!r}: expected {_describe(annotation)}")


def fail(key: str, value: Any, allowed: str) -> NoReturn:
    """Raise the one-line error ``key=value: allowed``."""
    raise ConfigError(f"{key}={value!r}: {allowed}")


def check_fields(section: Any) -> None:
    """Type-check every field of a dataclass instance against its annotation; its class's ``KEY`` is the
    full key of the section (``strategy.sync``, ``callbacks.run_summary``). An ``int`` given for a ``float`` field
    is stored as a ``float``."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if f.name.startswith("_"):
            continue
        value = getattr(section, f.name)
        check_value(f"{section.KEY}.{f.name}", value, hints[f.name])
        if hints[f.name] is float and isinstance(value, int):
            object.__setattr__(section, f.name, float(value))


_Section = TypeVar("_Section")


def section_from_dict(cls: type[_Section], data: Any, key: Optional[str] = None, show_value: bool = False,
                      taken: Sequence[str] = ()) -> _Section:
    """Build the dataclass ``cls`` from a mapping, an instance of ``cls`` or ``None`` (defaults).

    ``key``: the section's full key (default: ``cls.KEY``). ``show_value``: an unknown key's message shows its
    value too (``key.name=value: unknown key; ...``). ``taken``: keys of the block the caller took out of ``data``
    first (a callback block's ``enabled``): an unknown key's message lists them, and may suggest one.

    Example::

        sync = section_from_dict(SyncConfig, {"bucket_mb": 10})
    """
    key = key or getattr(cls, "KEY", cls.__name__)
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key}={data!r}: expected a mapping of {_field_names(cls)} or a {cls.__name__}")
    names = [*taken, *(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))]
    for name in data:
        if name not in names:
            close = difflib.get_close_matches(str(name), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            shown = f"={data[name]!r}" if show_value else ""
            raise ConfigError(f"{key}.{name}{shown}: unknown key; {hint}allowed: {', '.join(names)}")
    return cls(**dict(data))


def _field_names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))


def import_object(key: str, class_path: str) -> Any:
    """Import ``package.module.Name``; errors name the config key."""
    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        fail(key, class_path, "expected a dotted import path such as 'my_pkg.models.MyModel'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        fail(key, class_path, f"cannot import module {module_name!r} ({err})")
    target = getattr(module, attr, None)
    if target is None:
        fail(key, class_path, f"module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        fail(key, class_path, f"{class_path!r} is a {type(target).__name__}, not a class")
    return target


def check_kwargs_against(key: str, target: Any, kwargs: Mapping[str, Any], exclude: Sequence[str] = (),
                         taken: Sequence[str] = ()) -> None:
    """Check ``kwargs`` against the signature of ``target`` (a class or a callable): names and simple types.

    ``exclude``: argument names that exist but are not for the user to set (left out of the allowed list).
    ``taken``: keys the caller took out of ``kwargs`` first, listed (and suggested) among the allowed ones.
    """
    init = target.__init__ if isinstance(target, type) else target
    params = inspect.signature(init).parameters
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # unresolvable forward references: check names only
        hints = {}
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    allowed = [*taken] + [
        n
        for n, p in params.items()
        if n != "self" and n not in exclude and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    for name, value in kwargs.items():
        if name not in params or name == "self":
            if accepts_var_kw:
                continue
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{key}.{name}: unknown key; {hint}allowed: {', '.join(allowed)}")
        if name in hints:
            check_value(f"{key}.{name}", value, hints[name])
