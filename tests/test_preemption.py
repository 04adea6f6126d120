"""Preemption on real data: a 2-rank run on MDS shards with loader workers, killed whole (launcher, ranks and
workers, as a Slurm preemption or a node loss does) in the middle of an epoch and again in the middle of the
second epoch, then the same command each time, ends with bitwise the weights and EMA of an uninterrupted run.
And a benchmark stopped by SIGTERM (diffusion/callbacks/preemption.py; the 2-node Slurm version of stopping
is in tests/test_slurm.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_same_weights

# 32 samples, global batch 8: 4 batches an epoch; 10 batches span three epochs.
BATCHES = 10


def _cmd(mds: Path, folder: Path) -> list[str]:
    return [
        str(Path(sys.executable).with_name("composer")),
        "-n",
        "2",
        str(REPO / "train.py"),
        str(REPO / "yamls" / "sd-tiny-cpu.yaml"),
        "use_synth_data=false",
        f"local={mds}",
        "num_workers=2",
        "eval_interval=null",
        f"max_duration={BATCHES}ba",
        "save_interval=1ba",
        f"save_folder={folder}",
        "save_num_checkpoints_to_keep=-1",
        "progress=lines",
    ]


def _run(cmd, cwd, kill_when: Path | None = None) -> subprocess.CompletedProcess | None:
    """Run to the end; or, with ``kill_when``, SIGKILL the whole process group once that checkpoint exists."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if kill_when is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 400
    while not kill_when.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended ({proc.returncode}) before {kill_when.name} appeared"
    return None


@pytest.mark.slow
def test_killed_mid_epoch_and_in_the_second_epoch_resumes_bitwise(tmp_path, mds_images):
    full = _run(_cmd(mds_images, tmp_path / "a"), tmp_path)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]

    folder = tmp_path / "b"
    _run(_cmd(mds_images, folder), tmp_path, kill_when=folder / "ep0-ba2-rank0.pt")  # mid first epoch
    _run(_cmd(mds_images, folder), tmp_path, kill_when=folder / "ep1-ba6-rank0.pt")  # mid second epoch
    assert not (folder / f"ep2-ba{BATCHES}-rank0.pt").exists()
    again = _run(_cmd(mds_images, folder), tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    assert_same_weights(tmp_path / "a", folder, BATCHES)


def test_benchmark_stopped_by_sigterm_writes_its_results_line_and_exits_5(tmp_path):
    """Slurm's SIGTERM (preemption, scancel, the time limit) mid-benchmark: the batch in flight finishes, the
    results line holds what was measured, with stopped_by, and the exit status says the run was stopped."""
    results = tmp_path / "r.jsonl"
    cmd = [sys.executable, str(REPO / "benchmark.py"), "--use_synth_data", "--model_name", "sd-tiny",
           "--batch_size", "4", "--num_workers", "0", "--max_duration", "100000ba", "--results", str(results)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:  # console metrics every 10 batches: the third block means batch 30 is done
        seen.append(line)
        if sum("Train time/batch_in_epoch" in s for s in seen) == 3:
            break
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # again, as a second scancel would: only sets the flag again
    rest, _ = proc.communicate(timeout=120)
    out = "".join(seen) + rest
    assert proc.returncode == 5, out[-3000:]
    line = next(s for s in out.splitlines() if s.startswith("benchmark.py: error: "))
    assert "stopped by SIGTERM after batch" in line and "nothing to save (no save_folder)" in line
    (record,) = [json.loads(s) for s in results.read_text().splitlines()]
    assert record["stopped_by"] == "SIGTERM" and record["measured_batches"] > 0 and record["images_per_sec"] > 0
