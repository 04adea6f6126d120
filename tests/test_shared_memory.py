"""Streaming's shared memory after a run is killed with its whole process group (as Slurm and preemption kill):
the next run on that machine removes what it left (which else costs every later dataset a dozen file
descriptors per prefix and can be Streaming's "Reused local directory" error) and keeps a live run's."""

import os
import signal
import subprocess
import sys
import time
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


def test_datasets_are_registered_one_at_a_time_on_a_node(monkeypatch):
    """Streaming picks a free prefix, then creates it: two processes doing that at once can pick the same one.
    While one node leader holds ``registering``, another waits; a non-leader rank never does."""
    hold = "from diffusion.data.shared_memory import registering\nimport time\nwith registering():\n"
    hold += "    print('held', flush=True)\n    time.sleep(3)\n"
    env = dict(os.environ, PYTHONPATH=str(REPO), LOCAL_RANK="0")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("LOCAL_RANK", "1")
        start = time.monotonic()
        with shared_memory.registering():
            assert time.monotonic() - start < 1
        monkeypatch.setenv("LOCAL_RANK", "0")
        with shared_memory.registering():
            assert time.monotonic() - start > 1.5  # it waited for the holder (3 s)
    finally:
        holder.kill()
        holder.wait()


def test_a_half_removed_prefix_is_walked_past_not_created_twice(mds_images, monkeypatch):
    """Streaming walks to the first prefix missing each segment name and creates the largest answer: with one
    prefix lacking its locals but holding a barrier (a run exiting, or remove_stale halfway through a dead
    one's) and the next holding only locals, that is a prefix whose locals exist (FileExistsError, a CI
    failure). The project's walk (free_prefix) takes the first prefix with no segment at all."""
    from streaming import StreamingDataset
    from streaming.base.constant import BARRIER, LOCALS, SHM_TO_CLEAN
    from streaming.base.shared import prefix as streaming_prefix

    with shared_memory.registering():  # no other test process registers meanwhile
        first = shared_memory.free_prefix([str(mds_images)], [None])
        made = [shared_memory.SHM / f"{first:06}_{BARRIER}"]
        made[0].write_bytes(bytes(8))
        second = shared_memory.free_prefix([str(mds_images)], [None])  # the next without segments or file locks
        made.append(shared_memory.SHM / f"{second:06}_{LOCALS}")
        made[1].write_bytes(streaming_prefix._pack_locals(["/elsewhere"], second))
        try:
            walks = [shared_memory.STREAMING_WALK([str(mds_images)], [None], name) for name in SHM_TO_CLEAN]
            assert (shared_memory.SHM / f"{max(walks):06}_{LOCALS}").exists()  # Streaming would create that
            free = shared_memory.free_prefix([str(mds_images)], [None])
            dataset = StreamingDataset(local=str(mds_images), batch_size=2)
            assert dataset._shm_prefix_int == free and free not in (first, second) and len(dataset) > 0
        finally:
            for path in made:
                path.unlink()
