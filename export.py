"""Export a training checkpoint to a diffusers directory that from_pretrained loads: a pipeline
(StableDiffusionPipeline or FluxPipeline layout), or for an autoencoder run an AutoencoderKL folder with
its latent shift and scale measured in training (what a diffusion run takes as vae=DIR).

    python export.py checkpoints/sd-tiny-cpu/latest-rank0.pt exported/sd-tiny
    python -c "from diffusers import DiffusionPipeline; DiffusionPipeline.from_pretrained('exported/sd-tiny')"

A preset's name in place of the checkpoint writes the preset, with its random weights (drawn from --seed), as such
a folder (an autoencoder preset as an AutoencoderKL folder with the latent scale its config declares): a model to
start diffusers' own training scripts from, or train.py with model_name=OUT.

    python export.py sd-tiny exported/sd-tiny-init

The EMA weights are exported when the run kept them (unless --no_ema). A LoRA run (lora_rank) exports its
adapters, in the format diffusers' ``pipeline.load_lora_weights(OUT)`` reads (pytorch_lora_weights.safetensors,
and lora_base.json naming the base); with --merge, the base with the adapters folded in, as a whole pipeline.

    python export.py checkpoints/my-style/latest-rank0.pt out/my-style-lora
    python generate.py /models/base-pipeline --lora out/my-style-lora --lora_scale 0.8 --prompt "..."
"""

from __future__ import annotations

import argparse
import os
import sys

from diffusion.cli import add_trust_checkpoint, run
from diffusion.config import KEYS
from diffusion.settings import add_flags, pick
from diffusion.versions import check_stack


def main(argv=None) -> int:
    return run("export.py", _main, argv)


def _main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT|PRESET",
        help="checkpoint file (SAVE_FOLDER/latest-rank0.pt), sharded checkpoint directory, or a preset's name",
    )
    p.add_argument("out", metavar="OUT", help="directory to write the pipeline to")
    p.add_argument("--no_ema", action="store_true", help="export the live weights even if EMA weights exist")
    p.add_argument(
        "--merge", action="store_true", help="LoRA runs: a whole pipeline with the adapters folded into the base"
    )
    add_trust_checkpoint(p)
    add_flags(p, pick(KEYS, "seed"), groups=False)
    args = p.parse_args(argv)
    check_stack("export.py")
    from diffusion.errors import UsageError
    from diffusion.file_checks import check_output_folder

    check_output_folder(args.out, "OUT")  # before the checkpoint is read
    if "://" not in args.checkpoint and not os.path.exists(args.checkpoint):  # s3://...: a checkpoint object
        return _export_preset(args)
    from diffusion.eval.trained_model import load_trained
    from diffusion.techniques import active

    built, config, ema = load_trained(
        args.checkpoint, use_ema=not args.no_ema, trust=args.trust_checkpoint, trust_flag="--trust_checkpoint"
    )
    used = active(config)
    if args.merge and not any(t.MERGES for t in used):
        raise UsageError(f"--merge: {args.checkpoint} is not a LoRA run (no lora_rank); it exports whole as it is")
    label = f"{config['model_name']} ({'EMA' if ema else 'live'} weights)"
    for technique in used:  # a technique that exports its own way (LoRA: the adapters alone, or merged)
        line = technique.export(config, built, args.out, args.merge, label)
        if line is not None:
            print(line)
            return 0
    built.model.export(args.out, built.tokenizers)
    print(f"exported {label} to {args.out}")
    return 0


def _export_preset(args) -> int:
    """``args.checkpoint`` names no file or folder: a preset's name, written with random weights, or one line."""
    from diffusion.errors import UsageError
    from diffusion.models.presets import PRESETS  # data: no torch yet

    if args.checkpoint not in PRESETS:
        raise UsageError(
            f"CHECKPOINT|PRESET {args.checkpoint!r} is no checkpoint (no such file or folder) and no preset; give "
            f"SAVE_FOLDER/latest-rank0.pt, a sharded checkpoint folder, or one of {', '.join(PRESETS)}"
        )
    if args.merge:
        raise UsageError(f"--merge: {args.checkpoint} is a preset, not a LoRA run; it exports whole as it is")
    import torch

    from diffusion.models import build_model

    torch.manual_seed(args.seed)
    built = build_model(args.checkpoint)
    if built.family == "vae":  # untrained, no latent statistics measured: the scale its config declares
        built.model.vae.save_pretrained(args.out)
    else:
        built.model.export(args.out, built.tokenizers)
    print(f"exported the preset {args.checkpoint} (random weights, seed {args.seed}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
