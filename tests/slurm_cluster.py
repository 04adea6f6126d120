"""A real Slurm cluster on this machine, for the tests of the batch templates: munged, slurmctld and one
slurmd per node, from Debian's slurm-wlm 22.05 and munge packages.

Each node is a network namespace of its own (a bridge and veth pairs in a private /24 made here; no other
address is ever contacted) with its own hostname and a private /etc/hosts bind-mounted in its own mount
namespace, so ranks on different "nodes" meet over a real network by name, as on a cluster. Each node also has
its own /dev/shm (a tmpfs mounted in that mount namespace) and its own temp folder (TMPDIR, set for every task
by a TaskProlog), as separate machines have: Streaming keeps its state in /dev/shm and its file locks in the temp
folder, and so does diffusion/data/shared_memory.py its claims on prefixes. (Shared, a node lock this project
once held while registering a dataset hung a two-node run on MDS shards at its start: the first rank of one node
held it while Streaming's barrier waited for the other node's first rank, which waited for the lock.) The controller runs in
this namespace on the bridge's address. GPUs are a GRES count backed by symlinks to /dev/null, so
``--gpus-per-node`` is accepted and sets CUDA_VISIBLE_DEVICES as on a GPU node, and jobs run on the CPU.

Everything lives under one directory (config, munge key and socket, state, logs); ``stop`` ends only the
processes this started (by PID, plus whatever runs inside its own namespaces) and removes the namespaces
and links it made. ``python tests/slurm_cluster.py DIR`` brings one up by hand (Ctrl-C stops it).

Needs root, network namespaces, ``ip``, ``nsenter``, ``unshare``; ``unavailable()`` says why not in one line.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "ip", "nsenter", "unshare", "runuser")
APT = "apt-get install -y slurmctld slurmd slurm-client munge iproute2"


def unavailable() -> str | None:
    """Why a cluster cannot be brought up here (one line), or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (network namespaces, munged as the munge user)"
    missing = [p for p in PROGRAMS if not shutil.which(p, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if missing:
        return f"{', '.join(missing)} not installed ({APT})"
    probe = f"dfprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"network namespaces are not available here ({made.stderr.strip()[:120]})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.224.0.0/11 that no address or route on this machine overlaps."""
    used = _sh("ip", "-4", "route", "show", "table", "all").stdout + _sh("ip", "-4", "addr").stdout
    taken = [ipaddress.ip_network(m, strict=False) for m in re.findall(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", used)]
    start = os.getpid() % 8000
    for i in range(8192):
        net = ipaddress.ip_network(f"10.{224 + (start + i) // 256 % 32}.{(start + i) % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free private /24 for the test cluster")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(pids: list[int], grace: float = 10.0, group: bool = False) -> None:
    """SIGTERM these PIDs (``group``: their process groups, each a daemon started in a session of its own,
    with its helpers), then SIGKILL whichever outlive ``grace`` seconds."""
    send = os.killpg if group else os.kill
    alive = []
    for pid in pids:
        try:
            send(pid, signal.SIGTERM)
            alive.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace
    while alive and time.time() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.1)
    for pid in alive:
        try:
            send(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _running(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class SlurmCluster:
    """``nodes`` slurmd nodes named node1..nodeN with ``gpus`` GRES GPUs each, under ``root``."""

    def __init__(self, root: Path, nodes: int = 2, gpus: int = 8, kill_wait: int = 5):
        self.root, self.nodes, self.gpus, self.kill_wait = Path(root), nodes, gpus, kill_wait
        self.tag = f"df{os.getpid() % 100000}"
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.netns: list[str] = []
        self.links: list[str] = []
        self.timings: dict[str, float] = {}

    @property
    def env(self) -> dict:
        """The environment that sbatch/srun/scontrol need to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    # -- bring-up --------------------------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        t0 = time.time()
        try:
            self._files()
            self._munge()
            self._network()
            self._daemons()
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        self.timings["bring_up_s"] = time.time() - t0
        return self

    def _files(self) -> None:
        net = _free_subnet()
        hosts = list(net.hosts())
        self.bridge_ip, self.node_ips = str(hosts[0]), [str(hosts[10 + i]) for i in range(self.nodes)]
        self.prefix = net.prefixlen
        for d in ("state", "log", "dev", "munge", "munge-run", *(f"spool/{n}" for n in self.names)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        for name in self.names:  # each node's temp folder
            (self.root / "tmp" / name).mkdir(parents=True, exist_ok=True)
            os.chmod(self.root / "tmp" / name, 0o1777)
        prolog = self.root / "task_prolog.sh"  # a TaskProlog's "export" lines go into the task's environment
        prolog.write_text(f'#!/bin/sh\necho "export TMPDIR={self.root}/tmp/$SLURMD_NODENAME"\n')
        prolog.chmod(0o755)
        for i in range(self.gpus):  # GRES needs device files; /dev/null stands in for each GPU
            link = self.root / "dev" / f"gpu{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        self.ctl_port, self.slurmd_port = free_port(), free_port()
        control_host = socket.gethostname().split(".")[0]  # slurmctld checks its own hostname against this
        lines = [
            "ClusterName=difftest",
            f"SlurmctldHost={control_host}({self.bridge_ip})",
            f"SlurmctldPort={self.ctl_port}",
            f"SlurmdPort={self.slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.root}/munge-run/munge.socket",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root}/state",
            f"SlurmdSpoolDir={self.root}/spool/%n",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root}/log/slurmctld.log",
            f"SlurmdLogFile={self.root}/log/slurmd-%n.log",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            f"TaskProlog={prolog}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "GresTypes=gpu",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            f"KillWait={self.kill_wait}",
            "MinJobAge=3600",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
        ]
        cpus = os.cpu_count() or 1
        for name, ip in zip(self.names, self.node_ips):
            lines.append(
                f"NodeName={name} NodeAddr={ip} CPUs={cpus} RealMemory=1000 Gres=gpu:{self.gpus} State=UNKNOWN"
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        last = f"[0-{self.gpus - 1}]" if self.gpus > 1 else "0"
        (self.root / "gres.conf").write_text(f"Name=gpu File={self.root}/dev/gpu{last}\n")
        self.hosts = self.root / "hosts"
        self.hosts.write_text(
            "127.0.0.1 localhost\n"
            + f"{self.bridge_ip} {control_host}\n"
            + "".join(f"{ip} {n}\n" for n, ip in zip(self.names, self.node_ips))
        )

    def _munge(self) -> None:
        """A munged of our own (own key, own socket), so the machine's munge is never touched."""
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for d in ("munge", "munge-run"):
            shutil.chown(self.root / d, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        (self.root / "munge").chmod(0o700)
        (self.root / "munge-run").chmod(0o755)  # munged wants its socket's folder open to all
        socket_path = self.root / "munge-run" / "munge.socket"
        self._spawn(
            "munged",
            [
                "runuser",
                "-u",
                "munge",
                "--",
                shutil.which("munged") or "/usr/sbin/munged",
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={self.root}/munge-run/munged.pid",
                f"--log-file={self.root}/munge/munged.log",
                f"--seed-file={self.root}/munge/munged.seed",
            ],
        )
        self._wait_for(socket_path.exists, "munged's socket", 10)

    def _network(self) -> None:
        bridge = f"{self.tag}br"
        _sh("ip", "link", "add", bridge, "type", "bridge")
        self.links.append(bridge)
        _sh("ip", "addr", "add", f"{self.bridge_ip}/{self.prefix}", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        for i, (name, ip) in enumerate(zip(self.names, self.node_ips)):
            ns, host_end, node_end = f"{self.tag}-{name}", f"{self.tag}v{i}", f"{self.tag}p{i}"
            _sh("ip", "netns", "add", ns)
            self.netns.append(ns)
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            self.links.append(host_end)
            _sh("ip", "link", "set", host_end, "master", bridge, "up")
            _sh("ip", "link", "set", node_end, "netns", ns)
            inside = ["nsenter", f"--net=/run/netns/{ns}", "ip"]
            _sh(*inside, "link", "set", node_end, "name", "eth0")
            _sh(*inside, "addr", "add", f"{ip}/{self.prefix}", "dev", "eth0")
            _sh(*inside, "link", "set", "eth0", "up")
            _sh(*inside, "link", "set", "lo", "up")

    def _daemons(self) -> None:
        self._spawn("slurmctld", [shutil.which("slurmctld") or "/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)])
        slurmd = shutil.which("slurmd") or "/usr/sbin/slurmd"
        for name in self.names:
            # nsenter and unshare exec (no fork), so the PID is slurmd's own
            script = (
                f"mount --bind {self.hosts} /etc/hosts && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                f"hostname {name} && exec {slurmd} -D -f {self.conf} -N {name}"
            )
            self._spawn(
                name,
                ["nsenter", f"--net=/run/netns/{self.tag}-{name}", "unshare", "--uts", "--mount", "sh", "-c", script],
            )

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.console", "ab")
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited during bring-up: {self.logs(dead[0])[-1500:]}")
            if time.time() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout:g} s: {self.logs('slurmctld')[-1500:]}")
            time.sleep(0.1)

    def wait_idle(self, timeout: float = 60) -> None:
        def idle():
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            return out.count("idle") == self.nodes

        self._wait_for(idle, "every node idle in sinfo", timeout)

    # -- use -------------------------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        env = dict(kw.pop("env", None) or os.environ, **self.env)
        return _sh(*cmd, check=check, env=env, **kw)

    def sbatch(self, *args: str, cwd: Path, env: dict | None = None) -> int:
        out = self.run("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict:
        """The job's fields from ``scontrol show job`` (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(
        self,
        job_id: int,
        timeout: float,
        states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"),
    ) -> dict:
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.time() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:g} s")
            time.sleep(0.5)

    def logs(self, name: str) -> str:
        for p in (
            self.root / "log" / f"{name}.log",
            self.root / "log" / f"slurmd-{name}.log",
            self.root / "log" / f"{name}.console",
        ):
            if p.exists():
                return p.read_text(errors="replace")
        return ""

    # -- teardown --------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, stop the daemons and whatever still runs in the node namespaces, remove the
        namespaces and links; only what ``start`` made."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--quiet", "--user", "root", check=False, timeout=30)
        for ns in self.netns:  # job steps (slurmstepd and its tasks) live in the node namespaces
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            _kill([int(p) for p in pids], grace=self.kill_wait + 5)
        _kill([p.pid for p in self.procs.values()], grace=10, group=True)
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.netns:
            _sh("ip", "netns", "del", ns, check=False)
        for link in self.links:
            _sh("ip", "link", "del", link, check=False)
        self.netns, self.links = [], []


if __name__ == "__main__":
    import sys

    why = unavailable()
    if why:
        sys.exit(f"slurm_cluster: {why}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    cluster = SlurmCluster(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/slurm-cluster")).start()
    print(f"up in {cluster.timings['bring_up_s']:.1f} s; export SLURM_CONF={cluster.conf}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
