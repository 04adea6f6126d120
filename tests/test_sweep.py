"""diffusion.bench.sweep on CPU: a grid point that fails (exit 2) is recorded and the sweep goes on; the
recorded lines feed diffusion.bench.throughput; CUDA out-of-memory output is classified as oom."""

import argparse
import json

import pytest
from conftest import REPO

from diffusion.bench import sweep, throughput

TINY = [
    "--use_synth_data",
    "--model_name",
    "sd-tiny",
    "--batch_size",
    "2",
    "--max_duration",
    "2ba",
    "--measure_skip_batches",
    "1",
    "--num_workers",
    "0",
]

# The end of a real CUDA OOM as Composer's launcher shows it (torch 2.7 message).
OOM_OUTPUT = """Traceback (most recent call last):
  File "/workspace/benchmark.py", line 97, in <module>
    sys.exit(main())
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 5.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 3.2 GiB is free.
ERROR:composer.cli.launcher:Rank 0 crashed with exit code 1.
Global rank 0 (PID 4242) exited with code 1
"""


def test_failed_point_is_recorded_and_the_sweep_continues(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "sweep.jsonl"
    rc = sweep.main(
        [
            "--microbatch",
            "16",
            "2",
            "--ema",
            "on",
            "--results",
            str(results),
            "--script",
            str(REPO / "benchmark.py"),
            "--",
            *TINY,
        ]
    )
    assert rc == 0, capsys.readouterr()
    failed, ok = [json.loads(line) for line in results.read_text().splitlines()]
    assert failed["status"] == "error" and failed["device_train_microbatch_size"] == 16 and failed["ema"] is True
    assert failed["error"].startswith("benchmark.py: error: --device_train_microbatch_size 16 is larger than")
    assert "--use_ema" in failed["command"] and (tmp_path / failed["log"]).exists()
    assert ok["status"] == "ok" and ok["device_train_microbatch_size"] == 2 and ok["ema"] is True
    assert ok["images_per_sec"] > 0 and ok["model"] == "sd-tiny"
    out = capsys.readouterr().out
    assert "[1/2] ema" in out and "sweep: 1 ok, 0 oom, 1 error" in out

    header, rows, values = throughput.table(throughput.load([str(results)]))
    assert header == ["microbatch", "workers", "EMA", "CPU"]
    assert rows == [["2", "0", "yes", f"{ok['images_per_sec_per_gpu'] * 8:.2f}"], ["16", "-", "yes", "error"]]


def test_classify_oom_error_and_timeout():
    assert sweep.classify(1, OOM_OUTPUT) == ("oom", OOM_OUTPUT.splitlines()[3])
    status, line = sweep.classify(
        1,
        "Traceback (most recent call last):\n  x\nValueError: bad shape\n"
        "ERROR:composer.cli.launcher:Rank 0 crashed with exit code 1.\n",
    )
    assert (status, line) == ("error", "ValueError: bad shape")
    assert sweep.classify(None, "") == ("error", "timed out (--timeout)")
    assert sweep.classify(0, OOM_OUTPUT) == ("ok", None)


def test_grid_order_and_flags():
    args = argparse.Namespace(microbatch=[4, 8], ema=["on", "off"], image_size=[256], precision=[], num_workers=[])
    points = sweep.grid(args)
    assert [sweep.flags(p) for p in points] == [
        ["--image_size", "256", "--use_ema", "--device_train_microbatch_size", "4"],
        ["--image_size", "256", "--use_ema", "--device_train_microbatch_size", "8"],
        ["--image_size", "256", "--device_train_microbatch_size", "4"],
        ["--image_size", "256", "--device_train_microbatch_size", "8"],
    ]
    assert sweep.record_of(points[2]) == {"resolution": 256, "ema": False, "device_train_microbatch_size": 4}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--microbatch", "0"], "argument --microbatch: expected a positive int, got '0'"),
        (["--script", "nope.py"], "--script: nope.py not found"),
        (
            ["--microbatch", "4", "--script", str(REPO / "benchmark.py"), "--", "--device_train_microbatch_size=8"],
            "--device_train_microbatch_size after '--' is set by the sweep itself",
        ),
        (["--script", str(REPO / "benchmark.py"), "--", "--results", "x.jsonl"], "--results after '--'"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sweep.run("diffusion.bench.sweep", sweep.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusion.bench.sweep: error: ") and message in err[0], err


def test_a_stopped_sweep_takes_its_runs_ranks_with_it(tmp_path):
    """`timeout` or a scheduler stops the sweep with SIGTERM: the run it started (its own process group, so
    composer's launcher and its rank) is killed with it instead of running on and skewing the next timing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "rank.pid"
    script = tmp_path / "sleeper.py"
    script.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    sweeper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diffusion.bench.sweep",
            "--results",
            str(tmp_path / "s.jsonl"),
            "--script",
            str(script),
        ],
        cwd=REPO,
    )
    try:
        for _ in range(600):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.1)
        rank = int(pidfile.read_text())
        sweeper.send_signal(signal.SIGTERM)
        assert sweeper.wait(timeout=30) == 128 + signal.SIGTERM
        for _ in range(100):
            try:
                os.kill(rank, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(rank, signal.SIGKILL)
            pytest.fail("the rank outlived the sweep")
    finally:
        sweeper.kill()


def test_a_run_killed_at_the_timeout_after_its_results_line_keeps_its_figures(tmp_path, capsys):
    """On the lent H200 (2026-11-27) a compiled run wrote its results line and was killed by --timeout before it
    had exited: its measurement is kept (status ok, with a note), not recorded as an error."""
    script = tmp_path / "measured_then_slow.py"
    script.write_text(
        "import json, sys, time\n"
        "out = sys.argv[sys.argv.index('--results') + 1]\n"
        "open(out, 'w').write(json.dumps({'images_per_sec': 142.8, 'model': 'sd2-base'}) + '\\n')\n"
        "time.sleep(300)\n"
    )
    results = tmp_path / "s.jsonl"
    argv = ["--results", str(results), "--script", str(script), "--timeout", "20"]
    assert sweep.main(argv) == 0
    (line,) = [json.loads(x) for x in results.read_text().splitlines()]
    assert line["status"] == "ok" and line["images_per_sec"] == 142.8 and "error" not in line
    assert line["note"] == "killed at --timeout after writing its results line"
    assert "sweep: 1 ok, 0 oom, 0 error" in capsys.readouterr().out

    script.write_text("import time\ntime.sleep(300)\n")  # nothing measured: still an error
    results.unlink()
    assert sweep.main(argv) == 1
    (line,) = [json.loads(x) for x in results.read_text().splitlines()]
    assert (line["status"], line["error"]) == ("error", "timed out (--timeout)")
