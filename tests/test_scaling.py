"""diffusion.bench.scaling: the collective cost model by hand, and the docs' validation table recomputed from its CSV."""

import re
from pathlib import Path

import pytest

from diffusion.bench import scaling

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "docs" / "published" / "multinode_scaling.csv"


def test_worked_example_by_hand():
    """docs/throughput.md's worked example: SD2-base, DDP, EMA, AWS p4de, 25.5275 images/s/GPU on one node."""
    w = scaling.workload("sd2-base", None, sharding="ddp", backward_share=0.46, ema=True)
    net = scaling.INTERCONNECTS["p4de"]
    s = 865.9e6 * 4  # fp32 gradients
    buckets = 133  # ceil(3.4636e9 / 25 MiB)
    nvlink = 2 * 7 / 8 * s / 300e9
    assert scaling.communication(w, 1, 8, net) == (0.0, pytest.approx(nvlink + buckets * 3e-6))
    efa = 2 * 3 / 4 * s / 50e9  # 400 Gb/s = 50 GB/s per node
    assert scaling.communication(w, 4, 8, net)[1] == pytest.approx(nvlink + efa + buckets * (3 + 15 * 2 * 2) * 1e-6)
    update = 865.9e6 * 40 / 2.039e12  # AdamW 28 B + EMA 12 B per parameter at HBM speed
    c = (256 / 25.5275 - update) / 256  # one node: the all-reduce hides in the backward window
    p = scaling.predict(25.5275, 2048, 1, 2048, 4, 32, w, net)
    assert p["exposed"] == 0 and p["update"] == pytest.approx(update)
    assert p["images_per_sec_per_gpu"] == pytest.approx(64 / (64 * c + update))
    assert p["images_per_sec_per_gpu"] * 32 == pytest.approx(812.7, abs=0.1)


def test_exposed_communication_and_its_removal_from_the_measurement():
    """FLUX-size DDP over 4x100 Gb/s with one-image microbatches: the all-reduce outlasts the backward window."""
    w = scaling.workload("flux-schnell", None, sharding="ddp")
    net = scaling.INTERCONNECTS["p4de"]
    c = scaling.compute_per_image(8.0, 64, 1, w, 1, 8, net)
    one = scaling.step_time(c, 64, 1, w, 1, 8, net)
    assert one["total"] == pytest.approx(64 / 8.0)  # the solved compute reproduces the measurement
    assert one["exposed"] > 0  # 95 GB over NVLink is not hidden behind one image's backward
    two = scaling.step_time(c, 32, 1, w, 2, 8, net)
    assert two["exposed"] == pytest.approx(two["comm"] - 2 / 3 * c)
    p = scaling.predict(8.0, 512, 1, 512, 2, 1, w, net)
    assert p["efficiency"] == pytest.approx(32 / two["total"] / 8.0) and p["efficiency"] < 0.9


def test_sharding_volumes():
    net = scaling.INTERCONNECTS["dgx-h100"]
    kw = dict(params=1e9, grad_bytes=4, param_bytes=2, units=10)
    fsdp = scaling.communication(scaling.Workload(sharding="fsdp", **kw), 2, 8, net)
    zero2 = scaling.communication(scaling.Workload(sharding="shard_grad_op", **kw), 2, 8, net)
    gather = 7 / 8 * 2e9 / 450e9 + 1 / 2 * 2e9 / 400e9 + 10 * (3 + 5 * 2) * 1e-6
    scatter = 7 / 8 * 4e9 / 450e9 + 1 / 2 * 4e9 / 400e9 + 10 * (3 + 5 * 2) * 1e-6
    assert fsdp == (pytest.approx(gather), pytest.approx(gather + scatter))
    assert zero2 == (pytest.approx(gather), pytest.approx(scatter))


def test_docs_table_is_the_models_output():
    """docs/throughput.md's validation table equals what the model computes from the CSV, row for row."""
    rows = scaling.validate(str(CSV))
    table = scaling.validation_markdown(rows)
    assert table in (ROOT / "docs" / "throughput.md").read_text()
    assert len(rows) == 29
    ok = [r for r in rows if not r["note"] and r["series"] not in ("mosaic-sd2-256", "mosaic-benchmark-512")]
    assert all(abs(r["error"]) <= 0.2 for r in ok)  # every row where the microbatch stays as measured


def test_validate_cli_and_bad_input(capsys, tmp_path):
    assert scaling.main(["--validate", str(CSV)]) == 0
    assert "| mlperf5.1-uf-b200-flux | 16 -> 128 | 32 |" in capsys.readouterr().out
    assert scaling.run("diffusion.bench.scaling", scaling.main, ["--validate", str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"diffusion.bench.scaling: error: --validate .*none.csv: No such file", err[0])
