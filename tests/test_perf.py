import json

import benchmark
from diffusion.bench import perf


def test_every_target_command_is_a_valid_benchmark_invocation(capsys):
    assert perf.main(["--dry_run", "--results", "p.jsonl"]) == 0
    lines = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("python -m diffusion.bench.sweep")
    ]
    assert len(lines) == sum(len(t["microbatch"]) for t in perf.TARGETS.values())
    for cmd in perf.commands(list(perf.TARGETS), "p.jsonl", 30, 2):
        extra = cmd[cmd.index("--") + 1 :]
        args = benchmark.parse_args(extra + ["--device_train_microbatch_size", cmd[1]])
        assert args["use_synth_data"] and args["precision"] == "amp_bf16" and args["batch_size"] == 2 * int(cmd[1])


def test_report_keeps_the_fastest_ok_run_and_notes_failures(tmp_path):
    res = tmp_path / "p.jsonl"
    base = {"mfu": 0.3, "peak_memory_gib": 40.0, "gpu_name": "NVIDIA H100 80GB HBM3", "date": "2026-11-21T00:00:00"}
    lines = [
        {
            **base,
            "perf_target": "sd2-512-latents",
            "status": "ok",
            "images_per_sec_per_gpu": 120.0,
            "device_train_microbatch_size": 32,
        },
        {
            **base,
            "perf_target": "sd2-512-latents",
            "status": "ok",
            "images_per_sec_per_gpu": 151.5,
            "device_train_microbatch_size": 64,
            "compile": True,
            "channels_last": True,
        },
        # a failed sweep point has no results line of its own: target and switches come from its command
        {
            "status": "oom",
            "device_train_microbatch_size": 16,
            "command": ["benchmark.py", "--compile", "--tag", "perf_target=flux-mid-256"],
        },
    ]
    res.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    table = perf.report(str(res))
    row = next(line for line in table.splitlines() if line.startswith("| sd2-512-latents"))
    assert "| 151.5 | 30.0 | 40.0 | 64 | compile, channels_last | 150 img/s |" in row
    flux = next(line for line in table.splitlines() if line.startswith("| flux-mid-256"))
    assert "mb 16 compile: oom" in flux
    assert "sd2-256" not in table  # not run, not reported


def test_tag_lands_in_the_results_line(tmp_path):
    out = tmp_path / "r.jsonl"
    assert (
        benchmark.main(
            [
                "--model_name",
                "sd-tiny",
                "--use_synth_data",
                "--batch_size",
                "2",
                "--max_duration",
                "3ba",
                "--num_workers",
                "0",
                "--tag",
                "perf_target=x",
                "--results",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["perf_target"] == "x"
