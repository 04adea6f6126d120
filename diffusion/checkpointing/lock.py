"""One run per save folder: a second run started on a folder that a live run writes is refused in one line.

Two runs on one save_folder write the same ``.partial-`` names, and a starting run's resume removes the other's
half-written save (checkpointing.local.local_resume_point): checkpoints are lost or torn without a word. So global rank 0
holds the folder's lock from before it looks at the folder until the run ends (``save_folder_lock``):

* **A local folder**: ``SAVE_FOLDER/.lock``, held with ``flock`` (NFSv4 and Lustre mounted with ``flock`` lock
  across nodes too). The kernel drops the lock when its process ends in any way, SIGKILL and a lost node's
  NFS lease included, so a killed run never blocks its restart. The file holds the holder's host, pid and
  start time, for the message. A run that ends removes it while still holding it, and a run that locks a
  file checks that it is still the one at the path (else it opens the new one), so removal never lets two in.
* **A folder in object storage** (s3://): the object ``RUN/.lock`` holds the holder's host, pid, a random
  token and a heartbeat count that a thread rewrites every HEARTBEAT_SECONDS. A lock whose holder runs on this
  host is stale once that pid is gone; one from another host once its heartbeat stands still for
  STALE_SECONDS (a restart after a kill on another node waits that long, once). S3 has no atomic
  create-if-absent in every store, so the lock is written, then read back after a moment: of two runs that
  start together, the one whose token is not there is refused.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager

from diffusion import object_store
from diffusion.errors import UsageError, spell
from diffusion.file_checks import check_output_folder

LOCK = ".lock"
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 3 * HEARTBEAT_SECONDS  # a heartbeat standing still this long: its run is gone
SETTLE_SECONDS = 1.0  # between writing the lock object and reading it back
_HELD: set[str] = set()  # the tokens of the remote locks this process holds now


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _holder(held: dict) -> str:
    return f"pid {held.get('pid', '?')} on host {held.get('host', '?')}, started {held.get('started', '?')}"


def _refused(folder: str, held: dict) -> UsageError:
    return UsageError(
        f"{spell('save_folder')} {folder} is in use by another run ({_holder(held)}): two runs on one folder overwrite each "
        "other's checkpoints; wait for that run to end (or stop it), or give this run another save_folder"
    )


@contextmanager
def save_folder_lock(folder: str | None):
    """Hold ``folder``'s lock (global rank 0; the other ranks follow rank 0) while the block runs; a UsageError
    when another live run holds it. Nothing for no folder."""
    from composer.utils import dist

    if not folder or dist.get_global_rank() != 0:
        yield
        return
    release = _lock_remote(folder) if "://" in folder else _lock_local(folder)
    try:
        yield
    finally:
        release()


def _lock_local(folder: str):
    check_output_folder(folder, spell("save_folder"))  # this lock is the first to touch the folder
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK)
    while True:  # until the file locked is the one at ``path`` (a run ending removes it; see release)
        fd = _flock(folder, path)
        if fd is None:
            return lambda: None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_me()).encode(), 0)

    def release():  # removed while still held, so that a finished run leaves its folder as it was
        import fcntl

        os.unlink(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    return release


def _flock(folder: str, path: str) -> int | None:
    """``path`` opened and locked (its descriptor); a UsageError when another process holds it; None (and a
    line) on a filesystem that cannot lock."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        held = _parse(os.pread(fd, 4096, 0))
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _refused(folder, held) from None
        print(f"save_folder {folder}: cannot be locked ({e.strerror}); make sure no other run uses it", flush=True)
        return None
    return fd


def _parse(raw: bytes) -> dict:
    try:
        held = json.loads(raw)
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # someone else's process, or a pid we cannot judge: assume alive
    return True


class _RemoteLock:
    """The lock object of the s3:// folder ``url`` (see the module docstring)."""

    def __init__(self, url: str):
        _, self.bucket, prefix = object_store.split(url)
        self.url, self.key = url, f"{prefix.strip('/')}/{LOCK}".lstrip("/")
        self.client = object_store._client(quick=False)
        self.mine = {**_me(), "token": uuid.uuid4().hex, "beat": 0}
        self.stop = threading.Event()

    def read(self) -> dict | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        except Exception as e:  # noqa: BLE001
            if object_store.is_missing(e):
                return None
            raise UsageError(f"save_folder {self.url}: {object_store.problem(e, self.url)}") from None
        return _parse(body)

    def write(self) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key, Body=json.dumps(self.mine).encode())

    def acquire(self) -> None:
        held = self.read()
        if held is not None and not self._gone(held):
            raise _refused(self.url, held)
        self.write()
        time.sleep(SETTLE_SECONDS)
        now = self.read() or {}
        if now.get("token") != self.mine["token"]:
            raise _refused(self.url, now)
        _HELD.add(self.mine["token"])
        threading.Thread(target=self._beat, name="save-folder-lock", daemon=True).start()

    def _gone(self, held: dict) -> bool:
        """Whether the run that wrote ``held`` has ended: its pid on this host, else its heartbeat watched."""
        if held.get("host") == socket.gethostname() and held.get("pid") == os.getpid():
            alive = held.get("token") in _HELD  # an earlier run in this process that could not remove it
        elif held.get("host") == socket.gethostname():
            alive = _pid_alive(held.get("pid"))
        else:
            alive, deadline = False, time.monotonic() + STALE_SECONDS
            while time.monotonic() < deadline and not alive:
                time.sleep(min(1.0, STALE_SECONDS / 10))
                now = self.read()
                alive = now is not None and now != held
                if now is None:
                    return True
        if not alive:
            print(f"save_folder {self.url}: taking over the lock of a run that ended ({_holder(held)})", flush=True)
        return not alive

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_SECONDS):
            self.mine["beat"] += 1
            try:
                self.write()
            except Exception as e:  # noqa: BLE001 - a store that is down now: the next beat tries again
                print(f"save_folder {self.url}: lock heartbeat failed ({type(e).__name__})", file=sys.stderr)

    def release(self) -> None:
        self.stop.set()
        _HELD.discard(self.mine["token"])
        try:
            if (self.read() or {}).get("token") == self.mine["token"]:
                self.client.delete_object(Bucket=self.bucket, Key=self.key)
        except (Exception, UsageError):  # noqa: BLE001 - left behind, it goes stale on its own
            pass


def _lock_remote(url: str):
    object_store.check(url, "save_folder")  # the bucket answers (a write could create a missing one)
    lock = _RemoteLock(url)
    lock.acquire()
    return lock.release
