"""The quality measures of diffusion.bench.curves, and what a checkpoint says about the training behind it.

A measure takes one checkpoint file (SAVE_FOLDER/epE-baB-rank0.pt) and returns a float:

* ``val_loss``: the validation loss the run computed at that batch (SD's MSE, FLUX's MLPerf timestep-binned
  loss; the families' ``ValidationLoss``), read from the run's own eval line (``eval at batch B: ...``) in
  SAVE_FOLDER/train.log: the tool runs each variant with eval_interval set to --every. Lower is better.
* ``digits``: examples/digits/digits.py's judge: generate.py samples every digit from the checkpoint and the
  classifier trained on the real digits reads them; the share read as the prompted digit. Higher is better.
* ``module.path:function`` (or ``path/file.py:function``): a user's callable taking the checkpoint's path and
  returning a float; which way is better is declared with --better.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from diffusion.checkpointing.unpickling import load_checkpoint_file
from diffusion.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = re.compile(r"^ep\d+-ba(\d+)-rank0\.pt$")
EVAL_LINE = re.compile(r"^eval at batch (\d+): .*\bValidationLoss ([-+0-9.eE]+|nan|inf)", re.M)
LOG = "train.log"  # each variant's train.py output, in its save folder


@dataclass
class Quality:
    name: str
    measure: Callable[[str], float]  # checkpoint path -> quality
    higher_is_better: bool
    reachable: tuple[float, float] = (-math.inf, math.inf)  # the values it can take, ends included
    train_overrides: list[str] = field(default_factory=list)  # what each run needs for it (keys: train.py's)


def checkpoints(folder: Path) -> dict[int, Path]:
    """A save folder's checkpoint files by batch (the 'latest' link and sharded checkpoints left out)."""
    if not folder.is_dir():
        return {}
    found = {int(m[1]): folder / f for f in os.listdir(folder) if (m := CHECKPOINT.match(f))}
    return dict(sorted(found.items()))


def trained_to(path: Path, trust: bool = False) -> dict:
    """What a checkpoint's own timestamp says: its batch, the images seen and the training wall seconds
    (Composer's clock, evaluation left out, carried over resumptions)."""
    state = load_checkpoint_file(str(path), "checkpoint", trust, mmap=True, trust_flag="--trust_checkpoint")["state"]
    stamp = state["timestamp"]["Timestamp"]
    return {"batch": stamp["batch"], "samples": stamp["sample"], "seconds": stamp["total_wct"].total_seconds()}


def val_loss(checkpoint: str) -> float:
    """The ValidationLoss of the run's last eval line at the checkpoint's batch, in its folder's train.log."""
    path = Path(checkpoint)
    batch = int(CHECKPOINT.match(path.name)[1])
    log = path.parent / LOG
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = [float(v) for b, v in EVAL_LINE.findall(text) if int(b) == batch]
    if not found:
        raise UsageError(
            f"--quality val_loss: no 'eval at batch {batch}: ... ValidationLoss' line in {log}; the run must evaluate "
            f"at every checkpoint (eval_interval=--every, progress=lines) with its output appended to {log}"
        )
    return found[-1]


def _digits_module():
    spec = importlib.util.spec_from_file_location("digits_example", REPO / "examples" / "digits" / "digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_measure(seed: int = 0) -> Callable[[str], float]:
    """examples/digits/digits.py's judge as a measure: its defaults (20 samples per digit, 30 steps, guidance 4,
    16 px), its generate.py command and its classifier, trained once here. Samples and logs of the checkpoint
    at batch B go to SAVE_FOLDER/digits-baB. ``seed``: generate.py's (0, the curves'; another draws fresh noise,
    to re-judge a recipe chosen by its curve on samples the choice never saw: SAVE_FOLDER/digits-baB-seedS)."""
    digits = _digits_module()
    options = digits.parse_args([])

    def measure(checkpoint: str) -> float:
        path = Path(checkpoint).resolve()
        work = path.parent / f"digits-ba{CHECKPOINT.match(path.name)[1]}{f'-seed{seed}' if seed else ''}"
        work.mkdir(exist_ok=True)
        judge = digits.train_judge()[0]
        extra = ["--seed", str(seed)]
        return digits.judge_checkpoint("curves", str(path), options, str(work), judge, str(work), extra=extra)[
            "accuracy"
        ]

    return measure


def plug_in(spec: str) -> Callable[[str], float]:
    """``module.path:function`` or ``path/file.py:function``: the callable, or a one-line error."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError(f"--quality {spec}: expected val_loss, digits or module.path:function")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise UsageError(f"--quality {spec}: no file {where}")
            folder = os.path.dirname(os.path.abspath(where))  # its siblings import as when it runs as a script
            if folder not in sys.path:
                sys.path.insert(0, folder)
            loaded = importlib.util.spec_from_file_location(Path(where).stem, where)
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as e:
        raise UsageError(f"--quality {spec}: cannot import {where} ({e}); is it on PYTHONPATH?") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"--quality {spec}: {where} has no function {name}")
    return function


def quality_of(spec: str, better: str | None, every: str) -> Quality:
    """The measure ``spec`` names (--quality), which way is better (--better; a plug-in must say) and what the
    runs need for it."""
    if spec == "val_loss":
        chosen = Quality("val_loss", val_loss, False, (0.0, math.inf), [f"eval_interval={every}", "progress=lines"])
    elif spec == "digits":
        chosen = Quality("digits", digits_measure(), True, (0.0, 1.0))
    else:
        if better is None:
            raise UsageError(
                f"--quality {spec}: say whether a higher or a lower value is better (--better higher|lower)"
            )
        return Quality(spec, plug_in(spec), better == "higher")
    if better is not None and (better == "higher") != chosen.higher_is_better:
        raise UsageError(
            f"--better {better}: for --quality {spec} "
            f"{'higher' if chosen.higher_is_better else 'lower'} is better; drop --better"
        )
    return chosen


def check_target(quality: Quality, target: float | None) -> None:
    low, high = quality.reachable
    if target is not None and not low <= target <= high:
        raise UsageError(
            f"--target {target:g}: --quality {quality.name} takes values from {low:g} to {high:g}, so no run can reach "
            "it; give a target in that range"
        )
