"""Generate images from a trained checkpoint or an exported diffusers pipeline directory.

    python generate.py checkpoints/sd-tiny-cpu/latest-rank0.pt --prompt "a red cube" --prompt "two cats" --out samples
    python generate.py exported/ --prompts prompts.txt --steps 50 --guidance_scale 7.5 --sampler ddim --seed 1

Writes one PNG per image (NNNNN-prompt.png) and grid.png to --out (--captions: each prompt as NNNNN-prompt.txt
beside its image instead of the grid, a folder data.py convert reads). Checkpoints are sampled with their EMA
weights unless --no_ema.
"""

from __future__ import annotations

import sys

from diffusion.cli import Parser, add_lora_flags, add_trust_checkpoint, run
from diffusion.config import KEYS
from diffusion.settings import add_flags, from_flags, pick
from diffusion.versions import check_stack

# The settings generate.py shares with sampling during training (diffusion/config.py's sampling section), as
# flags without the prefix: --steps, --guidance_scale.
SAMPLING_KEYS = pick(KEYS, "sample_steps", "sample_guidance_scale")


def main(argv=None) -> int:
    return run("generate.py", _main, argv)


def _main(argv) -> int:
    p = Parser("generate.py", __doc__)
    p.add_argument("source", help="checkpoint file, sharded checkpoint directory, or exported pipeline directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", help="file with one prompt per line, or a tsv with a 'caption' column")
    p.add_argument("--out", default="samples", help="output directory (default samples)")
    p.add_argument("--images_per_prompt", type=int, default=1)
    add_flags(p, SAMPLING_KEYS, groups=False, strip="sample_")
    p.add_argument("--sampler", default=None, help="SD: ddim (default) or euler; FLUX: euler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image_size", type=int, default=None, help="side of square images (default: the VAE's size)")
    p.add_argument("--width", type=int, default=None, help="width in pixels of non-square images (with --height)")
    p.add_argument("--height", type=int, default=None, help="height in pixels of non-square images (with --width)")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--no_ema", action="store_true", help="sample a checkpoint's live weights, not its EMA")
    p.add_argument(
        "--captions",
        action="store_true",
        help="write each prompt beside its image (NNNNN-prompt.txt) and no grid: a folder data.py convert reads, "
        "e.g. a prior dataset of the base's own samples (prior_local)",
    )
    add_trust_checkpoint(p)
    add_lora_flags(p)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    vars(args).update(from_flags(args, SAMPLING_KEYS, strip="sample_"))
    check_stack("generate.py")
    from diffusion.errors import UsageError
    from diffusion.eval.sampling import load_pipeline, read_prompts, sample, save

    prompts = args.prompt + (read_prompts(args.prompts) if args.prompts else [])
    if not prompts:
        raise UsageError("give at least one --prompt or a --prompts file")
    prompts = [pr for pr in prompts for _ in range(args.images_per_prompt)]
    size = args.image_size
    if (args.width is None) != (args.height is None) or (args.width and args.image_size):
        raise UsageError("give --width and --height together (a non-square size), or --image_size alone (a square)")
    if args.width is not None:
        if args.width <= 0 or args.height <= 0:
            raise UsageError(f"--width {args.width} and --height {args.height} must be positive")
        size = (args.height, args.width)
    from diffusion.file_checks import check_output_folder

    check_output_folder(args.out, "--out")  # before the sampling, not after it
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
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
    images = sample(
        pipe,
        prompts,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        seed=args.seed,
        image_size=size,
        batch_size=args.batch_size,
    )
    paths = save(images, prompts, args.out, captions=args.captions)
    print(f"wrote {len(paths)} images and {'their captions' if args.captions else 'grid.png'} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
