"""Throughput record of a run: one JSON line appended to a results file at the end of training."""

from __future__ import annotations

import resource
import socket

import torch
from composer.core import State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.callbacks.batch_timer import BatchTimer
from diffusion.callbacks.learned_nothing import LearnedNothing
from diffusion.callbacks.peak_flops import this_gpu_peak_flops
from diffusion.callbacks.preemption import Preemption
from diffusion.callbacks.rank_stats import rank_figures
from diffusion.callbacks.results_line import SUMMARY, report, results_line


def peak_memory_gib() -> float:
    """The largest CUDA allocation of any rank; on CPU, this process's peak resident memory."""
    if not torch.cuda.is_available():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    peak = torch.cuda.max_memory_allocated() / 2**30
    peak_all = dist.all_reduce(torch.tensor([peak], device="cuda"), reduce_operation="MAX")
    return float(peak_all[0]) if peak_all is not None else peak


class ThroughputRecorder(BatchTimer):
    """Times the run's batches (``BatchTimer``: ``skip_batches`` warm-up batches left out, and evaluation),
    and at the end of fit logs and appends to ``path`` the results line (results_line.py) of images/s, MFU,
    memory and per-rank figures (rank_stats.py), gathered to rank 0 once.

    ``settings`` (the run's configuration, ``results_line.run_settings``) is stored in the line as is.
    ``straggler_threshold``: rank 0 prints one warning line naming (rank, host) every rank whose images/s is
    more than this share below the median rank's.
    """

    def __init__(
        self,
        path: str | None,
        flops_per_sample: dict[str, float],
        settings: dict,
        skip_batches: int = 2,
        straggler_threshold: float = 0.10,
    ):
        super().__init__(skip_batches)
        self.path = path
        self.flops_per_sample = flops_per_sample
        self.settings = settings
        self.straggler_threshold = straggler_threshold
        self.record: dict | None = None

    def fit_end(self, state: State, logger: Logger) -> None:
        world = dist.get_world_size()
        self.record = record = results_line(
            images=self.images,
            seconds=self.seconds,
            measured_batches=self.measured_batches(state),
            flops_per_sample=self.flops_per_sample,
            peak_flops=this_gpu_peak_flops(state.precision.value),
            peak_memory_gib=peak_memory_gib(),
            microbatch=state.device_train_microbatch_size,
            precision=state.precision.value,
            stopped_by=next((cb.stopped_by for cb in state.callbacks if isinstance(cb, Preemption)), None),
            learned_nothing=next((cb.verdict(state) for cb in state.callbacks if isinstance(cb, LearnedNothing)), None),
            settings=self.settings,
            ranks=rank_figures(
                self._gather_ranks(), self.images / world if self.measured else 0, self.straggler_threshold
            ),
            split=self.split,
            straggler_threshold=self.straggler_threshold,
            per_shape=self.per_shape,
        )
        logger.log_metrics({f"results/{k}": record[k] for k in SUMMARY if record[k] is not None})
        if dist.get_global_rank() == 0:
            report(record, self.path)

    def _gather_ranks(self) -> list[dict]:
        """Every rank's compute and sync seconds (a collective: called on all ranks)."""
        mine = {
            "rank": dist.get_global_rank(),
            "host": socket.gethostname(),
            "compute_s": self.compute,
            "sync_s": self.sync,
        }
        return dist.all_gather_object(mine) if dist.get_world_size() > 1 else [mine]
