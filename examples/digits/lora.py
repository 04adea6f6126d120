"""Proof that LoRA teaches a pretrained model something new, on a CPU: the digits proof's trained SD and FLUX
models (and those of the families digits.py trains when asked: --families z-image sd3 flux2 qwen-image) learn four
handwritten signs they never saw, through adapters, and we measure what that costs them.

    python examples/digits/digits.py --out runs/digits            # the bases (~10 min on 2 cores)
    python examples/digits/lora.py --base runs/digits --out runs/digits-lora

The chain, each step the repo's own command:
  1. export.py                       each family's digits checkpoint -> a pipeline folder: the pretrained base
  2. four signs drawn by hand-like strokes (plus, cross, square, equals) at 8x8, 100 of each, captioned
     "a handwritten sign plus"; data.py convert -> MDS
  3. a new judge: logistic regression on other drawings of the signs and on the real digits (five classes: the
     four signs, or "a digit"), so a digit drawn for a sign's prompt counts as wrong
  4. generate.py BASE                samples of each sign's prompt before any training (the base draws digits)
  5. train.py FAMILY.yaml model_name=BASE lora_rank=R     adapters only, on the signs
     export.py                       -> pytorch_lora_weights.safetensors (its size on disk)
  6. generate.py BASE --lora DIR     the signs, judged; the digits with the adapters on, judged by digits.py's
                                     judge (what the adapters made the base forget); the base alone is the
                                     adapters off (the base's weights never change)
  7. train.py FAMILY.yaml model_name=BASE                the same batches as a full fine-tune, for its peak
                                     memory, checkpoint size, signs and digits after

Results go to OUT/results.json and are printed: per family, the judge's accuracy on the signs before and
after, the digits' accuracy with the adapters on and off (and after the full fine-tune), the trainable share,
the adapters' size, the peak memory of both runs (this process tree's resident set on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import digits
import numpy as np
from PIL import Image, ImageDraw

SIGNS = ("plus", "cross", "square", "equals")
DIGIT = len(SIGNS)  # the judge's fifth class: any digit
# sd-tiny's UNet is mostly convolutions (attention is 7% of its weights): adapters on its ResNet convolutions too
SD_TARGETS = "conv1,conv2,to_q,to_k,to_v,to_out.0"
# FLUX's pooled CLIP text, trained on digit captions only, hardly tells the signs apart (cosine 0.99 for square and
# equals): adapters on CLIP too (flux-tiny base, seed 0: 95.0% with them, 77.5% without; docs/lora.md)
FAMILY_SET = {"flux": ["lora_text_encoder=true"]}
# training lengths where a family's proof differs from 1,000 batches (docs/lora.md, 2026-11-28: SD3 read 81.2% after
# 1,000 and 95.0% after 2,000; Z-Image 97.5% after 400)
DURATIONS = {"sd3": "2000ba", "z-image": "400ba"}


def sign_caption(sign: int) -> str:
    return f"a handwritten sign {SIGNS[sign]}"


def draw_sign(sign: int, rng: np.random.Generator) -> Image.Image:
    """One sign as the digits look: white strokes on black, drawn at 32 px with a random size, offset, slant and
    stroke, reduced to 8x8 (box filter, as the digits were)."""
    big = Image.new("L", (32, 32), 0)
    pen = ImageDraw.Draw(big)
    half = rng.uniform(8, 12)
    cx, cy = 16 + rng.uniform(-3, 3), 16 + rng.uniform(-3, 3)
    width = int(rng.integers(3, 6))
    ink = int(rng.integers(200, 256))
    lo, hi = -half, half
    if sign == 0:  # plus
        lines = [((0, lo), (0, hi)), ((lo, 0), (hi, 0))]
    elif sign == 1:  # cross
        lines = [((lo, lo), (hi, hi)), ((lo, hi), (hi, lo))]
    elif sign == 2:  # square
        lines = [((lo, lo), (hi, lo)), ((hi, lo), (hi, hi)), ((hi, hi), (lo, hi)), ((lo, hi), (lo, lo))]
    else:  # equals
        gap = half * 0.45
        lines = [((lo, -gap), (hi, -gap)), ((lo, gap), (hi, gap))]
    angle = rng.uniform(-0.2, 0.2)
    c, s = np.cos(angle), np.sin(angle)
    for (x0, y0), (x1, y1) in lines:
        points = [(cx + c * x - s * y, cy + s * x + c * y) for x, y in ((x0, y0), (x1, y1))]
        pen.line(points, fill=ink, width=width)
    return big.resize((8, 8), Image.BOX)


def write_signs(out: str, per_sign: int, seed: int) -> int:
    """``per_sign`` drawings of each sign as PNGs with sidecar captions (digits.py's folder layout)."""
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    for i in range(per_sign * len(SIGNS)):
        sign = i % len(SIGNS)
        draw_sign(sign, rng).save(os.path.join(out, f"{i:04d}.png"))
        with open(os.path.join(out, f"{i:04d}.txt"), "w") as f:
            f.write(sign_caption(sign))
    return per_sign * len(SIGNS)


def train_sign_judge(seed: int = 1):
    """Logistic regression on drawings of the signs (another seed than the training set's) and the real digits:
    five classes, the fifth any digit. Returns (judge, held-out accuracy)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    rng = np.random.default_rng(seed)
    signs = [(digits.features(draw_sign(i % len(SIGNS), rng)), i % len(SIGNS)) for i in range(1600)]
    real = load_digits().data
    x = np.concatenate([np.stack([f for f, _ in signs]), real])
    y = np.concatenate([[label for _, label in signs], np.full(len(real), DIGIT)])
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)
    judge = LogisticRegression(max_iter=5000).fit(x_train, y_train)
    return judge, float(judge.score(x_test, y_test))


def judge_signs(judge, samples: str, per_sign: int) -> dict:
    files = sorted(f for f in os.listdir(samples) if f[:5].isdigit())
    predicted = judge.predict(np.stack([digits.features(Image.open(os.path.join(samples, f))) for f in files]))
    wanted = np.repeat(np.arange(len(SIGNS)), per_sign)
    return {
        "accuracy": round(float((predicted == wanted).mean()), 4),
        "read_as_digit": round(float((predicted == DIGIT).mean()), 4),
        "per_sign": {SIGNS[s]: round(float((predicted[wanted == s] == s).mean()), 3) for s in range(len(SIGNS))},
    }


def prompts_file(path: str, captions: list[str], per: int) -> str:
    with open(path, "w") as f:
        f.write("\n".join(c for c in captions for _ in range(per)) + "\n")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="runs/digits", help="a finished digits.py OUT (its FAMILY/checkpoints)")
    p.add_argument("--out", default="runs/digits-lora", help="working directory (default runs/digits-lora)")
    # the others' digits bases are digits.py --families FAMILY
    families = (*digits.FAMILIES, *digits.ASKED)
    p.add_argument("--families", nargs="+", choices=families, default=["sd", "flux"])
    p.add_argument("--rank", nargs="+", default=["sd=1", "flux=1"], help="FAMILY=RANK (default sd=1 flux=1, others 4)")
    p.add_argument(
        "--targets",
        nargs="+",
        default=[f"sd={SD_TARGETS}"],
        help=f"FAMILY=LAYERS, lora_targets of a family (default sd={SD_TARGETS}; FLUX: its own default)",
    )
    p.add_argument(
        "--duration",
        default=None,
        help="adapter (and full fine-tune) training length (default 1000ba; sd3 2000ba, z-image 400ba)",
    )
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="more train.py overrides of the LoRA run (FLUX's sets lora_text_encoder=true unless this says false)",
    )
    p.add_argument("--lr", default="1e-2", help="the adapters' learning rate (default 1e-2)")
    p.add_argument("--full_lr", default="2e-3", help="the full fine-tune's (default 2e-3, the digits recipes')")
    p.add_argument("--per_sign", type=int, default=100, help="training drawings per sign (default 100)")
    p.add_argument("--samples", type=int, default=20, help="samples per sign and per digit (default 20)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--guidance_scale", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (settings were chosen on 0: judge on 1)")
    p.add_argument("--no_full", action="store_true", help="skip the full fine-tune comparison")
    p.add_argument(
        "--prior",
        type=int,
        default=0,
        help="prior preservation: the base's own samples of each digit's prompt (this many per digit, generate.py "
        "--captions, data.py convert) mixed into the LoRA run's batches at prior_share (default 0: none)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    ranks = {family: "4" for family in args.families} | dict(item.split("=") for item in args.rank)
    targets = {family: [f"lora_targets={layers}"] for family, layers in (t.split("=", 1) for t in args.targets)}
    folder, mds = os.path.join(out, "signs"), os.path.join(out, "signs-mds")
    results: dict = {"signs": write_signs(folder, args.per_sign, seed=0), "prior_per_digit": args.prior, "families": {}}
    digits.run("convert", ["data.py", "convert", folder, mds, "--format", "folder"], logs)
    sign_judge, accuracy = train_sign_judge()
    digit_judge, _ = digits.train_judge()
    results["sign_judge_accuracy_held_out"] = round(accuracy, 4)
    print(f"lora: the sign judge reads held-out signs and digits at {accuracy:.1%}", flush=True)
    sign_prompts = prompts_file(os.path.join(out, "signs.txt"), [sign_caption(s) for s in range(4)], args.samples)
    digit_prompts = prompts_file(os.path.join(out, "digits.txt"), [digits.caption(d) for d in range(10)], args.samples)
    sampling = ["--guidance_scale", str(args.guidance_scale), "--steps", str(args.steps), "--batch_size", "40"]
    sampling += ["--seed", str(args.seed)]
    sampling += ["--image_size", "16"]

    def judged(name: str, source: list[str], prompts: str, judge: str) -> dict:
        samples = os.path.join(out, "samples", name)
        digits.run(name, ["generate.py", *source, "--prompts", prompts, "--out", samples, *sampling], logs)
        if judge == "signs":
            return judge_signs(sign_judge, samples, args.samples)
        return digits.judge_samples(digit_judge, samples, args.samples)

    for family in args.families:
        base = os.path.join(out, family, "base")
        ckpt = os.path.join(os.path.abspath(args.base), family, "checkpoints", "latest-rank0.pt")
        digits.run(f"{family}_export_base", ["export.py", ckpt, base], logs)
        prior = []
        if args.prior:  # the base's own digits, captioned, as the LoRA run's prior dataset
            drawn, prior_mds = os.path.join(out, family, "prior"), os.path.join(out, family, "prior-mds")
            own = prompts_file(os.path.join(out, "prior.txt"), [digits.caption(d) for d in range(10)], args.prior)
            # another sampling seed than the judged samples' (argparse keeps the last --seed)
            generate = ["generate.py", base, "--prompts", own, "--out", drawn, "--captions", *sampling]
            digits.run(f"{family}_prior", [*generate, "--seed", str(args.seed + 100)], logs)
            digits.run(f"{family}_prior_convert", ["data.py", "convert", drawn, prior_mds, "--format", "folder"], logs)
            prior = [f"prior_local={prior_mds}"]
        runs = {
            "lora": [
                f"lora_rank={ranks[family]}",
                f"lr={args.lr}",
                "use_ema=false",
                *targets.get(family, []),
                *FAMILY_SET.get(family, []),
                *prior,
                *args.set,
            ],
            "full": [f"lr={args.full_lr}", "use_ema=false"],
        }
        result: dict = {
            "signs_before": judged(f"{family}_signs_before", [base], sign_prompts, "signs"),
            "digits_base": judged(f"{family}_digits_base", [base], digit_prompts, "digits"),
        }
        for kind, extra in runs.items():
            if kind == "full" and args.no_full:
                continue
            work, duration = os.path.join(out, family, kind), args.duration or DURATIONS.get(family, "1000ba")
            train = ["train.py", os.path.join(digits.HERE, f"{family}.yaml"), f"model_name={base}", f"local={mds}"]
            train += [f"save_folder={work}/checkpoints", f"max_duration={duration}", f"save_interval={duration}"]
            # AdamW for both (FLUX's digits recipe trains with Muon, which does not take LoRA's factors)
            train += ["warmup=20ba", "optimizer=adamw", f"results={work}/results.jsonl", *extra]
            seconds = digits.run(f"{family}_{kind}_train", train, logs)
            with open(os.path.join(work, "results.jsonl")) as f:
                line = json.loads(f.readlines()[-1])
            exported = os.path.join(work, "exported")
            digits.run(f"{family}_{kind}_export", ["export.py", f"{work}/checkpoints/latest-rank0.pt", exported], logs)
            source = [base, "--lora", exported] if kind == "lora" else [exported]
            size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(exported) for f in fs)
            result[kind] = {
                "train_seconds": round(seconds, 1),
                "peak_memory_gib": line.get("peak_memory_gib"),
                "lora": line.get("lora"),
                "checkpoint_bytes": os.path.getsize(f"{work}/checkpoints/latest-rank0.pt"),
                "exported_bytes": size,
                "signs_after": judged(f"{family}_{kind}_signs", source, sign_prompts, "signs"),
                "digits_after": judged(f"{family}_{kind}_digits", source, digit_prompts, "digits"),
            }
        results["families"][family] = result
        lora = result["lora"]
        print(
            f"lora: {family}: signs {result['signs_before']['accuracy']:.1%} -> {lora['signs_after']['accuracy']:.1%} "
            f"with {lora['lora']['trainable_share']:.2%} of the adapted parts trainable (rank {ranks[family]}); digits "
            f"{result['digits_base']['accuracy']:.1%} adapters off, {lora['digits_after']['accuracy']:.1%} on",
            flush=True,
        )
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"lora: results in {os.path.join(out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
