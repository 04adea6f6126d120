"""single-node/run.sh and multi-node/launch.sbatch without a cluster: fake srun/scontrol/python (the launcher)/docker
executables on PATH record what would run on each node, and the tests check ranks, world size,
rendezvous, pass-through arguments, logs and fail-fast flags. Plus shellcheck on every script.

tests/test_slurm.py runs the same scripts under a real Slurm; these cover what it cannot start here: Pyxis's
--container-* flags, the EFA settings, GPUs listed by nvidia-smi, and 4-node jobs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SCRIPTS = sorted(
    p for d in ("docker", "single-node", "multi-node") for p in (REPO / d).glob("*") if p.suffix in (".sh", ".sbatch")
)
ARGS = ["benchmark.py", "--use_synth_data", "--wandb_name", "two words", "--max_duration", "4ba"]

# Each fake appends what it saw to $FAKE_LOG/events.jsonl; SLURM_NODEID tells the nodes apart.
RECORD = """import json, os, sys
def record(what, **kw):
    with open(os.path.join(os.environ["FAKE_LOG"], "events.jsonl"), "a") as f:
        f.write(json.dumps({"what": what, "node": os.environ.get("SLURM_NODEID", "local"), **kw}) + "\\n")
"""
FAKES = {
    "python": RECORD
    + """assert sys.argv[1:3] == ["-m", "diffusion.launch"], sys.argv  # run.sh's one use of python: the launcher
record("launch", argv=sys.argv[3:], cwd=os.getcwd(),
       env={k: os.environ.get(k) for k in ("FI_PROVIDER", "FAKE_VENV")})
print("fake launcher on node", os.environ.get("SLURM_NODEID"))
sys.exit(1 if os.environ.get("FAKE_FAIL_NODE", "none") == os.environ.get("SLURM_NODEID") else 0)
""",
    "scontrol": RECORD
    + """record("scontrol", argv=sys.argv[1:])
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(os.environ["FAKE_NODES"].split(",")))
""",
    "srun": RECORD
    + """import subprocess
args, opts = sys.argv[1:], []
while args[0].startswith("--"):
    opts.append(args.pop(0))
record("srun", opts=opts, command=args)
opt = dict(o[2:].split("=", 1) for o in opts)
procs = []
for i, host in enumerate(os.environ["FAKE_NODES"].split(",")[:int(opt["nodes"])]):
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0", SLURMD_NODENAME=host)
    out = open(opt["output"].replace("%n", str(i)), "a")
    procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT))
sys.exit(max(p.wait() for p in procs))
""",
    "nvidia-smi": "import sys\nprint('\\n'.join(f'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})' for i in range(4)))\n",
    "docker": RECORD
    + """record("docker", argv=sys.argv[1:])
""",
}


def fake_env(tmp_path: Path, nodes: list[str], **extra: str) -> tuple[Path, dict]:
    """A copy of the launch scripts (so logs land in tmp_path) and an environment with the fakes first on PATH."""
    repo = tmp_path / "repo"
    for d in ("single-node", "multi-node"):
        shutil.copytree(REPO / d, repo / d)
    bin_dir, log = tmp_path / "bin", tmp_path / "fake-log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "FI_", "NCCL_"))
        and k
        not in (
            "NNODES",
            "NODE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "LOG_DIR",
            "VENV",
            "GPUS_PER_NODE",
            "CUDA_VISIBLE_DEVICES",
            "CONTAINER_IMAGE",
        )
    }
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), FAKE_NODES=",".join(nodes), **extra)
    return repo, env


def events(env: dict, what: str) -> list[dict]:
    lines = (Path(env["FAKE_LOG"]) / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["what"] == what]


def sbatch(
    repo: Path, env: dict, nodes: int, job_id: int, *args: str, gpus_per_node: str | None = "8"
) -> subprocess.CompletedProcess:
    """What sbatch would start on the first node: the batch script with Slurm's job variables (with the template's
    --exclusive, SLURM_GPUS_ON_NODE is the whole node's 8 whatever --gpus-per-node asked for)."""
    env = dict(
        env,
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NAME="diffusion",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_NODELIST=f"gpu-st-[1-{nodes}]",
        SLURM_SUBMIT_DIR=str(repo),
        SLURM_GPUS_ON_NODE="8",
        **({"SLURM_GPUS_PER_NODE": gpus_per_node} if gpus_per_node is not None else {}),
    )
    return subprocess.run(
        ["bash", str(repo / "multi-node/launch.sbatch"), *args],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("nodes,job_id", [(1, 59999), (2, 123456), (4, 4_000_000_007)])
def test_sbatch_starts_one_launcher_per_node_with_its_rank(tmp_path, nodes, job_id):
    hosts = [f"gpu-st-{i + 1}" for i in range(nodes)]
    repo, env = fake_env(tmp_path, hosts)
    proc = sbatch(repo, env, nodes, job_id, *ARGS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    port = 20000 + job_id % 40000
    assert 20000 <= port < 60000
    log_dir = repo / "logs" / f"diffusion-{job_id}"
    (scontrol,) = events(env, "scontrol")
    assert scontrol["argv"] == ["show", "hostnames", f"gpu-st-[1-{nodes}]"]
    (srun,) = events(env, "srun")
    assert {
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--open-mode=append",
        f"--output={log_dir}/node%n.log",
    } <= set(srun["opts"])
    assert not any(o.startswith("--container") for o in srun["opts"])
    calls = {e["node"]: e for e in events(env, "launch")}
    assert sorted(calls) == [str(i) for i in range(nodes)]
    for i in range(nodes):
        assert calls[str(i)]["argv"] == [
            "-n",
            "8",
            "--world_size",
            str(8 * nodes),
            "--node_rank",
            str(i),
            "--master_addr",
            "gpu-st-1",
            "--master_port",
            str(port),
            "--stdout",
            f"{log_dir}/rank{{rank}}.stdout",
            "--stderr",
            f"{log_dir}/rank{{rank}}.stderr",
            *ARGS,
        ]
        assert calls[str(i)]["cwd"] == str(repo)
        assert f"fake launcher on node {i}" in (log_dir / f"node{i}.log").read_text()


@pytest.mark.parametrize(
    "gpus_per_node,extra,ranks",
    [("h100:4", {}, "4"), ("0", {}, "1"), (None, {}, "4"), (None, {"CUDA_VISIBLE_DEVICES": "0,1"}, "2"),
     ("8", {"GPUS_PER_NODE": "2"}, "2")],
    ids=["typed", "no-gpus", "nvidia-smi", "step-devices", "override"],
)  # fmt: skip
def test_sbatch_ranks_per_node_come_from_the_jobs_request_not_the_whole_node(tmp_path, gpus_per_node, extra, ranks):
    """--gpus-per-node (maybe TYPE:N) gives the ranks; without it each node counts what its step sees
    (CUDA_VISIBLE_DEVICES, else the 4 GPUs the fake nvidia-smi lists); GPUS_PER_NODE overrides both."""
    repo, env = fake_env(tmp_path, ["a", "b"], **extra)
    proc = sbatch(repo, env, 2, 80, *ARGS, gpus_per_node=gpus_per_node)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for call in events(env, "launch"):
        assert call["argv"][:4] == ["-n", ranks, "--world_size", str(2 * int(ranks))]


def test_sbatch_in_a_pyxis_container_with_efa_settings(tmp_path):
    repo, env = fake_env(
        tmp_path, ["a", "b"], CONTAINER_IMAGE="/fsx/diffusion+latest.sqsh", CONTAINER_MOUNTS="/fsx:/fsx", AWS_EFA="1"
    )
    assert sbatch(repo, env, 2, 77, *ARGS).returncode == 0
    (srun,) = events(env, "srun")
    assert {
        "--container-image=/fsx/diffusion+latest.sqsh",
        f"--container-mounts={repo}:{repo},/fsx:/fsx",
        f"--container-workdir={repo}",
    } <= set(srun["opts"])
    assert srun["command"] == ["bash", f"{repo}/single-node/run.sh", *ARGS]
    assert {e["env"]["FI_PROVIDER"] for e in events(env, "launch")} == {"efa"}


def test_sbatch_fails_when_one_node_fails(tmp_path):
    repo, env = fake_env(tmp_path, ["a", "b"], FAKE_FAIL_NODE="1")
    proc = sbatch(repo, env, 2, 78, *ARGS)
    assert proc.returncode != 0 and len(events(env, "launch")) == 2


def test_sbatch_without_a_script_is_one_line(tmp_path):
    repo, env = fake_env(tmp_path, ["a"])
    proc = sbatch(repo, env, 1, 79)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "launch.sbatch: error: name the script to run, e.g. sbatch multi-node/launch.sbatch benchmark.py --use_synth_data"
    ]


def run_sh(repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(repo / "single-node/run.sh"), *args], env=env, cwd=repo, capture_output=True, text=True, timeout=60
    )


def test_single_node_uses_every_gpu_and_passes_args_through(tmp_path):
    repo, env = fake_env(tmp_path, [])
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/activate").write_text("export FAKE_VENV=1\n")
    assert run_sh(repo, env, *ARGS).returncode == 0
    assert run_sh(repo, env, "--gpus", "2", "--venv", str(venv), *ARGS).returncode == 0
    first, second = events(env, "launch")
    assert first["argv"] == ["-n", "4", *ARGS] and first["env"]["FAKE_VENV"] is None  # 4 GPUs from nvidia-smi
    assert second["argv"] == ["-n", "2", *ARGS] and second["env"]["FAKE_VENV"] == "1"


def test_single_node_in_docker(tmp_path):
    repo, env = fake_env(tmp_path, [])
    assert run_sh(repo, env, "--image", "diffusion:latest", "--gpus", "8", *ARGS).returncode == 0
    (docker,) = events(env, "docker")
    argv = docker["argv"]
    assert argv[:4] == ["run", "--rm", "--gpus", "all"] and f"{repo}:{repo}" in argv
    assert argv[argv.index("diffusion:latest") :] == [
        "diffusion:latest",
        "bash",
        f"{repo}/single-node/run.sh",
        "--gpus",
        "8",
        *ARGS,
    ]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--bogus", "benchmark.py"], "unknown option --bogus"),
        ([], "name the script to run"),
        (["--gpus", "two", "benchmark.py"], "--gpus two is not a positive number"),
    ],
)
def test_single_node_bad_input_is_one_line(tmp_path, argv, message):
    repo, env = fake_env(tmp_path, [])
    proc = run_sh(repo, env, *argv)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("run.sh: error: ") and message in err[0]


def test_shellcheck_clean():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck); the scripts were not linted")
    assert len(SCRIPTS) >= 3, SCRIPTS
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
