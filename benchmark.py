"""Throughput benchmark for text-to-image diffusion training (drop-in for mosaicml/diffusion-benchmark).

    composer benchmark.py --use_ema --use_synth_data --device_train_microbatch_size 4
    composer -n 2 benchmark.py --use_synth_data --model_name sd-tiny --use_ema --fsdp --batch_size 8 \\
        --max_duration 4ba --results r.jsonl

Every flag is a key of diffusion.config.TrainConfig (`--help` lists them by section); diffusion.trainer.build_trainer
does the rest.
"""

from __future__ import annotations

import sys

from diffusion.config import KEYS, TrainConfig  # the declaration of every setting (stdlib only)
from diffusion.versions import check_stack


def parse_args(argv=None) -> dict:
    """Every setting as a flag (diffusion/config.py declares them: name, type, default, help, allowed values),
    in a group per section; mosaicml/diffusion-benchmark's flags keep their names and meanings."""
    from diffusion.cli import Parser
    from diffusion.settings import add_flags, from_flags

    p = Parser("benchmark.py", __doc__, usage="composer [-n N] benchmark.py [--KEY VALUE | --SWITCH ...]")
    add_flags(p, KEYS)
    return from_flags(p.parse_args(argv), KEYS)


def main(argv=None) -> int:
    from diffusion.cli import run

    return run("benchmark.py", _main, argv)


def _main(argv) -> int:
    settings = parse_args(argv)
    check_stack("benchmark.py")
    from diffusion.config import check_settings

    cfg = check_settings(TrainConfig(**settings))  # every value checked before the heavy imports below
    from diffusion.trainer import fit

    fit(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
