"""Checkpoints in object storage (``save_folder=s3://bucket/run``; ``load_path``, generate.py, export.py and
evaluate.py given an s3:// checkpoint), with the guarantees checkpointing/local.py gives local folders.

The layout is Composer's own, so its autoresume and ``load_path`` read it: ``run/ep0-ba4-rank0.pt`` objects
and the pointer ``run/latest-rank0.pt.symlink``, a small object holding the name of the checkpoint object
(Composer's "symlink file"). What is added, and why Composer's own remote saver is not used as it is:

* **The pointer moves last, and only onto a whole object.** ``RemoteCheckpointSaver`` writes the checkpoint
  into local scratch, uploads it (an S3 PUT is atomic: the object appears whole or not at all), reads its
  size back, and only then uploads the pointer. A kill or a store that goes down at any moment leaves the
  pointer on the previous whole checkpoint. Composer 0.32.1 also uploads the pointer after the checkpoint,
  but from pools of spawned processes that poll every 30 s, and it raises the upload's raw exception at a
  later batch; here an upload that still fails after OBJECT_STORE_RETRY_SECONDS (default 120) of retries
  (a store restarting) stops every rank at the next batch end with one line saying what the bucket still
  holds.
* **Training goes on while a checkpoint uploads.** The file is written on the training thread (seconds per
  GB), then uploaded by a thread of global rank 0 during the next batches. One upload at a time: the next
  save, the run's end (a preemption stop's too) and the exit wait for the one under way.
* **Local scratch is cleaned.** Each checkpoint file is removed once uploaded; the scratch folder (one
  per process, under the temp dir) is removed at exit. Composer's saver keeps every file in a ``mkdtemp()``
  folder it never removes.
* **Resuming checks first** (``remote_resume_point``, rank 0, before the Trainer is built): the checkpoint
  the pointer names, then the others newest first, are downloaded into scratch and checked as local ones
  are (``checkpointing.local.check_checkpoint``); a missing or cut object is skipped in one line, the pointer is
  moved onto the first whole one, and that downloaded file is what Composer's autoresume loads (found in
  the saver's local folder: no second download on this node; other nodes download it through the pointer).

``save_num_checkpoints_to_keep`` rotates the objects the run uploaded (s3://; Composer rotates only its
local copies). Sharded (FSDP) checkpoints in object storage still go through Composer's own saver and
autoresume (``checkpointing.folder.checkpoint_saver`` hands them over). This module builds on checkpointing/local.py;
checkpointing/folder.py picks between the two.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
import types
from concurrent.futures import Future
from typing import Optional

import torch
from composer.callbacks import CheckpointSaver
from composer.utils import checkpoint, create_symlink_file, dist

from diffusion import object_store
from diffusion.checkpointing.local import (
    FILENAME,
    LATEST,
    PARTIAL,
    _check_sharded,
    check_checkpoint,
    newest_first,
    point_latest,
)
from diffusion.checkpointing.unpickling import load_checkpoint_file
from diffusion.errors import UsageError

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


def _newest_whole_sharded(url: str, objects: dict[str, int], trust: bool = False) -> Optional[str]:
    """The newest sharded (FSDP) checkpoint folder in ``url`` whose .metadata loads and names only shards that are
    there, whole (checkpointing.local._check_sharded on the listing); None if there is none. Composer's saver uploads the
    pointer to a sharded folder only after checking, every 30 s, that every rank's shard is up: a run killed
    before that leaves whole folders and no pointer, and without this its restart would begin again at batch 0
    over them."""
    for folder in _sharded_folders(objects):
        if _whole_sharded(url, folder, objects, trust):
            return folder
    return None


def _sharded_folders(objects: dict[str, int]) -> list[str]:
    """The sharded checkpoint folders among a listing's object names, newest first."""
    return newest_first({n.split("/")[0] for n in objects if n.count("/") == 1})


def _whole_sharded(url: str, folder: str, objects: dict[str, int], trust: bool = False) -> bool:
    return _sharded_problem(url, folder, objects, trust) is None


def _sharded_problem(url: str, folder: str, objects: dict[str, int], trust: bool = False) -> Optional[str]:
    """Why ``folder`` of the listing ``objects`` of ``url`` is not whole (None: whole): its .metadata must load
    (unpickled the way every checkpoint here is; ``trust``: the trust_checkpoint key) and name only shards that
    are there, whole (checkpointing.local._check_sharded on the listing)."""
    if f"{folder}/.metadata" not in objects:
        return "no .metadata (the save did not finish)"
    with tempfile.TemporaryDirectory() as copy:
        try:
            object_store.download(f"{url}/{folder}/.metadata", os.path.join(copy, ".metadata"))
        except Exception as e:  # noqa: BLE001
            if object_store.is_missing(e):
                return "no .metadata (the save did not finish)"
            raise _failed(e, url) from None
        shards = {n[len(folder) + 1 :]: size for n, size in objects.items() if n.startswith(folder + "/")}
        return _check_sharded(copy, shards, trust)


def _sharded_pointer_checked(url: str, pointed: str, objects: dict[str, int], latest: str, trust: bool) -> None:
    """The pointer names sharded folder ``pointed``: it is moved to the newest whole folder when that one is
    newer (a run killed between a folder's last shard and the pointer's move, which trails by a check) or when
    ``pointed`` is not whole (removed or damaged in the bucket: one line says so; Composer failed with its
    traceback) or holds a hostile .metadata (which Composer's load would have unpickled). No whole folder at
    all: one line, as for checkpoint files."""
    newest = _newest_whole_sharded(url, objects, trust)  # a whole pointed folder is never newer than this one
    if newest == pointed:
        return
    problem = _sharded_problem(url, pointed, objects, trust)
    foreign = problem is not None and problem.startswith(".metadata holds")
    if newest is None:
        which = f"whose {problem}" if foreign else "which is not whole"
        raise UsageError(
            f"autoresume: no checkpoint in {url} loads (the pointer names {pointed}, {which}, and no other sharded "
            "folder is); move them aside to start over, or set load_path to a good checkpoint"
        )
    if problem is not None:
        why = problem if foreign else "not whole in the bucket"
        print(f"autoresume: skipped {url}/{pointed}: {why}; resuming from {url}/{newest}", file=sys.stderr)
    write_pointer(url, _key(_names(url)[1], newest), latest)


def checkpoints_at(url: str) -> list[str]:
    """The checkpoints a run saved in the object-storage folder ``url`` (``.pt`` objects and sharded folders),
    newest first; a store that does not answer is one line."""
    try:
        objects = object_store.retrying(lambda: object_store.sizes(url), f"list {url}")
    except Exception as e:  # noqa: BLE001
        raise _failed(e, url) from None
    files = {n for n in objects if "/" not in n and n.endswith(".pt")}
    return newest_first(files | set(_sharded_folders(objects)))


def delete_checkpoint_at(url: str, name: str) -> None:
    """Delete the checkpoint ``name`` (an object, or every object of a sharded folder) under ``url``."""
    url = url.rstrip("/")
    if name.endswith(".pt"):
        object_store.delete(f"{url}/{name}")
        return
    for key in object_store.sizes(f"{url}/{name}"):
        object_store.delete(f"{url}/{name}/{key}")


def drop_pointer(url: str, latest: str = LATEST.format(rank=0)) -> None:
    """Delete the run's pointer object (nothing names a checkpoint until the next save moves it)."""
    root, prefix = _names(url)
    object_store.delete(f"{root}/{_key(prefix, latest)}{POINTER}")


def rotate_sharded(url: str, keep: int) -> list[str]:
    """``save_num_checkpoints_to_keep`` for sharded (FSDP) folders in object storage, which Composer's saver never
    deleted (it rotates only its local copies): the folder the pointer names stays with the ``keep`` - 1 newest
    whole folders before it; every older folder, whole or left unfinished by a killed run, is deleted; folders
    newer than the pointer (on their way up) are left. Returns the folders deleted."""
    url = url.rstrip("/")
    target = read_pointer(url)
    if keep < 1 or target is None:
        return []
    objects = object_store.sizes(url)
    folders = _sharded_folders(objects)
    pointed = target.rstrip("/").rsplit("/", 1)[-1]
    if pointed not in folders:
        return []
    kept, deleted = 1, []
    for folder in folders[folders.index(pointed) + 1 :]:
        if kept < keep and _whole_sharded(url, folder, objects):
            kept += 1
            continue
        for name in objects:
            if name.startswith(folder + "/"):
                object_store.delete(f"{url}/{name}")
        deleted.append(folder)
    return deleted


def remote_resume_point(url: str, trust: bool = False, latest: str = LATEST.format(rank=0)) -> Optional[str]:
    """``checkpointing.local.local_resume_point`` for a save folder in object storage: the local copy of the checkpoint to
    resume from, linked as ``scratch(url)/latest`` where the saver's folder is (None: nothing to resume).
    Global rank 0 only. Raises UsageError when checkpoints exist and none is whole, or the store fails."""
    if dist.get_global_rank() != 0:
        return None
    root, prefix = _names(url)
    try:
        objects = object_store.retrying(lambda: object_store.sizes(url), f"list {url}")
    except Exception as e:  # noqa: BLE001
        raise _failed(e, url) from None
    files = [name for name in newest_first(n for n in objects if "/" not in n) if name.endswith(".pt")]
    named = read_pointer(url, latest)
    pointed = named[len(prefix) + 1 :] if named and prefix and named.startswith(prefix + "/") else named
    if pointed and not pointed.endswith(".pt"):  # a sharded (FSDP) folder: Composer's own autoresume reads it
        _sharded_pointer_checked(url, pointed.rstrip("/").rsplit("/", 1)[-1], objects, latest, trust)
        return None
    if not pointed:
        sharded = _newest_whole_sharded(url, objects, trust)
        if sharded is not None and newest_first([sharded, *files[:1]])[0] == sharded:  # newer than any file
            write_pointer(url, _key(prefix, sharded), latest)  # what Composer's saver would have written
            return None
    candidates = ([pointed] if pointed else []) + [n for n in files if n != pointed]
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


class _UploadThreads:
    """The executor Composer's uploader gets instead of its pools of spawned processes: each job a daemon thread
    of the rank, at most ``max_workers`` running at once. Those processes were each a new Python importing
    Composer and torch (6 s of CPU on a 2-vCPU machine) started at the first save that needed them: a first
    save made for a scheduler's SIGTERM spent the launcher's 30 s grace starting them under load, and rank 0 was
    killed before its line (CI, 2026-11-27); the signal killed those still starting; and each rank held a
    Manager process and up to four workers. A thread starts at once, hears no signal, ends with its rank, and
    holds the exit only where Composer asks (``shutdown(wait=True)``: its ``wait_and_close``)."""

    def __init__(self, max_workers: int, mp_context=None):
        self._slots = threading.Semaphore(max_workers)
        self._jobs: list[tuple[Future, threading.Thread]] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()

        def job() -> None:
            with self._slots:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - the future carries it to whoever waits
                    future.set_exception(e)

        thread = threading.Thread(target=job, daemon=True, name="sharded checkpoint upload")
        self._jobs = [*(j for j in self._jobs if j[1].is_alive()), (future, thread)]  # the ended ones let go
        thread.start()
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        for future, thread in self._jobs:
            if cancel_futures:
                future.cancel()  # one not yet running never runs
            if wait:
                thread.join()
        self._jobs = [job for job in self._jobs if job[1].is_alive()]


def uploads_in_threads() -> None:
    """Composer 0.32.1's RemoteUploader (the saver of sharded checkpoints to object storage) uploads, and checks a
    folder whole before moving its pointer, in threads of the rank (``_UploadThreads``), its failure flag a
    threading.Event instead of a Manager's (every Composer saver to object storage builds one, this module's
    RemoteCheckpointSaver too, which never uploads through it: no Manager process per rank either). The one
    place this project reaches into that module;
    tests/test_preemption.py stops such a run with SIGTERM, tests/test_object_store_checkpoints.py takes the
    store away under it."""
    from composer.utils import remote_uploader

    threads = types.SimpleNamespace(Manager=lambda: types.SimpleNamespace(Event=threading.Event))
    remote_uploader.ProcessPoolExecutor = _UploadThreads
    remote_uploader.multiprocessing = types.SimpleNamespace(get_context=lambda method=None: threads)


def sharded_saver_fixes(callbacks) -> None:
    """Composer's saver of sharded checkpoints to object storage (its ``remote_uploader``), after the Trainer is
    built. Its pointer to a folder moves once every shard is up, checked every 30 s: a run stopped by SIGTERM then
    held its ranks past the launcher's 30 s grace (rank 0 killed, the stop line lost); every second instead (a
    listing of a few objects). A shard upload that failed (the store down past the uploader's 3 attempts) was a
    rank's traceback of botocore's: one line instead (``_upload_failures_reported``). Its local copies no longer
    fill the disk (``_local_copies_removed``)."""
    for cb in callbacks:
        if isinstance(cb, RemoteCheckpointSaver):  # this module's saver (monolithic checkpoints): uploads its own
            continue
        if isinstance(cb, CheckpointSaver) and getattr(cb, "remote_uploader", None) is not None:
            cb._symlink_upload_wait_before_next_try_in_seconds = 1.0
            _upload_failures_reported(cb.remote_uploader)
            keep, cb.num_checkpoints_to_keep = cb.num_checkpoints_to_keep, -1  # its local rotation: now ours
            _local_copies_removed(cb)
            _old_folders_deleted(cb, keep)
            _same_name_set_aside(cb)


def _old_folders_deleted(saver: CheckpointSaver, keep: int) -> None:
    """``rotate_sharded`` by global rank 0 after each save and at the run's end (once the last pointer is up),
    for save_num_checkpoints_to_keep >= 1. A store that fails it is one line: the folders stay, the run goes on."""
    url = saver.remote_uploader.remote_folder
    if keep < 1 or dist.get_global_rank() != 0:
        return

    def rotate() -> None:
        try:
            rotate_sharded(url, keep)
        except Exception as e:  # noqa: BLE001 - older folders left in the bucket never stop a run
            why = str(e).split(": ", 1)[-1] if isinstance(e, UsageError) else object_store.problem(e, url)
            print(
                f"save_num_checkpoints_to_keep={keep}: could not delete the older checkpoints in {url}: {why}; "
                "they stay",
                file=sys.stderr,
            )

    def after(call):
        def called(*args, **kwargs):
            call(*args, **kwargs)
            rotate()

        return called

    saver._save_checkpoint, saver.fit_end = after(saver._save_checkpoint), after(saver.fit_end)


def set_aside(url: str, name: str) -> bool:
    """Before a sharded save into the folder ``name`` of ``url``: what that folder holds leaves the name. A whole
    folder (an earlier run's, which save_overwrite starts over from) is copied within the store to a hidden name
    (``.partial-NAME``: never a checkpoint to resume from or rotate) and deleted, its .metadata first; a torn one (a
    killed save's) is deleted. Returns whether a whole folder was set aside. Composer's uploader writes a folder
    object by object, rank 0's .metadata among the first, so a save into a folder that held shards left the old
    shards under the new .metadata until each rank's were up: killed in between, a folder of the old shards whose
    names and sizes check out (the same model) passed as whole and loaded as neither run."""
    objects = object_store.sizes(url)
    aside = PARTIAL + name
    if any(n.startswith(aside + "/") for n in objects):  # a killed run's set-aside copy of the same name
        delete_checkpoint_at(url, aside)
    here = sorted((n for n in objects if n.startswith(name + "/")), key=lambda n: not n.endswith("/.metadata"))
    whole = bool(here) and _whole_sharded(url, name, objects)
    if whole:
        for n in here:
            object_store.copy(f"{url}/{n}", f"{url}/{aside}/{n[len(name) + 1 :]}")
    for n in here:  # .metadata first: a kill in between leaves a folder that is not whole, and skipped
        object_store.delete(f"{url}/{n}")
    return whole


def drop_set_aside(url: str, names: set[str]) -> set[str]:
    """The set-aside copies of ``names`` whose own folder is whole now are deleted; returns the names still
    waiting (their new folder not up yet)."""
    objects = object_store.sizes(url)
    waiting = set()
    for name in names:
        if not _whole_sharded(url, name, objects):
            waiting.add(name)
        elif any(n.startswith(PARTIAL + name + "/") for n in objects):
            delete_checkpoint_at(url, PARTIAL + name)
    return waiting


def _same_name_set_aside(saver: CheckpointSaver) -> None:
    """A sharded save to object storage into a folder name the bucket already holds (a save_overwrite run saving at
    the batch of an earlier run's folder) sets that folder aside first (``set_aside``, global rank 0, before any
    rank saves) and deletes the copy once the new folder is whole: after a later save, or at the fit's end once the
    uploads are done. As a local sharded save does (checkpointing/local.py, ``_save_sharded``)."""
    url = saver.remote_uploader.remote_folder.rstrip("/")
    if object_store.split(url)[0] != "s3":  # the store's delete and copy are s3:// only
        return
    save, end = saver._save_checkpoint, saver.fit_end
    pending: set[str] = set()

    def drop() -> None:
        if pending and dist.get_global_rank() == 0:
            pending.intersection_update(drop_set_aside(url, pending))

    def save_into_a_clear_name(state, logger):
        if dist.get_global_rank() == 0:
            path = checkpoint.get_save_filename(state, saver.filename.format(state, keep_placeholders=True))
            name = os.path.basename(os.path.dirname(path))
            try:
                aside = set_aside(url, name)
            except Exception:  # noqa: BLE001 - a store that fails here fails the uploads next: their one line says so
                aside = False
            if aside:
                pending.add(name)
                print(
                    f"checkpoint: {url}/{name} held an earlier run's whole checkpoint: set aside as {PARTIAL}{name} "
                    "until this run's is whole",
                    file=sys.stderr,
                    flush=True,
                )
        dist.barrier()  # no rank uploads into the name before it is clear
        save(state, logger)
        drop()

    def fit_end(state, logger):
        end(state, logger)
        drop()

    saver._save_checkpoint, saver.fit_end = save_into_a_clear_name, fit_end


def _local_copies_removed(saver: CheckpointSaver) -> None:
    """Composer's saver writes each rank's shard into a scratch folder of the rank's own (``mkdtemp()``), then its
    uploader copies it aside to upload it; the written copy stayed, every checkpoint of the run, in every rank's
    temp dir (save_num_checkpoints_to_keep rotates rank 0's only), and the folder stayed after the run: a long
    sharded run to object storage filled the nodes' disks. Each rank now removes its copy once the save has
    handed it to the uploader, and its scratch folder at exit. Nothing reads those copies: a resume reads the
    bucket."""
    save = saver._save_checkpoint
    scratch = os.path.abspath(saver.folder)

    def save_and_drop(state, logger):
        save(state, logger)
        for path in saver.saved_checkpoints:
            folder = os.path.dirname(os.path.abspath(path))
            if folder.startswith(scratch + os.sep):
                shutil.rmtree(folder, ignore_errors=True)
        del saver.saved_checkpoints[:-1]  # the newest stays named (a preemption stop's line names it)

    saver._save_checkpoint = save_and_drop
    root = _composer_scratch(saver.folder, saver.remote_uploader.remote_folder)
    if root is not None:
        atexit.register(shutil.rmtree, root, ignore_errors=True)


def _composer_scratch(folder: str, url: str) -> Optional[str]:
    """The ``mkdtemp()`` under which Composer's saver to ``url`` put its local ``folder`` (the bucket's path
    below it); None if ``folder`` is not below a folder of the temp dir (nothing of ours to remove)."""
    root = os.path.abspath(folder)
    for _ in [part for part in object_store.split(url)[2].split("/") if part]:
        root = os.path.dirname(root)
    return root if os.path.dirname(root) == os.path.abspath(tempfile.gettempdir()) else None


def _upload_failures_reported(uploader) -> None:
    """The uploader's calls that raise a failed upload's error in the rank (at a batch end, at a save, at the
    end) raise a one-line UsageError (exit 2) instead, saying what the store did and what is kept. The uploads
    not yet started are dropped; the check that a folder is whole stops on the failure flag those calls set."""
    url = uploader.remote_folder

    def reported(call):
        def checked():
            try:
                return call()
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - every way an upload fails becomes the run's one line
                for executor in (uploader.upload_executor, uploader.check_remote_files_exist_executor):
                    executor.shutdown(wait=False, cancel_futures=True)
                raise UsageError(
                    f"could not upload a shard of a sharded checkpoint to {url}: {object_store.problem(e, url)}; the "
                    "sharded checkpoints already whole there stay. Run the same command once the store answers to "
                    "resume from the newest of them"
                ) from None

        return checked

    for name in ("check_workers", "wait", "wait_and_close"):
        setattr(uploader, name, reported(getattr(uploader, name)))


class RemoteCheckpointSaver(CheckpointSaver):
    """Composer's ``CheckpointSaver`` for a save folder in object storage whose pointer moves only onto a
    whole object and whose local scratch is cleaned (see the module docstring).

    The upload runs in a thread of global rank 0 (the rank that writes a checkpoint file) while training goes
    on. Every rank knows an upload is under way (each one saved), so while one is, the ranks agree at each
    batch end (one all-reduce of one number, MAX: 0 uploading, 1 whole and pointed at, 2 failed) whether it
    ended; a failed one stops every rank at that same batch with one line (UsageError, exit 2). The next save,
    the run's end (FIT_END: the last checkpoint, a preemption stop's included) and the process's exit wait
    for it first."""

    background = True  # False: every save waits for its own upload (the way before; the benchmark's baseline)

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
        composer_scratch = _composer_scratch(self.folder, url)  # a mkdtemp() left empty
        if composer_scratch is not None:
            shutil.rmtree(composer_scratch, ignore_errors=True)
        self.url = url
        self.folder = self.filename.folder = self.latest_filename.folder = scratch(url)
        self.uploaded: list[str] = []  # object names, oldest first (rank 0: the ones it uploaded, whole)
        self.pending: Optional[int] = None  # every rank: the batch whose checkpoint is on its way up
        self._sending: Optional[tuple[threading.Thread, str]] = None  # rank 0: the upload thread, its object
        self._failure: Optional[str] = None  # rank 0: why that upload failed (the line to stop with)
        atexit.register(self._join)  # after scratch's rmtree is registered: runs before it

    def batch_checkpoint(self, state, logger):
        self._settle(state, wait=False)  # an upload that ended is taken in; a failed one stops every rank here
        super().batch_checkpoint(state, logger)

    def fit_end(self, state, logger):
        super().fit_end(state, logger)
        self._settle(state, wait=True)  # the last checkpoint whole and pointed at before the run ends

    def _save_checkpoint(self, state, logger):
        if state.fsdp_sharded_state_dict_enabled:
            return super()._save_checkpoint(state, logger)
        self._settle(state, wait=True)  # one upload at a time: the previous one whole, pointed at, its file gone
        self.last_checkpoint_batch = state.timestamp.batch
        local = checkpoint.get_save_filename(state, self.filename.format(state, keep_placeholders=True))
        self.all_saved_checkpoints_to_timestamp[local] = state.timestamp
        written = checkpoint.save_checkpoint(state, local, weights_only=self.weights_only, ignore_keys=self.ignore_keys)
        self.pending = state.timestamp.batch.value
        if not written:  # only rank 0 writes a monolithic checkpoint; the others only know it is on its way
            return
        root, _ = _names(self.url)
        name = self.remote_file_name.format(state).lstrip("/")
        if not self.overwrite and _exists(f"{root}/{name}"):
            os.remove(written)
            raise UsageError(
                f"save_folder {self.url} already holds {os.path.basename(name)} (another run's?); set autoresume=true "
                "to continue that run, save_overwrite=true to start over there, or save to a new folder"
            )
        latest = os.path.basename(self.latest_filename.format(state))
        keep = self.num_checkpoints_to_keep
        stale = [f"{root}/{old}" for old in (self.uploaded + [name])[:-keep]] if keep > 0 else []
        thread = threading.Thread(target=self._send, args=(written, name, latest, stale), name=f"upload {name}")
        self._failure, self._sending = None, (thread, name)
        thread.start()
        if not self.background:
            self._settle(state, wait=True)

    def _send(self, written: str, name: str, latest: str, stale: list[str]) -> None:
        """Rank 0's upload thread: the checkpoint object, its size checked, then the pointer; the local file
        removed; then the objects beyond save_num_checkpoints_to_keep deleted. A failure is kept for
        ``_settle`` to stop the run with."""
        root, _ = _names(self.url)
        whole = False  # the checkpoint object in the store, its size checked
        try:
            object_store.upload(written, f"{root}/{name}")
            whole = True
            write_pointer(self.url, name, latest)
        except Exception as e:  # noqa: BLE001 - every way of failing becomes the run's one line
            before = self.uploaded[-1] if self.uploaded else None
            # the pointer's write failed: the store may have taken it before its answer was lost, either name is whole
            if whole and before:
                kept = f"the pointer names {before} or {name}, both whole"
            elif whole:
                kept = f"the pointer names {name}, whole, or the checkpoint this run resumed from, if any"
            elif before:
                kept = f"the pointer still names {before}, whole"
            else:
                kept = "the pointer was not moved (it names the checkpoint this run resumed from, if any)"
            self._failure = (
                f"could not upload checkpoint {os.path.basename(name)} to {self.url}: "
                f"{object_store.problem(e, self.url)}; {kept}. Run the same command once the store answers to resume"
            )
            return
        finally:
            if os.path.exists(written):
                os.remove(written)
        for old in stale:  # the pointer has moved past them
            try:
                object_store.delete(old)
            except Exception as e:  # noqa: BLE001 - a checkpoint left behind costs storage, not the run
                print(f"checkpoint: could not delete {old}: {object_store.problem(e, old)}", file=sys.stderr)

    def _settle(self, state, wait: bool) -> None:
        """If a checkpoint is on its way up: whether its upload ended, agreed by every rank (``wait``: rank 0
        waits for it first). Ended whole: rank 0 counts it among ``uploaded``; failed: UsageError on every rank.
        A collective only while an upload is under way, and every rank knows when that is."""
        if self.pending is None:
            return
        status = 0  # 0 uploading, 1 whole and pointed at, 2 failed
        if self._sending is not None:
            thread, _ = self._sending
            if wait:
                thread.join()
            status = 0 if thread.is_alive() else 2 if self._failure else 1
        if dist.get_world_size() > 1:
            flag = state.device.tensor_to_device(torch.tensor([status], dtype=torch.int32))
            dist.all_reduce(flag, reduce_operation="MAX")
            status = int(flag.item())
        if status == 0:
            return
        batch, sending, self.pending, self._sending = self.pending, self._sending, None, None
        if status == 2:
            raise UsageError(
                self._failure
                or f"rank 0 could not upload the checkpoint of batch {batch} to {self.url} (its line says why); run "
                "the same command once the store answers to resume"
            )
        if sending is None:  # another rank than the one that uploads
            return
        self.uploaded.append(sending[1])
        if self.num_checkpoints_to_keep > 0:
            self.uploaded = self.uploaded[-self.num_checkpoints_to_keep :]

    def _join(self) -> None:
        """At exit (an error ended the run while a checkpoint uploaded): let that upload finish, so its local
        file is not removed under it and the pointer moves if it can."""
        if self._sending is not None:
            self._sending[0].join()
