"""What a run shows while it works: a progress bar for people at a terminal, one plain line per log interval
for logs.

The ``progress`` config key (and each entry point's ``--progress``) is one of config.PROGRESS: ``bar``,
``lines``, ``metrics`` or ``auto``, which draws a bar when the stream it is drawn on (stderr) is a terminal and
prints the lines otherwise (a Slurm log, a pipe, a CI log). Only global rank 0 draws a bar or prints the lines
(other ranks' output goes to files under the launcher). ``metrics`` is Composer's own ConsoleLogger, every
metric logged (a dozen lines per interval on every rank, token counts included), for when that is wanted.

Training uses Composer's own ``ProgressBarLogger``: ``ProgressBar`` below only adds images/s (SpeedMonitor's
``throughput/samples_per_sec``) beside the loss, which Composer's bar leaves out, and draws on global rather
than per-node rank 0. ``ProgressLines`` is ours, because Composer's console logger can only print every
metric, one per line. Loops outside the Trainer (precompute, evaluate) use tqdm, or their own lines.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

from composer.core import State, Time, TimeUnit
from composer.loggers import Logger, LoggerDestination, ProgressBarLogger
from composer.utils import dist
from tqdm import tqdm

THROUGHPUT = "throughput/samples_per_sec"  # SpeedMonitor's images/s over its window
LOSS = "loss/train/total"


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


def total_batches(state: State, batch_size: int) -> int | None:
    """The batch the run (or phase) ends at, whatever unit its max_duration is in: batches, epochs (once the
    loader's length is known) or samples (``batch_size``: the global batch). None when it cannot be known."""
    end, now = state.max_duration, state.timestamp
    if end is None:
        return None
    if end.unit == TimeUnit.BATCH:
        return end.value
    if end.unit == TimeUnit.EPOCH and state.dataloader_len is not None:
        return end.value * int(state.dataloader_len)
    if end.unit == TimeUnit.SAMPLE:
        return int(now.batch) + max(0, -(-(end.value - int(now.sample)) // batch_size))
    return None


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class ProgressLines(LoggerDestination):
    """One line per log interval for a person reading a log, printed by global rank 0 on ``stream``::

        batch 20/200, epoch 1: loss 0.8039, 85.3 images/s, ETA 0:00:21

    (the first batch and the last are printed too; images/s once SpeedMonitor's window is full), a line
    per evaluation (``eval at batch 20: ...``, every metric of each evaluator) and per quality measurement
    (``quality at batch 20: FID ...``). ``interval``: the log_interval key (batches or epochs);
    ``batch_size``: the global batch, to count the batches of a run measured in samples."""

    def __init__(self, interval: str, batch_size: int, stream=None):
        self.interval = Time.from_timestring(interval)
        self.batch_size = batch_size
        self.stream = sys.stderr if stream is None else stream
        self.metrics: dict[str, Any] = {}
        self.started: tuple[float, int] | None = None  # (wall time, batch) when this fit started

    def _print(self, line: str) -> None:
        if dist.get_global_rank() == 0:
            print(line, file=self.stream, flush=True)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.metrics.update(metrics)
        quality = {k.split("/")[-1]: v for k, v in metrics.items() if k.startswith("metrics/quality/")}
        if quality:  # QualityEval's figures, logged at the batch it measured
            self._print(f"quality at batch {step}: {_figures(quality)}")

    def fit_start(self, state: State, logger: Logger) -> None:
        self.started = (time.perf_counter(), int(state.timestamp.batch))

    def batch_end(self, state: State, logger: Logger) -> None:
        batch, end = int(state.timestamp.batch), state.max_duration
        due = self.interval.unit == TimeUnit.BATCH and batch % self.interval.value == 0
        first, last = batch == self.started[1] + 1, end is not None and state.timestamp.get(end.unit) >= end
        if due or first or last:  # the epoch under way: Composer counts it once it has ended
            self._print(self.line(state, int(state.timestamp.epoch) + 1))

    def epoch_end(self, state: State, logger: Logger) -> None:
        epoch = int(state.timestamp.epoch)
        if self.interval.unit == TimeUnit.EPOCH and epoch % self.interval.value == 0:
            self._print(self.line(state, epoch))

    def eval_start(self, state: State, logger: Logger) -> None:
        self.metrics = {k: v for k, v in self.metrics.items() if not k.startswith("metrics/")}

    def eval_end(self, state: State, logger: Logger) -> None:
        label = f"metrics/{state.dataloader_label}/"
        figures = {k[len(label) :]: v for k, v in self.metrics.items() if k.startswith(label)}
        if figures:
            self._print(f"{state.dataloader_label} at batch {int(state.timestamp.batch)}: {_figures(figures)}")

    def line(self, state: State, epoch: int) -> str:
        """``batch n/N, epoch e: loss L, R images/s, ETA h:mm:ss``, from what has been logged so far."""
        batch, total, end = int(state.timestamp.batch), total_batches(state, self.batch_size), state.max_duration
        epochs = end.value if end is not None and end.unit == TimeUnit.EPOCH else None
        where = f"batch {batch}" + (f"/{total}" if total else "")
        where += f", epoch {epoch}" + (f"/{epochs}" if epochs else "")
        said = []
        if LOSS in self.metrics:
            said.append(f"loss {float(self.metrics[LOSS]):.4g}")
        if THROUGHPUT in self.metrics:
            said.append(f"{float(self.metrics[THROUGHPUT]):,.1f} images/s")
        t0, b0 = self.started
        if total and b0 < batch < total:
            said.append(f"ETA {_clock((time.perf_counter() - t0) / (batch - b0) * max(0, total - batch))}")
        return f"{where}: {', '.join(said)}" if said else where


def _figures(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{name} {float(value):.4g}" for name, value in metrics.items())
