"""FID and CLIP score of a trained checkpoint or an exported pipeline, on the images it generates for a
prompts file (MLPerf SD: the 30k COCO-2014 validation captions, a tsv with a 'caption' column).

    python evaluate.py checkpoints/sd2/latest-rank0.pt --prompts val2014_30k.tsv \\
        --inception weights-inception-2015-12-05-6726825d.pth --clip /models/CLIP-ViT-H-14-laion2B-s32B-b79K \\
        --reference_stats val2014_512x512_30k_stats.npz --out results.json
    composer -n 8 evaluate.py exported/sd2 --prompts val2014_30k.tsv --inception ... --clip ... \\
        --reference_images coco/val2014_512x512_30k --num_samples 5000

Under `composer -n N` each rank samples its share (batch b of the prompts goes to rank b % N; image i is
seeded with seed + i, so the images are the same for any N) and the metric states are summed over ranks;
rank 0 writes --out. The FID reference is a folder of images or an .npz with mu and sigma. CLIP score is
reported as torchmetrics does (100 x mean cosine, 0-100) and as MLPerf does (the mean cosine, target >= 0.15).
Weights load from local paths only; docs/evaluation.md says where to get them.
"""

from __future__ import annotations

import json
import os
import sys

from diffusion.config import KEYS
from diffusion.settings import add_flags, from_flags, pick
from diffusion.versions import check_stack

# The settings evaluate.py shares with FID/CLIP during training (diffusion/config.py's quality section), as flags
# without the quality_ prefix: --prompts is quality_prompts, --steps quality_steps.
QUALITY_KEYS = pick(
    KEYS,
    "quality_prompts",
    "quality_inception",
    "quality_clip",
    "quality_num_samples",
    "quality_steps",
    "quality_guidance_scale",
    "quality_batch_size",
    "quality_fid_features",
)
REQUIRED = ("quality_prompts", "quality_inception", "quality_clip")


def parse_args(argv=None):
    from diffusion.cli import Parser, add_lora_flags, add_trust_checkpoint, positive

    p = Parser("evaluate.py", __doc__)
    p.add_argument("source", help="checkpoint file, sharded checkpoint directory, or exported pipeline directory")
    add_flags(p, QUALITY_KEYS, groups=False, required=REQUIRED, strip="quality_")
    ref = p.add_mutually_exclusive_group(required=True)
    ref.add_argument("--reference_images", help="folder of real images for FID")
    ref.add_argument("--reference_stats", help=".npz with the real images' feature mean 'mu' and covariance 'sigma'")
    p.add_argument("--sampler", default=None, help="SD: ddim (default) or euler; FLUX: euler")
    p.add_argument("--seed", type=int, default=0, help="image i is sampled with seed + i")
    p.add_argument("--image_size", type=positive(int), default=None, help="default: the VAE's configured size")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="sampling precision (default bf16 autocast on GPU, fp32 on CPU); metrics run in fp32",
    )
    p.add_argument("--no_ema", action="store_true", help="sample a checkpoint's live weights, not its EMA")
    add_trust_checkpoint(p)
    add_lora_flags(p)
    p.add_argument("--device", default=None, help="default: this rank's GPU if there is one, else cpu")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    add_flags(p, pick(KEYS, "progress"), groups=False)
    p.add_argument("--save_images", default=None, metavar="DIR", help="also save the generated images (NNNNN.png)")
    p.add_argument(
        "--save_reference_stats",
        default=None,
        metavar="FILE.npz",
        help="with --reference_images: save their mu/sigma for later --reference_stats runs",
    )
    args = p.parse_args(argv)
    for name, value in from_flags(args, QUALITY_KEYS, strip="quality_").items():
        setattr(args, name, value)
    return args


def main(argv=None) -> int:
    from diffusion.cli import run

    return run("evaluate.py", _main, argv)


def _main(argv=None) -> int:
    args = parse_args(argv)
    check_stack("evaluate.py")
    import torch

    from diffusion.eval.quality import against_mlperf, sample_and_measure
    from diffusion.eval.sampling import load_pipeline, native_size
    from diffusion.progress import wants_bar

    prompts = _prompts(args)
    from diffusion.file_checks import check_output_folder

    for folder, flag in (
        (args.out and os.path.dirname(os.path.abspath(args.out)), "--out's folder"),
        (args.save_images, "--save_images"),
    ):
        if folder:
            check_output_folder(folder, flag)  # before the sampling, not after it
    device, world, rank = _device_and_world(args.device)
    metrics = _metrics(args, device, rank, world)
    pipe = load_pipeline(
        args.source,
        use_ema=not args.no_ema,
        sampler=args.sampler,
        device=device,
        trust=args.trust_checkpoint,
        trust_flag="--trust_checkpoint",
        lora=args.lora,
        lora_scale=args.lora_scale,
    )
    precision = args.precision or ("bf16" if device.startswith("cuda") else "fp32")
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    sample_and_measure(
        pipe,
        prompts,
        metrics,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        seed=args.seed,
        image_size=args.image_size,
        batch_size=args.batch_size,
        rank=rank,
        world_size=world,
        autocast_dtype=dtype,
        save_dir=args.save_images,
        progress=wants_bar(args.progress),
    )
    results = metrics.compute()
    results.pop("num_samples_this_rank")
    results.update(
        mlperf=against_mlperf(results),
        source=args.source,
        prompts=args.prompts,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        sampler=args.sampler,
        seed=args.seed,
        image_size=args.image_size or native_size(pipe),
        precision=precision,
        world_size=world,
        inception=args.inception,
        fid_features=args.fid_features,
        clip=args.clip,
        reference=args.reference_images or args.reference_stats,
        ema=not args.no_ema,
    )
    if rank == 0:
        _report(results, args.out)
    return 0


def _prompts(args) -> list[str]:
    """The first ``--num_samples`` prompts, once the flags that go together are checked."""
    from diffusion.errors import UsageError
    from diffusion.eval.sampling import read_prompts

    prompts = read_prompts(args.prompts)
    n = args.num_samples or len(prompts)
    if n > len(prompts):
        raise UsageError(f"--num_samples {n} is more than the {len(prompts)} prompts in {args.prompts}")
    if n < 2:
        raise UsageError("--num_samples must be at least 2 (FID compares covariances)")
    if args.save_reference_stats and not args.reference_images:
        raise UsageError("--save_reference_stats needs --reference_images (the images to take statistics of)")
    return prompts[:n]


def _device_and_world(device: str | None) -> tuple[str, int, int]:
    """(this rank's device, world size, global rank); under ``composer -n N``, the process group."""
    import torch
    from composer.utils import dist

    world, rank = dist.get_world_size(), dist.get_global_rank()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        device = f"cuda:{dist.get_local_rank()}"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if world > 1:
        dist.initialize_dist("gpu" if device.startswith("cuda") else "cpu")
    return device, world, rank


def _metrics(args, device: str, rank: int, world: int):
    """FID and CLIP score with the reference set in place (each rank's share of ``--reference_images``, or
    ``--reference_stats``); with ``--save_reference_stats``, rank 0 saves the reference's mu/sigma."""
    import numpy as np

    from diffusion.eval.fid import reference_stats
    from diffusion.eval.quality import QualityMetrics

    metrics = QualityMetrics(args.inception, args.clip, fid_features=args.fid_features, device=device)
    metrics.set_reference(
        images=args.reference_images,
        stats=args.reference_stats,
        rank=rank,
        world_size=world,
        batch_size=args.batch_size,
    )
    if args.save_reference_stats:
        mu, sigma = reference_stats(metrics.fid)
        if rank == 0:
            np.savez(args.save_reference_stats, mu=mu, sigma=sigma)
    return metrics


def _report(results: dict, out: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    print(
        f"FID {results['fid']:.4f}, CLIP score {results['clip_score']:.4f} (cosine "
        f"{results['clip_score_cosine']:.4f}) over {results['num_samples']} images"
        f"{'; wrote ' + out if out else ''}"
    )


if __name__ == "__main__":
    sys.exit(main())
