"""Stop on a scheduler's signal without losing work: finish the batch, save a checkpoint, exit 5.

Slurm ends a job with SIGTERM (preemption, ``scancel``, the time limit; SIGKILL follows after KillWait) and
can warn a job ahead of its limit (``--signal=USR1@SECONDS``; multi-node/launch.sbatch forwards it to every
rank). Either signal on any rank only sets a flag here: Python runs the handler between bytecodes of the main
thread, so nothing is cut mid-step, and a second signal during the save just sets the flag again. At the end
of every batch the ranks agree (one all-reduce of one number, MAX) whether any of them was signalled; if so,
every rank stops after that same batch through Composer's ``state.stop_training()``: the checkpoint saver,
which runs after this callback on BATCH_CHECKPOINT, then saves as at the end of any run (the same atomic
save as always), the run ends through FIT_END (benchmark.py writes its results line for what it measured),
and ``fit`` raises ``Stopped`` (exit 5). No rank exits before the checkpoint is whole (and, for a remote
save_folder, uploaded): diffusion.cli.run waits for every rank at a barrier after the Trainer's close first.

Why by hand: Composer's own handler (composer/core/engine.py) turns SIGTERM into an immediate exit 143 and
it has none for SIGUSR1 (single-node/run.sh makes its launcher ignore that one); and the ranks must stop at
the same batch or the save's collectives would hang. This callback's handlers replace Composer's in the
ranks from the Trainer's INIT event on. Composer's launcher, on SIGTERM, passes it on and waits up to 30 s
for its ranks; Slurm's KillWait (default 30 s) bounds the time for the batch and the save after SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption(Callback):
    def __init__(self, signals=SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None  # the first signal this rank got
        self.stopped_by: str | None = None  # set on every rank once the ranks agreed to stop
        self.stopped_at: int | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def init(self, state: State, logger: Logger) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python takes signal handlers in the main thread only (a Trainer built elsewhere keeps defaults)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.stopped_by is not None:
            return
        flag = torch.tensor([self.received or 0], dtype=torch.int32)
        if dist.get_world_size() > 1:
            flag = state.device.tensor_to_device(flag)
            dist.all_reduce(flag, reduce_operation="MAX")
        signum = int(flag.item())
        if not signum:
            return
        self.stopped_by, self.stopped_at = signal.Signals(signum).name, state.timestamp.batch.value
        if dist.get_global_rank() == 0:
            print(
                f"preemption: {self.stopped_by} received; every rank stops after batch {self.stopped_at}"
                + (" and saves a checkpoint" if _saver(state) else ""),
                file=sys.stderr,
                flush=True,
            )
        state.stop_training()

    def close(self, state: State, logger: Logger) -> None:
        for sig, previous in self._previous.items():
            # Stopping anyway: a repeated signal until exit (Python's teardown puts back the default action of
            # any handler of its own) must not turn exit 5 into a kill; SIGKILL still ends a process that hangs.
            signal.signal(sig, signal.SIG_IGN if self.stopped_by is not None else previous)
        self._previous = {}

    def summary(self, state: State) -> str:
        """One line for the log: what stopped the run, where, and what was saved."""
        saver = _saver(state)
        saved = getattr(saver, "saved_checkpoints", None) or [  # local files, or objects in the bucket
            f"{saver.url.rstrip('/')}/{name.rsplit('/', 1)[-1]}" for name in getattr(saver, "uploaded", [])
        ]
        if saver is None:
            where = "nothing to save (no save_folder)"
        elif saved and getattr(saver, "last_checkpoint_batch", None) == state.timestamp.batch:
            # sharded (FSDP): the saver lists this rank's shard file; the checkpoint is the folder of every rank's
            last = os.path.dirname(saved[-1]) if state.fsdp_sharded_state_dict_enabled else saved[-1]
            uploader = getattr(saver, "remote_uploader", None)  # Composer's saver to object storage (sharded)
            if uploader is not None:
                last = f"{uploader.remote_folder.rstrip('/')}/{os.path.basename(last)}"
            where = f"the checkpoint {last} is whole; run the same command to resume from it"
        elif getattr(saver, "last_checkpoint_batch", None) == state.timestamp.batch:
            where = "rank 0 saved its checkpoint; run the same command to resume from it"
        else:
            where = "no checkpoint was saved"
        return f"stopped by {self.stopped_by} after batch {self.stopped_at}: {where}"


def _saver(state: State):
    from composer.callbacks import CheckpointSaver

    return next((cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)), None)
