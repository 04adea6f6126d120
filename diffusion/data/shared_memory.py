"""Streaming's shared memory that runs which died left behind, found and removed without touching a live run's.

A StreamingDataset keeps its state in POSIX shared memory (``/dev/shm/NNNNNN_<name>``, one prefix per
dataset) and removes it when its process exits normally. A killed run (preemption, a crashed rank, a test
that kills on purpose) leaves its segments, and they cost every later dataset on that machine: Streaming walks
every existing prefix when it registers a new one and holds each segment it opened until the process exits
(a dozen file descriptors per stale prefix, per dataset), and a stale prefix naming the same local cache as a
new run with a remote can be Streaming's "Reused local directory" error (when no file lock of the dead run's
in the temp folder makes Streaming skip that prefix).

Streaming's own ``clean_stale_shared_memory()`` removes every segment, a live job's on the same node too.
This removes only segments no process maps: a live dataset maps its segments in every process that uses
them (ranks and loader workers) for its whole life. A segment younger than ``min_age_s`` is left alone (one
being made has a moment between its creation and its mapping).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

SHM = Path("/dev/shm")
STREAMING_NAME = re.compile(r"^\d{6}_[a-z_]+$")  # Streaming's f"{prefix:06}_{name}"
MIN_AGE_S = 2.0  # a segment is mapped microseconds after it is made; younger ones may be being made


def mapped_segments(ignore_pids: frozenset[int] = frozenset()) -> set[str]:
    """Names of the shared-memory segments some process maps (from /proc/*/maps). A process whose maps cannot
    be read (exited meanwhile; another user's; a container's init) is not one of our training processes: a
    user can read the maps of every process it runs."""
    names = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in ignore_pids:
            continue
        try:
            text = (proc / "maps").read_text()
        except OSError:
            continue
        names.update(line.rsplit("/", 1)[-1] for line in text.splitlines() if "/dev/shm/" in line)
    return names


def remove_stale(ignore_pids: frozenset[int] = frozenset(), min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove Streaming's segments (ours, older than ``min_age_s``) that no process maps; return their names.
    ``ignore_pids``: processes whose mappings do not count (a test session's own, whose finished datasets
    stay mapped until it exits)."""
    if not SHM.is_dir():
        return []
    mapped = mapped_segments(ignore_pids)
    removed, uid, now = [], os.getuid(), time.time()
    for path in SHM.iterdir():
        if not STREAMING_NAME.match(path.name) or path.name in mapped:
            continue
        try:
            st = path.stat()
            if st.st_uid != uid or now - st.st_mtime < min_age_s:
                continue
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path.name)
    return removed


def release_own() -> int:
    """Close every Streaming shared-memory handle this process holds and remove the segments it made; the
    number closed. For a process that makes one dataset after another (precompute, bucket by bucket) once the
    datasets it made are done with: Streaming keeps each handle until the process exits (an exit hook per
    segment), the ones it opened only to look at other datasets' prefixes too, so each new dataset would hold
    a dozen more descriptors per dataset made before it. Never while a dataset of this process is in use."""
    import gc

    from streaming.base.shared.memory import SharedMemory

    closed = 0
    for obj in gc.get_objects():
        if type(obj) is SharedMemory:  # not isinstance: that asks every object its __class__ (some warn)
            try:
                obj.cleanup()  # close, and unlink what this process made (again at exit: a no-op then)
                closed += 1
            except (BufferError, OSError):  # an array still views it: it stays until exit
                continue
    return closed


def free_prefix(streams_local: list[str], streams_remote: list, shm_name: str | None = None) -> int:
    """Streaming's prefix walk (``streaming.base.shared.prefix._check_and_find``), made one answer for every
    segment name: the first prefix with none of its segments in /dev/shm and none of its file locks in the temp
    folder. Streaming walks once per segment name, each to the first prefix missing that name, and creates the
    largest answer: a prefix that lacks some segments and has others (a run exiting unlinks them one by one;
    ``remove_stale`` may be halfway through a dead run's) makes the walks disagree, and the dataset then creates
    a ``_locals`` segment that exists (``FileExistsError: '/NNNNNN_locals'``). As in Streaming's, a live prefix
    whose dataset reads one of our local folders for a remote is "Reused local directory". Reads each prefix's
    locals as a file: it keeps no segment open (Streaming's walk holds each until the process exits)."""
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    temp = tempfile.gettempdir()
    for prefix in itertools.count():
        if any(
            os.path.exists(os.path.join(temp, _get_path(prefix, lock))) for lock in (BARRIER_FILELOCK, CACHE_FILELOCK)
        ):
            continue
        if not any((SHM / _get_path(prefix, name)).exists() for name in SHM_TO_CLEAN):
            return prefix
        if not any(streams_remote):
            continue
        try:
            theirs, _ = _unpack_locals((SHM / _get_path(prefix, LOCALS)).read_bytes())
        except (OSError, ValueError, IndexError, UnicodeDecodeError):  # no locals (a partial prefix), or cut
            continue
        if any(remote is not None and local in theirs for local, remote in zip(streams_local, streams_remote)):
            # Streaming's words: its retry loop reads a ValueError as "wait a tick, the other may be exiting"
            raise ValueError(f"Reused local directory: {streams_local} vs {theirs}. Provide a different one.")
    raise AssertionError("unreachable")


def _walk_consistently() -> None:
    """Streaming's registration walks with ``free_prefix`` (on Linux, where its segments are /dev/shm files)."""
    from streaming.base.shared import prefix

    global STREAMING_WALK
    if SHM.is_dir() and prefix._check_and_find is not free_prefix:
        STREAMING_WALK, prefix._check_and_find = prefix._check_and_find, free_prefix


STREAMING_WALK = None  # Streaming's own walk, once replaced (tests show what it does)


@contextmanager
def registering():
    """Held by each node's first rank (LOCAL_RANK 0, as Streaming counts ranks) while it makes a Streaming
    dataset. Streaming registers a dataset by looking for the first free prefix and then creating it, so two
    jobs (or two test processes) making datasets at the same moment on one node can pick the same one
    (``FileExistsError: '/NNNNNN_locals'``); this node-wide lock, in the temp folder where Streaming keeps its
    own file locks, makes them take turns. The other ranks attach to their leader's prefix and never wait here
    (the leader waits for them inside Streaming). Every rank walks to its prefix with ``free_prefix``."""
    _walk_consistently()
    if os.environ.get("LOCAL_RANK", "0") != "0":
        yield
        return
    fd = os.open(
        os.path.join(tempfile.gettempdir(), "diffusion-streaming-prefix.lock"), os.O_RDONLY | os.O_CREAT, 0o644
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
