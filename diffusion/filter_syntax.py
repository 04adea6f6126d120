"""The text of a metadata filter, ``COLUMN OP NUMBER`` (``pwatermark<=0.5``, ``original_width>=512``): its
grammar, at the bottom of the package, so the settings declaration (config.py, the ``filters`` key) checks it
without importing data/, and data/filters.py applies what it parses. Standard library only."""

from __future__ import annotations

import operator
import re

OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<": operator.lt, ">": operator.gt}
_PATTERN = re.compile(r"\s*([A-Za-z_]\w*)\s*(<=|>=|==|!=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*")


def syntax_error(text: str) -> str | None:
    """What is wrong with a filter's text (None: it is COLUMN OP NUMBER); the settings declaration's rule
    for ``filters`` (diffusion/config.py)."""
    if _PATTERN.fullmatch(text):
        return None
    return f"is not COLUMN OP NUMBER with OP one of {', '.join(OPS)}, e.g. 'pwatermark<=0.5' or 'original_width>=512'"


def split(text: str) -> tuple[str, str, float]:
    """(column, op, number) of a filter whose ``syntax_error`` is None."""
    m = _PATTERN.fullmatch(text)
    return m.group(1), m.group(2), float(m.group(3))
