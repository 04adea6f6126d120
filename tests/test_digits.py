"""A short run of examples/digits (the CPU proof that training works): real learning, well above chance.

The full-length run and its figures are in docs/digits.md (SD 98%, FLUX 95% at guidance 4); this one runs
every step of the chain (convert, autoencoder, text encoder pretraining, SD and FLUX training, sampling,
the judge) for a fraction of the time and asserts that both families' samples are read as the prompted
digit far more often than chance (10%).
"""

import json
import sys

import pytest
from conftest import REPO, run

CHANCE = 0.10


@pytest.mark.proof  # ~8 minutes on 2 cores: `python -m pytest -q tests -m proof` (CI runs it after the suite)
@pytest.mark.timeout(1800)
def test_digits_short_run_learns_both_families(tmp_path):
    out = tmp_path / "digits"
    done = run(
        [
            sys.executable,
            str(REPO / "examples/digits/digits.py"),
            "--out",
            str(out),
            "--vae_duration",
            "120ba",
            "--text_steps",
            "150",
            "--duration",
            "800ba",
            # a short run needs a short EMA (with the recipes' 0.999, 45% of the average would still be the
            # initial weights after 800 batches) and SD's learning rate for FLUX too (FLUX at 1e-3: 36%)
            "--set",
            "ema_smoothing=0.99",
            "lr=2e-3",
            "warmup=50ba",
            "--samples_per_digit",
            "5",
            "--steps",
            "15",
        ],
        cwd=tmp_path,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["real_digits"] == 1797 and results["judge_accuracy_on_real"] > 0.93
    assert results["vae_psnr_db"] > 20  # the autoencoder reconstructs (an untrained one is below 10 dB)
    for family in ("sd", "flux"):
        judged = results["families"][family]["guidance"]["4"]
        assert judged["samples"] == 50
        assert judged["accuracy"] >= 4 * CHANCE, (family, judged)
    assert (out / "sd" / "samples-cfg4" / "grid.png").is_file()
