"""Checkpoints in object storage (``save_folder=s3://bucket/run``; ``load_path``, generate.py, export.py and
evaluate.py given an s3:// checkpoint), with the guarantees checkpoints.py gives local folders.

The layout is Composer's own, so its autoresume and ``load_path`` read it: ``run/ep0-ba4-rank0.pt`` objects
and the pointer ``run/latest-rank0.pt.symlink``, a small object holding the name of the checkpoint object
(Composer's "symlink file"). What is added, and why Composer's own remote saver is not used as it is:

* **The pointer moves last, and only onto a whole object.** ``RemoteCheckpointSaver`` writes the checkpoint
  into local scratch, uploads it (an S3 PUT is atomic: the object appears whole or not at all), reads its
  size back, and only then uploads the pointer. A kill or a store that goes down at any moment leaves the
  pointer on the previous whole checkpoint. Composer 0.32.1 also uploads the pointer after the checkpoint,
  but from pools of spawned processes that poll every 30 s, and it raises the upload's raw exception at a
  later batch; here an upload that still fails after OBJECT_STORE_RETRY_SECONDS (default 120) of retries
  (a store restarting) stops the run with one line saying what the bucket still holds. The price: a save
  waits for its upload (seconds per GB) instead of overlapping the next batches.
* **Local scratch is cleaned.** Each checkpoint file is removed once uploaded; the scratch folder (one
  per process, under the temp dir) is removed at exit. Composer's saver keeps every file in a ``mkdtemp()``
  folder it never removes.
* **Resuming checks first** (``remote_resume_point``, rank 0, before the Trainer is built): the checkpoint
  the pointer names, then the others newest first, are downloaded into scratch and checked as local ones
  are (``checkpoints.check_checkpoint``); a missing or cut object is skipped in one line, the pointer is
  moved onto the first whole one, and that downloaded file is what Composer's autoresume loads (found in
  the saver's local folder: no second download on this node; other nodes download it through the pointer).

``save_num_checkpoints_to_keep`` rotates the objects the run uploaded (s3://; Composer rotates only its
local copies). Sharded (FSDP) checkpoints in object storage still go through Composer's own saver and
autoresume (``checkpoint_folder.checkpoint_saver`` hands them over). This module builds on checkpoints.py;
checkpoint_folder.py picks between the two.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from typing import Optional

from composer.callbacks import CheckpointSaver
from composer.utils import checkpoint, create_symlink_file, dist

from diffusion import object_store
from diffusion.checkpoints import _CANDIDATE, FILENAME, LATEST, check_checkpoint, point_latest
from diffusion.errors import UsageError
from diffusion.unpickling import load_checkpoint_file

POINTER = ".symlink"  # Composer's suffix of the object that plays the part of the 'latest' link
_scratch: dict[str, str] = {}


def scratch(url: str) -> str:
    """This process's local folder for checkpoints of ``url`` on their way up or down; removed at exit."""
    if url not in _scratch:
        _scratch[url] = tempfile.mkdtemp(prefix="diffusion-checkpoints-")
        atexit.register(shutil.rmtree, _scratch[url], True)
    return _scratch[url]


def _names(url: str) -> tuple[str, str]:
    """(bucket URL, the run's key prefix) of ``s3://bucket/run``."""
    scheme, bucket, key = object_store.split(url)
    return f"{scheme}://{bucket}", key.strip("/")


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _failed(error: BaseException, url: str) -> UsageError:
    return UsageError(f"save_folder {url}: {object_store.problem(error, url)}")


def read_pointer(url: str, latest: str = LATEST.format(rank=0)) -> Optional[str]:
    """The object name (from the bucket root) the pointer of the run at ``url`` holds, or None."""
    root, prefix = _names(url)
    local = os.path.join(scratch(url), latest + POINTER)
    try:
        object_store.download(f"{root}/{_key(prefix, latest)}{POINTER}", local)
    except Exception as e:  # noqa: BLE001
        if object_store.is_missing(e):
            return None
        raise _failed(e, url) from None
    with open(local) as f:
        target = f.read().strip()
    os.remove(local)
    return target


def write_pointer(url: str, target: str, latest: str = LATEST.format(rank=0)) -> None:
    """Point the run's pointer at the object ``target`` (a name from the bucket root): one PUT."""
    root, prefix = _names(url)
    local = os.path.join(scratch(url), latest + POINTER)
    if os.path.exists(local):
        os.remove(local)
    create_symlink_file(target, local)
    object_store.upload(local, f"{root}/{_key(prefix, latest)}{POINTER}")
    os.remove(local)


def remote_resume_point(url: str, trust: bool = False, latest: str = LATEST.format(rank=0)) -> Optional[str]:
    """``checkpoints.resume_point`` for a save folder in object storage: the local copy of the checkpoint to
    resume from, linked as ``scratch(url)/latest`` where the saver's folder is (None: nothing to resume).
    Global rank 0 only. Raises UsageError when checkpoints exist and none is whole, or the store fails."""
    if dist.get_global_rank() != 0:
        return None
    root, prefix = _names(url)
    try:
        objects = object_store.retrying(lambda: object_store.sizes(url), f"list {url}")
    except Exception as e:  # noqa: BLE001
        raise _failed(e, url) from None
    found = [(int(m[2]), int(m[1]), name) for name in objects if (m := _CANDIDATE.match(name)) and "/" not in name]
    newest_first = [name for *_, name in sorted(found, reverse=True) if name.endswith(".pt")]
    named = read_pointer(url, latest)
    pointed = named[len(prefix) + 1 :] if named and prefix and named.startswith(prefix + "/") else named
    if pointed and not pointed.endswith(".pt"):
        return None  # a sharded (FSDP) checkpoint folder: Composer's own autoresume reads those
    candidates = ([pointed] if pointed else []) + [n for n in newest_first if n != pointed]
    folder, skipped = scratch(url), []
    for name in candidates:
        local = os.path.join(folder, name)
        try:
            object_store.download(f"{root}/{_key(prefix, name)}", local)
            why = check_checkpoint(local, trust)
        except Exception as e:  # noqa: BLE001
            if not object_store.is_missing(e):
                raise _failed(e, url) from None
            why = "cannot be read (no such object)"
        if why is None:
            for bad, reason in skipped:
                print(f"autoresume: skipped {url}/{bad}: {reason}; resuming from {url}/{name}", file=sys.stderr)
            if name != pointed:
                write_pointer(url, _key(prefix, name), latest)
            point_latest(os.path.join(folder, latest), local)
            return local
        skipped.append((name, why))
        if os.path.exists(local):
            os.remove(local)
    if skipped:
        newest, why = skipped[0]
        raise UsageError(
            f"autoresume: no checkpoint in {url} loads ({len(skipped)} tried; newest {newest}: {why}); move them "
            "aside to start over, or set load_path to a good checkpoint"
        )
    return None


def fetch(url: str, folder: str, what: str) -> str:
    """The checkpoint object ``url`` downloaded into ``folder`` (its local path), or a one-line UsageError."""
    local = os.path.join(folder, os.path.basename(url.rstrip("/")) or "checkpoint.pt")
    object_store.check(url, what)
    try:
        return object_store.download(url, local)
    except Exception as e:  # noqa: BLE001
        if object_store.is_missing(e):
            raise UsageError(f"{what} {url} does not exist; pass a checkpoint object (e.g. s3://BUCKET/RUN/ep0-ba100-rank0.pt)") from None  # fmt: skip
        raise UsageError(f"{what} {url}: {object_store.problem(e, url)}") from None


def check_remote_checkpoint(url: str, what: str, trust: bool = False) -> None:
    """The checkpoint object ``url`` (``load_path``) downloaded and checked as a local one is, on global
    rank 0, before the model is built: one line for a missing, cut or hostile object, not Composer's
    traceback after the build. (Composer then downloads it again to load it.)"""
    if dist.get_global_rank() != 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = fetch(url, tmp, what)
        try:
            load_checkpoint_file(local, what, trust, mmap=True)
        except UsageError as e:
            raise UsageError(str(e).replace(local, url)) from None


def _exists(url: str) -> bool:
    try:
        object_store.retrying(lambda: object_store.store(url).get_object_size(object_store.split(url)[2]), url)
    except Exception as e:  # noqa: BLE001
        if object_store.is_missing(e):
            return False
        raise
    return True


class RemoteCheckpointSaver(CheckpointSaver):
    """Composer's ``CheckpointSaver`` for a save folder in object storage whose pointer moves only onto a
    whole object and whose local scratch is cleaned (see the module docstring)."""

    def __init__(self, url: str, save_interval: str, keep: int, overwrite: bool):
        _, prefix = _names(url)
        super().__init__(
            folder=url,
            filename=FILENAME,
            remote_file_name=_key(prefix, FILENAME),
            latest_filename=LATEST,
            latest_remote_file_name=_key(prefix, LATEST),
            save_interval=save_interval,
            num_checkpoints_to_keep=keep,
            overwrite=overwrite,
        )
        composer_scratch = self.folder[: -len(prefix)] if prefix else self.folder  # a mkdtemp() left empty
        shutil.rmtree(composer_scratch, ignore_errors=True)
        self.url = url
        self.folder = self.filename.folder = self.latest_filename.folder = scratch(url)
        self.uploaded: list[str] = []  # object names, oldest first

    def _save_checkpoint(self, state, logger):
        if state.fsdp_sharded_state_dict_enabled:
            return super()._save_checkpoint(state, logger)
        self.last_checkpoint_batch = state.timestamp.batch
        local = checkpoint.get_save_filename(state, self.filename.format(state, keep_placeholders=True))
        self.all_saved_checkpoints_to_timestamp[local] = state.timestamp
        written = checkpoint.save_checkpoint(state, local, weights_only=self.weights_only, ignore_keys=self.ignore_keys)
        if not written:  # only rank 0 writes a monolithic checkpoint
            return
        root, _ = _names(self.url)
        name = self.remote_file_name.format(state).lstrip("/")
        if not self.overwrite and _exists(f"{root}/{name}"):
            os.remove(written)
            raise UsageError(
                f"save_folder {self.url} already holds {os.path.basename(name)} (another run's?); set autoresume=true "
                "to continue that run, or save to a new folder"
            )
        try:
            object_store.upload(written, f"{root}/{name}")
            write_pointer(self.url, name, os.path.basename(self.latest_filename.format(state)))
        except Exception as e:  # noqa: BLE001
            kept = (
                f"the pointer still names {self.uploaded[-1]}, whole"
                if self.uploaded
                else "the pointer was not moved (it names the checkpoint this run resumed from, if any)"
            )
            raise UsageError(
                f"could not upload checkpoint {os.path.basename(name)} to {self.url}: "
                f"{object_store.problem(e, self.url)}; {kept}. Run the same command once the store answers to resume"
            ) from None
        finally:
            if os.path.exists(written):
                os.remove(written)
        self.uploaded.append(name)
        self._rotate_uploaded(root)

    def _rotate_uploaded(self, root: str) -> None:
        """Keep the newest ``save_num_checkpoints_to_keep`` checkpoint objects this run uploaded (the pointer
        names the newest); older ones are deleted (s3:// only; a failed delete is a warning)."""
        while 0 < self.num_checkpoints_to_keep < len(self.uploaded):
            old = f"{root}/{self.uploaded.pop(0)}"
            try:
                object_store.delete(old)
            except Exception as e:  # noqa: BLE001 - a checkpoint left behind costs storage, not the run
                print(f"checkpoint: could not delete {old}: {object_store.problem(e, old)}", file=sys.stderr)
