"""A run file's YAML, before OmegaConf reads it: how deep it nests, and a reader's error on one line.

OmegaConf reads a file recursively, and a valid file nested a hundred levels deep ends in Python's ``RecursionError``;
YAML's own errors spread their cause and their line over several lines. Both become a one-line
:class:`~lightning_static_dist.config.ConfigError` that keeps the cause and the line.

Example::

    check_nesting("run.yaml")                        # ConfigError: nested deeper than 32 levels at line 40 ...
    yaml_error_text(err)                             # "while parsing a flow sequence (line 2, column 14); ..."
"""

from __future__ import annotations

import re

from lightning_static_dist.config.check import ConfigError
#: How deep a run file may nest mappings and lists: its own keys go four levels deep
#: (``strategy.simulate.link.gbps``), and OmegaConf cannot read a file nested a hundred levels deep (Python's
#: recursion limit), valid YAML or not.
MAX_NESTING = 32


def check_nesting(path: str) -> None:
    """A :class:`ConfigError` naming the line where the file at ``path`` nests deeper than :data:`MAX_NESTING`
    (read with YAML's scanner, token by token: no recursion, whatever the depth). A file that is not YAML is left to
    the loader, whose error says why."""
    import yaml

    depth = 0
    opening = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
               yaml.FlowSequenceStartToken)
    closing = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
    with open(path, encoding="utf-8", errors="replace") as f:
        try:
            for token in yaml.scan(f, Loader=yaml.SafeLoader):
                if isinstance(token, opening):
                    depth += 1
                    if depth > MAX_NESTING:
                        raise ConfigError(f"config file {path!r}: nested deeper than {MAX_NESTING} levels at line"
                                          f" {token.start_mark.line + 1}, column {token.start_mark.column + 1}; a"
                                          " run file's keys nest a few levels (allowed: at most"
                                          f" {MAX_NESTING})")
                elif isinstance(token, closing):
                    depth -= 1
        except yaml.YAMLError:
            return


def yaml_error_text(err: BaseException) -> str:
    """A YAML reader's error on one line, with its cause and where (``while parsing a flow sequence (line 2, column
    14): did not find expected ',' or ']' (line 3, column 10)``): the reader's own text spreads that over several
    lines, the file's name on each."""
    text = re.sub(r'\n\s*in "[^"]*", line (\d+), column (\d+)', r" (line \1, column \2)", str(err))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines)[:400] or type(err).__name__
