"""Timing of a run's batches: the measured window, and each rank's split of a batch into compute and sync.

``BatchTimer`` times every batch after ``skip_batches`` warm-up batches (compilation, allocator growth,
loader start), leaving out time spent in evaluation. ``ThroughputRecorder`` (throughput_recorder.py) is a
``BatchTimer`` that turns the timings into the results line at the end of fit.

Per rank, over the same measured batches, each batch is split at the moment this rank's own work for it
is done: **compute** runs from fetching the batch to the end of this rank's backward pass (data loading,
forward, backward); **sync** from there to the end of the batch (waiting for the other ranks' gradients,
the all-reduce not hidden behind backward, the optimizer step, end-of-batch callbacks such as EMA). Under DDP the split point is the gradient
hook of the last bucket (``GradBucket.is_last``: every gradient of this rank is computed, its last
all-reduce not yet started), set through DDP's documented comm hook API with its default all-reduce, so
training is unchanged; elsewhere (FSDP, one rank) it is the end of ``loss.backward()``, so under FSDP,
where ranks also meet at every layer's all-gather, the split shows only part of the waiting (rank_stats.py
turns the splits into each rank's waiting). On GPU the marks are CUDA events on the current stream (read
after the per-batch synchronize the overall figure already does); on CPU, clock reads. Cost per batch:
three marks and one Python call per gradient bucket.
"""

from __future__ import annotations

import time

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from diffusion.batch import IMAGE, LATENT_MOMENTS, LATENTS

SPATIAL = (IMAGE, LATENT_MOMENTS, LATENTS)  # batch keys whose last two dimensions are the sample's (h, w)


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _mark():
    if not torch.cuda.is_available():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(a, b) -> float:  # between two marks; CUDA events must have completed (after a synchronize)
    if not torch.cuda.is_available():
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1000


class BatchTimer(Callback):
    """The measured window (``images``, ``seconds``, ``measured_batches``) and this rank's ``compute`` and
    ``sync`` seconds over it; ``split`` names where a batch was split."""

    def __init__(self, skip_batches: int = 2):
        self.skip_batches = skip_batches
        self._t0: float | None = None
        self._s0 = 0
        self._t1: float | None = None
        self._s1 = 0
        self._eval_seconds = 0.0  # evaluation time inside the measured window
        self._eval_pending = 0.0  # evaluation time since the last batch (counted once a batch follows)
        self._eval_t0: float | None = None
        self._first = 0
        self._hooked = False  # DDP comm hook marks the end of this rank's gradient computation
        self._start = self._ready = None  # marks of the current batch: fetched, own gradients done
        self.compute = self.sync = 0.0  # this rank's seconds over the measured batches
        self._last: tuple[float, int] | None = None  # (time, samples) at the end of the previous batch
        # batch shape -> [batches, images, seconds, the first batch's seconds] over the measured window
        self.per_shape: dict[str, list] = {}

    # --- the window -----------------------------------------------------------------------------------
    @property
    def measured(self) -> bool:
        return self._t1 is not None and self._t0 is not None

    @property
    def images(self) -> int:
        return self._s1 - self._s0 if self.measured else 0

    @property
    def seconds(self) -> float:
        return (self._t1 - self._t0 - self._eval_seconds) if self.measured else 0.0

    def measured_batches(self, state: State) -> int:
        return state.timestamp.batch.value - self._first - self.skip_batches if self.measured else 0

    @property
    def split(self) -> str:
        return "ddp_last_grad_bucket" if self._hooked else "after_backward"

    # --- events ---------------------------------------------------------------------------------------
    def _grad_hook(self, process_group, bucket):
        if bucket.is_last():
            self._ready = _mark()
        return allreduce_hook(process_group, bucket)

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._start, self._ready = _mark(), None

    def after_backward(self, state: State, logger: Logger) -> None:
        if not self._hooked:  # FSDP or one rank: the end of loss.backward() (the last microbatch's wins)
            self._ready = _mark()

    def fit_start(self, state: State, logger: Logger) -> None:
        self._first = state.timestamp.batch.value  # nonzero when resuming from a checkpoint
        if self.skip_batches == 0:  # measure from the very start, first batch's loading included
            self._t0, self._s0 = _now(), state.timestamp.sample.value
            self._last = (self._t0, self._s0)
        if isinstance(state.model, DistributedDataParallel) and not self._hooked:
            try:
                state.model.register_comm_hook(None, self._grad_hook)
                self._hooked = True
            except RuntimeError:  # a comm hook is already registered: fall back to the end of backward
                pass

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = state.timestamp.batch.value - self._first
        if batch == self.skip_batches and batch > 0:
            self._t0, self._s0 = _now(), state.timestamp.sample.value
            self._last = (self._t0, self._s0)
        elif batch > self.skip_batches:
            self._t1, self._s1 = _now(), state.timestamp.sample.value
            self._eval_seconds += self._eval_pending
            self._count_shape(state.batch)
            if self._start is not None and self._ready is not None:
                self.compute += _seconds(self._start, self._ready)
                self.sync += _seconds(self._ready, _mark())
        self._eval_pending = 0.0

    def _count_shape(self, batch) -> None:
        """This batch's time and images under its shape (aspect-ratio buckets mix shapes in one run)."""
        if self._last is not None and isinstance(batch, dict):
            spatial = next((v.shape[-2:] for k, v in batch.items() if k in SPATIAL and hasattr(v, "shape")), None)
            if spatial is not None:
                key = f"{'' if IMAGE in batch else 'latents '}{spatial[1]}x{spatial[0]}"
                seconds = self._t1 - self._last[0] - self._eval_pending
                entry = self.per_shape.setdefault(key, [0, 0, 0.0, seconds])  # --compile: the first compiles
                entry[0] += 1
                entry[1] += self._s1 - self._last[1]
                entry[2] += seconds
        self._last = (self._t1, self._s1)

    def eval_start(self, state: State, logger: Logger) -> None:
        self._eval_t0 = _now()

    def eval_end(self, state: State, logger: Logger) -> None:
        if self._eval_t0 is not None:
            self._eval_pending += _now() - self._eval_t0
            self._eval_t0 = None
