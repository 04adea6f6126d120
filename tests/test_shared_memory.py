"""Streaming's shared memory after a run is killed with its whole process group (as Slurm and preemption kill):
the next run on that machine removes what it left (which else costs every later dataset a dozen file
descriptors per prefix and can be Streaming's "Reused local directory" error) and keeps a live run's."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from conftest import REPO

from diffusion.data import shared_memory
from diffusion.data.loaders import streaming_dataset

HOLDER = """
import sys, time
from streaming import StreamingDataset
from diffusion.data.shared_memory import registering
with registering():
    dataset = StreamingDataset(remote=sys.argv[1], local=sys.argv[2], batch_size=2)
print(f"{dataset._shm_prefix_int:06}_", flush=True)
time.sleep(300)
"""


def _hold(remote: Path, local: Path) -> tuple[subprocess.Popen, set[str]]:
    """A process with a Streaming dataset open on (remote, local), in its own process group; its dataset's
    segments (those of its prefix: it maps every other dataset's too, and tests may run beside this one)."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(remote), str(local)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    prefix = p.stdout.readline().strip()
    return p, {name for name in _segments() if name.startswith(prefix)}


def _segments() -> set[str]:
    return {p.name for p in shared_memory.SHM.iterdir() if shared_memory.STREAMING_NAME.match(p.name)}


def test_a_killed_runs_memory_is_removed_and_a_live_ones_kept(tmp_path, mds_images):
    live, live_segments = _hold(mds_images, tmp_path / "live-cache")
    try:
        killed, stale = _hold(mds_images, tmp_path / "cache")
        os.killpg(killed.pid, signal.SIGKILL)  # the resource tracker dies too: nothing unlinks the memory
        killed.wait()
        assert stale and live_segments and stale <= _segments()
        time.sleep(shared_memory.MIN_AGE_S)  # the restart on the same remote and cache
        dataset = streaming_dataset(
            remote=str(mds_images), local=str(tmp_path / "cache"), key="local", precomputed=False, image_size=32
        )
        assert len(dataset) > 0
        # Each stale name is gone or made afresh by this dataset (it may take the freed prefix); the live run's stay.
        left = {name for name in stale & _segments() if not name.startswith(f"{dataset._shm_prefix_int:06}_")}
        others = shared_memory.mapped_segments(ignore_pids=frozenset({os.getpid()}))
        assert not left and live_segments <= others
    finally:
        os.killpg(live.pid, signal.SIGTERM)
        live.wait()


JOB = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
from streaming import StreamingDataset
from diffusion.data.shared_memory import registering
if int(os.environ["WORLD_SIZE"]) > 1:
    dist.init_process_group("gloo")
signals = Path(sys.argv[2])
while os.environ.get("WAIT") and not (signals / os.environ["WAIT"]).exists():
    time.sleep(0.05)
print("registering", flush=True)
with registering():
    dataset = StreamingDataset(local=sys.argv[1], batch_size=2)
print(dataset._shm_prefix_int, flush=True)
while not (signals / "end").exists():  # the dataset stays live until the test has seen every prefix
    time.sleep(0.05)
"""


def _job(data: Path, signals: Path, rank: int = 0, world: int = 1, port: int = 0, wait: str = "") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    env.update(LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WAIT=wait)
    return subprocess.Popen(
        [sys.executable, "-c", JOB, str(data), str(signals)], stdout=subprocess.PIPE, text=True, env=env
    )


def _line(proc: subprocess.Popen, timeout: float) -> str:
    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(proc.stdout.readline).result(timeout).strip()
        except FutureTimeout:
            proc.kill()  # unblocks the reader
            raise AssertionError(f"no line from the job in {timeout:.0f} s") from None


def test_two_jobs_on_one_node_register_at_once_without_waiting(tmp_path, mds_images):
    """Streaming picks a free prefix on every rank, then (after a barrier of all the job's ranks) the node's first
    rank creates it. Job A's first rank has walked and waits in its job's barrier for its second rank; job B,
    on the same node meanwhile, makes its dataset without waiting (a node lock held through the barrier made it
    wait: two 2-node jobs sharing nodes deadlocked) and on another prefix (no lock at all: both take the same
    one, FileExistsError); then A's second rank takes the prefix its first rank claimed."""
    from slurm_cluster import free_port

    port, jobs = free_port(), []
    try:
        jobs += [_job(mds_images, tmp_path, r, 2, port, wait="go" if r else "") for r in (0, 1)]
        assert _line(jobs[0], 120) == "registering"
        time.sleep(2)  # A's first rank is in its barrier now
        jobs.append(_job(mds_images, tmp_path))
        assert _line(jobs[2], 120) == "registering"
        b = int(_line(jobs[2], 60))  # B's dataset, while A's registration is in flight
        (tmp_path / "go").touch()
        assert _line(jobs[1], 60) == "registering"
        a = [int(_line(job, 60)) for job in jobs[:2]]
        assert a[0] == a[1] != b, (a, b)
        (tmp_path / "end").touch()
        assert [job.wait(60) for job in jobs] == [0, 0, 0]
    finally:
        for job in jobs:
            job.kill()
            job.wait()


def test_a_half_removed_prefix_is_walked_past_not_created_twice(mds_images, monkeypatch):
    """Streaming walks to the first prefix missing each segment name and creates the largest answer: with one
    prefix lacking its locals but holding a barrier (a run exiting, or remove_stale halfway through a dead
    one's) and the next holding only locals, that is a prefix whose locals exist (FileExistsError, a CI
    failure). The project's walk (free_prefix) takes the first prefix with no segment at all."""
    from streaming import StreamingDataset
    from streaming.base.constant import BARRIER, LOCALS, SHM_TO_CLEAN
    from streaming.base.shared import prefix as streaming_prefix

    streams, made = ([str(mds_images)], [None]), []
    claims = [shared_memory._Registration() for _ in range(2)]  # other test processes' datasets walk past these
    try:
        first = claims[0].prefix(*streams)
        made.append(shared_memory.SHM / f"{first:06}_{BARRIER}")
        made[0].write_bytes(bytes(8))
        second = claims[1].prefix(*streams)  # the next without segments, file locks or a claim
        made.append(shared_memory.SHM / f"{second:06}_{LOCALS}")
        made[1].write_bytes(streaming_prefix._pack_locals(["/elsewhere"], second))
        shared_memory._walk_consistently()
        walks = [shared_memory.STREAMING_WALK(*streams, name) for name in SHM_TO_CLEAN]
        assert (shared_memory.SHM / f"{max(walks):06}_{LOCALS}").exists()  # Streaming would create that
        with shared_memory.registering():
            dataset = StreamingDataset(local=str(mds_images), batch_size=2)
        assert dataset._shm_prefix_int not in (first, second) and len(dataset) > 0
    finally:
        for path in made:
            path.unlink()
        for claim in claims:
            claim.release()
