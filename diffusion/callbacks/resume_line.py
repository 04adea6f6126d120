"""One line, before training, saying where a run with autoresume starts: from which checkpoint, at which
batch (and phase), saved when; or that the save folder holds none yet."""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.errors import spell
from diffusion.progress import total_batches


class ResumeLine(Callback):
    """Prints on global rank 0, once the Trainer has loaded what autoresume found (``Event.AFTER_LOAD``)::

        autoresume: resuming from ck/ep0-ba4-rank0.pt (batch 4 of 6, saved 2026-11-25 17:02 UTC)
        autoresume: no checkpoint in ck yet, starting from batch 0
        autoresume: resuming from ck/ep0-ba4 (batch 4 of 6, saved 2026-11-25 17:02 UTC); saved by 2 ranks, now 4: ...

    The same for a local folder, one in object storage and a sharded (FSDP) checkpoint folder: the name is the
    checkpoint Composer loaded, the batch the state it restored, and the save time the one each checkpoint
    keeps in this callback's state (file times would tell when a copy was downloaded; a checkpoint written
    before this callback existed has none, and the line leaves it out).

    ``phase`` (e.g. "phase 2 of 3") names a phase of a phased run; ``final``: this run ends where the whole run
    does. A phase that the checkpoint has already finished says nothing unless it is the final one (the
    phase that trains says where it starts). ``announce=False``: say nothing (a later phase after one trained
    in this process: a handover, not a resume)."""

    def __init__(
        self,
        save_folder: str,
        load_path: str | None,
        batch_size: int,
        phase: str | None = None,
        final: bool = True,
        announce: bool = True,
    ):
        self.save_folder, self.load_path, self.batch_size = save_folder, load_path, batch_size
        self.phase, self.final, self.announce = phase, final, announce
        self.saved: float | None = None  # when the checkpoint loaded was saved (seconds since the epoch)
        self.ranks: int | None = None  # the world size that saved it

    def state_dict(self) -> dict[str, Any]:
        return {"saved": time.time(), "ranks": dist.get_world_size()}  # called as the checkpoint is written

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state.get("saved")
        self.ranks = state.get("ranks")  # None: saved before this callback kept it

    def after_load(self, state: State, logger: Logger) -> None:
        end = state.max_duration
        done = end is not None and state.timestamp.get(end.unit) >= end
        if self.announce and (self.final or not done) and dist.get_global_rank() == 0:
            print(self.line(state), file=sys.stderr, flush=True)

    def line(self, state: State) -> str:
        batch = int(state.timestamp.batch)
        if state.load_path is None or state.load_path == self.load_path:  # autoresume found nothing
            start = f"{self.load_path} (batch {batch})" if self.load_path else f"batch {batch}"
            phase = f" ({self.phase})" if self.phase else ""
            return f"autoresume: no checkpoint in {self.save_folder} yet, starting from {start}{phase}"
        where = [self.phase] if self.phase else []
        total = total_batches(state, self.batch_size)
        where.append(f"batch {batch}" + (f" of {total}" if total else ""))
        if self.saved is not None:
            saved = datetime.datetime.fromtimestamp(self.saved, datetime.timezone.utc)
            where.append(f"saved {saved:%Y-%m-%d %H:%M} UTC")
        line = f"autoresume: resuming from {_loaded(state.load_path, self.save_folder)} ({', '.join(where)})"
        end = state.max_duration
        if self.final and end is not None and state.timestamp.get(end.unit) >= end:  # a rerun of a finished run
            line += f"; that run has finished: nothing to train (raise {spell('max_duration')} to train on)"
        world = dist.get_world_size()
        if self.ranks is not None and self.ranks != world:
            line += (
                f"; saved by {self.ranks} ranks, now {world}: the global batch of {self.batch_size} is kept "
                f"({self.batch_size // world} a rank) and so is the sample order, the noise drawn for each sample "
                "is not (docs/reliability.md)"
            )
        return line


def _loaded(path: str, save_folder: str) -> str:
    """The checkpoint Composer loaded, named in the save folder: Composer loads the ``latest`` link of a local
    folder (and of the local copy of one in object storage), a sharded folder or object by its own name."""
    name = os.path.basename(path.rstrip("/") if "://" in path else os.path.realpath(path))
    return f"{save_folder.rstrip('/')}/{name}"
