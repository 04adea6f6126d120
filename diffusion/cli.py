"""Shared plumbing for every entry point (benchmark.py, train.py, data.py, ... and the `python -m
diffusion.<tool>` CLIs): one runner, one-line errors, and markdown tables.

People scanning a log (or a sweep recording the last error line) want just the line that says what was
wrong, so every entry point reports in one shape: ``<prog>: error: <what, where, what to do>``, with the
exit code of the error (diffusion/errors.py: 2 bad input, 3 diverged loss, 4 a rank lost, 5 stopped on a signal
with a checkpoint saved).
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from collections.abc import Callable, Sequence

from diffusion.errors import REPORTED, Stopped, UsageError, keys_spelled


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageErrors, so `run` reports them like any other bad input.
    The module docstring (``description``) is shown as written: it holds the usage examples."""

    def __init__(self, prog: str, description: str | None, usage: str | None = None):
        super().__init__(
            prog=prog, description=description, usage=usage, formatter_class=argparse.RawDescriptionHelpFormatter
        )

    def error(self, message: str):  # type: ignore[override]
        # argparse's "argument --x: " in front of a message that names --x already (the declared rules' do)
        raise UsageError(re.sub(r"^argument (\S+): (?=\1\b)", "", message))


def run(
    prog: str, main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None, *, flags: bool = True
) -> int:
    """Call ``main(argv)``: the errors in diffusion.errors.REPORTED become one line and their exit code. A
    run that succeeded, or stopped on a signal, leaves the process group before returning (every rank got there;
    after an error the others may not, so none is waited for). ``flags``: the entry point takes --flags (messages name keys as
    --key) or recipe keys (as key=value, train.py)."""
    take_back_stop_signals()
    try:
        with keys_spelled(flags):
            code = main(argv)
    except REPORTED as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        if isinstance(e, Stopped):  # every rank stopped at the same batch: the group can be left cleanly
            leave_process_group()
        return e.exit_code
    if code == 0:
        leave_process_group()
    return code


def take_back_stop_signals() -> None:
    """Under Slurm, single-node/run.sh starts Composer's launcher with SIGUSR1 ignored (so it outlives its ranks'
    last checkpoint), and its ranks inherit that: each entry point takes the default action back, and training
    then installs its own handlers (diffusion/callbacks/preemption.py)."""
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def one_line(error: BaseException) -> str:
    """The error's message; for one raised in a DataLoader worker, which PyTorch re-raises in the main process
    as the same type with the worker's traceback for a message, the worker's own message (its last line)."""
    text = str(error)
    if "\nOriginal Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def leave_process_group() -> None:
    """Wait for every rank, then destroy torch.distributed's default group, if this process joined one; call
    it on every rank. Composer never destroys it, and a gloo rank whose group outlives its work can abort at
    interpreter exit (SIGABRT, "terminate called without an active exception", seen on torch 2.11): a gloo
    worker thread still releasing the tensors of its last collective needs the GIL while the interpreter is
    torn down, so a run that finished was reported as a crashed rank. Destroying the group straight after
    the last collective deadlocks the same way (its destructor joins that thread holding the GIL), so the
    barrier comes first: waiting in it releases the GIL and lets the workers finish. It also lets the next
    run in the same process start its own group (with its own dist_timeout)."""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def add_trust_checkpoint(parser: argparse.ArgumentParser) -> None:
    """--trust_checkpoint, the flag of the trust_checkpoint key as diffusion/config.py declares it, for the tools
    that read checkpoints."""
    from diffusion.config import KEYS
    from diffusion.settings import add_flags, pick

    add_flags(parser, pick(KEYS, "trust_checkpoint"), groups=False)


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
