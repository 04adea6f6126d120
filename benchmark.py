"""Throughput benchmark for text-to-image diffusion training (drop-in for mosaicml/diffusion-benchmark).

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4
    composer -n 2 benchmark.py --use_synth_data --model_name sd-tiny --use_ema --fsdp --batch_size 8 \\
        --max_duration 4ba --results r.jsonl

Every flag maps onto diffusion.config.TrainConfig; diffusion.trainer.build_trainer does the rest.
"""

from __future__ import annotations

import argparse
import sys

from diffusion.config import CROPS, PROGRESS, TrainConfig  # the schema and its defaults (stdlib only)
from diffusion.versions import check_stack

D = TrainConfig()  # every flag's default is the config key's


def microbatch(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument(
        "--batch_size", type=int, default=D.batch_size, help="global batch size, all ranks (default %(default)s)"
    )
    d.add_argument(
        "--image_size",
        type=int,
        default=D.image_size,
        help="image side in pixels (default: the model's native size, 512 for sd2-base)",
    )
    d.add_argument(
        "--remote", type=str, default=D.remote, help="MDS dataset location to stream from (s3://, gs://, dir)"
    )
    d.add_argument(
        "--local",
        type=str,
        default=D.local,
        help="local MDS cache directory, or a local MDS dataset when --remote is not given",
    )
    d.add_argument("--use_synth_data", action="store_true", help="train on synthetic data shaped for the model")
    d.add_argument(
        "--precomputed_latents",
        action="store_true",
        help="batches carry VAE latent moments + text embeddings; the encoders do not run",
    )
    d.add_argument(
        "--eval_interval",
        type=str,
        default=D.eval_interval,
        help="evaluate every N (e.g. 500ba, 262144sp) on the validation set; default: never",
    )
    d.add_argument(
        "--eval_local", type=str, default=D.eval_local, help="local MDS validation set (or cache for --eval_remote)"
    )
    d.add_argument("--eval_remote", type=str, default=D.eval_remote, help="remote MDS validation set")
    d.add_argument(
        "--eval_samples",
        type=int,
        default=D.eval_samples,
        help="size of the synthetic validation set when no MDS one is given (default %(default)s)",
    )
    d.add_argument(
        "--filter",
        dest="filters",
        action="append",
        default=D.filters,
        metavar="EXPR",
        help="keep samples whose metadata passes EXPR, e.g. 'pwatermark<=0.5' (repeatable; MDS data)",
    )
    d.add_argument(
        "--caption_dropout",
        type=float,
        default=D.caption_dropout,
        help="probability of training on the empty caption (classifier-free guidance; images only)",
    )
    d.add_argument("--crop", choices=CROPS, default=D.crop, help="square crop: center (default) or random")
    d.add_argument("--hflip", action="store_true", help="random left-right flips of the images")
    d.add_argument(
        "--num_workers", type=int, default=D.num_workers, help="dataloader workers per rank (default %(default)s)"
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model_name",
        type=str,
        default=D.model_name,
        help="a preset (sd2-base, sd-tiny, flux-schnell, flux-mid, flux-tiny), a local diffusers "
        "pipeline directory, or a Hugging Face id (org/name[@revision]) read from the local cache, "
        "never downloaded (default %(default)s)",
    )
    m.add_argument(
        "--tokenizer", type=str, default=D.tokenizer, help="local tokenizer directory (default: the model's)"
    )
    m.add_argument(
        "--prediction_type",
        choices=["epsilon", "v_prediction"],
        default=D.prediction_type,
        help="training target (default: the model's scheduler; epsilon for presets)",
    )
    m.add_argument("--attention", type=str, default=D.attention, help="sdpa (default) or xformers (needs xformers)")
    m.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    m.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the trainable denoiser (measure with --measure_skip_batches past the compile)",
    )
    m.add_argument(
        "--channels_last",
        action="store_true",
        help="channels-last memory layout for the denoiser's convolutions (UNet)",
    )
    m.add_argument(
        "--encoder_dtype",
        type=str,
        default=D.encoder_dtype,
        help="dtype for the frozen VAE and text encoder: fp32, bf16 or fp16 (default: as trained)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--use_ema", action="store_true", help="keep an exponential moving average of the weights")
    t.add_argument(
        "--device_train_microbatch_size",
        type=microbatch,
        default=D.device_train_microbatch_size,
        help="samples per forward/backward on each rank: an integer or 'auto' (default: auto on GPU, "
        "the whole per-rank batch on CPU)",
    )
    t.add_argument(
        "--max_duration", type=str, default=D.max_duration, help="run length: 200ba, 2ep, 10000sp (default %(default)s)"
    )
    t.add_argument(
        "--precision",
        type=str,
        default=D.precision,
        help="amp_bf16 (GPU default), amp_fp16 or fp32 (CPU default, the only one on CPU)",
    )
    t.add_argument(
        "--fsdp", action="store_true", help="shard the trainable model with FSDP2 across ranks (needs >= 2 ranks)"
    )
    t.add_argument("--lr", type=float, default=D.lr, help="AdamW learning rate (default %(default)s)")
    t.add_argument("--seed", type=int, default=D.seed)
    t.add_argument(
        "--dist_timeout",
        type=float,
        default=D.dist_timeout,
        help="seconds a rank waits for the others in a collective before the job ends (default %(default)s)",
    )
    o = p.add_argument_group("logging and results")
    o.add_argument(
        "--wandb_name",
        type=str,
        default=D.wandb_name,
        help="wandb run name (wandb logs only when a name or project is given)",
    )
    o.add_argument("--wandb_project", type=str, default=D.wandb_project, help="wandb project")
    o.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra field for the results line (repeatable), e.g. --tag cluster=p5",
    )
    o.add_argument(
        "--results",
        type=str,
        default=D.results,
        help="append one JSON line per run: images/s (overall, per GPU), MFU, peak memory, settings, versions",
    )
    o.add_argument(
        "--progress",
        choices=PROGRESS,
        default=D.progress,
        help="a progress bar with loss and images/s, or the periodic metric lines (default auto: "
        "the bar when stderr is a terminal)",
    )
    o.add_argument(
        "--measure_skip_batches",
        type=int,
        default=D.measure_skip_batches,
        help="warm-up batches left out of the throughput figure (default 2)",
    )
    o.add_argument(
        "--straggler_threshold",
        type=float,
        default=D.straggler_threshold,
        help="warn naming every rank whose images/s is more than this share below the median rank's "
        "(default %(default)s)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    from diffusion.cli import run

    return run("benchmark.py", _main, argv)


def _main(argv) -> int:
    args = parse_args(argv)
    check_stack("benchmark.py")
    from diffusion.errors import UsageError

    fields = vars(args)
    tags = fields.pop("tag")
    bad = [t for t in tags if "=" not in t]
    if bad:
        raise UsageError(f"--tag {bad[0]!r} is not KEY=VALUE")
    from diffusion.trainer import fit

    fit(TrainConfig(**fields, tags=dict(t.split("=", 1) for t in tags)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
