"""diffusion.bench.planning against hand computations."""

import json

import pytest

from diffusion.bench import planning


def test_per_doubling_by_hand():
    # 4 nodes x 8 GPUs, 100 images/s/GPU, 0.9 per doubling: 2 doublings -> 0.81 -> 100 * 0.81 * 32 = 2592 images/s;
    # 1e9 samples / 2592 = 385,802.5 s = 107.167 h; x 32 GPUs = 3429.3 GPU-hours; 1e9 / 4096 -> 244,141 steps.
    (row,) = planning.plan([100.0], [1e9], 4096, [4], 8, 0.9)
    assert row["efficiency"] == pytest.approx(0.81)
    assert row["images_per_sec"] == [pytest.approx(2592.0)]
    assert row["total_hours"] == pytest.approx(107.1674, abs=1e-3)
    assert row["gpu_hours"] == pytest.approx(3429.36, abs=0.01)
    assert row["batch_per_gpu"] == 128 and row["steps"] == [244141]


def test_phases_add_up_and_flat_scaling():
    # Two phases on 2 nodes (16 GPUs), flat 0.8: phase 1: 1.6e8 / (50 * 0.8 * 16 = 640/s) = 250,000 s;
    # phase 2: 3.2e7 / (10 * 0.8 * 16 = 128/s) = 250,000 s; total 500,000 s = 138.889 h.
    one, two = planning.plan([50.0, 10.0], [1.6e8, 3.2e7], 2048, [1, 2], 8, 0.8, scaling="flat")
    assert one["efficiency"] == 1.0 and two["efficiency"] == 0.8
    assert two["hours"] == [pytest.approx(250000 / 3600), pytest.approx(250000 / 3600)]
    assert two["total_hours"] == pytest.approx(138.8889, abs=1e-3)
    assert two["gpu_hours"] == pytest.approx(138.8889 * 16, abs=0.02)
    # one node: no scaling loss: 1.6e8 / 400 + 3.2e7 / 80 = 800,000 s
    assert one["total_hours"] * 3600 == pytest.approx(800000)


def test_per_doubling_matches_published_scaling():
    """0.9 per doubling from 8 to 128 A100s (4 doublings) reproduces MosaicML's published 11,600 images/s at
    256 px within 1% from their 8-GPU 1,100 (anchors.md)."""
    (row,) = planning.plan([1100 / 8], [1e9], 2048, [16], 8, 0.9)
    assert row["images_per_sec"][0] == pytest.approx(11600, rel=0.01)


def test_cli_table_and_sample_suffixes(capsys):
    assert (
        planning.main(
            [
                "--images_per_sec_per_gpu",
                "100",
                "--samples",
                "1B",
                "--global_batch",
                "4096",
                "--nodes",
                "4",
                "--scaling_efficiency",
                "0.9",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 4 | 32 | 128 | 0.810 | 2,592 | 107.2 | 4.5 | 3,429 |" in out
    assert planning.count("1.1B") == pytest.approx(1.1e9) and planning.count("2.5e6") == 2.5e6


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--images_per_sec_per_gpu", "100", "--samples", "1B", "2B", "--global_batch", "2048"],
            "--images_per_sec_per_gpu has 1 value(s) but --samples has 2",
        ),
        (
            [
                "--images_per_sec_per_gpu",
                "100",
                "--samples",
                "1B",
                "--global_batch",
                "2048",
                "--scaling_efficiency",
                "1.5",
            ],
            "--scaling_efficiency 1.5 is above 1",
        ),
        (
            ["--images_per_sec_per_gpu", "-3", "--samples", "1B", "--global_batch", "2048"],
            "argument --images_per_sec_per_gpu: expected a positive float, got '-3'",
        ),
        (
            ["--images_per_sec_per_gpu", "100", "--samples", "lots", "--global_batch", "2048"],
            "argument --samples: expected a positive count",
        ),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    assert planning.run("diffusion.bench.planning", planning.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusion.bench.planning: error: ") and message in err[0], err


def test_scaling_model_from_a_results_file(tmp_path, capsys):
    """--results takes the figure, batch, microbatch, EMA and FLOP shares from benchmark.py's line; with
    --interconnect the efficiency is diffusion.bench.scaling's prediction, not a guess (the worked example)."""
    line = {
        "images_per_sec_per_gpu": 25.5275,
        "model": "sd2-base",
        "world_size": 8,
        "num_nodes": 1,
        "global_batch_size": 2048,
        "device_train_microbatch_size": 32,
        "fsdp": False,
        "ema": True,
        "tflop_per_image": 2.41 / 0.69,
        "tflop_per_image_denoiser": 2.41,
    }
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "model": "flux-mid"}) + "\n")
    assert (
        planning.main(
            [
                "--results",
                str(path),
                "--model",
                "sd2-base",
                "--samples",
                "1.7B",
                "--global_batch",
                "2048",
                "--nodes",
                "1",
                "4",
                "--interconnect",
                "p4de",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 1 | 8 | 256 | 1.000 | 204 |" in out and "| 4 | 32 | 64 | 0.995 | 813 |" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--interconnect", "p6"], "--interconnect 'p6' is unknown; choose one of p4de, p5"),
        (["--interconnect", "p5", "--nodes", "0"], "--nodes 0 is below 1"),
        (
            ["--interconnect", "p5", "--global_batch", "1000", "--nodes", "3"],
            "--global_batch 1000 does not divide over 24 GPUs",
        ),
        (["--node_gbps", "800"], "--node_gbps, --nvlink_gbytes and --hbm_tbytes go together"),
        (
            [],
            "give --interconnect (or --node_gbps/--nvlink_gbytes/--hbm_tbytes) for the scaling model, or --scaling_efficiency",
        ),
        (["--interconnect", "p5", "--model", "sd3"], "--model 'sd3' has no known parameter count"),
    ],
)
def test_scaling_model_bad_input_is_one_line(argv, message, capsys):
    base = ["--images_per_sec_per_gpu", "100", "--samples", "1B", "--global_batch", "2048", "--model", "sd2-base"]
    assert planning.run("diffusion.bench.planning", planning.main, base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_results_file_without_the_workload(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"images_per_sec_per_gpu": 30.0, "model": "flux-mid"}) + "\n")
    argv = [
        "--results",
        str(path),
        "--model",
        "sd2-base",
        "--samples",
        "1B",
        "--global_batch",
        "2048",
        "--interconnect",
        "p5",
    ]
    assert planning.run("diffusion.bench.planning", planning.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no measured images_per_sec_per_gpu for --model sd2-base" in err[0], err
