"""save_overwrite: the checkpoints a previous run left in the save folder are deleted once this run has saved a
whole one of its own, never before (a run stopped before its first save leaves them as they were).

``checkpointing.folder.check_unused`` dropped ``latest`` when this run started, so the first time ``latest`` names a
checkpoint again, this run's saver wrote it, whole (the link moves, and the pointer object is uploaded, only
after the checkpoint is complete). The previous run's checkpoints this run has not written over are then
deleted, on global rank 0. Checked after each save (this callback comes after the saver), at the end of the fit
and at close, where Composer's uploader of sharded folders has finished.
"""

from __future__ import annotations

import os
import sys

from composer.callbacks import CheckpointSaver
from composer.core import Callback
from composer.utils import dist

from diffusion.checkpointing.folder import checkpoints_in, delete_checkpoint, pointed
from diffusion.checkpointing.local import newest_first


def saved_names(state) -> set[str]:
    """The names of the checkpoints this run's savers have written or begun to write (files, sharded folders)."""
    names = set()
    for cb in state.callbacks:
        if isinstance(cb, CheckpointSaver):
            for path in cb.all_saved_checkpoints_to_timestamp:
                names |= set(newest_first(str(path).split(os.sep)))  # its checkpoint-named parts
    return names


class PreviousRunDeleted(Callback):
    def __init__(self, save_folder: str):
        self.save_folder = save_folder
        self.previous = checkpoints_in(save_folder) if dist.get_global_rank() == 0 else []
        self._state = None

    def init(self, state, logger):
        self._state = state  # for post_close, which gets none

    def _delete_once_saved(self, state) -> None:
        if not self.previous or pointed(self.save_folder) is None:
            return
        mine = saved_names(state)
        gone = [name for name in self.previous if name not in mine]
        for name in gone:
            delete_checkpoint(self.save_folder, name)
        self.previous = []
        if gone:
            print(
                f"save_overwrite: this run's first checkpoint is whole; deleted the previous run's {len(gone)} "
                f"({', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''}) from {self.save_folder}",
                file=sys.stderr,
                flush=True,
            )

    def batch_checkpoint(self, state, logger):
        self._delete_once_saved(state)

    def epoch_checkpoint(self, state, logger):
        self._delete_once_saved(state)

    def fit_end(self, state, logger):
        self._delete_once_saved(state)

    def post_close(self):
        if self._state is not None:
            self._delete_once_saved(self._state)
