"""Shared plumbing for every entry point (benchmark.py, train.py, data.py, ... and the `python -m
diffusion.<tool>` CLIs): one runner, one-line errors, and markdown tables.

People scanning a log (or a sweep recording the last error line) want just the line that says what was
wrong, so every entry point reports in one shape: ``<prog>: error: <what, where, what to do>``, with the
exit code of the error (diffusion/errors.py: 2 bad input, 3 diverged loss, 4 a rank lost, 5 stopped on a signal
with a checkpoint saved).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from diffusion.config import KEYS
from diffusion.errors import REPORTED, RankLost, Stopped, UsageError, keys_spelled, rank_lost
from diffusion.settings import add_flags, pick


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
    run that succeeded, or stopped on a signal, waits for every rank at the end (bounded by dist_timeout;
    after an error the others may not come, so none is waited for). ``flags``: the entry point takes --flags
    (messages name keys as --key) or recipe keys (as key=value, train.py).

    A rank of a multi-process run ends here and never returns: see ``end_rank``. A single process (every
    in-process call, a test's) returns the code."""
    die_with_launcher()
    take_back_stop_signals()
    try:
        with keys_spelled(flags):
            code = main(argv)
    except REPORTED as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        code = e.exit_code
        if isinstance(e, Stopped):  # every rank stopped at the same batch: the others come to the end too
            code = wait_for_ranks(prog, code)
    except SystemExit as e:  # Composer's handler turns SIGTERM and SIGINT into sys.exit(128 + signal)
        if not in_a_group():
            raise
        end_rank(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        if not in_a_group():
            raise
        traceback.print_exc()  # what Python would print, before the exit that skips the teardown
        end_rank(1)
    else:
        if code == 0:
            code = wait_for_ranks(prog, code)
    if in_a_group():
        end_rank(code)
    leave_process_group()
    return code


def in_a_group() -> bool:
    """Whether this process is one rank of several in torch.distributed's default group."""
    torch_dist = sys.modules.get("torch.distributed")
    return bool(
        torch_dist is not None
        and torch_dist.is_available()
        and torch_dist.is_initialized()
        and torch_dist.get_world_size() > 1
    )


def wait_for_ranks(prog: str, code: int) -> int:
    """Wait at a barrier for every rank to reach the end of its work, at most the group's timeout (the run's
    dist_timeout); ``code`` when they all came, else one line naming this rank and exit code 4."""
    if not in_a_group():
        return code
    import torch.distributed as torch_dist

    try:
        torch_dist.barrier()
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        lost = (
            rank_lost(e, _group_timeout())
            or f"rank {torch_dist.get_rank()}: waiting for the others at the end failed ({first})"
        )
        print(f"{prog}: error: {lost}", file=sys.stderr)
        return RankLost.exit_code
    return code


def _group_timeout() -> float:
    """The default group's collective timeout in seconds (the run's dist_timeout), 0 where torch hides it."""
    import torch
    from torch.distributed import distributed_c10d

    try:
        backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return 0.0


def end_rank(code: int) -> NoReturn:
    """End a rank of a multi-process run with ``code``, now: flush its output, run its exit handlers (checkpoint
    uploads, Streaming's cleanup, loggers), then leave without Python's teardown. That teardown destroys the
    process group, and gloo's destructor joins its worker threads while holding the GIL: a worker still
    releasing the tensors of the last collective (torchmetrics' state sync in FID/CLIP, say) needs the GIL,
    so the rank that had printed its result never exited (seen: rank 1 of a finished `composer -n 2
    evaluate.py`, alive 52 minutes later). A barrier first narrows that window but cannot close it; not
    running the destructor does. Every rank got here only after ``wait_for_ranks``, or after an error that
    the launcher ends the others for. A SIGTERM meanwhile (the launcher ending the ranks after another's error,
    a second scancel) no longer cuts a handler short with Composer's SystemExit (a traceback): the rank is
    leaving, and the launcher's SIGKILL after its grace, or its own death (``die_with_launcher``), still ends it."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) else 1)


def die_with_launcher() -> None:
    """A rank started by a launcher (Composer's, torchrun: they set LOCAL_WORLD_SIZE) dies with it: the kernel
    sends it SIGKILL when its parent exits, however the parent ended (SIGKILL, the OOM killer, a test's
    timeout). Without it a rank whose launcher was killed lived on as an orphan, holding memory and its
    collectives' peers, until killed by hand. A rank whose launcher was gone before this call (reparented to
    init, which is no launcher; in a container the launcher itself may be process 1) exits at once. Linux
    only; elsewhere nothing changes."""
    if "LOCAL_WORLD_SIZE" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent, pr_set_pdeathsig = os.getppid(), 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or (parent == 1 and not _launches_ranks(1)):
        os._exit(128 + signal.SIGKILL)


def _launches_ranks(pid: int) -> bool:
    """Whether process ``pid`` looks like a launcher of ranks (its command line names one); True where it
    cannot be read, so that an unknown case never ends a rank."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True
    return any(name in cmdline for name in ("composer", "torchrun", "torch.distributed.run", "python"))


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
    """Destroy torch.distributed's default group of a single process, if it joined one (Composer never
    destroys it), so that the next run in the same process (a test's) starts its own group with its own
    dist_timeout. A rank of several never gets here: it ends in ``end_rank``."""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized() and not in_a_group():
        torch_dist.destroy_process_group()


def add_trust_checkpoint(parser: argparse.ArgumentParser) -> None:
    """--trust_checkpoint, the flag of the trust_checkpoint key as diffusion/config.py declares it, for the tools
    that read checkpoints."""
    add_flags(parser, pick(KEYS, "trust_checkpoint"), groups=False)


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """--lora DIR and --lora_scale S, for the tools that sample (generate.py, evaluate.py)."""
    parser.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="LoRA adapters to sample with (a folder export.py wrote from a LoRA run, or any diffusers LoRA folder); "
        "the source is then the base pipeline they were trained on",
    )
    parser.add_argument(
        "--lora_scale",
        type=float,
        default=1.0,
        help="how strongly the adapters act (1: as trained, 0: the base alone); also for a LoRA run's checkpoint",
    )


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
