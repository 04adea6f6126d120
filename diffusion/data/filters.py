"""Metadata filters such as ``pwatermark<=0.5`` or ``original_width>=512``.

A sample passes a filter only when its value is known and satisfies the comparison: a score that is
NaN (the source did not have it for that sample) fails every filter on it. The text's grammar is
diffusion/filter_syntax.py's (the settings declaration checks it there, below data/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diffusion.errors import UsageError, spell
from diffusion.filter_syntax import OPS, split, syntax_error


@dataclass(frozen=True)
class Filter:
    column: str
    op: str
    value: float

    def __call__(self, sample: dict) -> bool:
        value = float(sample[self.column])
        return not math.isnan(value) and OPS[self.op](value, self.value)

    def __str__(self) -> str:
        return f"{self.column}{self.op}{self.value:g}"


def parse_filters(texts, key: str = "filters") -> list[Filter]:
    filters = []
    for text in texts or ():
        wrong = syntax_error(text)
        if wrong:
            raise UsageError(f"{spell(key)} {text!r} {wrong}")
        filters.append(Filter(*split(text)))
    return filters


def check_filter_columns(filters: list[Filter], columns: dict[str, str], where: str, key: str = "filters") -> None:
    numeric = {c for c, enc in columns.items() if enc.startswith(("int", "uint", "float"))}
    for f in filters:
        if f.column not in numeric:
            raise UsageError(
                f"{spell(key)} {f}: {where} has no numeric column '{f.column}' (numeric columns: "
                f"{', '.join(sorted(numeric)) or 'none'}); convert with the score kept "
                "(data.py convert --metadata NAME) or drop the filter"
            )


def passes(filters: list[Filter], sample: dict) -> bool:
    return all(f(sample) for f in filters)
