"""A short run of examples/digits (the CPU proof that training works): real learning, well above chance.

The full-length run and its figures are in docs/digits.md (SD 98%, FLUX 95% at guidance 4); this one runs
every step of the chain (convert, autoencoder, text encoder pretraining, SD and FLUX training, sampling,
the judge) for a fraction of the time and asserts that both families' samples are read as the prompted
digit far more often than chance (10%).

Two lengths (DIFFUSION_PROOF): ``short``, the default and what CI runs (~24 minutes on 2 cores: the square chain
on 500 batches, SD's LoRA run, then Z-Image and Qwen-Image on 500 batches each, SD3 and FLUX.2 on 1,000), and ``full`` (~20 minutes on a good day, 31 in CI's run of 2026-11-27, which
ran past CI's budget: the square chain on 800 batches, the aspects runs of all three families, LoRA for SD and
FLUX), run once for a change to the recipes or the examples and recorded in docs/testing.md.
"""

import json
import os
import sys

import pytest
from conftest import REPO, run

CHANCE = 0.10
FULL = os.environ.get("DIFFUSION_PROOF", "short") == "full"
# The short chain: autoencoder, text encoder, diffusion (a length given per test), sampling.
SHORT = ["--vae_duration", "120ba", "--text_steps", "150", "--samples_per_digit", "5", "--steps", "15"]
# a short run needs a short EMA (with the recipes' 0.999, 45% of the average would still be the initial
# weights after 800 batches) and SD's learning rate for FLUX too (FLUX at 1e-3: 36%)
SHORT_SET = ["--set", "ema_smoothing=0.99", "lr=2e-3", "warmup=50ba"]
# Batches of the square chain, and the share each family's samples must reach (in multiples of chance). Measured on
# the 2-core VM: after 800 batches the LoRA test's samples of the bases' digits read SD 98% and FLUX 100%
# (2026-11-27); after 500, this test's read SD 62% and FLUX 44% (2026-11-28, 5.9 minutes for the chain), and with
# the CLIP-shaped tokenizer SD 58% and FLUX 32% (2026-11-28, a loaded VM; 50 samples each, about +-7 points): FLUX's
# bar is twice chance, which both runs cleared with margin (the full chain reads FLUX 100%: docs/digits.md).
SQUARE = {"duration": "800ba", "sd": 4, "flux": 4} if FULL else {"duration": "500ba", "sd": 4, "flux": 2}
# LoRA's families: both in the full proof; SD's alone in the short one (FLUX's adapters on CLIP too: the longer run)
LORA_FAMILIES = ("sd", "flux") if FULL else ("sd",)


def run_example(script: str, out, *options: str) -> dict:
    """examples/digits/SCRIPT into ``out`` with ``options``; its results.json."""
    done = run(
        [sys.executable, str(REPO / "examples/digits" / script), "--out", str(out), *options],
        cwd=out.parent,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = {p.name: p.read_text(errors="replace") for p in (out / "logs").glob("*.log")}
    flagged = {name: text[-1500:] for name, text in logs.items() if "learned nothing" in text}  # every training learns
    assert logs and not flagged, flagged
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def square_run(tmp_path_factory):
    """digits.py's short chain (its OUT): its autoencoder and text encoder serve the aspects run as well."""
    out = tmp_path_factory.mktemp("proof") / "digits"
    run_example("digits.py", out, *SHORT, *SHORT_SET, "--duration", SQUARE["duration"])
    return out


@pytest.mark.proof  # ~6 minutes on 2 cores (8 in full): `python -m pytest -q tests -m proof` (CI runs it after the suite)
@pytest.mark.timeout(1800)
def test_digits_short_run_learns_both_families(square_run):
    results = json.loads((square_run / "results.json").read_text())
    assert results["real_digits"] == 1797 and results["judge_accuracy_on_real"] > 0.93
    assert results["vae_psnr_db"] > 20  # the autoencoder reconstructs (an untrained one is below 10 dB)
    for family in ("sd", "flux"):
        judged = results["families"][family]["guidance"]["4"]
        assert judged["samples"] == 50
        assert judged["accuracy"] >= SQUARE[family] * CHANCE, (family, judged)
    assert (square_run / "sd" / "samples-cfg4" / "grid.png").is_file()
    from diffusion.techniques.repa.alignment import (
        encoder_spec,  # the CLIP image tower kept for REPA (repa_encoder=DIR)
    )

    spec = encoder_spec(str(square_run / "vision_encoder"))
    assert (spec.cls, spec.patch, spec.image_size) == ("AutoModel", 4, 16)


# The families digits.py trains when asked, on the square run's autoencoder (FLUX.2 and Qwen-Image train their own
# kind first; SD3 takes its first CLIP from that run too), with their presets' other random text encoders, in two
# groups by the batches they need (the short set; 50 samples each, about +-7 points). Measured on the 2-core VM:
# - Z-Image and Qwen-Image on 500 batches (2026-11-28, other jobs running): Z-Image 32% and 28% (on a 200- and on this
#   test's 120-batch autoencoder), Qwen-Image 46% twice; about 9 minutes for the two.
# - SD3 and FLUX.2 [klein], which read 18% and 12% (chance) after 500, on 1,000 (2026-11-28, another training beside
#   it): SD3 38%, FLUX.2 62%, 5.1 minutes for the two (their full chains: SD3 100% after 2,000 batches, FLUX.2 97%
#   after 1,000 at 200 samples, docs/digits.md).
# - 2026-12-02, the pinned set on transformers 5.5.4 / diffusers 0.42.1 / streaming-community (nothing beside it):
#   Z-Image 34%, Qwen-Image 44% (4.5 minutes); SD3 48%, FLUX.2 74% (8.8 minutes).
# The full proof's only since 2026-12-02: 13 of CI's minutes (CI passed in 79 on 2026-12-01, its aim is 60); CI's short
# proof keeps the square run (SD, FLUX) and LoRA. DIFFUSION_PROOF=full runs them, with the aspects.
ASKED_GROUPS = {"z-image,qwen-image": "500ba", "sd3,flux2": "1000ba"}


@pytest.mark.proof  # ~4.5 and ~9 minutes on 2 cores after the square run
@pytest.mark.skipif(not FULL, reason="the full proof's (DIFFUSION_PROOF=full): 13 minutes, past CI's budget")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("group", list(ASKED_GROUPS))
def test_the_asked_families_short_runs_learn_the_digits(square_run, group):
    families = group.split(",")
    options = ["--families", *families, "--encoders", str(square_run), *SHORT, *SHORT_SET]
    results = run_example(
        "digits.py", square_run.parent / group.replace(",", "-"), *options, "--duration", ASKED_GROUPS[group]
    )
    for family in families:
        judged = results["families"][family]["guidance"]["4"]
        assert judged["samples"] == 50
        assert judged["accuracy"] >= 2 * CHANCE, (family, judged)


@pytest.mark.proof  # ~9 minutes on 2 cores after the square run (docs/digits.md); the full proof only
@pytest.mark.skipif(not FULL, reason="the full proof's (DIFFUSION_PROOF=full): buckets train as squares do")
@pytest.mark.timeout(1800)
def test_aspects_short_run_samples_wide_and_tall_digits(square_run):
    """examples/digits/aspects.py with its own short defaults and the square run's encoders: digits on 2:1
    and 1:2 canvases, bucketed (data.py bucket), each family trained on the buckets; samples asked for at the
    wide and the tall bucket's size are read, by their centre square, as the prompted digit far more often
    than chance."""
    out = square_run.parent / "aspects"
    results = run_example("aspects.py", out, "--encoders", str(square_run))
    assert results["canvases"] == {"2x1": 899, "1x2": 898} and results["encoders_from"] == str(square_run)
    for family in ("sd", "flux", "sdxl"):
        shapes = results["families"][family]["shapes"]
        assert {s: (r["height"], r["width"]) for s, r in shapes.items()} == {"2x1": (16, 32), "1x2": (32, 16)}
        for shape, figures in shapes.items():
            judged = figures["guidance"]["4"]
            assert judged["samples"] == 50
            assert judged["accuracy"] >= 3 * CHANCE, (family, shape, judged)
    sample = next((out / "sd" / "samples-2x1-cfg4").glob("0*.png"))
    from PIL import Image

    assert Image.open(sample).size == (32, 16)  # (width, height): wide


@pytest.mark.proof  # ~4 minutes on 2 cores after the square run (docs/lora.md#proof-on-the-cpu)
@pytest.mark.timeout(1500)
def test_lora_short_run_teaches_both_bases_signs_they_never_saw(square_run):
    """examples/digits/lora.py on the square run's SD and FLUX models as the pretrained bases: before, their samples
    for the four signs' prompts are read as digits; after a short LoRA run (under 2% of the parameters) they are read
    as the prompted sign far more often than chance, and the bases (the adapters off) still draw their digits."""
    out = square_run.parent / "lora"
    options = ["--base", str(square_run), "--families", *LORA_FAMILIES, "--no_full", "--samples", "5", "--steps", "15"]
    results = run_example("lora.py", out, *options, "--duration", "600ba")
    assert results["sign_judge_accuracy_held_out"] > 0.95
    for family in LORA_FAMILIES:
        judged = results["families"][family]
        assert judged["signs_before"]["accuracy"] <= 0.25  # chance among the four signs is 25%; the bases draw digits
        assert judged["lora"]["lora"]["trainable_share"] < 0.02
        # the full runs read 98.8% (SD) and 95.0% (FLUX) after 1,000 batches (docs/lora.md); these short ones read 90%
        # and 70% on 2026-11-27 (signs 0% before, the bases' digits 98% and 100%; 7.3 minutes for the square run and
        # this one, FLUX's share of it 1.5); SD's on the short proof's 500-batch base read 70% (2026-11-28: base 62%,
        # 4.0 minutes): half is the bar
        assert judged["lora"]["signs_after"]["accuracy"] >= 0.5, (family, judged["lora"]["signs_after"])
        assert judged["digits_base"]["accuracy"] >= 4 * CHANCE
        lora = out / family / "lora" / "exported" / "pytorch_lora_weights.safetensors"
        assert lora.is_file()
