"""A run that learned nothing says so (callbacks/learned_nothing.py): the warning line and the results line's
``learned_nothing``. The proof's runs, which learn, never carry it (test_digits.py checks every log)."""

import json
import sys

import torch
from conftest import REPO, run
from torchmetrics.image import PeakSignalNoiseRatio

from diffusion.callbacks.learned_nothing import flat_image_psnr


def test_the_flat_image_baseline_is_torchmetrics_psnr_of_the_mean_colour():
    torch.manual_seed(0)
    images = torch.rand(6, 3, 8, 10) * 1.6 - 0.9
    images[:, 0] *= 0.3  # channels of different spread
    flat = images.mean(dim=(0, 2, 3), keepdim=True).expand_as(images)
    expected = PeakSignalNoiseRatio(data_range=(-1.0, 1.0))(flat, images).item()
    per_channel = images.transpose(0, 1).reshape(3, -1).double()
    got = flat_image_psnr(per_channel.sum(1), per_channel.pow(2).sum(1), per_channel.shape[1])
    assert abs(got - expected) < 1e-4, (got, expected)


def test_an_autoencoder_that_cannot_learn_is_named_in_its_output_and_results_line(tmp_path, mds_images):
    """vae-tiny on real images at a learning rate of 1e-12 for 50 batches (the least judged): its PSNR stays near a
    flat image's, its loss where it started; the run exits 0 with one warning line naming both signs."""
    results = tmp_path / "results.jsonl"
    args = [
        "model_name=vae-tiny", f"remote={mds_images}", f"local={tmp_path / 'cache'}", f"eval_local={mds_images}",
        "image_size=32", "batch_size=4", "num_workers=0", "lr=1e-12",
        "max_duration=50ba", "eval_interval=50ba", "save_folder=null", f"results={results}",
    ]  # fmt: skip
    done = run([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "learned nothing" in line]
    assert len(warnings) == 1 and warnings[0].startswith("train.py: warning: learned nothing: eval PSNR "), warnings
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    reason = record["learned_nothing"]
    assert "dB, the PSNR of a flat image of the eval images' mean colour" in reason, reason
    assert "is less than 10% below that of the first 10" in reason and "after 50 batches" in reason, reason
    assert warnings[0].endswith(reason)
