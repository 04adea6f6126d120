"""Throughput record of a run: one JSON line appended to a results file at the end of training."""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version

import torch
from composer.callbacks.speed_monitor import get_gpu_flops_available
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from diffusion.callbacks.preemption import Preemption

SUMMARY = ("images_per_sec", "images_per_sec_per_gpu", "mfu", "peak_memory_gib")
PER_RANK = ("rank_images_per_sec", "rank_wait_share", "slowest_ranks")  # printed with SUMMARY
SLOWEST = 3  # ranks listed by name in the record (all of them when there are this few)
VERSIONED = ("torch", "mosaicml", "mosaicml-streaming", "diffusers", "transformers", "xformers", "diffusion")


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


class ThroughputRecorder(Callback):
    """Times every batch after ``skip_batches`` warm-up batches (compilation, allocator growth, loader
    start), leaving out time spent in evaluation, and at the end of fit logs and appends to ``path`` a
    record of images/s, MFU and memory.

    ``settings`` (the run's configuration) is stored in the record as is.

    Per rank, over the same measured batches, each batch is split at the moment this rank's own work for it
    is done: **compute** runs from fetching the batch to the end of this rank's backward pass (data loading,
    forward, backward); **sync** from there to the end of the batch (waiting for the other ranks' gradients,
    the all-reduce not hidden behind backward, the optimizer step, end-of-batch callbacks such as EMA). Under DDP the split point is the gradient
    hook of the last bucket (``GradBucket.is_last``: every gradient of this rank is computed, its last
    all-reduce not yet started), set through DDP's documented comm hook API with its default all-reduce, so
    training is unchanged; elsewhere (FSDP, one rank) it is the end of ``loss.backward()``, so under FSDP,
    where ranks also meet at every layer's all-gather, the split shows only part of the waiting. Sync is the
    same work on every rank except for waiting, so **wait** = a rank's sync time minus the least sync time of
    any rank, and a rank's images/s is its images over its time less its wait: what it would do if it never
    waited. A slow GPU, node or data loader shows as a low images/s and a short wait beside fast ranks that
    wait long. On GPU the marks are CUDA events on the current stream (read after the per-batch synchronize
    the overall figure already does); on CPU, clock reads. Cost per batch: three marks and one Python call per
    gradient bucket; the figures are gathered to rank 0 once, at the end of fit.

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
        self.path = path
        self.flops_per_sample = flops_per_sample
        self.settings = settings
        self.skip_batches = skip_batches
        self._t0: float | None = None
        self._s0 = 0
        self._t1: float | None = None
        self._s1 = 0
        self._eval_seconds = 0.0  # evaluation time inside the measured window
        self._eval_pending = 0.0  # evaluation time since the last batch (counted once a batch follows)
        self._eval_t0: float | None = None
        self._first = 0
        self.straggler_threshold = straggler_threshold
        self._hooked = False  # DDP comm hook marks the end of this rank's gradient computation
        self._start = self._ready = None  # marks of the current batch: fetched, own gradients done
        self._compute = self._sync = 0.0  # this rank's seconds over the measured batches
        self.record: dict | None = None

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    @staticmethod
    def _mark():
        if not torch.cuda.is_available():
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _seconds(a, b) -> float:  # between two marks; CUDA events must have completed (after a synchronize)
        if not torch.cuda.is_available():
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1000

    def _grad_hook(self, process_group, bucket):
        if bucket.is_last():
            self._ready = self._mark()
        return allreduce_hook(process_group, bucket)

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self._start, self._ready = self._mark(), None

    def after_backward(self, state: State, logger: Logger) -> None:
        if not self._hooked:  # FSDP or one rank: the end of loss.backward() (the last microbatch's wins)
            self._ready = self._mark()

    def fit_start(self, state: State, logger: Logger) -> None:
        self._first = state.timestamp.batch.value  # nonzero when resuming from a checkpoint
        if self.skip_batches == 0:  # measure from the very start, first batch's loading included
            self._t0, self._s0 = self._now(), state.timestamp.sample.value
        if isinstance(state.model, DistributedDataParallel) and not self._hooked:
            try:
                state.model.register_comm_hook(None, self._grad_hook)
                self._hooked = True
            except RuntimeError:  # a comm hook is already registered: fall back to the end of backward
                pass

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = state.timestamp.batch.value - self._first
        if batch == self.skip_batches and batch > 0:
            self._t0, self._s0 = self._now(), state.timestamp.sample.value
        elif batch > self.skip_batches:
            self._t1, self._s1 = self._now(), state.timestamp.sample.value
            self._eval_seconds += self._eval_pending
            if self._start is not None and self._ready is not None:
                self._compute += self._seconds(self._start, self._ready)
                self._sync += self._seconds(self._ready, self._mark())
        self._eval_pending = 0.0

    def eval_start(self, state: State, logger: Logger) -> None:
        self._eval_t0 = self._now()

    def eval_end(self, state: State, logger: Logger) -> None:
        if self._eval_t0 is not None:
            self._eval_pending += self._now() - self._eval_t0
            self._eval_t0 = None

    def fit_end(self, state: State, logger: Logger) -> None:
        world = dist.get_world_size()
        measured = self._t1 is not None and self._t0 is not None
        images = self._s1 - self._s0 if measured else 0
        seconds = (self._t1 - self._t0 - self._eval_seconds) if measured else 0.0
        ips = images / seconds if seconds > 0 else None
        on_gpu = torch.cuda.is_available()
        peak_flops = get_gpu_flops_available(state) if on_gpu else None
        mfu = (ips * self.flops_per_sample["total"] / (world * peak_flops)) if ips and peak_flops else None
        if on_gpu:
            peak_mem = torch.cuda.max_memory_allocated() / 2**30
            peak_all = dist.all_reduce(torch.tensor([peak_mem], device="cuda"), reduce_operation="MAX")
            peak_mem = float(peak_all[0]) if peak_all is not None else peak_mem
        else:
            peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        mb = state.device_train_microbatch_size
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "images_per_sec": ips,
            "images_per_sec_per_gpu": ips / world if ips else None,
            "measured_batches": state.timestamp.batch.value - self._first - self.skip_batches if measured else 0,
            "measured_seconds": seconds,
            "mfu": mfu,
            "tflop_per_image": self.flops_per_sample["total"] / 1e12,
            "tflop_per_image_denoiser": self.flops_per_sample["denoiser"] / 1e12,
            "peak_memory_gib": peak_mem,
            "peak_memory_kind": "cuda_max_allocated" if on_gpu else "cpu_max_rss_rank0",
            "device_train_microbatch_size": mb,
            "precision": state.precision.value,
            "gpu_name": torch.cuda.get_device_name() if on_gpu else None,
            "gpu_count": world if on_gpu else 0,
            "device": "gpu" if on_gpu else "cpu",
            "world_size": world,
            "num_nodes": dist.get_world_size() // max(dist.get_local_world_size(), 1),
            # a signal (Slurm's preemption, time limit or warning) ended the run early: what it measured so far
            "stopped_by": next((cb.stopped_by for cb in state.callbacks if isinstance(cb, Preemption)), None),
            **self.settings,
            "versions": _versions(),
        }
        record.update(self._per_rank(images / world if measured else 0))
        self.record = record
        logger.log_metrics({f"results/{k}": record[k] for k in SUMMARY if record[k] is not None})
        if dist.get_global_rank() == 0:
            print("results: " + json.dumps({k: record[k] for k in SUMMARY + PER_RANK}), flush=True)
            if record["stragglers"]:
                print(
                    f"{os.path.basename(sys.argv[0])}: warning: {straggler_warning(record)}",
                    file=sys.stderr,
                    flush=True,
                )
            if self.path:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")

    def _per_rank(self, images: float) -> dict:
        """Per-rank figures (gathered from every rank; called on all of them): min/median/max of images/s
        and of the share of time spent waiting, the slowest ranks by host and global rank, the stragglers."""
        mine = {
            "rank": dist.get_global_rank(),
            "host": socket.gethostname(),
            "compute_s": self._compute,
            "sync_s": self._sync,
        }
        ranks = dist.all_gather_object(mine) if dist.get_world_size() > 1 else [mine]
        least_sync = min(r["sync_s"] for r in ranks)
        for r in ranks:
            r["wait_s"] = r["sync_s"] - least_sync
            busy = r["compute_s"] + least_sync
            r["images_per_sec"] = images / busy if busy > 0 and images else None
            r["wait_share"] = r["wait_s"] / (r["compute_s"] + r["sync_s"]) if r["compute_s"] + r["sync_s"] else None
        if any(r["images_per_sec"] is None for r in ranks):
            return {
                "rank_images_per_sec": None,
                "rank_wait_share": None,
                "rank_wait_seconds": None,
                "rank_split": None,
                "slowest_ranks": [],
                "stragglers": [],
                "straggler_threshold": self.straggler_threshold,
            }
        ranks.sort(key=lambda r: r["images_per_sec"])
        median = statistics.median(r["images_per_sec"] for r in ranks)
        figures = [
            {
                "rank": r["rank"],
                "host": r["host"],
                "images_per_sec": r["images_per_sec"],
                "slower_than_median": 1 - r["images_per_sec"] / median,
                "compute_s": r["compute_s"],
                "wait_s": r["wait_s"],
            }
            for r in ranks
        ]
        return {
            "rank_images_per_sec": _spread([r["images_per_sec"] for r in ranks]),
            "rank_wait_share": _spread([r["wait_share"] for r in ranks]),
            "rank_wait_seconds": _spread([r["wait_s"] for r in ranks]),
            "rank_split": "ddp_last_grad_bucket" if self._hooked else "after_backward",
            "slowest_ranks": figures[:SLOWEST],
            "stragglers": [f for f in figures if f["slower_than_median"] > self.straggler_threshold],
            "straggler_threshold": self.straggler_threshold,
        }


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def straggler_warning(record: dict) -> str:
    """One line naming every straggler of a results record (rank, host, how much slower than the median)."""
    named = ", ".join(
        f"rank {s['rank']} on {s['host']} {s['slower_than_median']:.0%} slower ({s['images_per_sec']:.3g} images/s)"
        for s in record["stragglers"]
    )
    return (
        f"{named}: more than straggler_threshold {record['straggler_threshold']:.0%} below the median rank "
        f"({record['rank_images_per_sec']['median']:.3g} images/s); ranks waited for others up to "
        f"{record['rank_wait_share']['max']:.0%} of their batch time"
    )
