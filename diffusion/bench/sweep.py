"""Sweep benchmark.py over a grid of settings on this node's GPUs, one `composer` run per grid point.

    python -m diffusion.bench.sweep --microbatch 4 8 16 32 --ema on off --image_size 256 512 --precision amp_bf16 \\
        --results sweep.jsonl -- --use_synth_data --model_name sd2-base --max_duration 50ba

Every point appends one line to --results: benchmark.py's own record with ``status: ok``, or, for a run
that failed, a line with the point's settings and ``status: oom`` (CUDA out of memory, read from its
output) or ``status: error`` plus the last error line. The sweep goes on after a failure, so the
largest microbatch that fits is found in one command. Each run's full output is kept in --logs.
Arguments after ``--`` go to every run unchanged.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from diffusion.cli import Parser, positive, run
from diffusion.errors import UsageError

# sweep flag -> (benchmark.py flag, key of that setting in a results line)
AXES = {
    "microbatch": ("--device_train_microbatch_size", "device_train_microbatch_size"),
    "image_size": ("--image_size", "resolution"),
    "precision": ("--precision", "precision"),
    "num_workers": ("--num_workers", "num_workers"),
}
OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED")
# "benchmark.py: error: ..." (usage errors) or a Python exception line "SomeError: ..."
ERROR_LINE = re.compile(r"^\S+: error: |^[\w.]*(Error|Exception)\b(:|$)")


def microbatch(text: str) -> int | str:
    return text if text == "auto" else positive(int)(text)


def classify(returncode: int | None, output: str) -> tuple[str, str | None]:
    """(status, error line) of a finished run from its exit code and combined output."""
    if returncode == 0:
        return "ok", None
    if returncode is None:
        return "error", "timed out (--timeout)"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if any(OOM.search(line) for line in lines):
        return "oom", next((line for line in reversed(lines) if OOM.search(line)), None)
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return "error", (errors or lines or [f"exit code {returncode}, no output"])[-1]


def grid(args: argparse.Namespace) -> list[dict]:
    """The points in run order (microbatch innermost, so a memory limit shows as one failing tail)."""
    axes = {name: getattr(args, name) for name in ("image_size", "precision", "ema", "num_workers", "microbatch")}
    given = {name: values for name, values in axes.items() if values}
    return [dict(zip(given, combo)) for combo in itertools.product(*given.values())]


def flags(point: dict) -> list[str]:
    out = []
    for name, value in point.items():
        if name == "ema":
            out += ["--use_ema"] if value == "on" else []
        else:
            out += [AXES[name][0], str(value)]
    return out


def record_of(point: dict) -> dict:
    """A point's settings under the keys benchmark.py uses, so failed points line up with measured ones."""
    rec = {AXES[k][1]: v for k, v in point.items() if k in AXES}
    if "ema" in point:
        rec["ema"] = point["ema"] == "on"
    return rec


def gpu_name() -> str | None:
    """The first GPU's name as torch reports it, read with nvidia-smi so the sweep holds no CUDA context."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def launcher() -> str:
    here = Path(sys.executable).with_name("composer")
    found = str(here) if here.exists() else shutil.which("composer")
    if not found:
        raise UsageError(
            "composer (Composer's launcher) is not on PATH; activate the environment the project is installed in"
        )
    return found


def run_point(cmd: list[str], log: Path, timeout: float | None) -> int | None:
    """Run one point with its output in ``log``; None when it ran past ``timeout`` (then it is killed). The run
    has its own process group (its ranks and workers); when the sweep itself is stopped (SIGTERM from
    ``timeout`` or a scheduler, Ctrl-C) that group is killed too, so no rank outlives the sweep."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        previous = signal.signal(signal.SIGTERM, _stopped)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def point_lines(point: dict, cmd: list[str], returncode: int | None, log: Path, out: Path, gpu: str | None) -> tuple:
    """(status, error, results lines) of a point that ended with ``returncode`` (None: killed at --timeout): the run's
    own lines when it measured, else one line saying how it failed."""
    status, error = classify(returncode, log.read_text(errors="replace"))
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    measured = any(r.get("images_per_sec") for r in lines)
    if returncode is None and measured:
        # killed at --timeout after its measurement was written (a compiled run's exit, a slow teardown): the
        # figures are the run's own, so they count; the line says how it ended
        status, error = "ok", None
        lines = [{**r, "note": "killed at --timeout after writing its results line"} for r in lines]
    if status == "ok" and not measured:
        status, error = "error", "ran, but measured no batches: make --max_duration longer than --measure_skip_batches"
    if status != "ok":
        when = datetime.now(timezone.utc).isoformat(timespec="seconds")
        device = "gpu" if gpu else "cpu"
        lines = [{"status": status, "error": error, **record_of(point), "gpu_name": gpu, "device": device,
                  "date": when, "host": socket.gethostname(), "command": cmd}]  # fmt: skip
    return status, error, lines


def sweep(args: argparse.Namespace, extra: list[str]) -> int:
    """Run every point, appending its line(s) as soon as it ends, so a sweep stopped halfway keeps its results."""
    script = Path(args.script)
    if not script.is_file():
        raise UsageError(
            f"--script: {args.script} not found from {Path.cwd()}; run from the repository root or pass --script PATH"
        )
    controlled = {"--results"} | {AXES[n][0] for n in AXES if getattr(args, n)} | ({"--use_ema"} if args.ema else set())
    clash = sorted(controlled & {a.split("=")[0] for a in extra})
    if clash:
        raise UsageError(
            f"{', '.join(clash)} after '--' is set by the sweep itself; drop it there "
            "(use --results and the grid flags of diffusion.bench.sweep)"
        )
    results = Path(args.results)
    logs = Path(args.logs or results.with_name(results.stem + "-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    base = [launcher()] + (["-n", str(args.nproc)] if args.nproc else []) + [str(script), *extra]
    points, gpu = grid(args), gpu_name()
    counts = {"ok": 0, "oom": 0, "error": 0}
    for i, point in enumerate(points):
        label = "-".join(f"{k}{v}" for k, v in point.items()) or "default"
        log, out = logs / f"{i:03d}-{label}.log", logs / f"{i:03d}-{label}.jsonl"
        out.unlink(missing_ok=True)
        cmd = base + flags(point) + ["--results", str(out)]
        status, error, lines = point_lines(point, cmd, run_point(cmd, log, args.timeout), log, out, gpu)
        with open(results, "a") as f:
            for rec in lines:
                f.write(json.dumps({**rec, "status": status, "log": str(log)}) + "\n")
        counts[status] += 1
        figure = f"{lines[0]['images_per_sec']:.2f} images/s" if status == "ok" else error
        print(f"[{i + 1}/{len(points)}] {label}: {status}: {figure}  (log {log})", flush=True)
    print(f"sweep: {counts['ok']} ok, {counts['oom']} oom, {counts['error']} error -> {results}")
    return 0 if counts["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = Parser("diffusion.bench.sweep", __doc__)
    p.add_argument(
        "--microbatch",
        nargs="+",
        type=microbatch,
        default=[],
        metavar="N",
        help="--device_train_microbatch_size values (integers or auto)",
    )
    p.add_argument("--ema", nargs="+", choices=["on", "off"], default=[], help="with and/or without --use_ema")
    p.add_argument("--image_size", nargs="+", type=positive(int), default=[], metavar="PX", help="--image_size values")
    p.add_argument("--precision", nargs="+", default=[], help="--precision values (amp_bf16, amp_fp16, fp32)")
    p.add_argument("--num_workers", nargs="+", type=int, default=[], metavar="N", help="--num_workers values")
    p.add_argument("--results", default="sweep.jsonl", help="results file, appended to (default sweep.jsonl)")
    p.add_argument("--logs", default=None, help="folder for each run's output (default: <results>-logs)")
    p.add_argument("--script", default="benchmark.py", help="script composer runs (default benchmark.py)")
    p.add_argument(
        "--nproc", type=positive(int), default=None, help="processes per run (default: composer's, one per visible GPU)"
    )
    p.add_argument(
        "--timeout", type=positive(float), default=None, help="seconds before a run is killed (status error)"
    )
    return sweep(p.parse_args(own), extra)


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.sweep", main))
