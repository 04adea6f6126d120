"""Preemption on real data: a 2-rank run on MDS shards with loader workers, killed whole (launcher, ranks and
workers, as a Slurm preemption or a node loss does) in the middle of an epoch and again in the middle of the
second epoch, then the same command each time, ends with bitwise the weights and EMA of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from diffusion.callbacks.ema import ema_in_checkpoint

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


def _final(folder: Path) -> dict:
    state = torch.load(folder / f"ep2-ba{BATCHES}-rank0.pt", map_location="cpu", weights_only=False)["state"]
    return {"model": state["model"], "ema": ema_in_checkpoint(state), "batch": state["timestamp"]["Timestamp"]["batch"]}


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

    a, b = _final(tmp_path / "a"), _final(folder)
    assert a["batch"] == b["batch"] == BATCHES
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert a["ema"] and a["ema"].keys() == b["ema"].keys()
    for name in a["ema"]:
        assert torch.equal(a["ema"][name], b["ema"][name]), name
