"""Aspect-ratio buckets on two nodes across epoch ends, under the real Slurm cluster of tests/slurm_cluster.py.
Buckets are Streaming streams read with ``per_stream`` batching (diffusion/data/loaders.py): each global batch
comes whole from one bucket, the partial batch at a bucket's edge is left out for every rank alike, and the padding
Streaming adds for loader workers is whole global batches of nothing. So every rank of every node runs the same
number of batches each epoch, whatever the bucket sizes. (``device_per_stream``, where each rank's batch may come
from another bucket, pads the nodes apart: Photoroom's PRX patches Streaming for the NCCL hang that gives at an
epoch's end. We do not use it.) This is the proof on two nodes, one CPU rank each, two loader workers per rank:
buckets of 7, 6 and 5 samples that no global batch divides, a run past two epoch ends, each rank's batches per
epoch counted from Composer's own per-rank log (progress=metrics: ``time/batch_in_epoch`` at every batch), run as
two jobs at once sharing the two nodes, the job stopped by SIGTERM to every process inside the second epoch and
submitted again, whose final weights and EMA must be bitwise those of an uninterrupted run."""

import re
import time
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import REPO, assert_same_weights, final_state, write_mds_aspects
from test_slurm import TEMPLATE, _wait_for, batch_output, finished, job_env

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# 1x1, 2x1 and 1x2 samples, 3, 2 and 1 over a multiple of the global batch of 4 (2 a rank, 2 ranks). Streaming
# splits each bucket over the 2 nodes (an odd one padded with one of its samples again), so a bucket of n gives
# n // 4 + (n % 4 == 3) whole global batches: 2 + 1 + 1 = 4 an epoch; one sample of the 7 is read twice, 2 of the
# 6 and 1 of the 5 are left out.
COUNTS = (7, 6, 5)
EPOCH = 4
BATCHES = 2 * EPOCH + 2  # two epoch ends, and 2 batches into the third epoch
LAST = list(range(BATCHES - 2 * EPOCH))


def _train(folder: Path, data: Path) -> list[str]:
    return [
        "train.py", str(REPO / "yamls" / "sd-tiny-cpu.yaml"), "use_synth_data=false", f"local={data}",
        "batch_size=4", "num_workers=2", "eval_interval=null", f"max_duration={BATCHES}ba", "save_interval=1ba",
        f"save_folder={folder}", "progress=metrics", "log_interval=1ba",
    ]  # fmt: skip


def batches_per_epoch(log: Path) -> dict[int, list[int]]:
    """The batches one rank ran, by epoch, from Composer's console log of that rank (its node's log): each
    ``[batch=B/N]:`` block carries ``time/batch_in_epoch`` k, the rank's own count before that batch, so its epoch
    began after global batch B - 1 - k. {that batch: [k, ...] in the order run}."""
    ran = defaultdict(list)
    for batch, block in re.findall(r"\[batch=(\d+)/\d+\]:((?:\n\t .*)*)", log.read_text(errors="replace")):
        k = int(re.search(r"Train time/batch_in_epoch: (\d+)", block)[1])
        ran[int(batch) - 1 - k].append(k)
    return dict(ran)


def test_buckets_on_two_nodes_keep_every_rank_in_step_across_epoch_ends_and_a_resume(slurm, tmp_path):
    t0 = time.time()
    data = tmp_path / "buckets"
    from diffusion.data.bucket_split import split_buckets

    assert split_buckets(str(write_mds_aspects(tmp_path / "mds", COUNTS)), str(data))["buckets"] == {
        "1x1": 7, "2x1": 6, "1x2": 5,
    }  # fmt: skip
    sbatch = ("--nodes=2", "--gpus-per-node=0", TEMPLATE)

    # The whole run, as two jobs at once on the same two nodes (--oversubscribe over the template's --exclusive, as
    # a user without it shares nodes): both make their datasets on both nodes at the same time, and both run whole.
    # (A node lock held through Streaming's barrier deadlocked two such jobs; shared_memory.registering.)
    logs = [tmp_path / "full", tmp_path / "full-beside"]
    jobs = [
        slurm.sbatch("--oversubscribe", "--nodelist=node1,node2", *sbatch, *_train(tmp_path / f, data), cwd=tmp_path,
                     env=job_env(tmp_path, LOG_DIR=str(log)))
        for f, log in zip(("a", "a2"), logs)
    ]  # fmt: skip
    for job, log in zip(jobs, logs):
        assert finished(slurm, job, tmp_path, log_dir=log)["JobState"] == "COMPLETED", batch_output(tmp_path, job)
    times = [slurm.job(job) for job in jobs]  # Slurm's own record: they ran at the same time
    assert max(t["StartTime"] for t in times) < min(t["EndTime"] for t in times), times
    took = [time.time() - t0]
    full = [batches_per_epoch(logs[0] / f"node{n}.log") for n in (0, 1)]
    whole = {0: list(range(EPOCH)), EPOCH: list(range(EPOCH)), 2 * EPOCH: LAST}
    assert full == [whole, whole], full
    assert_same_weights(final_state(tmp_path / "a"), final_state(tmp_path / "a2"), BATCHES)

    # Stopped by `scancel --signal=TERM` (SIGTERM to every process of the job's steps: launchers, ranks and their
    # loader workers, as a preemption or the time limit does) once a checkpoint inside the second epoch is whole:
    # every rank saves the batch it stopped after, then the same job is submitted again. (Before
    # data/loader_workers.py, the workers died of it and each rank failed with "DataLoader worker ... is killed by
    # signal: Terminated" instead of saving.)
    cmd, first, again = _train(tmp_path / "b", data), tmp_path / "killed", tmp_path / "resumed"
    job = slurm.sbatch(*sbatch, *cmd, cwd=tmp_path, env=job_env(tmp_path, LOG_DIR=str(first)))
    _wait_for(f"ep1-ba{EPOCH + 1}-rank0.pt", tmp_path / "b", job, slurm, "checkpoint inside the second epoch")
    slurm.run("scancel", "--signal=TERM", str(job))
    assert finished(slurm, job, tmp_path, timeout=90, log_dir=first)["JobState"] in ("FAILED", "CANCELLED")
    stopped = (first / "node0.log").read_text(errors="replace")
    assert "killed by signal" not in stopped and "stopped by SIGTERM after batch" in stopped, stopped[-3000:]

    took.append(time.time() - t0 - sum(took))
    job = slurm.sbatch(*sbatch, *cmd, cwd=tmp_path, env=job_env(tmp_path, LOG_DIR=str(again)))
    assert finished(slurm, job, tmp_path, log_dir=again)["JobState"] == "COMPLETED", batch_output(tmp_path, job)
    took.append(time.time() - t0 - sum(took))
    start = int(re.search(r"autoresume: resuming from \S+/ep1-ba(\d+)-rank0.pt", (again / "node0.log").read_text())[1])
    assert EPOCH < start < 2 * EPOCH, f"resumed from batch {start}, not inside the second epoch"
    killed, resumed = ([batches_per_epoch(log / f"node{n}.log") for n in (0, 1)] for log in (first, again))
    for before, after in zip(killed, resumed):  # the rest of the second epoch, from the batch after the checkpoint
        assert before[0] == whole[0] and before[EPOCH][: start - EPOCH] == list(range(start - EPOCH)), before
        assert after == {EPOCH: list(range(start - EPOCH, EPOCH)), 2 * EPOCH: LAST}, after
    counts = [[len(before[0]), start - EPOCH + len(after[EPOCH]), len(after[2 * EPOCH])]
              for before, after in zip(killed, resumed)]  # fmt: skip

    assert_same_weights(final_state(tmp_path / "a"), final_state(tmp_path / "b"), BATCHES)
    print(f"batches per epoch, ranks 0 and 1: {[[len(r) for r in ran.values()] for ran in full]} (whole run), "
          f"{counts} (killed, resumed from batch {start}); jobs {', '.join(f'{t:.0f}' for t in took)} s")  # fmt: skip


def test_a_bucket_no_global_batch_can_come_from_on_four_nodes_is_left_out_in_one_line(slurm, tmp_path):
    """On 4 nodes (one CPU rank each, 2 loader workers, a global batch of 4), buckets of 3 and 5 samples give
    Streaming's per_stream batching no whole global batch once it splits them over the nodes (its numpy
    "could not broadcast" error in every loader worker at the first batch, before buckets.whole_global_batches):
    the run names them in one line from rank 0 and every rank trains the same batches on the rest."""
    from diffusion.data.bucket_split import split_buckets

    data = tmp_path / "buckets"
    split_buckets(str(write_mds_aspects(tmp_path / "mds", (40, 3, 5))), str(data))
    logs, args = tmp_path / "logs", _train(tmp_path / "ck", data)
    args[args.index(f"max_duration={BATCHES}ba")] = "max_duration=3ba"
    job = slurm.sbatch(
        "--nodes=4", "--gpus-per-node=0", TEMPLATE, *args, cwd=tmp_path, env=job_env(tmp_path, LOG_DIR=str(logs))
    )
    assert finished(slurm, job, tmp_path, log_dir=logs)["JobState"] == "COMPLETED", batch_output(tmp_path, job)
    first = (logs / "node0.log").read_text(errors="replace")
    (line,) = [line for line in first.splitlines() if line.startswith(f"buckets: local {data}: ")]
    assert "bucket 2x1 (3 samples)" in line and "bucket 1x2 (5 samples)" in line and "left out of this run" in line
    assert "cannot fill one whole global batch of 4 (4 nodes x 1 rank x batch_size=1)" in line, line
    assert [batches_per_epoch(logs / f"node{n}.log") for n in range(4)] == [{0: [0, 1, 2]}] * 4
