"""Proof that training on images that are not square works, on a CPU: digits on wide and tall canvases in,
recognisable digits out at a requested wide or tall size.

    python examples/digits/aspects.py --out runs/aspects                   # SD, FLUX and SDXL (~10 min)
    python examples/digits/aspects.py --out runs/aspects --families sd     # one
    python examples/digits/aspects.py --encoders runs/digits               # a digits.py run's encoders

The digits proof (digits.py, whose steps this reuses) with data that is not square:
  1. scikit-learn's 1,797 digits, each on a canvas of one of two aspect ratios in turn (2:1: 16x8 wide,
     1:2: 8x16 tall; the digit fills the short side, centred, black margins), captioned as there
  2. data.py convert                 folder -> MDS shards (each sample's original size recorded)
     data.py bucket                  -> one MDS dataset per aspect ratio (2x1/, 1x2/) and buckets.json
  3. train.py vae.yaml               the autoencoder, on the converted set (its centre squares: the digits)
     text_encoder.py                 the tiny CLIP text encoder, on the square digits
                                     (or, with --encoders DIR, an earlier digits.py run's: the same digits)
  4. train.py FAMILY.yaml            each family on the bucketed set (local=DIR with buckets.json): every batch
                                     is one bucket's shape, at 24 px: 32x16 (w x h) or 16x32
  5. generate.py --width --height    N samples per digit at each bucket's shape
  6. digits.py's classifier reads each sample's centre square (where the digit is): the share read as the
     prompted digit is the score, per family and per shape (chance: 10%)

Results go to OUT/results.json (per family: per shape, its accuracy per guidance scale and per digit), the
samples to OUT/FAMILY/samples-SHAPE-cfgG. The options are digits.py's, with shorter defaults (``SHORT``,
``DURATIONS``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import digits
from PIL import Image

from diffusion.data import buckets

# (width units, height units); sample i goes on CANVASES[i % 2]. The square case is digits.py's; here every
# batch is wide or tall, with the digit at the scale digits.py trains at (2 px per digit pixel).
CANVASES = ((2, 1), (1, 2))
# Buckets of about 24 x 24 pixels (image_size=24 for the diffusion runs): with the f2 autoencoder the models'
# size factor is 4 (model.size_multiple), so at 16 px 2:1 would be 24x12 (w x h), which the diffusers SD and
# SDXL pipelines cannot sample (their sides must be multiples of 8); at 24 px: 32x16 and 16x32.
RESOLUTION = 24
# Shorter than digits.py's defaults, so that all three families train in about 10 minutes on 2 cores: a short
# run wants a short EMA, SD's learning rate for FLUX too, and batches of 16 (measured on SD: 1,400 batches of 16
# read 93% right where 700 of 32, the same images in 82% of the time, read 46%). tests/test_digits.py runs these.
SHORT = dict(
    vae_duration="120ba",
    text_steps=150,
    set=["ema_smoothing=0.99", "lr=2e-3", "warmup=50ba", "batch_size=16"],
    samples_per_digit=5,
    steps=15,
)
# Each family's length when --duration is not given: FLUX learns the layout in more batches than SD (with AdamW:
# 1,500: 34% and 20% right; 3,000: 68% and 66%), each about 40% of the cost of an SD batch. FLUX's recipe trains
# with Muon since 2026-11-26 (0.72x AdamW's batches to 90% on the square digits, 15% more per batch): 2,400.
DURATIONS = {"sd": "900ba", "flux": "2400ba", "sdxl": "900ba"}


def write_canvases(square: str, out: str) -> dict[str, int]:
    """Each 8x8 digit of ``square`` centred on a black canvas of its aspect ratio (the digit fills the short
    side), with its caption; returns the images per canvas."""
    os.makedirs(out, exist_ok=True)
    counts = dict.fromkeys(map(buckets.name, CANVASES), 0)
    for i, name in enumerate(sorted(f[:-4] for f in os.listdir(square) if f.endswith(".png"))):
        digit = Image.open(os.path.join(square, name + ".png"))
        aspect = CANVASES[i % len(CANVASES)]
        side = min(digit.size)
        canvas = Image.new(digit.mode, (side * aspect[0], side * aspect[1]))
        canvas.paste(digit, ((canvas.width - side) // 2, (canvas.height - side) // 2))
        canvas.save(os.path.join(out, name + ".png"))
        with open(os.path.join(square, name + ".txt")) as src, open(os.path.join(out, name + ".txt"), "w") as dst:
            dst.write(src.read())
        counts[buckets.name(aspect)] += 1
    return counts


def shapes(family: str, vae_dir: str) -> dict[str, tuple[int, int]]:
    """(height, width) of each canvas's bucket for this family's model with the trained VAE: the sizes it
    trains at, and the sizes its samples are asked for."""
    from diffusion.config import load_config

    return model_shapes(load_config([os.path.join(digits.HERE, f"{family}.yaml")]).model_name, vae_dir)


def model_shapes(model: str, vae_dir: str) -> dict[str, tuple[int, int]]:
    from diffusion.models.build import describe

    factor = describe(model, {"vae": vae_dir}).downsample_factor
    return {buckets.name(a): buckets.bucket_size(a, RESOLUTION, factor) for a in CANVASES}


def quality(checkpoint: str) -> float:
    """This proof's score as a measure for the curves tool (``--quality examples/digits/aspects.py:quality
    --better higher``): digits.py's sampling defaults (20 samples per digit, 30 steps, guidance 4) at each
    canvas's bucket shape, each sample's centre square read by digits.py's judge; the mean of the shapes' shares
    read as the prompted digit. The model and VAE come from the run's settings (OUT/NAME/variant.json, which the
    curves tool writes); samples and logs of the checkpoint at batch B go to OUT/NAME/aspects-baB."""
    from diffusion.config import load_config

    path = Path(checkpoint).resolve()
    record = json.loads((path.parent / "variant.json").read_text())
    cfg = load_config(record["recipes"], record["overrides"])
    batch = re.search(r"-ba(\d+)", path.name)[1]
    work = path.parent / f"aspects-ba{batch}"
    work.mkdir(exist_ok=True)
    sizes = model_shapes(cfg.model_name, cfg.vae)
    judge = digits.train_judge()[0]
    judged = digits.judge_checkpoint("curves", str(path), digits.parse_args([]), str(work), judge, str(work), sizes)
    return sum(shape["accuracy"] for shape in judged["shapes"].values()) / len(sizes)


def main(argv=None) -> int:
    args = digits.parse_args(argv, __doc__, "runs/aspects", digits.FAMILIES, **SHORT)
    out, logs, results = digits.start(args)
    square, folder = os.path.join(out, "digits"), os.path.join(out, "folder")
    mds, bucketed = os.path.join(out, "mds"), os.path.join(out, "mds-buckets")
    n = digits.write_folder(square)
    results["canvases"] = write_canvases(square, folder)
    seconds = results["seconds"]
    seconds["convert"] = digits.run("convert", ["data.py", "convert", folder, mds, "--format", "folder"], logs)
    seconds["bucket"] = digits.run("bucket", ["data.py", "bucket", mds, bucketed], logs)
    encoders = digits.train_encoders(args, out, mds, square, logs, results)
    judge = digits.start_judge(results, n)
    for family in args.families:
        work = os.path.join(out, family)
        sizes = shapes(family, encoders[0].partition("=")[2])
        overrides = [f"local={bucketed}", *encoders, f"image_size={RESOLUTION}"]
        if not args.duration:
            overrides += [f"{key}={DURATIONS[family]}" for key in ("max_duration", "save_interval")]
        results["families"][family] = digits.train_and_judge(family, args, work, overrides, judge, logs, sizes)
    for family, result in results["families"].items():
        print(f"aspects: {family}: " + ", ".join(f"{s} {r['accuracy']:.0%}" for s, r in result["shapes"].items()))
    return digits.finish(out, results)


if __name__ == "__main__":
    sys.exit(main())
