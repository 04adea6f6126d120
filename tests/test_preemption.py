"""Preemption on real data: a 2-rank run on MDS shards with loader workers, killed whole (launcher, ranks and
workers, as a Slurm preemption or a node loss does) in the middle of an epoch and again in the middle of the
second epoch, then the same command each time, ends with bitwise the weights and EMA of an uninterrupted run. And
runs stopped by SIGTERM (diffusion/callbacks/preemption.py; the 2-node Slurm version of stopping is in
tests/test_slurm.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    REPO,
    assert_same_weights,
    composer_launcher,
    download_folder,
    final_state,
    preemption_cmd,
    repo_env,
    run,
    run_or_kill,
    sharded_state,
)

# 32 samples, global batch 8: 4 batches an epoch (bucketed: 8 samples in each of 4 buckets, one batch each);
# 10 batches span three epochs.
BATCHES = 10


# Square crops. Buckets killed and resumed across epoch ends: tests/test_slurm_buckets.py (2 nodes); FSDP with EMA
# killed and resumed: test_object_store_checkpoints.py's sharded folders in a bucket and test_slurm.py's stops (both
# once variants here, they left CI's time budget on 2026-11-28).
@pytest.mark.slow
def test_killed_mid_epoch_and_in_the_second_epoch_resumes_bitwise(tmp_path, mds_images):
    local = mds_images
    full = run_or_kill(preemption_cmd(tmp_path / "a", BATCHES, f"local={local}"), tmp_path)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]

    folder = tmp_path / "b"
    cmd = preemption_cmd(folder, BATCHES, f"local={local}")
    run_or_kill(cmd, tmp_path, kill_when=folder / "ep0-ba2-rank0.pt")  # mid first epoch
    run_or_kill(cmd, tmp_path, kill_when=folder / "ep1-ba6-rank0.pt")  # mid second epoch
    assert not (folder / f"ep2-ba{BATCHES}-rank0.pt").exists()
    again = run_or_kill(cmd, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    a, b = final_state(tmp_path / "a", f"ep2-ba{BATCHES}-rank0.pt"), final_state(folder, f"ep2-ba{BATCHES}-rank0.pt")
    assert a["batch"] == b["batch"] == BATCHES
    assert_same_weights(a, b)


def _signal_after(cmd: list[str], cwd, blocks: int) -> tuple[subprocess.Popen, str]:
    """Start ``cmd``; once it has printed ``blocks`` progress lines (batch 1, then every 10), SIGTERM every process
    it started (launcher, ranks, loader workers: scancel signals every process of a Slurm step) twice, 0.2 s apart
    (as a second scancel would: the second only sets the flag again); its whole output."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if sum(s.startswith("batch ") for s in seen) == blocks:
            break
    for _ in range(2):
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
    rest, _ = proc.communicate(timeout=120)
    return proc, "".join(seen) + rest


def _error_line(out: str, prog: str) -> str:
    return next(s for s in out.splitlines() if s.startswith(f"{prog}: error: "))


def test_benchmark_stopped_by_sigterm_writes_its_results_line_and_exits_5(tmp_path):
    """Slurm's SIGTERM (preemption, scancel, the time limit) mid-benchmark, to the run and its 2 loader workers: the
    batch in flight finishes, the results line holds what was measured, with stopped_by, and the exit status says
    the run was stopped. (A worker that died of the signal failed the run: data/loader_workers.py.)"""
    results = tmp_path / "r.jsonl"
    cmd = [sys.executable, str(REPO / "benchmark.py"), "--use_synth_data", "--model_name", "sd-tiny",
           "--batch_size", "4", "--num_workers", "2", "--max_duration", "100000ba", "--results", str(results)]  # fmt: skip
    proc, out = _signal_after(cmd, tmp_path, blocks=3)
    assert proc.returncode == 5, out[-3000:]
    line = _error_line(out, "benchmark.py")
    assert "stopped by SIGTERM after batch" in line and "nothing to save (no save_folder)" in line
    assert "killed by signal" not in out, out[-3000:]
    (record,) = [json.loads(s) for s in results.read_text().splitlines()]
    assert record["stopped_by"] == "SIGTERM" and record["measured_batches"] > 0 and record["images_per_sec"] > 0


def test_training_stopped_by_sigterm_saves_to_the_bucket_and_names_it(tmp_path, s3):
    """The same stop with save_folder in object storage: the checkpoint of the stop batch is uploaded and the
    pointer names it before the run exits 5, and the line names the object."""
    url = f"s3://{s3.bucket}/run"
    cmd = [sys.executable, str(REPO / "train.py"), str(REPO / "yamls" / "sd-tiny-cpu.yaml"), "eval_interval=null",
           "num_workers=0", "batch_size=4", "progress=lines", "max_duration=100000ba", "save_interval=100000ba",
           f"save_folder={url}"]  # fmt: skip
    proc, out = _signal_after(cmd, tmp_path, blocks=2)
    assert proc.returncode == 5, out[-3000:]
    line = _error_line(out, "train.py")
    batch = int(re.search(r"stopped by SIGTERM after batch (\d+)", line)[1])
    name = f"ep0-ba{batch}-rank0.pt"
    assert f"the checkpoint {url}/{name} is whole" in line
    pointer = s3.client().get_object(Bucket=s3.bucket, Key="run/latest-rank0.pt.symlink")["Body"].read().decode()
    assert pointer.endswith(name)


@pytest.mark.slow
def test_fsdp_ranks_stopped_by_sigterm_save_one_sharded_checkpoint_in_the_bucket_and_resume_from_it(tmp_path, s3):
    """Slurm's SIGTERM to every process of a 2-rank FSDP step (launcher and ranks) saving to s3://: both ranks stop
    after the same batch and save one sharded folder together (a collective: a rank gone early would leave the other
    waiting); the line names that folder, whole, within the launcher's 30 s grace; the same command resumes from it
    and ends bitwise (weights and EMA) where an uninterrupted run of as many batches does. The processes Composer's
    uploader spawned died of the signal and rank 0 hung; made to ignore it, their start under CI's load outlasted the
    30 s; remote_checkpoints.uploads_in_threads. The same stop to a local folder, on 2 Slurm nodes: test_slurm.py."""
    launch = [composer_launcher(), "-n", "2", str(REPO / "train.py"), str(REPO / "yamls" / "sd-tiny-cpu.yaml"),
              "eval_interval=null", "num_workers=0", "batch_size=4", "progress=lines", "save_interval=100000ba",
              "schedule=constant", "warmup=0ba", "fsdp=true", "autoresume=true"]  # fmt: skip
    folder = f"s3://{s3.bucket}/run"
    proc = subprocess.Popen(
        [*launch, "max_duration=100000ba", f"save_folder={folder}"], cwd=tmp_path, start_new_session=True,
        env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if sum(s.startswith("batch ") for s in seen) == 2:
            break
    # Once: the upload outlasts 0.2 s, and a second SIGTERM cuts short the 30 s that Composer's launcher waits for
    # its ranks, and the ranks die with it (cli.die_with_launcher) before their checkpoint is up (docs/reliability.md).
    os.killpg(proc.pid, signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=180)[0]
    assert "has still not exited" not in out, out[-3000:]
    stop = int(re.search(r"stopped by SIGTERM after batch (\d+)", out)[1])
    saved = f"{folder}/ep0-ba{stop}"
    assert f"train.py: error: stopped by SIGTERM after batch {stop}: the checkpoint {saved} is whole" in out, out[
        -3000:
    ]
    pointer = s3.client().get_object(Bucket=s3.bucket, Key="run/latest-rank0.pt.symlink")["Body"].read().decode()
    assert pointer == f"run/ep0-ba{stop}"

    end = stop + 2
    again = run([*launch, f"max_duration={end}ba", f"save_folder={folder}"], tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"autoresume: resuming from {saved} (batch {stop} of {end}," in again.stderr, again.stderr[-3000:]
    straight = run([*launch, f"max_duration={end}ba", f"save_folder={tmp_path / 'a'}"], tmp_path)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    resumed = tmp_path / "b" / f"ep0-ba{end}"
    download_folder(s3, f"run/ep0-ba{end}/", resumed)
    assert_same_weights(sharded_state(tmp_path / "a" / f"ep0-ba{end}"), sharded_state(resumed), end)


@pytest.mark.slow
def test_sigterm_to_every_process_is_a_stop_with_its_checkpoint_not_a_crash(tmp_path, mds_images):
    """scancel's SIGTERM (twice, as a second scancel would) to every process of a 2-rank run on MDS shards with 2
    loader workers a rank, launched as the README does (`composer -n 2`, whose script this package installs:
    diffusion/launch.py): the launcher passes it on once, the ranks stop after the same batch and save one
    checkpoint, and the launcher says so in one line and exits 5. Composer's own launcher printed its
    SystemExit(143) traceback and each rank's exit 5 as a crash; and the workers died of the signal, so each rank
    failed ("DataLoader worker ... is killed by signal: Terminated") instead of saving (data/loader_workers.py)."""
    from diffusion.checkpointing.local import check_checkpoint

    cmd = [composer_launcher(), "-n", "2", str(REPO / "train.py"),
           str(REPO / "yamls/sd-tiny-cpu.yaml"), "use_synth_data=false", f"local={mds_images}", "num_workers=2",
           "eval_interval=null", "batch_size=4", "progress=lines", "log_interval=1ba", "save_interval=100000ba",
           "autoresume=true", f"save_folder={tmp_path / 'ck'}", "max_duration=100000ba"]  # fmt: skip
    proc, out = _signal_after(cmd, tmp_path, blocks=2)
    assert proc.returncode == 5, out[-3000:]
    assert "Traceback" not in out and "crashed" not in out and "exited with code" not in out, out[-3000:]
    assert "killed by signal" not in out, out[-3000:]
    assert "launch: SIGTERM: passed to the 2 running ranks" in out, out[-3000:]
    stop = int(re.search(r"stopped by SIGTERM after batch (\d+)", out)[1])
    assert check_checkpoint(str(tmp_path / f"ck/ep0-ba{stop}-rank0.pt")) is None
    assert out.rstrip().endswith(
        "launch: stopped on SIGTERM: every rank saved the checkpoint of its last batch and exited 5; run the same "
        "command with autoresume to go on"
    ), out[-3000:]
