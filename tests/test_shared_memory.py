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
