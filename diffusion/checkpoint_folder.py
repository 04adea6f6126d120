"""A run's save folder, local or in object storage: the one place that picks checkpoints.py (a local folder:
atomic saves, torn files skipped on resume) or remote_checkpoints.py (s3:// and the like: the pointer moves
last), so checkpoint reading and writing import one way: this module -> remote_checkpoints -> checkpoints."""

from __future__ import annotations

from typing import Optional

from composer.callbacks import CheckpointSaver

from diffusion import checkpoints, object_store
from diffusion.remote_checkpoints import RemoteCheckpointSaver, remote_resume_point, uploads_in_threads


def resume_point(save_folder: str, trust: bool = False, unshard: bool = False) -> Optional[str]:
    """The checkpoint autoresume loads from ``save_folder``, checked first, with ``latest`` pointed at it (None:
    nothing to resume); global rank 0 only. ``trust``: the trust_checkpoint key; ``unshard``: a run without FSDP
    (a local sharded folder is converted to a file: checkpoints.unsharded)."""
    if object_store.is_remote(save_folder):
        return remote_resume_point(save_folder, trust)
    return checkpoints.resume_point(save_folder, trust, unshard=unshard)


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
    return checkpoints.local_saver(save_folder, save_interval, keep, overwrite)
