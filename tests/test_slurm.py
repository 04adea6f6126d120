"""The batch templates under a real Slurm 22.05 cluster started on this machine (tests/slurm_cluster.py: munged,
slurmctld, two slurmd nodes in network namespaces of their own, 8 GRES GPUs each backed by /dev/null): jobs
run as written to COMPLETED, ranks per node follow what the step really has, a failing node ends the job, and
a job stopped by the time-limit warning or scancel loses nothing (bitwise equal to an uninterrupted run)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_same_weights, read_results, sharded_state

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TEMPLATE = str(REPO / "multi-node" / "launch.sbatch")
RUN_SH = str(REPO / "single-node" / "run.sh")

# A rank that records what it was given (and, asked to, fails on node 1 while node 0 waits).
RANKS_PY = """import json, os, socket, sys, time
out, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES")
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({**{k: os.environ.get(k) for k in keys}, "host": socket.gethostname()}, f)
if mode == "fail-on-node-1":
    sys.exit(3) if os.environ["NODE_RANK"] == "1" else time.sleep(600)
"""


def job_env(tmp_path: Path, **extra: str) -> dict:
    """The submitter's environment: this Python's tools first on PATH (sbatch exports it to the job), no
    Slurm variables of an enclosing job, logs under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("GPUS_PER_NODE", "VENV")}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", REPO=str(REPO), PYTHONUNBUFFERED="1")
    env["OMP_NUM_THREADS"] = "1"  # two nodes' ranks share 2 cores: 2 threads each made a batch 10x slower
    env.setdefault("LOG_DIR", str(tmp_path / "logs"))
    env.update(extra)
    return env


def batch_output(cwd: Path, job: int) -> str:
    path = cwd / f"slurm-diffusion-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def finished(slurm, job: int, cwd: Path, timeout: float = 240, log_dir: Path | None = None) -> dict:
    """Wait for the job to end; on a timeout, what it printed."""
    try:
        return slurm.wait(job, timeout)
    except TimeoutError:
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted((log_dir or cwd).glob("**/node*.log")))
        slurm.run("scancel", str(job), check=False)
        raise AssertionError(f"job {job} did not end: {batch_output(cwd, job)[-2000:]}\n{logs}") from None


def ranks_seen(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.fixture
def ranks_py(tmp_path) -> Path:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_PY)
    (tmp_path / "out").mkdir()
    return script


@pytest.mark.parametrize(
    "sbatch_args,extra,per_node",
    [
        (["--gpus-per-node=2"], {}, 2),  # with the template's --exclusive the batch script sees all 8 GPUs
        (["--gpus-per-node=0"], {}, 1),  # no GPUs: one CPU rank per node
        ([], {"GPUS_PER_NODE": "1"}, 1),  # the user's own count wins over the template's 8
    ],
    ids=["gpus-per-node-2-exclusive", "cpu", "GPUS_PER_NODE"],
)
def test_ranks_per_node_follow_the_gpus_the_step_has(slurm, tmp_path, ranks_py, sbatch_args, extra, per_node):
    env = job_env(tmp_path, **extra)
    job = slurm.sbatch("--nodes=2", *sbatch_args, TEMPLATE, str(ranks_py), str(tmp_path / "out"), cwd=tmp_path, env=env)
    info = finished(slurm, job, tmp_path)
    assert info["JobState"] == "COMPLETED", batch_output(tmp_path, job)
    seen = ranks_seen(tmp_path / "out")
    assert len(seen) == 2 * per_node
    assert {r["WORLD_SIZE"] for r in seen} == {str(2 * per_node)}
    assert {r["LOCAL_WORLD_SIZE"] for r in seen} == {str(per_node)}
    assert {(r["host"], r["NODE_RANK"]) for r in seen} == {("node1", "0"), ("node2", "1")}
    assert {r["MASTER_ADDR"] for r in seen} == {"node1"}
    if sbatch_args == ["--gpus-per-node=2"]:
        assert {r["CUDA_VISIBLE_DEVICES"] for r in seen} == {"0,1"}


def test_a_failing_node_ends_the_job_on_every_node(slurm, tmp_path, ranks_py):
    env = job_env(tmp_path)
    t0 = time.time()
    job = slurm.sbatch(
        "--nodes=2", "--gpus-per-node=0", TEMPLATE, str(ranks_py), str(tmp_path / "out"), "fail-on-node-1",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    info = finished(slurm, job, tmp_path, timeout=120)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0"
    assert time.time() - t0 < 90  # node 0 would wait 600 s: --kill-on-bad-exit ended it
    assert len(ranks_seen(tmp_path / "out")) == 2


def test_run_sh_under_srun_counts_the_gpus_of_its_step(slurm, tmp_path, ranks_py):
    env = job_env(tmp_path)
    env.pop("LOG_DIR")
    for gpus in (3, 1):
        out = tmp_path / f"out{gpus}"
        out.mkdir()
        proc = slurm.run(
            "srun", "--nodes=1", f"--gpus-per-node={gpus}", RUN_SH, str(ranks_py), str(out),
            cwd=tmp_path, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        seen = ranks_seen(out)
        assert len(seen) == gpus and {r["WORLD_SIZE"] for r in seen} == {str(gpus)}
        assert {r["CUDA_VISIBLE_DEVICES"] for r in seen} == {",".join(map(str, range(gpus)))}


def test_benchmark_on_one_node_with_run_sh_as_the_batch_script(slurm, tmp_path):
    results = tmp_path / "results.jsonl"
    args = ["--use_synth_data", "--model_name", "sd-tiny", "--batch_size", "4", "--num_workers", "0"]
    job = slurm.sbatch(
        "--nodes=1", "--gpus-per-node=0", "--output", str(tmp_path / "slurm-%j.out"), RUN_SH, "benchmark.py", *args,
        "--max_duration", "4ba", "--results", str(results), cwd=REPO, env=job_env(tmp_path),
    )  # fmt: skip
    info = finished(slurm, job, tmp_path)
    assert info["JobState"] == "COMPLETED", (tmp_path / f"slurm-{job}.out").read_text()[-3000:]
    (record,) = read_results(results)
    assert record["world_size"] == 1 and record["host"] == "node1"


def _git_status() -> set[str]:
    proc = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    return set(proc.stdout.splitlines()) if proc.returncode == 0 else set()


def test_benchmark_on_two_nodes_from_the_checkout(slurm, tmp_path):
    """As the README says it: submitted from the checkout's root, logs where the docs say, git status clean."""
    before = _git_status()
    results = tmp_path / "results.jsonl"
    env = job_env(tmp_path)
    env.pop("LOG_DIR")  # the default: logs/<name>-<id> in the checkout
    job = slurm.sbatch(
        "--nodes", "2", "--gpus-per-node=0", TEMPLATE, "benchmark.py", "--use_synth_data", "--model_name", "sd-tiny",
        "--batch_size", "8", "--num_workers", "0", "--max_duration", "6ba", "--results", str(results),
        cwd=REPO, env=env,
    )  # fmt: skip
    out, logs = REPO / f"slurm-diffusion-{job}.out", REPO / "logs" / f"diffusion-{job}"
    try:
        info = finished(slurm, job, REPO, log_dir=logs)
        assert info["JobState"] == "COMPLETED", out.read_text()[-3000:]
        (record,) = read_results(results)
        assert record["world_size"] == 2 and record["num_nodes"] == 2
        assert {r["host"] for r in record["slowest_ranks"]} == {"node1", "node2"}
        assert out.exists() and (logs / "node0.log").exists() and (logs / "node1.log").exists()
        assert _git_status() == before
    finally:
        out.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(logs)])


# Preemption: train.py on 2 nodes (one rank each), synthetic data read by 2 loader workers a rank (Slurm signals them
# too), a checkpoint every 10 batches.
BATCHES = 80


def _train_args(folder: Path) -> list[str]:
    return [
        "train.py", str(REPO / "yamls" / "sd-tiny-cpu.yaml"), "eval_interval=null", "num_workers=2",
        f"max_duration={BATCHES}ba", "save_interval=10ba", "save_num_checkpoints_to_keep=-1",
        f"save_folder={folder}", "progress=lines", "fsdp=true",
    ]  # fmt: skip


def _saved(batch: int) -> str:
    """What exists once the sharded checkpoint of ``batch`` is whole: its folder's .metadata (written last)."""
    return f"ep0-ba{batch}/.metadata"


def _wait_for(path_glob, folder: Path, job: int, slurm, what: str, timeout: float = 360) -> None:
    """Until ``path_glob`` is in ``folder``: a requeued job starts again from nothing (imports, the model, the
    checkpoint) before it trains up to the next save; CI's two test processes once took more than 180 s."""
    deadline = time.time() + timeout
    while not list(folder.glob(path_glob)):
        state = slurm.job(job).get("JobState")
        log = folder.parent / "logs" / "node0.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no node0.log yet)"
        assert state in ("PENDING", "RUNNING", "REQUEUED"), f"job {job} is {state} before {what}: {tail}"
        assert time.time() < deadline, f"no {what} after {timeout} s (job {job} {state}): {tail}"
        time.sleep(0.05)


def _stops(log: Path) -> list[tuple[str, int]]:
    """(signal, batch) of each stop train.py reported in the node log, and the checkpoint it names is there."""
    from diffusion.checkpointing.local import check_checkpoint

    found = re.findall(r"stopped by (SIG\w+) after batch (\d+): the checkpoint (\S+) is whole", log.read_text())
    assert all(check_checkpoint(path) is None for *_, path in found), found
    return [(sig, int(batch)) for sig, batch, _ in found]


def _restarted(slurm, job: int, restarts: int, cwd: Path) -> None:
    """Wait until the job has been requeued ``restarts`` times and may run again (Slurm holds a requeued job ~2
    minutes before it may start again: started now)."""
    deadline = time.time() + 120
    while (info := slurm.job(job))["Restarts"] != str(restarts) or info["JobState"] not in ("PENDING", "RUNNING"):
        assert info["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED"), batch_output(cwd, job)
        assert time.time() < deadline, f"job {job} was not requeued: {batch_output(cwd, job)[-2000:]}"
        time.sleep(0.2)
    if info["JobState"] == "PENDING":
        slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now")


# One case, fsdp=true: a plain DDP case (~130 s) and a LoRA one (DDP, ~200 s) left CI's time budget (2026-11-27 and
# 2026-11-28); the stop itself is the same for every model and mode (callbacks/preemption.py): the DDP stop on SIGTERM
# is test_preemption.py's launcher test, LoRA's checkpoints and resume are test_lora.py's.
def test_time_limit_warning_requeue_and_scancel_lose_nothing(slurm, tmp_path):
    """An uninterrupted run, then the same run warned (SIGUSR1 to the batch script, as --signal=B:USR1@N does):
    every rank stops at one batch, saves, the job requeues itself and resumes; then requeued from outside
    (`scontrol requeue`, as an admin or a preemption with PreemptMode=REQUEUE does: SIGTERM to every process of the
    job, the batch script, ranks and loader workers): saved again, requeued, resumed; then `scancel`, which ends a
    job as its time limit does (slurmd's terminate path: SIGTERM to the batch script and every process of its steps,
    SIGKILL after KillWait, 5 s here): saved again, the job ends; the same command submitted again finishes. Final
    weights bitwise equal. With fsdp=true each save is one sharded folder written by both nodes' ranks together (a
    collective). Before data/loader_workers.py a loader worker died of the SIGTERM and its rank failed mid-save."""
    env = job_env(tmp_path)
    args = _train_args(tmp_path / "a")
    full = slurm.sbatch("--nodes=2", "--gpus-per-node=0", TEMPLATE, *args, cwd=tmp_path, env=env)
    assert finished(slurm, full, tmp_path, timeout=400)["JobState"] == "COMPLETED", batch_output(tmp_path, full)

    folder = tmp_path / "b"
    resumable = _train_args(folder)  # the same command, submitted again after the scancel
    job = slurm.sbatch("--nodes=2", "--gpus-per-node=0", TEMPLATE, *resumable, cwd=tmp_path, env=env)
    _wait_for(_saved(10), folder, job, slurm, "first checkpoint")
    slurm.run("scancel", "--batch", f"--signal={signal.SIGUSR1.name[3:]}", str(job))
    _restarted(slurm, job, 1, tmp_path)
    node0 = tmp_path / "logs" / "node0.log"
    ((sig, first),) = _stops(node0)
    assert sig == "SIGUSR1" and 10 <= first < BATCHES

    _wait_for(_saved((first // 10 + 1) * 10), folder, job, slurm, "a checkpoint after the first restart")
    slurm.run("scontrol", "requeue", str(job))
    _restarted(slurm, job, 2, tmp_path)
    assert [s for s, _ in _stops(node0)] == ["SIGUSR1", "SIGTERM"], _stops(node0)
    second = _stops(node0)[1][1]
    assert second > first

    _wait_for(_saved((second // 10 + 1) * 10), folder, job, slurm, "a checkpoint after the second restart")
    slurm.run("scancel", str(job))  # Slurm's end of a job, as at its time limit: SIGTERM, then SIGKILL after KillWait
    assert finished(slurm, job, tmp_path, timeout=60)["JobState"] == "CANCELLED"
    *_, (sig, third) = _stops(node0)
    assert sig == "SIGTERM" and third > second and len(_stops(node0)) == 3, _stops(node0)
    batch = batch_output(tmp_path, job)
    assert "time-limit warning (SIGUSR1)" in batch and f"requeueing job {job}" in batch
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("node*.log"))
    assert "killed by signal" not in logs, logs[-3000:]

    again = slurm.sbatch("--nodes=2", "--gpus-per-node=0", TEMPLATE, *resumable, cwd=tmp_path, env=env)
    assert finished(slurm, again, tmp_path, timeout=400)["JobState"] == "COMPLETED", batch_output(tmp_path, again)
    assert f"ep0-ba{third} (batch {third} of {BATCHES}," in node0.read_text(), node0.read_text()[-3000:]  # resumed

    final = sharded_state(tmp_path / "a" / f"ep0-ba{BATCHES}"), sharded_state(folder / f"ep0-ba{BATCHES}")
    assert_same_weights(*final, BATCHES)
