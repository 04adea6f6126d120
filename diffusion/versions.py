"""The software stack this project is tested on, as data, and the check every entry point runs first.

Two dependency sets are tested in CI with the whole suite: the pinned one (pyproject.toml, torch 2.7.0)
and a current one (install/current.txt, torch 2.15). Composer 0.32.1 is frozen and pins torch < 2.7.1,
numpy < 2.3 and Pillow < 12, yet runs on both sets; so outside the pinned install it goes in without its pins
(`python install.py into-env`) and everything it imports is named here. Streaming is the maintained fork,
streaming-community (`import streaming`), installed with ordinary resolution.

This module is standard library only: install.py loads it by path before anything else is installed,
and the check runs before an entry point imports Composer, so a stack that cannot work says so in one
line instead of failing in a traceback deep inside an import.

    python -m diffusion.versions        # the table: installed vs tested, one row per package
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata

# package: (lowest supported, highest tested). The lowest is a hard floor (an older one fails, exit 2);
# newer than the highest tested (compared on as many parts as it has: "2.11" admits 2.11.x) prints one
# warning line and runs. torch and torchvision are never installed over by install.py into-env.
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.6", "2.15"),
    "torchvision": ("0.21", "0.29"),
    "mosaicml": ("0.32.1", "0.32.1"),
    "streaming-community": ("0.14.2", "0.14"),
    "transformers": ("5.5", "5.23"),
    "huggingface-hub": ("1.32", "2.4"),
    "tokenizers": ("0.22", "0.23"),
    "diffusers": ("0.42", "0.42"),
    "peft": ("0.18", "0.21"),
    "numpy": ("1.26", "2.5"),
    "torchmetrics": ("1.7", "1.9"),
    "torch-fidelity": ("0.4.0", "0.4.0"),
    "omegaconf": ("2.3", "2.3"),
    "pillow": ("11.3", "11"),
    "safetensors": ("0.8", "0.8"),
    "pyarrow": ("17", "26"),
}

# Installed with --no-deps outside the pinned set: their own requirements pin what no longer holds.
NO_DEPS = ("mosaicml",)

# Frozen Streaming, which the fork replaces: both install the `streaming` package, so with both installed
# whichever pip wrote last wins, file by file. The check refuses the pair in one line.
REPLACED = {"mosaicml-streaming": "streaming-community"}  # old: new, both `import streaming`

# What Composer 0.32.1 imports besides torch, torchvision and the TESTED packages, with its own ranges (from its
# wheel's metadata), installed with ordinary dependency resolution.
THEIR_IMPORTS = [
    # composer
    "pyyaml>=6.0,<7",
    "tqdm>=4.62.3,<5",
    "torch_optimizer>=0.3.0,<0.4",
    "requests>=2.26.0,<3",
    "psutil>=5.8.0,<8",
    "coolname>=1.1.0,<3",
    "tabulate==0.9.0",
    "py-cpuinfo>=8.0.0,<10",
    "packaging>=21.3.0",
    "importlib-metadata>=5.0.0,<9",
    "mosaicml-cli>=0.5.25,<0.8",
]

TORCH_FAMILY = ("torch", "torchvision")


def release(version: str) -> tuple[int, ...]:
    """The leading numeric parts of a version: '2.8.0a0+5228986c39.nv25.05' -> (2, 8, 0)."""
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def next_after(highest: str) -> str:
    """The first release past a tested prefix: '5.17' -> '5.18', '0.4.0' -> '0.4.1', '11' -> '12'."""
    parts = list(release(highest))
    parts[-1] += 1
    return ".".join(map(str, parts))


def requirement(name: str) -> str:
    """A pip requirement for the tested range of ``name``: 'transformers>=4.57,<5.18'."""
    low, high = TESTED[name]
    return f"{name}>={low},<{next_after(high)}"


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def status(name: str, version: str | None) -> str:
    """'ok', 'missing', 'too old' or 'newer than tested'."""
    if version is None:
        return "missing"
    low, high = TESTED[name]
    v = release(version)
    if v < release(low):
        return "too old"
    if v[: len(release(high))] > release(high):
        return "newer than tested"
    return "ok"


def problems() -> tuple[list[str], list[str]]:
    """(errors, warnings) for the installed stack, one sentence each."""
    errors, warnings = [], []
    for old, new in REPLACED.items():
        if (version := installed(old)) is not None:
            errors.append(
                f"{old} {version} is installed, and {new} replaces it (both install the same package, so "
                f"one overwrites the other's files); run `pip uninstall -y {old}`, "
                f"then `pip install --force-reinstall --no-deps {requirement(new)!r}`"
            )
    for name, (low, high) in TESTED.items():
        version = installed(name)
        state = status(name, version)
        if state == "missing" and name in ("pyarrow", "torch-fidelity"):
            continue  # optional: parquet sources and FID say so themselves when used
        if state == "missing":
            errors.append(
                f"{name} is not installed (tested {low} to {high}); install the project with "
                "`pip install -e .` (pinned set) or `python install.py into-env` (an environment "
                "that already has torch)"
            )
        elif state == "too old":
            errors.append(
                f"{name} {version} is older than this project supports (tested {low} to {high}); "
                f"install {requirement(name)!r}"
            )
        elif state == "newer than tested":
            warnings.append(
                f"{name} {version} is newer than the tested range ({low} to {high}); it may work: report what breaks"
            )
    return errors, warnings


def check_stack(prog: str) -> None:
    """Entry points call this before importing Composer: one line per problem; a stack that cannot work
    exits 2. It also silences transformers 5's weight-loading bar (quiet_weight_loading). Warnings print on the
    first rank only (every rank runs the check). DIFFUSION_SKIP_VERSION_CHECK=1 silences the whole check for
    people who know what they run; DIFFUSION_NO_NEWER_WARNING=1 only the "newer than tested" lines (the test
    suite sets it, so tests that expect one line on stderr pass on a newer stack unless something broke)."""
    quiet_weight_loading()
    if os.environ.get("DIFFUSION_SKIP_VERSION_CHECK") == "1":
        return
    errors, warnings = problems()
    if errors:
        print(f"{prog}: error: {errors[0]}", file=sys.stderr)
        raise SystemExit(2)
    if os.environ.get("RANK", "0") == "0" and os.environ.get("DIFFUSION_NO_NEWER_WARNING") != "1":
        for w in warnings:
            print(f"{prog}: warning: {w}", file=sys.stderr)


def quiet_weight_loading() -> None:
    """transformers 5 draws a "Loading weights" bar on stderr for every from_pretrained, which buries one-line
    errors and fills Slurm logs; transformers 4 draws none. Off on both unless HF_HUB_DISABLE_PROGRESS_BARS is
    set otherwise (read by huggingface_hub and transformers at import; switched off in-process if already
    imported). Our own progress bars (--progress) are not affected."""
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" and "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def table() -> list[str]:
    rows = [f"{'package':<20} {'installed':<28} {'tested':<18} status"]
    for name, (low, high) in TESTED.items():
        version = installed(name)
        rows.append(f"{name:<20} {version or '-':<28} {low + ' to ' + high:<18} {status(name, version)}")
    return rows


if __name__ == "__main__":
    print("\n".join(table()))
    errs, _ = problems()
    sys.exit(2 if errs else 0)
