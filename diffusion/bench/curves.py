"""Learning curves side by side: train variants of one recipe and compare how fast each reaches quality.

    python -m diffusion.bench.curves yamls/sd-tiny-cpu.yaml max_duration=200ba --variant base \\
        --variant "warm=warmup=50ba lr=2e-3" --every 50ba --quality val_loss --target 0.3 --out runs/curves
    python -m diffusion.bench.curves examples/digits/sd.yaml local=runs/digits/mds \\
        vae=runs/digits/vae/exported text_encoder=runs/digits/text_encoder --variant base \\
        --variant "snr=objective.loss_weighting=min_snr" --every 250ba --quality digits --target 0.9 --out runs/curves

Positional arguments are train.py's: recipes and key=value overrides for every variant. A variant is
``NAME`` or ``NAME=key=value [key=value ...]``: its own overrides on top. Every variant keeps the recipe's
seed (so the same initial weights and data order: the curves differ only by the change; --vary_seed lets a
variant set it). Each variant is an ordinary train.py run, one after another, in OUT/NAME (its checkpoints every
--every, kept, with autoresume; its output appended to OUT/NAME/train.log). Then every checkpoint is measured
with --quality (see diffusion/bench/curve_quality.py) and the point appended to OUT/points.jsonl at once.
Running the same command again skips the points measured and the runs finished, and resumes the others. With
--collect_only nothing is trained (each variant ran as its own job, e.g. on a cluster): the checkpoints found are
measured, and the command of each variant not trained yet is printed.

Out: the table (stdout and OUT/curves.md), OUT/curves.png (quality against batches, training seconds and training
TFLOP), OUT/points.jsonl. Training seconds are Composer's clock saved in each checkpoint (evaluation left out);
TFLOP are the run's traced count per image (its results line, OUT/NAME/results.jsonl) times the images seen.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from diffusion.bench.curve_quality import LOG, REPO, Quality, check_target, checkpoints, quality_of, trained_to
from diffusion.bench.curve_report import chart, curves_of, table
from diffusion.bench.sweep import launcher
from diffusion.cli import Parser, positive, run
from diffusion.errors import UsageError, keys_spelled

# keys the tool sets on every run: a recipe override of them would break the comparison or the resume
CONTROLLED = ("save_folder", "autoresume", "save_interval", "save_num_checkpoints_to_keep", "results", "run_name")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Variant:
    name: str
    overrides: list[str]
    max_batch: int = 0  # where its run ends

    @property
    def spec(self) -> str:
        return self.name + ("=" + " ".join(self.overrides) if self.overrides else "")


def variant(text: str) -> Variant:
    """argparse type of --variant: ``NAME`` or ``NAME=key=value [key=value ...]``."""
    name, _, rest = text.partition("=")
    if not NAME.match(name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a variant is NAME or NAME=key=value [key=value ...], NAME of letters, digits, '_', '.', '-'"
        )
    overrides = shlex.split(rest)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]!r} is not key=value")
    return Variant(name, overrides)


def batches(text: str) -> int:
    """argparse type of --every: a positive number of batches, NNNba."""
    m = re.fullmatch(r"(\d+)ba", text.strip())
    if not m or int(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of batches like 250ba, got {text!r}")
    return int(m[1])


def split_recipe(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """train.py's positional arguments: (recipe files, key=value overrides), every recipe checked to be there."""
    recipes = [a for a in args if "=" not in a]
    if not recipes:
        raise UsageError("give a recipe (yamls/*.yaml or examples/digits/sd.yaml) before the key=value overrides")
    for recipe in recipes:
        if not recipe.endswith((".yaml", ".yml")) or not Path(recipe).is_file():
            raise UsageError(f"recipe {recipe}: no such yaml file (from {Path.cwd()})")
    return recipes, [a for a in args if "=" in a]


def check_variants(args: argparse.Namespace, recipes: list[str], common: list[str], quality: Quality) -> None:
    """Every variant's recipe loaded and checked as train.py would, before anything runs; fills max_batch."""
    from diffusion.config import load_config

    names = [v.name for v in args.variant]
    if len(set(names)) != len(names):
        raise UsageError(f"--variant: the name {next(n for n in names if names.count(n) > 1)!r} is given twice")
    taken = sorted({o.split("=", 1)[0] for o in common} & set(CONTROLLED))
    if taken:
        raise UsageError(f"{taken[0]}: set by the tool for every variant (each runs in --out/NAME); drop it")
    for v in args.variant:
        check_keys(v, args.vary_seed)
    for v in args.variant:
        try:
            with keys_spelled(False):
                cfg = load_config(recipes, [*common, *v.overrides, *quality.train_overrides])
        except UsageError as e:
            raise UsageError(f"--variant {v.name}: {e}") from None
        end = re.fullmatch(r"(\d+)ba", cfg.max_duration)
        if not end:
            raise UsageError(f"--variant {v.name}: max_duration={cfg.max_duration}: give it in batches (e.g. 2000ba)")
        v.max_batch = int(end[1])


def check_keys(v: Variant, vary_seed: bool) -> None:
    """A variant changes neither what the tool sets on every run nor where the runs start (the seed: with
    ``vary_seed`` only; load_path: set it for all, before the variants)."""
    keys = {o.split("=", 1)[0] for o in v.overrides}
    taken = sorted(keys & set(CONTROLLED))
    if taken:
        raise UsageError(f"--variant {v.name}: {taken[0]} is set by the tool; drop it")
    if "load_path" in keys:
        raise UsageError(
            f"--variant {v.name}: load_path: every variant starts from the same weights; give it before the "
            "variants, for all"
        )
    if "seed" in keys and not vary_seed:
        raise UsageError(f"--variant {v.name}: seed differs per variant only with --vary_seed; drop it")


def train_command(args, recipes, common, quality: Quality, v: Variant) -> list[str]:
    folder = Path(args.out) / v.name
    nproc = ["-n", str(args.nproc)] if args.nproc else []
    return [
        launcher(),
        *nproc,
        str(REPO / "train.py"),
        *recipes,
        *common,
        *v.overrides,
        *quality.train_overrides,
        f"save_folder={folder}",
        "autoresume=true",
        f"save_interval={args.every}ba",
        "save_num_checkpoints_to_keep=-1",
        f"results={folder / 'results.jsonl'}",
    ]


def same_variant(folder: Path, record: dict, write: bool = True) -> None:
    """A variant's folder holds runs of these settings only: written on first use, compared after."""
    path = folder / "variant.json"
    if path.is_file():
        before = json.loads(path.read_text())
        if before != record:
            raise UsageError(
                f"{folder} holds a run of other settings ({before['recipes']} {before['overrides']}); "
                "give this variant another name or use another --out"
            )
    if write:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record) + "\n")


def train(command: list[str], v: Variant, folder: Path) -> int:
    """One variant's train.py run, its output appended to its train.log; its exit code."""
    print(f"curves: training {v.spec} in {folder} (log {folder / LOG})", flush=True)
    with open(folder / LOG, "a") as log:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode


def tflop_per_image(folder: Path) -> float | None:
    path = folder / "results.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]).get("tflop_per_image") if lines else None


def measure(args, quality: Quality, v: Variant, folder: Path, points: list[dict], out: Path) -> None:
    """Every checkpoint of ``v`` without a point yet, measured and appended to ``out`` at once."""
    have = {p["batch"] for p in points if p["variant"] == v.name}
    per_image = tflop_per_image(folder)
    for batch, path in checkpoints(folder).items():
        if batch in have:
            continue
        point = {"variant": v.name, "quality_measure": quality.name, **trained_to(path, args.trust_checkpoint)}
        point["tflop"] = per_image * point["samples"] if per_image is not None else None
        point["quality"] = float(quality.measure(str(path)))
        point["checkpoint"] = str(path)
        print(f"curves: {v.name} at batch {batch}: {quality.name} {point['quality']:.4g}", flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(point) + "\n")
        points.append(point)
    for point in points:  # a run that had no results line when its points were measured has one now
        if point["variant"] == v.name and point.get("tflop") is None and per_image is not None:
            point["tflop"] = per_image * point["samples"]


def read_points(path: Path, quality: str) -> list[dict]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return [p for p in map(json.loads, filter(str.strip, lines)) if p.get("quality_measure") == quality]


def compare(args: argparse.Namespace) -> int:
    recipes, common = split_recipe(args.recipe)
    quality = quality_of(args.quality, args.better, f"{args.every}ba")
    check_target(quality, args.target)
    check_variants(args, recipes, common, quality)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points, failed = read_points(out / "points.jsonl", quality.name), []
    records = {v.name: {"recipes": recipes, "overrides": [*common, *v.overrides]} for v in args.variant}
    for v in args.variant:  # every folder checked before any is written or trained
        same_variant(out / v.name, records[v.name], write=False)
    for v in args.variant:
        folder = out / v.name
        same_variant(folder, records[v.name])
        command = train_command(args, recipes, common, quality, v)
        if max(checkpoints(folder), default=0) < v.max_batch:
            if args.collect_only:
                train_with = f"{shlex.join(command)} >> {shlex.quote(str(folder / LOG))} 2>&1"
                print(f"curves: {v.name} is not trained to batch {v.max_batch} yet; train it with:\n  {train_with}")
            elif (code := train(command, v, folder)) != 0:
                failed.append(v.name)
                print(
                    f"curves: error: {v.name}: train.py exited {code}; see {folder / LOG}", file=sys.stderr, flush=True
                )
        measure(args, quality, v, folder, points, out / "points.jsonl")
    curves = curves_of(points, [v.name for v in args.variant])
    lines = table(curves, quality.name, args.target, quality.higher_is_better)
    print("\n".join(lines))
    (out / "curves.md").write_text("\n".join(lines) + "\n")
    chart(curves, quality.name, args.target, str(out / "curves.png"))
    print(f"curves: {out / 'curves.md'}, {out / 'curves.png'}, {out / 'points.jsonl'}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    from diffusion.cli import add_trust_checkpoint

    p = Parser("diffusion.bench.curves", __doc__)
    p.add_argument("recipe", nargs="+", metavar="RECIPE.yaml | key=value", help="train.py's recipes and overrides")
    p.add_argument("--variant", action="append", type=variant, required=True, metavar="NAME[=key=value ...]")
    p.add_argument("--every", type=batches, required=True, metavar="Nba", help="checkpoint and measure every N batches")
    p.add_argument(
        "--quality", required=True, help="val_loss, digits, or module.path:function (a checkpoint path -> float)"
    )
    p.add_argument(
        "--better", choices=["higher", "lower"], default=None, help="for a plug-in --quality: which way is better"
    )
    p.add_argument("--target", type=float, default=None, help="the quality each variant is timed to")
    p.add_argument(
        "--out", default="runs/curves", help="folder of the variants' runs and the results (default runs/curves)"
    )
    p.add_argument(
        "--nproc", type=positive(int), default=None, help="processes per run (default: composer's, one per GPU)"
    )
    p.add_argument("--collect_only", action="store_true", help="train nothing: measure the checkpoints there are")
    p.add_argument("--vary_seed", action="store_true", help="let a variant set its own seed")
    add_trust_checkpoint(p)
    return compare(p.parse_intermixed_args(argv))


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.curves", main))
