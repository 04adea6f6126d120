"""Per-rank figures in the results line and the straggler warning, with one rank slowed on purpose.

The slow rank is made from outside the library: a sitecustomize.py on the ranks' PYTHONPATH wraps
torch's mse_loss (the training loss) with a sleep on global rank 1 only."""

import json
import socket
import textwrap

import pytest
from conftest import composer, read_results

SLOW_SITE = textwrap.dedent("""
    import os
    if os.environ.get("RANK") == "1" and os.environ.get("SLOW_RANK_SECONDS"):
        import time
        import torch.nn.functional as F
        _mse, _pause = F.mse_loss, float(os.environ["SLOW_RANK_SECONDS"])

        def mse_loss(*args, **kwargs):
            time.sleep(_pause)
            with open("slept.txt", "a") as f:
                print(_pause, file=f)
            return _mse(*args, **kwargs)

        F.mse_loss = mse_loss
""")


@pytest.mark.slow
def test_a_slowed_rank_is_named_with_its_host(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("SLOW_RANK_SECONDS", "3")  # well above sd-tiny's batch time on a busy 2-core machine
    proc = composer(
        2,
        "benchmark.py",
        "--use_synth_data",
        "--model_name",
        "sd-tiny",
        "--batch_size",
        "2",
        "--max_duration",
        "4ba",
        "--num_workers",
        "0",
        "--results",
        "r.jsonl",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = read_results(tmp_path / "r.jsonl")
    assert len((tmp_path / "slept.txt").read_text().split()) == 4  # rank 1 slept in each batch's loss
    host = socket.gethostname()
    warnings = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and warnings[0].startswith("benchmark.py: warning: rank 1 on " + host), (
        warnings,
        {k: v for k, v in rec.items() if k.startswith(("rank_", "slowest", "measured"))},
    )
    assert "rank 0 " not in warnings[0] and "straggler_threshold 10%" in warnings[0]
    slow, fast = rec["slowest_ranks"]
    assert (slow["rank"], slow["host"], fast["rank"], fast["host"]) == (1, host, 0, host)
    assert slow["images_per_sec"] < 0.9 * fast["images_per_sec"] and slow["slower_than_median"] > 0.1
    assert fast["wait_s"] > 3.0 and slow["wait_s"] == 0.0  # rank 0 sat ~3 s a batch in the gradient sync
    assert rec["rank_split"] == "ddp_last_grad_bucket" and [s["rank"] for s in rec["stragglers"]] == [1]
    assert rec["rank_images_per_sec"]["min"] == slow["images_per_sec"] < rec["rank_images_per_sec"]["max"]
    assert rec["rank_images_per_sec"]["min"] == pytest.approx(rec["images_per_sec_per_gpu"], rel=0.1)
    assert rec["rank_wait_share"]["max"] > 0.2 and rec["rank_wait_seconds"]["max"] == fast["wait_s"]
    printed = json.loads(proc.stdout.split("results: ", 1)[1].splitlines()[0])
    assert printed["slowest_ranks"][0]["rank"] == 1 and printed["rank_images_per_sec"] == rec["rank_images_per_sec"]


def test_warning_names_every_straggler():
    from diffusion.callbacks.results_line import straggler_warning

    record = {
        "straggler_threshold": 0.1,
        "rank_images_per_sec": {"median": 20.0},
        "rank_wait_share": {"max": 0.31},
        "stragglers": [
            {"rank": 5, "host": "node-2", "slower_than_median": 0.4, "images_per_sec": 12.0},
            {"rank": 9, "host": "node-3", "slower_than_median": 0.15, "images_per_sec": 17.0},
        ],
    }
    assert straggler_warning(record) == (
        "rank 5 on node-2 40% slower (12 images/s), rank 9 on node-3 15% slower (17 images/s): more than "
        "straggler_threshold 10% below the median rank (20 images/s); ranks waited for others up to 31% of their "
        "batch time"
    )
