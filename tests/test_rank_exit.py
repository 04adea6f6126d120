"""A rank that finished its work exits, always, and no rank outlives its launcher: a finished `composer -n 2
evaluate.py` printed its result and then rank 1 never exited (gloo's teardown deadlocked), and when the
test's timeout killed the launcher, that rank lived on as an orphan for 52 minutes (diffusion/cli.py:
end_rank, die_with_launcher)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import REPO, composer_launcher
from slurm_cluster import free_port

WORKER = REPO / "tests" / "exit_worker.py"


def _start_ranks(mode: str, timeout: float) -> list[subprocess.Popen]:
    """Two ranks of exit_worker.py with the environment Composer's launcher gives its ranks."""
    port, ranks = free_port(), []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, str(WORKER), mode, str(timeout)]
        ranks.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return ranks


def _finish(ranks: list[subprocess.Popen], within: float) -> list[tuple[int | None, str, str]]:
    """Each rank's (exit code or None if it was still running ``within`` s after its 'done' line, stdout, stderr)."""
    out = []
    for proc in ranks:
        done = proc.stdout.readline()
        try:
            rest, err = proc.communicate(timeout=within)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, err = proc.communicate()
            out.append((None, done + rest, err))
            continue
        out.append((proc.returncode, done + rest, err))
    return out


@pytest.mark.slow
def test_finished_ranks_exit_every_time():
    """Two 2-rank jobs that gather metric states and finish: every rank exits 0 within seconds of its last
    line, each time (the teardown deadlock was rare: the loop is what shows a regression; four jobs until
    2026-11-28, two for CI's time budget)."""
    for attempt in range(2):
        results = _finish(_start_ranks("gather", timeout=60), within=30)
        for rank, (code, out, err) in enumerate(results):
            assert f"done rank {rank}" in out, (attempt, out, err)
            assert code == 0, f"attempt {attempt}: rank {rank} exited {code} (None: still running)\n{err}"


@pytest.mark.slow
def test_a_rank_waits_for_the_others_at_the_end_at_most_dist_timeout():
    """Rank 1 is done while rank 0 works on: rank 1 waits for it at most dist_timeout, then exits 4 with one
    line naming itself, not a traceback and not a wait forever."""
    ranks = _start_ranks("stuck", timeout=4)
    try:
        rank1 = ranks[1]
        assert rank1.stdout.readline() == "done rank 1\n"
        start = time.monotonic()
        _, err = rank1.communicate(timeout=60)
        waited = time.monotonic() - start
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()
    assert rank1.returncode == 4, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("exit_worker.py: error: rank 1 "), err
    assert "dist_timeout=4 s" in lines[0], err
    assert 3 <= waited < 30, waited


@pytest.mark.slow
def test_ranks_die_with_their_launcher(tmp_path):
    """SIGKILL to Composer's launcher of a long 2-rank run: both ranks are gone within seconds."""
    launcher = composer_launcher()
    cmd = [str(launcher), "-n", "2", str(REPO / "benchmark.py"), "--use_synth_data", "--model_name", "sd-tiny"]
    cmd += ["--batch_size", "4", "--num_workers", "0", "--max_duration", "100000ba", "--progress", "lines"]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            ranks = [c for c in psutil.Process(proc.pid).children() if "benchmark.py" in " ".join(c.cmdline())]
        assert len(ranks) == 2, "the launcher did not start two ranks"
        time.sleep(8)  # into the imports or training: a rank dies with its launcher at any point
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=20)
        assert not alive, f"ranks outlived their launcher: {[p.pid for p in alive]}"
    finally:
        proc.kill()
        for rank in ranks:  # only what this test started
            try:
                rank.kill()
            except psutil.NoSuchProcess:
                pass
