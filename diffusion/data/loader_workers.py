"""Loader workers that a scheduler's stop signal does not end; their own rank still does.

Slurm signals every process of a step: scancel, a preemption and the time limit send SIGTERM to each (the loader
workers too), and ``--signal=USR1@N`` without ``B:`` sends SIGUSR1 to each. A worker's default action for both is
to die, and torch's SIGCHLD check in the rank then raised "DataLoader worker (pid N) is killed by signal:
Terminated" from wherever the rank was: in the middle of the checkpoint that callbacks/preemption.py had stopped
to save. The rank alone decides when to stop; its workers must live until it has.

Yet a worker must still die of a SIGTERM from its rank: torch's loader ends a worker that does not stop in time
with ``terminate()``, and at the rank's exit multiprocessing terminates its daemon processes (persistent workers
are) and then joins them. The two earlier tries (2026-11-28) made workers ignore SIGTERM, the second with an exit
hook that SIGKILLed them first, and a 2-rank FSDP benchmark with workers hung at its exit every time (py-spy,
2026-12-01, 4 runs: both ranks in multiprocessing's ``_exit_function``, joining the eval loader's 8 persistent
workers, which Composer's close never shuts, only the training loader's; the hook had matched none of them, as
CPython drops a started Process's ``_target`` in the parent, and it looked for ``_worker_loop`` there). So a worker
here tells the two apart by the sender, which only ``sigwaitinfo`` gives Python (``si_pid``): ``filter_stop_signals``
(the loaders' ``worker_init_fn``) blocks both signals in the worker and starts a daemon thread that waits for them.
SIGTERM from the worker's parent (its rank) ends it as the default action does (killed by SIGTERM, as
multiprocessing and torch expect); any other SIGTERM or SIGUSR1 is dropped. Nothing changes at the rank's exit,
and a worker still ends with its rank (torch's watchdog in each worker), or by SIGKILL (Slurm's after KillWait).
"""

from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def filter_stop_signals(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: this worker dies of its rank's SIGTERM only; a scheduler's stop signals,
    sent to every process of the job, are left to the rank."""
    # A forked worker inherits its rank's Python handlers (Composer's sys.exit(143), the preemption flag): not here.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # threads started after this inherit the mask
    threading.Thread(target=_wait_for_stop_signals, args=(os.getppid(),), name="stop-signals", daemon=True).start()


def _wait_for_stop_signals(rank_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == rank_pid:
            # The default action, from the one thread that does not block it: the process ends killed by SIGTERM.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM,))
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
