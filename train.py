"""Train a text-to-image diffusion model from a yaml recipe.

    composer train.py yamls/sd2-base-256.yaml remote=s3://bucket/laion-mds save_folder=/ckpt/sd2
    composer -n 2 train.py yamls/sd-tiny-cpu.yaml max_duration=20ba lr=2e-4

Arguments are recipe files (later ones override earlier ones) and key=value overrides of any key of
diffusion.config.TrainConfig (nested keys with dots: objective.text_dropout=0.1); `train.py --help-keys` lists
them all by section (docs/settings.md, the same list). Every value is checked before anything starts; diffusion.trainer.build_trainer (the same builder as benchmark.py's) does the rest.
"""

from __future__ import annotations

import sys

from diffusion.cli import Parser
from diffusion.versions import check_stack


def main(argv=None) -> int:
    from diffusion.cli import run

    return run("train.py", _main, argv, flags=False)


def _main(argv) -> int:
    p = Parser("train.py", __doc__)
    p.add_argument("args", nargs="*", metavar="RECIPE.yaml | key=value")
    p.add_argument("--help-keys", action="store_true", help="list every key by section: allowed values, default, help")
    parsed = p.parse_args(argv)
    if parsed.help_keys:
        from diffusion.settings_docs import help_keys

        print(help_keys(flags=False))
        return 0
    if not parsed.args:
        p.error("give a recipe (yamls/*.yaml) and/or key=value overrides; --help-keys lists the keys")
    args = parsed.args
    check_stack("train.py")
    from diffusion.config import load_config  # the schema and yaml: no torch, Composer or diffusers yet

    recipes = [a for a in args if "=" not in a and a.endswith((".yaml", ".yml"))]
    overrides = [a for a in args if a not in recipes]
    cfg = load_config(recipes, overrides)  # every value checked before the heavy imports below (~10 s on a CPU)
    from diffusion.trainer import fit

    fit(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
