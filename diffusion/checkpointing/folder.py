"""A run's save folder, local or in object storage: the one place that picks local.py (a local folder: atomic saves,
torn files skipped on resume) or remote.py (s3:// and the like: the pointer moves last), so checkpoint reading and
writing import one way: this module -> remote.py -> local.py."""

from __future__ import annotations

import os
import sys
from typing import Optional

from composer.callbacks import CheckpointSaver
from composer.utils import dist

from diffusion import object_store
from diffusion.checkpointing import local
from diffusion.checkpointing.remote import (
    RemoteCheckpointSaver,
    checkpoints_at,
    delete_checkpoint_at,
    drop_pointer,
    read_pointer,
    remote_resume_point,
    uploads_in_threads,
)
from diffusion.errors import UsageError, spell


def resume_point(save_folder: str, trust: bool = False, unshard: bool = False) -> Optional[str]:
    """The checkpoint autoresume loads from ``save_folder``, checked first, with ``latest`` pointed at it (None:
    nothing to resume); global rank 0 only. ``trust``: the trust_checkpoint key; ``unshard``: a run without FSDP
    (a local sharded folder is converted to a file: local.unsharded)."""
    if object_store.is_remote(save_folder):
        return remote_resume_point(save_folder, trust)
    return local.local_resume_point(save_folder, trust, unshard=unshard)


def checkpoint_saver(
    save_folder: Optional[str], save_interval: str, keep: int, overwrite: bool, sharded: bool = False
) -> Optional[CheckpointSaver]:
    """The saver for ``save_folder`` (named as the Trainer would name its own): atomic saves in a local
    folder, pointer-last uploads to object storage; None for no folder, and for ``sharded`` (FSDP)
    checkpoints in object storage (Composer's own saver and autoresume handle those)."""
    if not save_folder:
        return None
    if object_store.is_remote(save_folder):
        uploads_in_threads()  # Composer's uploader (built by either saver): threads, no processes
        if sharded:  # Composer's saver uploads them
            return None
        return RemoteCheckpointSaver(save_folder, save_interval, keep, overwrite)
    return local.local_saver(save_folder, save_interval, keep, overwrite)


def checkpoints_in(save_folder: str) -> list[str]:
    """The names of the checkpoints in ``save_folder`` (files, sharded folders), newest first."""
    if object_store.is_remote(save_folder):
        return checkpoints_at(save_folder)
    return local.checkpoints_in(save_folder)


def pointed(save_folder: str) -> Optional[str]:
    """The name of the checkpoint ``latest`` names in ``save_folder`` (its link, or its pointer object), or None."""
    if object_store.is_remote(save_folder):
        target = read_pointer(save_folder)
        return target.rstrip("/").rsplit("/", 1)[-1] if target else None
    link = os.path.join(save_folder, local.LATEST.format(rank=0))
    return os.path.basename(os.path.normpath(os.readlink(link))) if os.path.islink(link) else None


def delete_checkpoint(save_folder: str, name: str) -> None:
    """Delete the checkpoint ``name`` (a file or a sharded folder) from ``save_folder``."""
    if object_store.is_remote(save_folder):
        delete_checkpoint_at(save_folder, name)
    else:
        local.delete_checkpoint(save_folder, name)


def check_unused(save_folder: Optional[str], autoresume: bool, overwrite: bool) -> None:
    """Before any work: a ``save_folder`` that holds a run's checkpoints is refused in one line unless the run
    continues it (autoresume) or starts over there (``overwrite``: the save_overwrite key). Starting over, the
    checkpoints stay until this run has saved a whole one (callbacks/previous_run.py deletes them then); only
    ``latest`` is dropped now, so that nothing names the old run's checkpoints as this run's. A second run on
    a used folder otherwise began at batch 0 and wrote over the first one's checkpoints (sharded ones without
    a word, files with Composer's traceback). Global rank 0 only, as it holds the folder's lock (the launcher ends
    the other ranks when it stops, and reports its exit 2)."""
    if not save_folder or autoresume or dist.get_global_rank() != 0:
        return
    found = checkpoints_in(save_folder)
    if not found:
        return
    held = f"{found[0]}{f' and {len(found) - 1} older' if len(found) > 1 else ''}"
    if not overwrite:
        raise UsageError(
            f"{spell('save_folder')} {save_folder} already holds a run's checkpoints (newest {held}); to continue "
            f"that run set {spell('autoresume', 'true')}, to start over there set {spell('save_overwrite', 'true')} "
            "(they are deleted once this run has saved a whole checkpoint), or give another save_folder"
        )
    if object_store.is_remote(save_folder):
        drop_pointer(save_folder)
    else:
        link = os.path.join(save_folder, local.LATEST.format(rank=0))
        if os.path.islink(link):
            os.remove(link)
    print(
        f"save_overwrite: {save_folder} holds another run's checkpoints (newest {held}); this run starts at batch 0 "
        "and deletes them once it has saved a whole checkpoint",
        file=sys.stderr,
        flush=True,
    )


# What makes a run the run it is: resuming its checkpoint with another of these continues something else.
# (max_duration, lr, intervals, fsdp, the number of ranks, logging and the like may change on a resume.)
RUN_DEFINING = (
    "model_name",
    "batch_size",
    "image_size",
    "objective",
    "prediction_type",
    "use_synth_data",
    "remote",
    "local",
    "precomputed_latents",
    "lora_rank",
    "optimizer",
)


def settings_changed(checkpoint: str, now: dict, trust: bool = False) -> list[tuple[str, object, object]]:
    """(key, the value of the run that saved ``checkpoint``, the value in ``now``) for each RUN_DEFINING setting
    that differs; [] for a checkpoint that keeps no settings. ``local`` counts only without ``remote`` (then it is
    the dataset; with one, a cache)."""
    saved = local.run_config(checkpoint, trust)
    if not saved:
        return []
    keys = [k for k in RUN_DEFINING if k in saved and k in now and not (k == "local" and now.get("remote"))]
    return [(k, saved[k], now[k]) for k in keys if saved[k] != now[k]]
