"""Data for training: image-caption sources -> MDS shards -> (optional) precomputed latents -> loaders.

    python data.py convert /data/laion-wds /data/mds                  # img2dataset webdataset output
    python data.py convert "/data/{00000..00099}.tar" s3://bucket/mds --max_size 512 --workers 16
    composer -n 8 data.py precompute /data/mds /data/mds-latents --model_name sd2-base --image_size 256
    python data.py bucket /data/mds /data/mds-buckets                  # one dataset per aspect ratio
    python data.py inspect /data/mds --grid samples.png --filter "pwatermark<=0.5"
    python data.py bench /data/mds --image_size 512 --num_workers 1 2 4

Every subcommand reports bad input as one line, `data.py: error: ...`, exit code 2. See docs/data.md.
"""

from __future__ import annotations

import os
import sys

from diffusion.cli import Parser, positive, run
from diffusion.config import KEYS
from diffusion.data.sources import FORMATS  # standard library only
from diffusion.settings import add_flags, from_flags, pick
from diffusion.techniques import TECHNIQUES
from diffusion.versions import check_stack

# The settings precompute shares with training (declared in diffusion/config.py): the same model, the same
# encoders, the same seed, so the latents fit the run that reads them.
PRECOMPUTE_KEYS = pick(
    KEYS,
    "model_name",
    "image_size",
    "encoder_dtype",
    "tokenizer",
    "tokenizer_2",
    "tokenizer_3",
    "vae",
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "seed",
    "progress",
    *(key for t in TECHNIQUES for key in t.PRECOMPUTE),  # what a technique stores too (REPA: the encoder's features)
)
BENCH_KEYS = pick(KEYS, "crop", "hflip")  # the training loader's augmentations, timed as a run would use them


def parse_args(argv=None):
    p = Parser("data.py", __doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    _add_convert(sub)
    _add_precompute(sub)
    _add_bucket(sub)
    _add_inspect(sub)
    _add_bench(sub)
    return p.parse_args(argv)


def _add_convert(sub) -> None:
    """data.py convert: image-caption source -> MDS shards."""

    c = sub.add_parser("convert", description="image-caption source -> MDS shards (image bytes, caption, metadata)")
    c.add_argument(
        "src",
        help="folder of images + .txt captions, tar shards (a folder, a file, a brace pattern "
        "like /d/{00000..00099}.tar) or parquet (a folder or a file)",
    )
    c.add_argument("out", help="output MDS directory: local, or any URL Streaming writes (s3://, gs://, oci://...)")
    c.add_argument("--format", choices=FORMATS, default=None, help="source format (default: detected from SRC)")
    c.add_argument(
        "--max_size",
        type=positive(int),
        default=None,
        help="shrink images whose shorter side is longer than this (re-encoded as JPEG q95); "
        "default: store images as they came",
    )
    c.add_argument(
        "--filter",
        dest="filters",
        action="append",
        default=[],
        help="keep only samples passing COLUMN OP NUMBER, e.g. 'pwatermark<=0.5' (repeatable)",
    )
    c.add_argument(
        "--metadata",
        nargs="+",
        default=[],
        help="numeric metadata to keep besides pwatermark, punsafe, aesthetic, similarity",
    )
    c.add_argument("--image_column", default=None, help="parquet: the image-bytes column (default jpg/image/...)")
    c.add_argument("--caption_column", default=None, help="parquet: the caption column (default txt/caption/...)")
    c.add_argument("--compression", default=None, help="shard compression, e.g. zstd or zstd:7 (default none)")
    c.add_argument("--shard_size", default="64mb", help="MDS shard size limit (default 64mb)")
    c.add_argument(
        "--workers",
        type=positive(int),
        default=min(8, os.cpu_count() or 1),
        help="input shards converted in parallel (default min(8, CPUs))",
    )


def _add_precompute(sub) -> None:
    """data.py precompute: MDS -> latents and embeddings."""
    pc = sub.add_parser(
        "precompute",
        description="image-caption MDS -> MDS of VAE latent moments + text embeddings (+ with --repa_encoder, "
        "that vision encoder's patch features, for REPA on the latents) (run under `composer -n N` to use N GPUs)",
    )
    pc.add_argument("src", help="image-caption MDS dataset (local directory or remote URL)")
    pc.add_argument("out", help="output MDS directory (local or remote URL)")
    pc.add_argument(
        "--batch_size", type=positive(int), default=32, help="images per encoder batch per rank (default 32)"
    )
    pc.add_argument("--num_workers", type=int, default=4, help="decoding workers per rank (default 4)")
    add_flags(pc, PRECOMPUTE_KEYS, groups=False, required=("model_name",))
    pc.add_argument("--local", dest="cache", default=None, help="local cache when SRC is remote (default: a temp dir)")
    pc.add_argument(
        "--part_size",
        type=positive(int),
        default=10_000,
        help="samples per output part, the unit of work split over ranks and of resumption (default 10000)",
    )
    pc.add_argument("--compression", default=None, help="shard compression, e.g. zstd (default none)")
    pc.add_argument("--shard_size", default="64mb", help="MDS shard size limit (default 64mb)")


def _add_bucket(sub) -> None:
    """data.py bucket: one MDS dataset per aspect-ratio bucket."""
    bk = sub.add_parser(
        "bucket", description="image-caption MDS -> one MDS dataset per aspect-ratio bucket (training reads all)"
    )
    bk.add_argument("src", help="image-caption MDS dataset (local directory or remote URL)")
    bk.add_argument("out", help="output folder of bucket datasets (local or remote URL)")
    bk.add_argument("--local", dest="cache", default=None, help="local cache when SRC is remote")
    bk.add_argument("--compression", default=None, help="shard compression, e.g. zstd (default none)")
    bk.add_argument("--shard_size", default="64mb", help="MDS shard size limit (default 64mb)")


def _add_inspect(sub) -> None:
    """data.py inspect: counts, ranges, a grid."""
    i = sub.add_parser("inspect", description="count, columns, score ranges, and a PNG grid of samples")
    i.add_argument("src", help="MDS dataset (local directory or remote URL)")
    i.add_argument("--grid", default=None, help="write a PNG grid of samples with captions here")
    i.add_argument("--n", type=positive(int), default=16, help="samples in the grid (default 16)")
    i.add_argument("--filter", dest="filters", action="append", default=[], help="report how many samples pass")
    i.add_argument("--scan", type=positive(int), default=10_000, help="samples read for ranges/filters (default 10000)")
    i.add_argument("--local", dest="cache", default=None, help="local cache when SRC is remote")


def _add_bench(sub) -> None:
    """data.py bench: training-loader throughput."""
    b = sub.add_parser("bench", description="training-loader throughput (samples/s) for images or latents")
    b.add_argument("src", help="MDS dataset (local directory or remote URL)")
    b.add_argument("--image_size", type=positive(int), default=256, help="pixels, for image datasets (default 256)")
    b.add_argument("--num_workers", type=int, nargs="+", default=[1], help="worker counts to time (default 1)")
    b.add_argument("--batch_size", type=positive(int), default=64, help="per-loader batch (default 64)")
    b.add_argument("--batches", type=positive(int), default=20, help="batches timed after warm-up (default 20)")
    b.add_argument("--warmup", type=int, default=3, help="batches left out first (default 3)")
    b.add_argument("--model_name", default="sd-tiny", help="whose tokenizers to use for captions (default sd-tiny)")
    add_flags(b, BENCH_KEYS, groups=False)
    b.add_argument("--results", default=None, help="append one JSON line per worker count")
    b.add_argument("--local", dest="cache", default=None, help="local cache when SRC is remote")


def main(argv=None) -> int:
    args = vars(parse_args(argv))
    check_stack("data.py")
    command = args.pop("command")
    if command == "convert":
        from diffusion.data.convert import convert
        from diffusion.data.filters import parse_filters

        args["filters"] = parse_filters(args["filters"])
        convert(args.pop("src"), args.pop("out"), fmt=args.pop("format"), **args)
    elif command == "precompute":
        from diffusion.config import LOCAL_PARTS, LOCAL_TOKENIZERS, local_parts
        from diffusion.precompute import precompute

        args.update(from_flags(args, PRECOMPUTE_KEYS))
        args["local_parts"] = local_parts({part: args.pop(part) for part in LOCAL_PARTS})
        args["tokenizers"] = local_parts({key: args.pop(key) for key in LOCAL_TOKENIZERS}, LOCAL_TOKENIZERS)
        precompute(args.pop("src"), args.pop("out"), **args)
    elif command == "bucket":
        from diffusion.data.bucket_split import split_buckets

        split_buckets(args.pop("src"), args.pop("out"), **args)
    elif command == "inspect":
        from diffusion.data.filters import parse_filters
        from diffusion.data.inspect import inspect

        args["filters"] = parse_filters(args["filters"])
        inspect(args.pop("src"), **args)
    else:
        from diffusion.bench.loader import bench

        args.update(from_flags(args, BENCH_KEYS))
        if any(w < 0 for w in args["num_workers"]):
            from diffusion.errors import UsageError

            raise UsageError(f"--num_workers {args['num_workers']}: worker counts must be >= 0")
        bench(args.pop("src"), **args)
    return 0


if __name__ == "__main__":
    sys.exit(run("data.py", main))
