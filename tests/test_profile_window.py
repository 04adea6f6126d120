"""profile=FIRST-LAST (callbacks/profile_window.py): a real run writes its trace and summary and trains exactly as
without it; the busy/idle arithmetic of trace_summary.py on synthetic kernel timelines (a CPU has no kernels)."""

import gzip
import json
from pathlib import Path

import pytest
from conftest import FAST, REPO, assert_same_weights, final_state

import benchmark
import train
from diffusion.callbacks.trace_summary import WINDOW, busy_seconds, device_share, markdown, summarize


@pytest.mark.parametrize(
    "intervals, busy",
    [
        ([], 0),
        ([(10, 20), (30, 40)], 20),  # disjoint
        ([(10, 30), (20, 40)], 30),  # overlapping (two streams): counted once
        ([(10, 50), (20, 30), (25, 35)], 40),  # nested
        ([(-10, 10), (90, 120)], 20),  # clipped to the window [0, 100]
        ([(-20, -10), (100, 110)], 0),  # wholly outside
        ([(30, 40), (10, 20), (15, 35)], 30),  # unsorted
        ([(0, 100), (40, 60)], 100),  # always busy
    ],
)
def test_busy_time_is_the_union_of_intervals_inside_the_window(intervals, busy):
    assert busy_seconds(intervals, 0, 100) == busy
    share = device_share(intervals, 0, 100)
    assert share["busy_share"] == pytest.approx(busy / 100) and share["idle_share"] == pytest.approx(1 - busy / 100)
    assert share["busy_s"] + share["idle_s"] == pytest.approx(share["window_s"]) == pytest.approx(100e-6)


def _event(name, cat, ts, dur, **extra):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, **extra}


def test_summary_of_a_cuda_like_trace():
    """A 1000 us window with kernels on two streams (one overlapping), a memcpy, and kernels before and after it."""
    trace = {
        "traceEvents": [
            _event(WINDOW, "user_annotation", 1000, 1000),
            _event("aten::convolution", "cpu_op", 1010, 50),
            _event("sm90_xmma_gemm_bf16", "kernel", 1100, 300, tid=7),
            _event("sm90_xmma_gemm_bf16", "kernel", 1500, 200, tid=7),
            _event("group_norm_kernel", "kernel", 1600, 150, tid=13),  # overlaps the second GEMM by 100 us
            _event("Memcpy HtoD", "gpu_memcpy", 1050, 20),
            _event("diffusion/ema_update", "user_annotation", 1800, 120),
            _event("diffusion/ema_update", "gpu_user_annotation", 1850, 90),
            _event("multi_tensor_apply_kernel", "kernel", 1850, 90),
            _event("before_window", "kernel", 500, 100),
            _event("straddling", "kernel", 950, 100),  # the previous batch's last kernel: its last 50 us count
            _event("after_window", "kernel", 2100, 100),
            {"ph": "i", "name": "marker", "ts": 1200},  # not a complete event: ignored
        ]
    }
    s = summarize(trace)
    assert s["device_measured"] and s["window_s"] == pytest.approx(1e-3)
    busy = 50 + 20 + 300 + (1750 - 1500) + 90  # straddling, memcpy, GEMM, GEMM and GroupNorm as one span, EMA
    assert s["device"]["busy_s"] == pytest.approx(busy * 1e-6)
    assert s["device"]["idle_share"] == pytest.approx(1 - busy / 1000)
    top = s["top_kernels"]
    assert [k["name"] for k in top][:2] == ["sm90_xmma_gemm_bf16", "group_norm_kernel"]
    assert top[0]["calls"] == 2 and top[0]["ms"] == pytest.approx(0.5) and top[0]["share_of_window"] == 0.5
    assert {k["name"] for k in top}.isdisjoint({"before_window", "after_window"})
    assert s["phases"]["diffusion/ema_update"] == {"calls": 1, "host_ms": 0.12, "device_ms": 0.09}
    page = markdown({"batches": "3-4", "batch_count": 2, "on": "H100", "top_ops": [], **s})
    assert "GPU busy 71.0%, idle 29.0%" in page and "| sm90_xmma_gemm_bf16 | 0.500 | 2 | 50.0% |" in page


def test_a_trace_without_the_window_is_refused():
    with pytest.raises(ValueError, match="no 'diffusion/profile_window' annotation"):
        summarize({"traceEvents": [_event("k", "kernel", 0, 10)]})


def _train(folder: Path, *extra: str) -> dict:
    args = [str(REPO / "yamls/sd-tiny-cpu.yaml"), *FAST, "batch_size=4", "max_duration=4ba", "autoresume=false"]
    assert train.main([*args, f"save_folder={folder}", "save_interval=4ba", *extra]) == 0
    return final_state(folder)


def test_a_profiled_run_writes_trace_and_summary_and_trains_the_same(tmp_path, capsys):
    plain = _train(tmp_path / "plain")
    profiled = _train(tmp_path / "profiled", "profile=2-3", f"profile_folder={tmp_path / 'prof'}")
    assert_same_weights(plain, profiled, batches=4)  # weights and EMA bitwise equal: the window changes nothing
    err = capsys.readouterr().err
    assert "profile: batches 2-3" in err and "GPU share not measurable on CPU" in err, err[-2000:]

    summary = json.loads((tmp_path / "prof/summary-rank0.json").read_text())
    assert summary["batches"] == "2-3" and summary["batch_count"] == 2 and summary["on"] == "cpu"
    assert not summary["device_measured"] and "no kernel timeline" in summary["device_note"]
    assert summary["window_s"] > 0 and "device" not in summary
    names = [op["name"] for op in summary["top_ops"]]
    # the UNet's convolutions lead on any CPU; which ops follow them depends on the machine's load (a loaded VM put
    # attention and elementwise ops above the linears' matmuls, 2026-11-28), so only the convolutions are asserted
    assert any("conv" in n for n in names), names
    assert all(op["self_ms"] > 0 for op in summary["top_ops"][:3])
    assert summary["phases"]["diffusion/ema_update"]["calls"] == 2  # the EMA update of each profiled batch
    with gzip.open(summary["trace"], "rt") as f:
        trace = json.load(f)
    assert any(e.get("name") == WINDOW for e in trace["traceEvents"])  # the Chrome trace, whole
    page = (tmp_path / "prof/summary-rank0.md").read_text()
    assert "GPU share: not measurable" in page and "| aten::" in page


def test_a_window_the_run_never_reaches_is_said(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    args = ["--model_name", "sd-tiny", "--use_synth_data", "--batch_size", "2", "--max_duration", "1ba"]
    args += ["--num_workers", "0", "--results", str(out), "--profile", "5-6", "--profile_folder", str(tmp_path / "p")]
    assert benchmark.main(args) == 0
    assert "before the profile window 5-6 began; nothing was profiled" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("value", ["0-3", "4-3", "a", "2:3"])
def test_a_bad_window_is_one_line(value, capsys):
    assert benchmark.main(["--model_name", "sd-tiny", "--use_synth_data", "--profile", value]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"benchmark.py: error: --profile {value!r} ") and "FIRST-LAST" in line
