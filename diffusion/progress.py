"""What a run shows while it works: a progress bar for people at a terminal, plain periodic lines for logs.

The ``progress`` config key (and each entry point's ``--progress``) is ``auto``, ``bar`` or ``lines``;
``auto`` draws a bar when the stream it is drawn on (stderr, Composer's console stream and tqdm's) is a
terminal, so a Slurm log or a pipe gets today's lines. Only global rank 0 draws a bar; other ranks keep
their lines (the launcher writes them to files).

Training uses Composer's own ``ProgressBarLogger``: ``ProgressBar`` below only adds images/s (SpeedMonitor's
``throughput/samples_per_sec``, the figure the lines show) beside the loss, which Composer's bar leaves out,
and draws on global rather than per-node rank 0. Loops outside the Trainer (precompute, evaluate) use tqdm.
"""

from __future__ import annotations

import sys
from typing import Any

from composer.loggers import ProgressBarLogger
from composer.utils import dist
from tqdm import tqdm

THROUGHPUT = "throughput/samples_per_sec"  # SpeedMonitor's images/s over its window


def wants_bar(mode: str, stream=None) -> bool:
    """Whether this rank draws a bar in ``mode`` (one of config.PROGRESS): auto, a bar when ``stream``
    (default stderr, where the bars are drawn) is a terminal."""
    if dist.get_global_rank() != 0:
        return False
    stream = sys.stderr if stream is None else stream
    return mode == "bar" or (mode == "auto" and stream.isatty())


def images_bar(total: int, desc: str, show: bool) -> tqdm:
    """A tqdm bar over images that always shows images/s (tqdm would flip a slow rate to s/image)."""
    return tqdm(
        total=total,
        desc=desc,
        disable=not show,
        file=sys.stderr,
        dynamic_ncols=True,
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]",
        unit=" images",
    )


class ProgressBar(ProgressBarLogger):
    """Composer's training bar with images/s beside the loss, drawn by global rank 0 only."""

    @property
    def show_pbar(self) -> bool:
        return dist.get_global_rank() == 0

    def _build_pbar(self, state, is_train: bool):
        pbar = super()._build_pbar(state, is_train)
        if is_train:
            pbar.keys_to_log = [*pbar.keys_to_log, "images/s"]
        if not pbar.pbar.dynamic_ncols:  # not a terminal (a forced bar): Composer's 120 columns would cut images/s
            pbar.pbar.ncols = None
        return pbar

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        if THROUGHPUT in metrics:
            self.log_to_pbar({"images/s": float(metrics[THROUGHPUT])})

    def batch_end(self, state, logger) -> None:
        super().batch_end(state, logger)
        # Callbacks see FIT_END before loggers: the bar is finished at the last batch, so the results line
        # ThroughputRecorder prints at FIT_END lands under it rather than on it.
        end = state.max_duration
        if end is not None and state.timestamp.get(end.unit) >= end:
            self.close(state, logger)
