"""Bad samples: skipped, counted, and reported with where they are, never fatal.

A corrupt image deep in a 2-billion-sample run must cost one sample, not the run. Readers raise
``BadSample`` for a sample that cannot be used; the converter and the training datasets catch it, count
it under its reason and log the first few (with shard and key) and then every power of two, so a log
shows that something is wrong without drowning in it.
"""

from __future__ import annotations

import logging
import re
from collections import Counter

log = logging.getLogger("diffusion.data")


class BadSample(Exception):
    """A sample that cannot be used. ``reason`` is a short tag (the count's key)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def describe_error(e: BaseException) -> str:
    """One short line: the exception's type and first line (PIL's object reprs left out)."""
    text = str(e).strip().splitlines()
    first = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", text[0] if text else "")
    return f"{type(e).__name__}: {first}"[:200]


def printable(name: str) -> tuple[str, bool]:
    """A file name as text that prints and encodes (a name that is not UTF-8 arrives with lone surrogates),
    and whether it had to be mended."""
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return text, text != name


class SkipCounter:
    """Counts skipped samples per reason, keeps a few examples, logs sparingly."""

    def __init__(self, log_first: int = 5, examples: int = 3):
        self.log_first, self.keep = log_first, examples
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, reason: str, where: str, detail: str = "", log_it: bool = True) -> None:
        self.counts[reason] += 1
        example = printable(f"{where}: {detail}" if detail else where)[0]
        if len(self.examples.setdefault(reason, [])) < self.keep:
            self.examples[reason].append(example)
        total = self.total
        if log_it and (total <= self.log_first or total & (total - 1) == 0):
            log.warning(
                "skipped a bad sample (%s), %s; %d skipped so far in this process (%s)",
                reason,
                example,
                total,
                self.summary_counts(),
            )

    def update(self, other: "SkipCounter") -> None:
        self.counts.update(other.counts)
        for reason, examples in other.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(examples[: self.keep - len(mine)])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary_counts(self) -> str:
        return ", ".join(f"{reason} {n}" for reason, n in sorted(self.counts.items()))

    def report(self) -> list[str]:
        """One line per reason with its count and first examples."""
        return [
            f"{reason}: {n} (e.g. {'; '.join(self.examples.get(reason, []))})"
            for reason, n in sorted(self.counts.items())
        ]
