"""``composer -n N script.py ...`` (this package installs its script of that name, over mosaicml's) and ``python -m
diffusion.launch -n N script.py ...``: Composer's launcher (the same arguments), with a stop that reads as a stop.

SIGTERM (``scancel``, a preemption, ``docker stop``, ``kill``) or Ctrl-C to ``composer -n 2 train.py ...`` does the
right thing in the ranks: each finishes its batch, saves a whole checkpoint, says how to resume and exits 5
(callbacks/preemption.py). Composer 0.32.1's launcher then made that look like a crash: its process imports
``composer.core.engine``, whose handler turns SIGTERM into ``SystemExit(143)`` wherever the launcher is (its
monitoring loop), and its bare ``except`` prints that as a traceback before it passes SIGTERM on; then it reports
each rank's exit 5 as "Rank 0 crashed" and dumps every rank's whole output. Composer is frozen upstream, so
this module is the one place that mends it, by wrapping three of the launcher's own functions and leaving the
rest (arguments, the ranks' environment and output files, what happens when a rank fails) as Composer has it:

* SIGTERM is passed on to every rank still running, once, with one line, and the launcher waits for its ranks to
  save and stop, however long the save takes (Composer's launcher SIGKILLed them after 30 s, and a second SIGTERM
  ended it at once, its ranks with it: a slow save was lost). A rank that hangs is bounded by dist_timeout, a
  scheduler's patience by its own SIGKILL (Slurm's KillWait). Ctrl-C (SIGINT, which the terminal sends to the ranks
  too) stays Composer's: an interrupt, without a checkpoint.
* Ranks that stopped on the signal with exit 5 are not reported as crashes; one line says the run stopped with
  its checkpoint saved and how to resume. A rank that failed otherwise is reported as Composer reports it.

single-node/run.sh (and so multi-node/launch.sbatch) launches with it, and so does ``composer`` where this package is
installed after mosaicml (pyproject's ``[project.scripts]``; every install mode here installs it last). Where mosaicml's
own script is on the path (reinstalled over this one), ``composer -n N`` still runs, with Composer's messages.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from composer.cli import launcher

from diffusion.errors import Stopped


class _Stop:
    """What the launcher has seen: its ranks (Composer's dict, filled as it starts them) and the stop signal."""

    def __init__(self):
        self.processes: dict = {}
        self.signal: int | None = None

    def on_signal(self, signum, frame) -> None:
        running = [p for p in self.processes.values() if p.poll() is None]
        if self.signal is not None:  # a second one (a second scancel, the batch script's trap): already passed on
            return
        self.signal = signum
        launcher.log.setLevel(logging.CRITICAL)  # its "Rank 0 crashed with exit code 5": said here instead
        print(
            f"launch: {signal.Signals(signum).name}: passed to the {len(running)} running ranks; each finishes its "
            "batch and saves a checkpoint before it stops; waiting for them",
            file=sys.stderr,
            flush=True,
        )
        for process in running:
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:
                pass

    def stopped(self, process) -> bool:
        """Whether ``process`` is a rank that ended as the stop asked: it saved and exited with Stopped's code, or
        it had not begun training (no checkpoint to save: Composer's handler in the rank, exit 128 + SIGTERM)."""
        ended = (Stopped.exit_code, 128 + signal.SIGTERM, -signal.SIGTERM)
        return self.signal is not None and process.returncode in ended


def main(argv: list[str] | None = None) -> int:
    stop = _Stop()
    launch, report, total = (
        launcher._launch_processes,
        launcher._print_process_exit_status,
        launcher._aggregate_process_returncode,
    )

    def launch_processes(*args, **kwargs):
        stop.processes = kwargs["processes"]  # Composer's own dict, filled as each rank starts
        return launch(*args, **kwargs)

    def print_exit_status(global_rank, process):
        if not stop.stopped(process):
            report(global_rank, process)

    def aggregate(processes) -> int:
        if stop.signal is not None and all(stop.stopped(p) for p in processes.values()):
            saved = sum(p.returncode == Stopped.exit_code for p in processes.values())
            said = (
                f"every rank saved the checkpoint of its last batch and exited {Stopped.exit_code}; run the same "
                "command with autoresume to go on"
                if saved == len(processes)
                else f"{len(processes) - saved} of {len(processes)} ranks had not begun training (nothing to save)"
            )
            print(f"launch: stopped on SIGTERM: {said}", file=sys.stderr, flush=True)
            return Stopped.exit_code if saved else 128 + signal.SIGTERM
        return total(processes)

    launcher._launch_processes = launch_processes
    launcher._print_process_exit_status = print_exit_status
    launcher._aggregate_process_returncode = aggregate
    monitor = launcher._monitor_processes

    def monitor_processes(processes):
        monitor(processes)
        if stop.signal is not None:  # every rank stops on its own: wait for them here, not as after a crash
            for process in processes.values():
                process.wait()

    launcher._monitor_processes = monitor_processes
    signal.signal(signal.SIGTERM, stop.on_signal)  # over composer.core.engine's: SystemExit in the monitoring loop
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    return launcher.main()


if __name__ == "__main__":
    sys.exit(main())
