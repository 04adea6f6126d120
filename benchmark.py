"""Throughput benchmark for text-to-image diffusion training (drop-in for mosaicml/diffusion-benchmark).

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4
    composer -n 2 benchmark.py --use_synth_data --model_name sd-tiny --use_ema --fsdp --batch_size 8 \\
        --max_duration 4ba --results r.jsonl

Every flag maps onto diffusion.config.TrainConfig; diffusion.trainer.build_trainer does the rest.
"""
from __future__ import annotations

import argparse
import sys

from diffusion.versions import check_stack


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
    d.add_argument("--batch_size", type=int, default=2048, help="global batch size, all ranks (default 2048)")
    d.add_argument("--image_size", type=int, default=None,
                   help="image side in pixels (default: the model's native size, 512 for sd2-base)")
    d.add_argument("--remote", type=str, default=None, help="MDS dataset location to stream from (s3://, gs://, dir)")
    d.add_argument("--local", type=str, default="/tmp/mds-cache/mds-laion-2/",
                   help="local MDS cache directory, or a local MDS dataset when --remote is not given")
    d.add_argument("--use_synth_data", action="store_true", help="train on synthetic data shaped for the model")
    d.add_argument("--precomputed_latents", action="store_true",
                   help="batches carry VAE latent moments + text embeddings; the encoders do not run")
    d.add_argument("--eval_interval", type=str, default=None,
                   help="evaluate every N (e.g. 500ba, 262144sp) on the validation set; default: never")
    d.add_argument("--eval_local", type=str, default=None, help="local MDS validation set (or cache for --eval_remote)")
    d.add_argument("--eval_remote", type=str, default=None, help="remote MDS validation set")
    d.add_argument("--eval_samples", type=int, default=64,
                   help="size of the synthetic validation set when no MDS one is given (default 64)")
    d.add_argument("--filter", dest="filters", action="append", default=[], metavar="EXPR",
                   help="keep samples whose metadata passes EXPR, e.g. 'pwatermark<=0.5' (repeatable; MDS data)")
    d.add_argument("--caption_dropout", type=float, default=0.0,
                   help="probability of training on the empty caption (classifier-free guidance; images only)")
    d.add_argument("--crop", choices=["center", "random"], default="center", help="square crop: center (default) or random")
    d.add_argument("--hflip", action="store_true", help="random left-right flips of the images")
    d.add_argument("--num_workers", type=int, default=8, help="dataloader workers per rank (default 8)")
    m = p.add_argument_group("model")
    m.add_argument("--model_name", type=str, default="sd2-base",
                   help="a preset (sd2-base, sd-tiny, flux-schnell, flux-mid, flux-tiny), a local diffusers "
                        "pipeline directory, or a Hugging Face id (org/name[@revision]) read from the local cache, "
                        "never downloaded (default sd2-base)")
    m.add_argument("--tokenizer", type=str, default=None, help="local tokenizer directory (default: the model's)")
    m.add_argument("--prediction_type", choices=["epsilon", "v_prediction"], default=None,
                   help="training target (default: the model's scheduler; epsilon for presets)")
    m.add_argument("--attention", type=str, default="sdpa", help="sdpa (default) or xformers (needs xformers)")
    m.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    m.add_argument("--compile", action="store_true",
                   help="torch.compile the trainable denoiser (measure with --measure_skip_batches past the compile)")
    m.add_argument("--channels_last", action="store_true",
                   help="channels-last memory layout for the denoiser's convolutions (UNet)")
    m.add_argument("--encoder_dtype", type=str, default=None,
                   help="dtype for the frozen VAE and text encoder: fp32, bf16 or fp16 (default: as trained)")
    t = p.add_argument_group("training")
    t.add_argument("--use_ema", action="store_true", help="keep an exponential moving average of the weights")
    t.add_argument("--device_train_microbatch_size", type=microbatch, default=None,
                   help="samples per forward/backward on each rank: an integer or 'auto' (default: auto on GPU, "
                        "the whole per-rank batch on CPU)")
    t.add_argument("--max_duration", type=str, default="200ba", help="run length: 200ba, 2ep, 10000sp (default 200ba)")
    t.add_argument("--precision", type=str, default=None,
                   help="amp_bf16 (GPU default), amp_fp16 or fp32 (CPU default, the only one on CPU)")
    t.add_argument("--fsdp", action="store_true",
                   help="shard the trainable model with FSDP2 across ranks (needs >= 2 ranks)")
    t.add_argument("--lr", type=float, default=1.0e-4, help="AdamW learning rate (default 1e-4)")
    t.add_argument("--seed", type=int, default=17)
    t.add_argument("--dist_timeout", type=float, default=600.0,
                   help="seconds a rank waits for the others in a collective before the job ends (default 600)")
    o = p.add_argument_group("logging and results")
    o.add_argument("--wandb_name", type=str, default=None, help="wandb run name (wandb logs only when a name or project is given)")
    o.add_argument("--wandb_project", type=str, default=None, help="wandb project")
    o.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                   help="extra field for the results line (repeatable), e.g. --tag cluster=p5")
    o.add_argument("--results", type=str, default=None,
                   help="append one JSON line per run: images/s (overall, per GPU), MFU, peak memory, settings, versions")
    o.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto",  # config.PROGRESS
                   help="a progress bar with loss and images/s, or the periodic metric lines (default auto: "
                        "the bar when stderr is a terminal)")
    o.add_argument("--measure_skip_batches", type=int, default=None,
                   help="warm-up batches left out of the throughput figure (default 2)")
    o.add_argument("--straggler_threshold", type=float, default=0.10,
                   help="warn naming every rank whose images/s is more than this share below the median rank's "
                        "(default 0.10)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from diffusion.cli import run
    return run("benchmark.py", _main, argv)


def _main(argv) -> int:
    args = parse_args(argv)
    check_stack("benchmark.py")
    from diffusion.config import TrainConfig  # heavy imports after argument parsing
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
