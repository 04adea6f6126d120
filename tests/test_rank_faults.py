"""A rank that dies or hangs in a 2-rank run: the job ends in bounded time, non-zero, with a line saying what
happened; never an endless hang."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, Job, composer_launcher, run

from diffusion.errors import rank_lost


def _run_and_signal(sig: int, tmp_path: Path, timeout: float = 10):
    """Start a long 2-rank sd-tiny run, send ``sig`` to rank 1 once batches are being logged; return
    (exit code, seconds from the signal to the job's end, whole output)."""
    launcher = composer_launcher()
    cmd = [
        str(launcher),
        "-n",
        "2",
        str(REPO / "benchmark.py"),
        "--use_synth_data",
        "--model_name",
        "sd-tiny",
        "--batch_size",
        "8",
        "--num_workers",
        "0",
        "--max_duration",
        "5000ba",
        "--dist_timeout",
        str(timeout),
        "--progress",
        "lines",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("batch "):  # progress=lines: "batch 1/5000, epoch 1: loss ..."
                break
        (rank1,) = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.environ().get("RANK") == "1"]
        os.kill(rank1.pid, sig)
        sent = time.monotonic()
        rest, _ = proc.communicate(timeout=timeout + 120)
        return proc.returncode, time.monotonic() - sent, "".join(out) + rest
    finally:
        if proc.poll() is None:  # never leave a stopped or running job behind
            for c in psutil.Process(proc.pid).children(recursive=True):
                c.kill()
            proc.kill()


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_at_once(tmp_path):
    code, seconds, out = _run_and_signal(signal.SIGKILL, tmp_path, timeout=600)
    assert code != 0 and seconds < 45, (code, seconds, out[-3000:])
    # The launcher names the first rank it finds ended: the killed one, or rank 0, whose collective failed at
    # once (its peer's socket closed) and which said so in one line; a loaded machine gives either order.
    rank0_first = f"benchmark.py: error: rank 0 on {socket.gethostname()}: a collective with the other ranks failed ("
    assert "Rank 1 crashed with exit code -9" in out or (
        rank0_first in out and "Rank 0 crashed with exit code 4" in out
    ), out[-3000:]


def test_rank_lost_reads_gloo_and_nccl_and_nothing_else():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "15000ms for recv operation to complete"
    )
    line = rank_lost(gloo, 15)
    assert line.startswith(
        f"rank 0 on {socket.gethostname()}: a collective with the other ranks failed "
        "([/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out"
    )
    assert "dist_timeout=15 s" in line and "\n" not in line
    assert rank_lost(RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)"), 600)
    assert rank_lost(RuntimeError("Connection closed by peer [10.0.0.2]:4312"), 600)
    assert rank_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), 600) is None


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_a_rank_hung_or_killed_in_a_sharded_save_ends_the_job_and_the_last_checkpoint_stays(tmp_path, fault):
    """fsdp=true on 2 ranks, a sharded save every 2 batches. Rank 1's shard file of batch 4 is a named pipe, so
    rank 1 blocks opening it to write, inside the save (hung); or is SIGKILLed there (killed). The job ends in
    bounded time, non-zero, with one line; the folder of batch 4 never gets its .metadata, `latest` still names
    batch 2's, and the same command (the pipe gone: the fault was the node's) resumes from batch 2 to the end
    (checked once, after the hang)."""
    folder = tmp_path / "ck"
    cmd = [composer_launcher(), "-n", "2", str(REPO / "train.py"), str(REPO / "yamls" / "sd-tiny-cpu.yaml"),
           "eval_interval=null", "num_workers=0", "batch_size=4", "progress=lines", "save_interval=2ba",
           "max_duration=6ba", "fsdp=true", f"save_folder={folder}", "dist_timeout=10"]  # fmt: skip
    with Job(cmd, tmp_path) as job:
        job.wait_until(lambda: (folder / "ep0-ba2" / ".metadata").exists(), timeout=240, every=0.01)
        # batch 2's save is whole: batches 3 and 4 train meanwhile
        (folder / "ep0-ba4").mkdir()
        os.mkfifo(folder / "ep0-ba4" / "__1_0.distcp")  # torch.distributed.checkpoint's name for rank 1's shard
        job.wait_until(lambda: (folder / "ep0-ba4" / "__0_0.distcp").exists())  # rank 0's shard: rank 1 is at the pipe
        time.sleep(1)
        ranks = [c for c in psutil.Process(job.proc.pid).children(recursive=True) if c.environ().get("RANK")]
        (rank1,) = [c for c in ranks if c.environ()["RANK"] == "1"]
        if fault == "killed":
            rank1.kill()
        seconds = job.seconds_to_end(timeout=10 + 120)
    text, proc = job.text(), job.proc
    assert proc.returncode != 0 and seconds < 10 + 60, (proc.returncode, seconds, text[-3000:])
    rank0 = f"train.py: error: rank 0 on {socket.gethostname()}: a collective with the other ranks failed ("
    if fault == "hung":
        assert rank0 in text and "no answer within dist_timeout=10 s" in text, text[-3000:]
    else:
        assert "Rank 1 crashed with exit code -9" in text or rank0 in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not (folder / "ep0-ba4" / ".metadata").exists()
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba2"
    assert not [r.pid for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]  # none outlived it

    if fault == "killed":  # the same folders as the hung case's, whose resume follows (~40 s a launch)
        return
    (folder / "ep0-ba4" / "__1_0.distcp").unlink()
    again = run(cmd, tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"autoresume: resuming from {folder / 'ep0-ba2'} (batch 2 of 6," in again.stderr, again.stderr[-3000:]
    assert (folder / "ep0-ba6" / ".metadata").exists()
