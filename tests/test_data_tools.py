"""data.py inspect and bench on small datasets: real figures, real files."""

import json

from conftest import write_images, write_latents
from PIL import Image

import data
from diffusion.cli import run


def test_inspect_counts_columns_ranges_filters_and_grid(tmp_path, capsys):
    src = write_images(tmp_path / "d", 30, bad={4})
    assert data.main(["inspect", src, "--grid", str(tmp_path / "g.png"), "--n", "6", "--filter", "pwatermark<0.1"]) == 0
    out = capsys.readouterr().out
    assert f"{src}: 30 samples in " in out and "pwatermark           float32" in out
    assert "pwatermark           min 0, mean 0.145, max 0.29  (all 30 samples)" in out
    assert "filters pwatermark<0.1: 10 of all 30 samples pass (33.3%)" in out
    grid = Image.open(tmp_path / "g.png")
    assert grid.size == (4 * 224, 2 * (224 + 4 * 12 + 8))
    assert data.main(["inspect", write_latents(tmp_path / "lat", 3), "--grid", str(tmp_path / "none.png")]) == 0
    out = capsys.readouterr().out
    assert "latent_moments       ndarray:float16:8,8,8  (1.0 KiB per sample)" in out and "no grid:" in out


def test_bench_times_the_training_loader_for_images_and_latents(tmp_path, capsys):
    images, latents = write_images(tmp_path / "img", 64), write_latents(tmp_path / "lat", 64)
    results = tmp_path / "bench.jsonl"
    for src in (images, latents):
        assert (
            data.main(
                [
                    "bench",
                    src,
                    "--image_size",
                    "32",
                    "--num_workers",
                    "0",
                    "1",
                    "--batch_size",
                    "8",
                    "--batches",
                    "4",
                    "--warmup",
                    "1",
                    "--results",
                    str(results),
                ]
            )
            == 0
        )
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["kind"], r["num_workers"]) for r in rows] == [
        ("images", 0),
        ("images", 1),
        ("latents", 0),
        ("latents", 1),
    ]
    assert all(r["samples_per_sec"] > 0 and r["samples_timed"] == 32 for r in rows)
    assert "bench: images at 32 px, 1 worker, batch 8:" in capsys.readouterr().out


def test_bench_on_a_dataset_smaller_than_the_batch_says_its_size_and_the_largest_batch(tmp_path, capsys):
    src = write_images(tmp_path / "img", 5)
    assert (
        run("data.py", data.main, ["bench", src, "--image_size", "32", "--num_workers", "0", "2", "--batch_size", "8"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"data.py: error: --batch_size 8 is larger than the dataset: {src} has 5 samples; the largest "
        "batch that fits is 5, pass --batch_size 5 or less"
    ]
    assert (
        data.main(
            [
                "bench",
                src,
                "--image_size",
                "32",
                "--num_workers",
                "0",
                "2",
                "--batch_size",
                "5",
                "--batches",
                "2",
                "--warmup",
                "1",
            ]
        )
        == 0
    )  # it fits, with workers too (batches span epochs)
    assert "batch 5: " in capsys.readouterr().out
