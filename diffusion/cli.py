"""Shared plumbing for the small `python -m diffusion.<tool>` CLIs: one-line errors and markdown tables.

argparse prints a usage block before its error; people scanning a log (or a sweep recording the last
error line) want just the line that says what was wrong, so every tool reports in the same shape
as benchmark.py: ``<prog>: error: <what, where, what to do>``, exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from diffusion.errors import UsageError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageErrors, so `run` reports them like any other bad input.
    The module docstring (``description``) is shown as written: it holds the usage examples."""

    def __init__(self, prog: str, description: str | None):
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def run(prog: str, main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``, turning a UsageError into the one-line report and exit code 2."""
    try:
        return main(argv)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def add_trust_checkpoint(parser: argparse.ArgumentParser) -> None:
    """--trust_checkpoint, the flag of the trust_checkpoint key (diffusion/eval/checkpoint.py), for the tools
    that read checkpoints."""
    parser.add_argument("--trust_checkpoint", action="store_true",
                        help="unpickle the checkpoint with no weights_only restriction, so code in it can run: "
                             "only for files you made (default: refuse any type a checkpoint of ours never holds)")


def positive(kind: type = float) -> Callable[[str], int | float]:
    """argparse type: a number > 0 (``kind`` int or float), with a message that names the value."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """GitHub-markdown table lines, for docs and terminals alike."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
