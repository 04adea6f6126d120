import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

import benchmark
from diffusion.bench import fit, measured, perf, performance_docs
from diffusion.errors import UsageError


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


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _line(gpu: str, ips: float, mb: int, **kw) -> dict:
    return {
        "perf_target": "sd2-512-latents",
        "status": "ok",
        "images_per_sec_per_gpu": ips,
        "mfu": 0.3,
        "peak_memory_gib": 40.0,
        "device_train_microbatch_size": mb,
        "gpu_name": gpu,
        "date": "2026-11-21T00:00:00",
        **kw,
    }


def _section(table: str, kind: str) -> str:
    return table.split(f"**{kind}**", 1)[1].split("\n**", 1)[0]


def test_report_groups_by_gpu_kind_each_against_its_own_goal():
    lines = [
        _line(H100, 120.0, 32),
        _line(H100, 110.0, 16),
        _line(H200, 151.5, 64, compile=True, channels_last=True),
        _line(H200, 114.8, 64),
        # a failed sweep point has no results line of its own: target and switches come from its command
        {
            "status": "oom",
            "device_train_microbatch_size": 64,
            "gpu_name": H100,
            "date": "2026-11-25T01:00:00",
            "command": ["benchmark.py", "--tag", "perf_target=sd2-512-latents"],
        },
        {"status": "error", "device_train_microbatch_size": 16, "gpu_name": H200, "command": ["--compile"]},
    ]
    table = perf.report(lines)
    h100, h200 = _section(table, "H100-80GB"), _section(table, "H200")
    # the H200's compiled 151.5 never stands against the H100's goal, nor in its table
    assert "151.5" not in h100 and "| sd2-512-latents | eager | 120.0 | 30.0 | 40.0 | 32 | >= 150 img/s | 80% |" in h100
    assert "mb 64: oom (2026-11-25)" in h100 and "compile" not in h100
    assert "| sd2-512-latents | eager | 114.8 |" in h200 and ">= 160 img/s | 72% |" in h200
    assert "| sd2-512-latents | compile, channels_last | 151.5 |" in h200 and "| 95% |" in h200
    assert "flux-mid" not in table and "| 110.0 |" not in table  # not run; not the fastest


def test_report_only_reads_the_lent_gpus_committed_lines(capsys):
    assert perf.main(["--report_only"]) == 0
    table = capsys.readouterr().out
    h100, h200 = _section(table, "H100-80GB"), _section(table, "H200")
    assert "| 95.6 |" in h100 and ">= 150 img/s | 64% |" in h100 and "142.8" not in h100
    assert "| compile, channels_last | 142.8 | 34.8 | 67.1 | 64 | >= 160 img/s | 89% |" in h200
    assert "| flux-mid-256 | eager | 68.1 | 29.7 | 80.0 | 16 | >= 42% MFU | 71% |" in h200


def test_a_line_that_is_not_json_is_named_with_its_file_and_number(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(_line(H100, 1.0, 1)) + "\n{oops\n")
    with pytest.raises(UsageError, match=r"a.jsonl:2: not a results line"):
        measured.read(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no .jsonl"):
        measured.read(tmp_path / "empty")


def test_the_committed_lines_are_results_lines_with_device_date_and_settings():
    lines = measured.read(measured.MEASURED)
    assert len(lines) >= 15
    for rec in lines:
        assert rec["gpu_name"] and rec["date"] and rec["status"] in ("ok", "oom", "error"), rec
        assert rec.get("perf_target") or rec.get("model"), rec
        assert not rec.get("transcribed") or rec["source"].startswith("docs/performance.md at commit "), rec
        if rec["status"] == "ok" and rec.get("perf_target"):
            assert rec["images_per_sec_per_gpu"] and rec["mfu"] and rec["peak_memory_gib"], rec


def test_the_performance_doc_is_generated_from_the_lines(tmp_path):
    assert performance_docs.main(["--check"]) == 0, "run python -m diffusion.bench.performance_docs"
    doc = performance_docs.DOC.read_text()
    for name in ("report", "plan", *(f.name for f in measured.files(measured.MEASURED))):
        assert f"<!-- measured: {name} -->" in doc, name
    # a figure changed in a line makes the doc stale
    shutil.copytree(measured.MEASURED, tmp_path / "m")
    day = tmp_path / "m" / "2026-11-27-h200.jsonl"
    day.write_text(day.read_text().replace("142.8", "143.9"))
    assert "142.8" in doc and "143.9" not in doc
    assert "143.9" in performance_docs.render(doc, tmp_path / "m") != doc


@pytest.mark.parametrize(
    "target, gib, compiled, expected",
    [
        ("sd2-512-latents", 79.6, False, 40),  # 64 ran out of memory on the H100, eager
        ("sd2-512-latents", 79.6, True, 64),  # Inductor keeps fewer activations: 67.1 GiB at 64 on the H200
        ("sd2-512-latents", 139.0, False, 64),
        ("sd2-256-latents", 79.6, False, 160),  # 256 ran out of memory on the H100
        ("sd2-256-latents", 139.0, False, 256),
        ("sd2-512-online", 79.6, False, 40),
        ("sd2-512-online", 139.0, False, 48),
        ("flux-mid-256", 79.6, False, 8),  # 80.0 GiB at 16 on the H200 would not fit
        ("flux-mid-256", 139.0, True, 16),
        ("sd2-512-latents", 1000.0, False, 64),  # never beyond what was measured to fit
    ],
)
def test_the_microbatch_comes_from_the_cards_memory(target, gib, compiled, expected):
    assert fit.microbatch(target, gib, compiled) == expected


def test_a_card_too_small_for_any_microbatch_is_one_line():
    with pytest.raises(UsageError, match=r"flux-mid-256 at microbatch 4 needs about 66 GiB, more than 90% of"):
        fit.microbatch("flux-mid-256", 40.0)


def test_the_memory_model_agrees_with_every_committed_line():
    card = {"H100-80GB": 79.6, "H200": 139.0}
    for rec in measured.read(measured.MEASURED):
        name, mb = rec.get("perf_target"), rec.get("device_train_microbatch_size")
        if name not in fit.MEMORY or rec["status"] == "error":
            continue
        predicted = fit.predicted_gib(name, mb, bool(rec.get("compile")))
        if rec["status"] == "ok":
            assert abs(predicted - rec["peak_memory_gib"]) <= 1.0, (rec, predicted)
            assert mb in fit.MEMORY[name].microbatches
        else:  # out of memory: the model must not call it a fit
            assert predicted > fit.HEADROOM * card[measured.kind(rec)], (rec, predicted)


def test_microbatch_fit_sizes_each_target_for_the_card(capsys):
    argv = ["--only", "sd2-512-latents", "flux-mid-256", "--microbatch", "fit", "--memory_gib", "79.6", "--dry_run"]
    assert perf.main([*argv, "--extra=--compile --channels_last"]) == 0
    out = capsys.readouterr().out
    assert "sd2-512-latents compiled on a 79.6 GiB card: microbatch 64 (predicted peak 67.1 GiB)" in out
    commands = [line for line in out.splitlines() if line.startswith("python -m diffusion.bench.sweep")]
    assert [c.split()[4] for c in commands] == ["64", "8"] and all("--compile" in c for c in commands)
    assert perf.main(argv) == 0
    assert "sd2-512-latents on a 79.6 GiB card: microbatch 40" in capsys.readouterr().out
    with pytest.raises(UsageError, match="fit stands alone"):
        perf.main(["--microbatch", "fit", "32", "--memory_gib", "80", "--dry_run"])


FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
case "$*" in *diffusion.bench.perf*--results*) [[ "$*" == *--report_only* ]] || echo '{}' >> "$OUT/perf.jsonl" ;; esac
"""


def _ci_gpu(tmp_path: Path, **env: str) -> tuple[list[str], str, Path]:
    """.ci/gpu with python3 and nvidia-smi faked (each call logged): which steps run, in what order, how bounded."""
    repo, bin_dir, out = tmp_path / "repo", tmp_path / "bin", tmp_path / "out"
    (repo / ".ci").mkdir(parents=True)
    bin_dir.mkdir()
    for name in ("gpu", "gpu-env"):
        shutil.copy(REPO / ".ci" / name, repo / ".ci" / name)
    (repo / "docs/measured/compile-cache").mkdir(parents=True)  # an earlier lent machine's, committed
    (repo / "docs/measured/compile-cache/torch-2.11.0+cu130-NVIDIA_H100_80GB_HBM3.bin").write_bytes(b"kernels")
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(out),
        "FAKE_LOG": str(log),
        "HOME": str(tmp_path),
        **env,
    }
    proc = subprocess.run(["bash", str(repo / ".ci/gpu")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines() if log.exists() else [], (out / "steps.txt").read_text(), out


def test_ci_gpu_runs_the_goal_then_the_baseline_then_the_compile_tests_all_bounded(tmp_path):
    calls, steps, out = _ci_gpu(tmp_path, GPU_SECONDS="200")
    goal, baseline, tests, versions, report = calls
    assert "-m diffusion.bench.perf --only sd2-512-latents --microbatch fit" in goal
    assert (
        f"--extra=--compile --channels_last --compile_cache {out}/compile-cache" in goal and "--extra" not in baseline
    )
    cached = out / "compile-cache/torch-2.11.0+cu130-NVIDIA_H100_80GB_HBM3.bin"  # read by the goal, returned updated
    assert cached.read_bytes() == b"kernels"
    assert "-m diffusion.bench.perf --only sd2-512-latents --microbatch fit" in baseline
    assert "-m pytest -v -rfE tests/test_gpu.py -m gpu -k compile" in tests and "-m diffusion.versions" in versions
    assert f"--report_only --results {out}/perf.jsonl" in report
    # every run is bounded by what is left of GPU_SECONDS (200 s, 15 kept for the report)
    timeouts = [int(c.split("--timeout ")[1].split()[0]) for c in (goal, baseline, tests)]
    assert all(0 < t <= 200 - 15 for t in timeouts) and timeouts[0] <= 200 - 15 - 15, timeouts
    assert [line.split()[0] for line in steps.splitlines()] == [
        "goal",
        "baseline",
        "compile-tests",
        "versions",
        "perf-report",
    ]
    assert sorted(p.name for p in out.iterdir()) == [
        "compile-cache",
        "gpu.txt",
        "logs.tgz",
        "perf.jsonl",
        "perf.md",
        "steps.txt",
    ]


def test_ci_gpu_skips_what_its_time_does_not_hold(tmp_path):
    calls, steps, _ = _ci_gpu(tmp_path, GPU_SECONDS="30", GPU_STEPS="compile-tests goal")
    assert calls == [] and steps.splitlines() == ["compile-tests skipped (out of time)", "goal skipped (out of time)"]


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


def test_ci_gpu_families_runs_each_new_family_sized_for_the_card_and_bounded(tmp_path):
    calls, steps, _ = _ci_gpu(tmp_path, GPU_SECONDS="540", GPU_STEPS="families")
    runs = calls[:-1]  # then the report
    assert [c.split("--only ")[1].split()[0] for c in runs] == list(perf.FAMILIES)
    assert all("--microbatch fit --batches 20 " in c for c in runs)
    assert all(int(c.split("--timeout ")[1].split()[0]) <= 120 for c in runs)
    assert [line.split()[0] for line in steps.splitlines()] == [f"family-{t}" for t in perf.FAMILIES] + ["perf-report"]
