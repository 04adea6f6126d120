"""Export a training checkpoint to a diffusers directory that from_pretrained loads: a pipeline
(StableDiffusionPipeline or FluxPipeline layout), or for an autoencoder run an AutoencoderKL folder with
its latent shift and scale measured in training (what a diffusion run takes as vae=DIR).

    python export.py checkpoints/sd-tiny-cpu/latest-rank0.pt exported/sd-tiny
    python -c "from diffusers import DiffusionPipeline; DiffusionPipeline.from_pretrained('exported/sd-tiny')"

The EMA weights are exported when the run kept them (unless --no_ema). A LoRA run (lora_rank) exports its
adapters, in the format diffusers' ``pipeline.load_lora_weights(OUT)`` reads (pytorch_lora_weights.safetensors,
and lora_base.json naming the base); with --merge, the base with the adapters folded in, as a whole pipeline.

    python export.py checkpoints/my-style/latest-rank0.pt out/my-style-lora
    python generate.py /models/base-pipeline --lora out/my-style-lora --lora_scale 0.8 --prompt "..."
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
    p.add_argument(
        "--merge", action="store_true", help="LoRA runs: a whole pipeline with the adapters folded into the base"
    )
    add_trust_checkpoint(p)
    args = p.parse_args(argv)
    check_stack("export.py")
    from diffusion.errors import UsageError
    from diffusion.eval.trained_model import load_trained
    from diffusion.file_checks import check_output_folder
    from diffusion.models.lora import WEIGHTS, export_adapters, lora_options, merge_adapters

    check_output_folder(args.out, "OUT")  # before the checkpoint is read

    built, config, ema = load_trained(
        args.checkpoint, use_ema=not args.no_ema, trust=args.trust_checkpoint, trust_flag="--trust_checkpoint"
    )
    weights = "EMA" if ema else "live"
    if lora_options(config) is None:
        if args.merge:
            raise UsageError(f"--merge: {args.checkpoint} is not a LoRA run (no lora_rank); it exports whole as it is")
        built.model.export(args.out, built.tokenizers)
        print(f"exported {config['model_name']} ({weights} weights) to {args.out}")
    elif args.merge:
        merge_adapters(built.model)
        built.model.export(args.out, built.tokenizers)
        print(f"exported {config['model_name']} with its LoRA adapters merged ({weights} weights) to {args.out}")
    else:
        export_adapters(built.model, args.out)
        print(f"exported the LoRA adapters of {config['model_name']} ({weights} weights) to {args.out}/{WEIGHTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
