"""diffusion.bench.throughput on the published AWS CSV (ratios against the published ones, computed here) and on
benchmark.py JSONL lines; GPU-name normalisation; bad input as one line."""

import csv
import json

import pytest
from conftest import REPO

from diffusion.bench import throughput

AWS = REPO / "docs" / "published" / "aws_p4de_p5_sd2_512.csv"  # the AWS test case's published figures


def published() -> dict[tuple[str, str], float]:
    rows = csv.DictReader(line for line in AWS.read_text().splitlines() if not line.startswith("#"))
    return {(r["microbatch"], r["ema"], r["hardware"]): float(r["images_per_sec"]) for r in rows}


def test_aws_csv_ratios_match_the_published_figures(tmp_path, capsys):
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    assert (
        throughput.main(
            [
                str(AWS),
                "--baseline",
                "A100-80GB",
                "--compare",
                "NVIDIA H100 80GB HBM3",
                "--markdown",
                str(md),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert md.read_text() == capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    header, rows, values = throughput.table(throughput.load([str(AWS)]), 8, "A100-80GB", "H100-80GB")
    assert header == ["microbatch", "workers", "EMA", "A100-80GB", "H100-80GB", "H100-80GB / A100-80GB"]
    figures = published()
    assert len(rows) == 7
    for row in rows:
        mb, workers, ema = row[:3]
        a100, h100 = figures[(mb, ema, "A100-80GB")], figures[(mb, ema, "H100-80GB")]
        assert workers == "8" and row[3:5] == [f"{a100:.2f}", f"{h100:.2f}"]  # a node of 8: figures as published
        assert abs(float(row[5].rstrip("x")) - h100 / a100) <= 0.01
    by_mb = {(r[0], r[2]): r[5] for r in rows}
    assert by_mb[("32", "yes")] == "1.89x"  # the AWS README's headline ratio
    assert abs(float(by_mb[("4", "yes")].rstrip("x")) - 189.28 / 142.69) <= 0.01


def _header(out: str) -> list[str]:
    return [c.strip() for c in out.splitlines()[0].strip("|").split("|")]


def test_two_hardware_types_get_the_ratio_by_default(tmp_path, capsys):
    """The faster over the slower unless --baseline/--compare say otherwise; one name picks the other;
    --no_ratio leaves it out; three types need the pair named."""
    assert throughput.main([str(AWS)]) == 0
    out = capsys.readouterr().out
    assert _header(out)[3:] == ["A100-80GB", "H100-80GB", "H100-80GB / A100-80GB"] and "| 1.89x |" in out
    assert throughput.main([str(AWS), "--compare", "A100-80GB"]) == 0
    assert _header(capsys.readouterr().out)[-1] == "A100-80GB / H100-80GB"
    assert throughput.main([str(AWS), "--no_ratio"]) == 0
    assert _header(capsys.readouterr().out)[3:] == ["A100-80GB", "H100-80GB"]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(result_line("NVIDIA H200", 60.0, 8, mb=32)) + "\n")
    assert throughput.main([str(AWS), str(path), "--where", "resolution=512"]) == 0
    assert _header(capsys.readouterr().out)[3:] == ["A100-80GB", "H100-80GB", "H200"]


def result_line(gpu_name, per_gpu, world_size, mb=8, ema=True, workers=8, **kw):
    """A benchmark.py --results line with the keys the table reads (values as benchmark.py writes them)."""
    return {
        "images_per_sec": per_gpu * world_size,
        "images_per_sec_per_gpu": per_gpu,
        "gpu_name": gpu_name,
        "gpu_count": world_size,
        "world_size": world_size,
        "device_train_microbatch_size": mb,
        "ema": ema,
        "num_workers": workers,
        "model": "sd2-base",
        "resolution": 512,
        "precision": "amp_bf16",
        "fsdp": False,
        "precomputed_latents": False,
        **kw,
    }


def test_jsonl_scaled_to_a_node_with_median_and_oom(tmp_path):
    lines = [
        result_line("NVIDIA A100-SXM4-80GB", 25.0, 8),
        result_line("NVIDIA H100 80GB HBM3", 40.0, 1),
        result_line("NVIDIA H100 80GB HBM3", 50.0, 1),
        result_line("NVIDIA H100 80GB HBM3", 46.0, 1),
        {
            "status": "oom",
            "device_train_microbatch_size": 64,
            "ema": True,
            "num_workers": 8,
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "error": "torch.OutOfMemoryError: CUDA out of memory.",
        },
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    header, rows, _ = throughput.table(throughput.load([str(path)]), 8, "A100-80GB", "H100-80GB")
    assert header[3:] == ["A100-80GB", "H100-80GB", "H100-80GB / A100-80GB"]
    # A100: 25/GPU x 8 = 200; H100: median(40, 50, 46) = 46/GPU x 8 = 368; 368 / 200 = 1.84
    assert rows == [["8", "8", "yes", "200.00", "368.00", "1.84x"], ["64", "8", "yes", "-", "oom", ""]]


def test_jsonl_and_csv_together_and_where(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps(result_line("NVIDIA H200", 60.0, 8, mb=32))
        + "\n"
        + json.dumps(result_line("NVIDIA H200", 20.0, 8, mb=32, resolution=256))
        + "\n"
    )
    with pytest.raises(throughput.UsageError, match="mix resolution=256 and resolution=512.*--where resolution=512"):
        throughput.load([str(path)])
    points = throughput.load([str(AWS), str(path)], where=["resolution=512"])
    _, rows, _ = throughput.table(points, 8, "H100-80GB", "H200")
    assert [r for r in rows if r[0] == "32"] == [["32", "8", "yes", "385.31", "480.00", "204.22", "1.25x"]]


@pytest.mark.parametrize(
    "name,short",
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB-PCIe"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("A100-80GB", "A100-80GB"),
        ("h100-80gb", "H100-80GB"),
        (None, "CPU"),
    ],
)
def test_hardware_names(name, short):
    assert throughput.hardware_name(name) == short


@pytest.mark.parametrize(
    "argv,message",
    [
        (["/no/such.jsonl"], "FILES: /no/such.jsonl does not exist"),
        (
            [str(AWS), "--baseline", "B200", "--compare", "H100-80GB"],
            "--baseline B200: no results for that hardware; the inputs have A100-80GB, H100-80GB",
        ),
        (
            "THREE",
            "--baseline and --compare go together when the inputs have 3 hardware types (A100-80GB, H100-80GB, H200)",
        ),
        ([str(AWS), "--no_ratio", "--compare", "H100-80GB"], "--no_ratio leaves the ratio out"),
        ([str(AWS), "--where", "resolution"], "--where 'resolution': expected key=value"),
        ("EMPTY", "no results in"),
        ("NOTJSON", ":1: not a JSON object"),
        ("BADCSV", "data row 1: gpus 'eight' and images_per_sec '1.0' must be numbers"),
    ],
)
def test_bad_input_is_one_line(argv, message, tmp_path, capsys):
    if isinstance(argv, str):
        path = tmp_path / ("r.csv" if argv == "BADCSV" else "r.jsonl")
        path.write_text(
            {
                "EMPTY": "",
                "NOTJSON": "results: {'images_per_sec': 3}\n",
                "BADCSV": "microbatch,hardware,gpus,images_per_sec\n4,A100,eight,1.0\n",
                "THREE": json.dumps(result_line("NVIDIA H200", 60.0, 8, mb=32)) + "\n",
            }[argv]
        )
        argv = [str(AWS), str(path), "--baseline", "A100-80GB"] if argv == "THREE" else [str(path)]
    assert throughput.run("diffusion.bench.throughput", throughput.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusion.bench.throughput: error: ") and message in err[0], err
