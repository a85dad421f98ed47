"""The one checker of typed configuration, validated once, at the edge.

:mod:`~lightning_static_dist.config.check` checks a value against an annotation and a dataclass against its fields;
:class:`ConfigError`'s message is one line naming the full key, the bad value and what is allowed. Every options
dataclass uses it, each beside its owner: the strategy's sections (``CompileConfig`` in ``compile/config.py``,
``SyncConfig`` in ``sync/config.py`` ..., held together by :mod:`lightning_static_dist.plan.strategy_config`), the
callbacks' ``Config``s, and the run file (:mod:`lightning_static_dist.runfile`, beside the command line).

Example::

    from lightning_static_dist.config import check_fields, fail

    @dataclass
    class MyOptions:
        KEY = "callbacks.my_callback"
        every_n_steps: int = 1

        def __post_init__(self) -> None:
            check_fields(self)
            if self.every_n_steps < 1:
                fail(f"{self.KEY}.every_n_steps", self.every_n_steps, "must be an integer >= 1")
"""

from lightning_static_dist.config.check import (
    ConfigError,
    check_fields,
    check_kwargs_against,
    check_value,
    fail,
    import_object,
    section_from_dict,
)

__all__ = [
    "ConfigError",
    "check_fields",
    "check_kwargs_against",
    "check_value",
    "fail",
    "import_object",
    "section_from_dict",
]
