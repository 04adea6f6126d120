"""Loader workers that outlive a scheduler's stop signal, and end with their rank.

Slurm's scancel (preemption, the time limit) sends SIGTERM to every process of a step, loader workers included,
and a `--signal=USR1@N` without `B:` sends SIGUSR1 to them too. A worker's default action for both is to die, and
torch's SIGCHLD handler in the rank then raises "DataLoader worker (pid N) is killed by signal: Terminated" from
wherever the rank is: in the middle of the checkpoint that callbacks/preemption.py stops to save. So a worker
ignores both (``ignore_stop_signals``, the loaders' ``worker_init_fn``): the rank alone decides to stop, and a worker
still ends as before when its loader shuts it down, when its rank dies (torch's watchdog in each worker) or by
SIGKILL.

One thing relied on a worker dying of SIGTERM: at interpreter exit, multiprocessing terminates the daemon processes
still running (persistent workers are) and then joins them, which would wait forever for a worker that ignores it.
``end_workers_at_exit`` runs before that (atexit runs handlers last-registered first, and multiprocessing registers
its own on import, before any loader exists): it SIGKILLs this process's live loader workers and reaps them, with
torch's SIGCHLD check put back to the default first, so their end is not reported as a failure."""

from __future__ import annotations

import atexit
import multiprocessing
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_registered = False


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: this worker ignores the scheduler's stop signals (its rank handles them)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_workers_at_exit() -> None:
    """Once per process: at exit, this process's loader workers still alive are killed before multiprocessing
    would terminate and join them."""
    global _registered
    if not _registered:
        atexit.register(_kill_workers)
        _registered = True


def _kill_workers() -> None:
    workers = [p for p in multiprocessing.active_children() if _is_loader_worker(p)]
    if not workers:
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in workers:
        worker.kill()
    for worker in workers:
        worker.join(timeout=10)


def _is_loader_worker(process) -> bool:
    return getattr(getattr(process, "_target", None), "__name__", "") == "_worker_loop"
