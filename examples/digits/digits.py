"""Proof that training works, on a CPU: handwritten digits in, recognisable digits out.

    python examples/digits/digits.py --out runs/digits                  # both families (~10 min on 2 cores)
    python examples/digits/digits.py --out runs/digits --families sd    # one (sd, flux, sdxl, z-image, flux2, qwen-image, sd3, krea2)
    python examples/digits/digits.py --guidance_scale 1 2 4 7           # judge several guidance scales
    python examples/digits/digits.py --text_steps 0                     # keep the presets' random text encoder

The whole chain, each step the repo's own command:
  1. scikit-learn's 1,797 handwritten digits (8x8) -> a folder of PNGs captioned "a handwritten digit seven"
  2. data.py convert                 folder -> MDS shards
  3. train.py vae.yaml               a small autoencoder (f2, 4 channels) on the digits at 16 px
     export.py                       -> an AutoencoderKL directory with its latent shift and scale
     text_encoder.py                 a tiny CLIP text encoder, pretrained contrastively on the same pairs
                                     (what a real run loads from a local path; the presets' are random);
                                     its image tower is kept in OUT/vision_encoder (REPA: repa_encoder=DIR)
  4. train.py sd.yaml / flux.yaml    tiny SD and tiny FLUX in that latent space with that text encoder
                                     (vae=DIR text_encoder=DIR); flux2 and qwen-image train their own VAE class
                                     first (vae-flux2.yaml, vae-qwen-image.yaml) and keep their random Qwen encoders
  5. generate.py                     N samples per digit from the EMA weights
  6. a logistic-regression classifier trained on the real digits reads each sample: the share read as
     the prompted digit is the score (chance: 10%)

Results (accuracies per guidance scale and per digit, wall times per step) are printed and go to
OUT/results.json; the samples and their grids are under OUT/FAMILY/samples-cfgG, the logs of every step
under OUT/logs. Step lengths can be shortened with --vae_duration, --text_steps and --duration (the test
suite runs a short version).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FAMILIES = ("sd", "flux", "sdxl")  # each has examples/digits/FAMILY.yaml
# families trained when asked (--families sd3), outside the default runs
ASKED = ("sd3", "z-image", "flux2", "qwen-image", "flux2-dev", "krea2")
# of those, the ones whose text encoder is not a CLIP tower, so the pretrained one does not serve them: they keep their
# preset's random one
OWN_TEXT_ENCODER = ("z-image", "flux2", "qwen-image", "flux2-dev", "krea2")
# families whose first text encoder is a CLIP tower with its projection (CLIPTextModelWithProjection): they take the
# pretrained tower with the projection it was trained with (OUT/text_encoder_projected); SD3's second CLIP and its T5
# stay the preset's random ones
PROJECTED = ("sd3",)
# families whose VAE is not an AutoencoderKL -> the recipe of their own f2 autoencoder (examples/digits/KIND.yaml), trained
# once per kind into OUT/KIND (vae-flux2: an AutoencoderKLFlux2, whose batch-norm statistics FLUX.2 normalises with;
# vae-qwen-image: an AutoencoderKLQwenImage with its latents_mean/std, Qwen-Image's and Krea 2's)
AUTOENCODERS = {
    "flux2": "vae-flux2",
    "qwen-image": "vae-qwen-image",
    "flux2-dev": "vae-flux2",
    "krea2": "vae-qwen-image",
}


def caption(digit: int) -> str:
    return f"a handwritten digit {NAMES[digit]}"


def write_folder(out: str) -> int:
    """The digits as 8x8 grayscale PNGs (ink white on black, 0-16 -> 0-255) with sidecar captions."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    os.makedirs(out, exist_ok=True)
    for i, (image, digit) in enumerate(zip(digits.images, digits.target)):
        Image.fromarray(np.round(image * 255 / 16).astype(np.uint8)).save(os.path.join(out, f"{i:04d}.png"))
        with open(os.path.join(out, f"{i:04d}.txt"), "w") as f:
            f.write(caption(int(digit)))
    return len(digits.images)


def centre_square(image: Image.Image) -> Image.Image:
    """The largest centred square of an image (itself when square): where a digit is on a wide or tall canvas."""
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side))


def features(image: Image.Image) -> np.ndarray:
    """An image as the classifier sees digits: its centre square, 8x8 gray (box-filtered), 0-16."""
    gray = centre_square(image).convert("L").resize((8, 8), Image.BOX)
    return np.asarray(gray, dtype=np.float64).reshape(-1) * 16 / 255


@functools.cache
def train_judge(seed: int = 0):
    """Logistic regression on the real digits; returns (classifier, held-out accuracy on real digits). Trained
    once per process (the curves' measures ask for it at every checkpoint)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.25, stratify=digits.target, random_state=seed
    )
    judge = LogisticRegression(max_iter=5000).fit(x_train, y_train)
    return judge, float(judge.score(x_test, y_test))


def judge_samples(judge, samples: str, per_digit: int) -> dict:
    """The share of a folder of samples (prompted per digit, in order) that the judge reads as the prompted digit."""
    files = sorted(f for f in os.listdir(samples) if f[:5].isdigit())
    predicted = judge.predict(np.stack([features(Image.open(os.path.join(samples, f))) for f in files]))
    wanted = np.repeat(np.arange(10), per_digit)
    return {
        "accuracy": round(float((predicted == wanted).mean()), 4),
        "samples": len(files),
        "per_digit": {NAMES[d]: round(float((predicted[wanted == d] == d).mean()), 3) for d in range(10)},
    }


def run(step: str, args: list[str], log_dir: str) -> float:
    """One repo command as a subprocess (output to LOG_DIR/STEP.log); its wall time in seconds."""
    start = time.time()
    log = os.path.join(log_dir, f"{step}.log")
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.time() - start
    if done.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"digits: step '{step}' failed (exit {done.returncode}); last output of {log}:\n{tail}")
    print(f"digits: {step:<14} {seconds:7.1f} s", flush=True)
    return seconds


def parse_args(argv=None, doc: str = __doc__, out: str = "runs/digits", families=("sd", "flux"), **defaults):
    """digits.py's options (a sibling passes its own docstring, working directory, families and defaults)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=out, help=f"working directory (default {out})")
    p.add_argument("--families", nargs="+", choices=(*FAMILIES, *ASKED), default=list(families))
    p.add_argument("--vae_duration", default=None, help="autoencoder training length (default: vae.yaml's)")
    p.add_argument(
        "--text_steps",
        type=int,
        default=300,
        help="text encoder pretraining steps (default 300; 0 keeps the presets' random text encoder)",
    )
    p.add_argument(
        "--encoders",
        default=None,
        metavar="DIR",
        help="reuse the autoencoder and text encoder of an earlier run's OUT (DIR/vae/exported, DIR/text_encoder) "
        "instead of training them",
    )
    p.add_argument("--duration", default=None, help="diffusion training length (default: the family yaml's)")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="more train.py overrides for the diffusion runs, e.g. ema_smoothing=0.99 for a short run",
    )
    p.add_argument("--samples_per_digit", type=int, default=20)
    p.add_argument("--steps", type=int, default=30, help="sampling steps (default 30)")
    p.add_argument(
        "--guidance_scale",
        type=float,
        nargs="+",
        default=[4.0],
        help="classifier-free guidance scale(s) to sample and judge at; the first is the headline accuracy (default 4)",
    )
    p.set_defaults(**defaults)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out, logs, results = start(args)
    folder, mds = os.path.join(out, "folder"), os.path.join(out, "mds")
    n = write_folder(folder)
    results["seconds"]["convert"] = run("convert", ["data.py", "convert", folder, mds, "--format", "folder"], logs)
    encoders = train_encoders(args, out, mds, folder, logs, results)
    judge = start_judge(results, n)
    for family in args.families:
        own = family in OWN_TEXT_ENCODER
        overrides = [f"local={mds}", *(e for e in encoders if not (own and e.startswith("text_encoder=")))]
        if family in PROJECTED:
            overrides = [f"{e}_projected" if e.startswith("text_encoder=") else e for e in overrides]
        if family in AUTOENCODERS:  # its own autoencoder class in place of step 3's
            vae = own_autoencoder(AUTOENCODERS[family], args, out, mds, logs, results)
            overrides = [f"vae={vae}" if e.startswith("vae=") else e for e in overrides]
        results["families"][family] = train_and_judge(family, args, os.path.join(out, family), overrides, judge, logs)
    return finish(out, results)


def start(args) -> tuple[str, str, dict]:
    """The working directory (absolute), its logs folder and the results to fill."""
    out = os.path.abspath(args.out)
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    return out, logs, {"families": {}, "seconds": {}}


def train_encoders(args, out: str, mds: str, folder: str, logs: str, results: dict) -> list[str]:
    """Step 3: the autoencoder (on ``mds`` at 16 px) and the text encoder (on ``folder``'s square pairs);
    returns train.py's overrides that load them (vae=DIR, text_encoder=DIR). With ``--encoders``, an earlier
    run's are used instead."""
    if args.encoders:
        return earlier_encoders(args, results)
    # step 3's AutoencoderKL, when a family takes it (a placeholder for families with their own: main replaces it)
    served = any(family not in AUTOENCODERS for family in args.families)
    vae_dir = train_autoencoder(args, out, mds, logs, results) if served else "own"
    if not args.text_steps:
        return [f"vae={vae_dir}"]
    text_dir, vision_dir = os.path.join(out, "text_encoder"), os.path.join(out, "vision_encoder")
    command = [os.path.join(HERE, "text_encoder.py"), folder, text_dir, "--steps", str(args.text_steps)]
    command += ["--vision", vision_dir, "--projected", f"{text_dir}_projected"]
    results["seconds"]["text_encoder"] = run("text_encoder", command, logs)
    return [f"vae={vae_dir}", f"text_encoder={text_dir}"]


def earlier_encoders(args, results: dict) -> list[str]:
    """``--encoders DIR``'s autoencoder and text encoder (an earlier digits.py or aspects.py OUT), checked to
    be there; the earlier run's autoencoder PSNR is carried into ``results``."""
    earlier = os.path.abspath(args.encoders)
    parts = {"vae": os.path.join(earlier, "vae", "exported"), "text_encoder": os.path.join(earlier, "text_encoder")}
    earlier_results = os.path.join(earlier, "results.json")  # written last: the earlier run finished
    if any(family in PROJECTED for family in args.families):
        parts["text_encoder_projected"] = os.path.join(earlier, "text_encoder_projected")
    missing = [path for path in parts.values() if not os.path.isdir(path)]
    missing += [] if os.path.isfile(earlier_results) else [earlier_results]
    if missing:
        raise SystemExit(f"digits: --encoders {args.encoders}: no {missing[0]} (run digits.py --out DIR first)")
    with open(earlier_results) as f:
        results["vae_psnr_db"] = json.load(f).get("vae_psnr_db")
    results["encoders_from"] = earlier
    return [f"{key}={path}" for key, path in parts.items() if key != "text_encoder_projected"]


def start_judge(results: dict, real_digits: int):
    """Step 6's classifier, its held-out accuracy on real digits recorded in ``results``."""
    judge, real_accuracy = train_judge()
    results.update(real_digits=real_digits, judge_accuracy_on_real=round(real_accuracy, 4))
    print(f"digits: the judge reads held-out real digits at {real_accuracy:.1%}")
    return judge


def finish(out: str, results: dict) -> int:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"digits: results in {os.path.join(out, 'results.json')}")
    return 0


def own_autoencoder(kind: str, args, out: str, mds: str, logs: str, results: dict) -> str:
    """A family's own autoencoder (AUTOENCODERS' ``kind``): an earlier run's (``--encoders DIR``: DIR/KIND/exported,
    or this run's), else trained now; its exported directory."""
    for earlier in (args.encoders, out):
        exported = os.path.join(os.path.abspath(earlier), kind, "exported") if earlier else ""
        if exported and os.path.isfile(os.path.join(exported, "config.json")):
            return exported
    return train_autoencoder(args, out, mds, logs, results, kind)


def train_autoencoder(args, out: str, mds: str, logs: str, results: dict, kind: str = "vae") -> str:
    """Step 3: the autoencoder of recipe examples/digits/KIND.yaml trained on the digits (its PSNR and time into
    ``results``: KIND_psnr_db, seconds KIND_train) and exported to OUT/KIND/exported; returns that directory."""
    vae_ckpt = os.path.join(out, kind, "checkpoints")
    overrides = [f"local={mds}", f"save_folder={vae_ckpt}", f"eval_local={mds}"]  # reconstruction PSNR at the end
    if args.vae_duration:
        overrides += [f"{key}={args.vae_duration}" for key in ("max_duration", "save_interval", "eval_interval")]
    step = f"{kind}_train"
    results["seconds"][step] = run(step, ["train.py", os.path.join(HERE, f"{kind}.yaml"), *overrides], logs)
    with open(os.path.join(logs, f"{step}.log")) as f:
        psnr = re.findall(r"^eval at batch \d+: .*\bPSNR ([0-9.]+)", f.read(), re.M)  # progress=lines' eval line
    results[f"{kind}_psnr_db"] = float(psnr[-1]) if psnr else None
    print(f"digits: the autoencoder {kind} reconstructs the digits at {results[f'{kind}_psnr_db']} dB PSNR")
    vae_dir = os.path.join(out, kind, "exported")
    run(f"{kind}_export", ["export.py", os.path.join(vae_ckpt, "latest-rank0.pt"), vae_dir], logs)
    return vae_dir


def train_and_judge(family: str, args, work: str, overrides: list[str], judge, logs: str, shapes=None) -> dict:
    """Steps 4-6 for one family: train it in ``work`` (``overrides``: the data, VAE and text encoder), then
    sample every digit at each guidance scale and judge the samples: square ones at 16 px, or with ``shapes``
    (name -> (height, width)) at each of those sizes, judged by their centre square."""
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "checkpoints")
    overrides = [*overrides[:2], f"save_folder={ckpt}", *overrides[2:], *args.set]
    if args.duration:
        overrides += [f"max_duration={args.duration}", f"save_interval={args.duration}"]
    train_s = run(f"{family}_train", ["train.py", os.path.join(HERE, f"{family}.yaml"), *overrides], logs)
    judged = judge_checkpoint(family, os.path.join(ckpt, "latest-rank0.pt"), args, work, judge, logs, shapes)
    return {"train_seconds": round(train_s, 1), **judged}


def judge_checkpoint(name: str, checkpoint: str, args, work: str, judge, logs: str, shapes=None, extra=()) -> dict:
    """Steps 5-6 for a checkpoint: ``args.samples_per_digit`` samples of every digit (generate.py with ``extra``
    flags) at each guidance scale, judged: square ones at 16 px, or with ``shapes`` (name -> (height, width)) at
    each of those sizes, judged by their centre square (then under "shapes")."""
    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("\n".join(caption(d) for d in range(10) for _ in range(args.samples_per_digit)) + "\n")
    generate = ["generate.py", checkpoint, "--prompts", prompts, *extra]
    if shapes is None:
        return sample_and_judge(name, "", generate + ["--image_size", "16"], args, work, judge, logs)
    result: dict = {"shapes": {}}
    for shape, (height, width) in shapes.items():
        size = ["--width", str(width), "--height", str(height)]
        judged = sample_and_judge(name, shape, generate + size, args, work, judge, logs)
        result["shapes"][shape] = {"height": height, "width": width, **judged}
    return result


def sample_and_judge(family: str, shape: str, generate: list[str], args, work: str, judge, logs: str) -> dict:
    """Steps 5-6: ``generate`` (generate.py's command less the output and sampling settings) at each guidance
    scale into WORK/samples-[SHAPE-]cfgG, each folder judged: its accuracy, per-digit shares and time."""
    result: dict = {"guidance": {}}
    name = f"{family}_{shape}" if shape else family
    for scale in args.guidance_scale:
        samples = os.path.join(work, f"samples-{shape + '-' if shape else ''}cfg{scale:g}")
        sampling = ["--out", samples, "--guidance_scale", str(scale), "--steps", str(args.steps), "--batch_size", "50"]
        sample_s = run(f"{name}_generate_cfg{scale:g}", [*generate, *sampling], logs)
        judged = judge_samples(judge, samples, args.samples_per_digit)
        result["guidance"][f"{scale:g}"] = {**judged, "generate_seconds": round(sample_s, 1)}
        print(
            f"digits: {name}: {judged['accuracy']:.1%} of {judged['samples']} samples (guidance {scale:g}) "
            f"read as the prompted digit; per digit: {judged['per_digit']}",
            flush=True,
        )
    result["accuracy"] = result["guidance"][f"{args.guidance_scale[0]:g}"]["accuracy"]  # the headline scale
    return result


if __name__ == "__main__":
    sys.exit(main())
