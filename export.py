"""Export a training checkpoint to a diffusers directory that from_pretrained loads: a pipeline
(StableDiffusionPipeline or FluxPipeline layout), or for an autoencoder run an AutoencoderKL folder with
its latent shift and scale measured in training (what a diffusion run takes as vae=DIR).

    python export.py checkpoints/sd-tiny-cpu/latest-rank0.pt exported/sd-tiny
    python -c "from diffusers import DiffusionPipeline; DiffusionPipeline.from_pretrained('exported/sd-tiny')"

The EMA weights are exported when the run kept them (unless --no_ema).
"""

from __future__ import annotations

import argparse
import sys

from diffusion.cli import add_trust_checkpoint, run
from diffusion.versions import check_stack


def main(argv=None) -> int:
    return run("export.py", _main, argv)


def _main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint file (SAVE_FOLDER/latest-rank0.pt) or sharded checkpoint directory")
    p.add_argument("out", help="directory to write the pipeline to")
    p.add_argument("--no_ema", action="store_true", help="export the live weights even if EMA weights exist")
    add_trust_checkpoint(p)
    args = p.parse_args(argv)
    check_stack("export.py")
    from diffusion.eval.trained_model import load_trained
    from diffusion.file_checks import check_output_folder

    check_output_folder(args.out, "OUT")  # before the checkpoint is read

    built, config, ema = load_trained(
        args.checkpoint, use_ema=not args.no_ema, trust=args.trust_checkpoint, trust_flag="--trust_checkpoint"
    )
    built.model.export(args.out, built.tokenizers)
    print(f"exported {config['model_name']} ({'EMA' if ema else 'live'} weights) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
