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
    segment name: the first prefix with none of its segments in /dev/shm, none of its file locks in the temp
    folder and no registration in flight (another dataset's claim, below). Streaming walks once per segment
    name, each to the first prefix missing that name, and creates the largest answer: a prefix that lacks some
    segments and has others (a run exiting unlinks them one by one; ``remove_stale`` may be halfway through a
    dead run's) makes the walks disagree, and the dataset then creates a ``_locals`` segment that exists
    (``FileExistsError: '/NNNNNN_locals'``). As in Streaming's, a live prefix whose dataset reads one of our
    local folders for a remote is "Reused local directory". Reads each prefix's locals as a file: it keeps no
    segment open (Streaming's walk holds each until the process exits).

    Inside ``registering``, the answer is that registration's claimed prefix (the same for every segment name)."""
    if _REGISTRATION is not None:
        return _REGISTRATION.prefix(streams_local, streams_remote)
    return _walk(streams_local, streams_remote)


def _walk(streams_local: list[str], streams_remote: list, start: int = 0) -> int:
    """The first prefix from ``start`` that is neither in use (``_in_use``) nor claimed."""
    for prefix in itertools.count(start):
        if not _in_use(prefix, streams_local, streams_remote) and _claimed(prefix) is None:
            return prefix
    raise AssertionError("unreachable")


def _in_use(prefix: int, streams_local: list[str], streams_remote: list) -> bool:
    """Whether ``prefix`` has a Streaming file lock in the temp folder or a segment in /dev/shm."""
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN
    from streaming.base.shared.prefix import _get_path, _unpack_locals

    temp = tempfile.gettempdir()
    if any(os.path.exists(os.path.join(temp, _get_path(prefix, lock))) for lock in (BARRIER_FILELOCK, CACHE_FILELOCK)):
        return True
    if not any((SHM / _get_path(prefix, name)).exists() for name in SHM_TO_CLEAN):
        return False
    if any(streams_remote):
        try:
            theirs, _ = _unpack_locals((SHM / _get_path(prefix, LOCALS)).read_bytes())
        except (OSError, ValueError, IndexError, UnicodeDecodeError):  # no locals (a partial prefix), or cut
            return True
        if any(remote is not None and local in theirs for local, remote in zip(streams_local, streams_remote)):
            # Streaming's words: its retry loop reads a ValueError as "wait a tick, the other may be exiting"
            raise ValueError(f"Reused local directory: {streams_local} vs {theirs}. Provide a different one.")
    return True


def _walk_consistently() -> None:
    """Streaming's registration walks with ``free_prefix`` (on Linux, where its segments are /dev/shm files)."""
    from streaming.base.shared import prefix

    global STREAMING_WALK
    if SHM.is_dir() and prefix._check_and_find is not free_prefix:
        STREAMING_WALK, prefix._check_and_find = prefix._check_and_find, free_prefix


STREAMING_WALK = None  # Streaming's own walk, once replaced (tests show what it does)

# A registration's claim on a prefix: a file in the temp folder (node-local, where Streaming keeps its own file
# locks) that the node's first rank holds an exclusive flock on from its walk until its dataset is made, and
# whose text names the registration, for the node's other ranks to find. The kernel drops the flock when the
# process dies, so a claim never outlives its registration; the files stay (one per prefix ever claimed).
CLAIM = "{:06}_diffusion_claim"
CLAIM_WAIT_S = 1800.0  # a node's other ranks wait this long for their first rank's claim (torch's barrier's 30 min)
_REGISTRATION = None
_ordinal = itertools.count()


def _claim_path(prefix: int) -> str:
    return os.path.join(tempfile.gettempdir(), CLAIM.format(prefix))


def _claimed(prefix: int) -> str | None:
    """The text of ``prefix``'s claim while a live registration holds it, else None."""
    try:
        fd = os.open(_claim_path(prefix), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held
            return os.pread(fd, 4096, 0).decode(errors="replace")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class _Registration:
    """One dataset being made on this node. The node's first rank claims the first free prefix: it never waits
    for another registration (a claim it cannot take is walked past), so no lock is held across Streaming's
    barriers, where two jobs sharing nodes deadlocked (each one's first rank on one node waiting, inside its
    job's barrier, for the node lock the other job's held on the other node). The other ranks take the prefix
    their first rank claimed, found by the registration's name."""

    def __init__(self) -> None:
        env = os.environ
        self.leader = env.get("LOCAL_RANK", "0") == "0"
        node = env.get("NODE_RANK", env.get("GROUP_RANK"))
        self.name = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')} node {node} dataset {next(_ordinal)}"
        self.fd: int | None = None
        self.claimed: int | None = None

    def prefix(self, streams_local: list[str], streams_remote: list) -> int:
        if self.claimed is None:
            named = f"{self.name} {streams_local}"
            self.claimed = self._claim(streams_local, streams_remote, named) if self.leader else self._find(named)
        return self.claimed

    def _claim(self, streams_local: list[str], streams_remote: list, named: str) -> int:
        prefix = -1
        while True:
            prefix = _walk(streams_local, streams_remote, prefix + 1)
            fd = os.open(_claim_path(prefix), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # claimed between the walk's look and now
                os.close(fd)
                continue
            if _in_use(prefix, streams_local, streams_remote):  # a dataset made there meanwhile
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, named.encode(), 0)
            self.fd = fd
            return prefix

    def _find(self, named: str) -> int:
        deadline = time.monotonic() + CLAIM_WAIT_S
        folder = tempfile.gettempdir()
        pattern = re.compile(r"^(\d{6})_diffusion_claim$")
        while time.monotonic() < deadline:
            for entry in os.listdir(folder):
                found = pattern.match(entry)
                if found and _claimed(int(found[1])) == named:
                    return int(found[1])
            time.sleep(0.05)
        raise RuntimeError(
            f"this node's first rank (LOCAL_RANK 0) claimed no Streaming prefix for {named!r} in {CLAIM_WAIT_S:.0f} s "
            f"(claims in {folder}); every rank of a node must share one temp folder (TMPDIR)"
        )

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock
            self.fd = None


@contextmanager
def registering():
    """Around the making of one Streaming dataset, on every rank. Streaming registers a dataset by walking to
    the first free prefix and creating it after a barrier of all ranks, so two jobs (or two test processes)
    making datasets at the same moment on one node could pick the same one (``FileExistsError:
    '/NNNNNN_locals'``): the node's first rank claims its prefix (``_Registration``) and holds the claim until
    the dataset is made; the other ranks take the prefix it claimed. Every rank walks with ``free_prefix``."""
    global _REGISTRATION
    _walk_consistently()
    _REGISTRATION = _Registration()
    try:
        yield
    finally:
        _REGISTRATION.release()
        _REGISTRATION = None
