"""Errors meant for people: what was wrong, where, and what to do."""

from contextlib import contextmanager


class UsageError(ValueError):
    """Bad input from the user (a flag, a yaml key, a path). Entry points print it as one line and exit 2."""

    exit_code = 2


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite (callbacks/nan_guard.py). One line, exit 3."""

    exit_code = 3


class RankLost(RuntimeError):
    """A collective failed because another rank died, hung or was stopped (see rank_lost). One line, exit 4."""

    exit_code = 4


class Stopped(RuntimeError):
    """Training stopped on a signal (Slurm's preemption, time limit or warning) after every rank finished the same
    batch and the checkpoint was saved (callbacks/preemption.py). One line, exit 5: the same command resumes.
    Every rank raises it, so the entry point still leaves the process group cleanly."""

    exit_code = 5


# How the running entry point spells a config key: as a flag (--key, the tools with argparse flags; the
# default) or as a recipe key (key, key=value: train.py). Library code names keys through ``spell``;
# diffusion.cli.run sets the style while its entry point runs.
_style = {"flags": True}
# Keys whose flag has another name (a repeatable flag takes one item: filters -> --filter); the settings
# declaration (diffusion/settings.py: ``setting(flag=...)``) fills it as its sections are declared.
FLAG_NAMES: dict[str, str] = {}


def spell(key: str, value: str | None = None) -> str:
    """``key`` (a TrainConfig key or a tool's argument name) as its user types it: ``--key`` (``--key VALUE``;
    a switch for the value "true") for the flag tools, ``key`` or ``key=value`` for train.py's recipes. A key
    inside a section (objective.shift) is ``--objective shift=VALUE`` as a flag. An upper-case name is a
    positional argument (SRC, DIR) and stays as it is."""
    if key.isupper():
        return key
    if _style["flags"]:
        head, dot, rest = key.partition(".")
        flag = f"--{FLAG_NAMES.get(head, head)}"
        if dot:
            return f"{flag} {rest}" if value is None else f"{flag} {rest}={value}"
        return flag if value in (None, "true") else f"{flag} {value}"
    return key if value is None else f"{key}={value}"


@contextmanager
def keys_spelled(flags: bool):
    """Within it, ``spell`` writes keys as flags (``flags``) or as recipe keys; the style before comes back
    after, so library code called outside an entry point (tests, notebooks) keeps the default."""
    before, _style["flags"] = _style["flags"], flags
    try:
        yield
    finally:
        _style["flags"] = before


# The errors an entry point reports as one line and its exit code (diffusion/cli.py: run); any other is a bug
# and keeps its traceback.
REPORTED = (UsageError, TrainingDiverged, RankLost, Stopped)


# What gloo and NCCL say when the rank at the other end of a collective is gone (killed, a dead node)
# or silent (hung, stopped) past the process group's timeout.
_PEER_GONE = (
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)


def rank_lost(error: BaseException, timeout: float) -> str | None:
    """One line for a collective that failed because another rank is gone or silent, naming this rank, its
    host and what it saw; None for any other error. Launchers end the surviving ranks when one exits
    (Composer's does within 30 s), so a job with a dead or stopped rank ends in about ``timeout`` seconds."""
    text = str(error)
    if not any(marker in text for marker in _PEER_GONE):
        return None
    import socket

    from composer.utils import dist

    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    return (
        f"rank {dist.get_global_rank()} on {socket.gethostname()}: a collective with the other ranks failed "
        f"({first[:160]}): another rank died, hung or was stopped (no answer within dist_timeout="
        f"{timeout:g} s); look for the rank that exited first in the launcher's log, then rerun "
        "(autoresume continues from the last checkpoint)"
    )
