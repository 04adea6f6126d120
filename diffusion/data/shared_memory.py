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


@contextmanager
def registering():
    """Held by each node's first rank (LOCAL_RANK 0, as Streaming counts ranks) while it makes a Streaming
    dataset. Streaming registers a dataset by looking for the first free prefix and then creating it, so two
    jobs (or two test processes) making datasets at the same moment on one node can pick the same one
    (``FileExistsError: '/NNNNNN_locals'``); this node-wide lock, in the temp folder where Streaming keeps its
    own file locks, makes them take turns. The other ranks attach to their leader's prefix and never wait here
    (the leader waits for them inside Streaming)."""
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
