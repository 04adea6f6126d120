"""Throughput record of a run: one JSON line appended to a results file at the end of training."""
from __future__ import annotations

import json
import os
import platform
import resource
import socket
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version

import torch
from composer.callbacks.speed_monitor import get_gpu_flops_available
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

SUMMARY = ("images_per_sec", "images_per_sec_per_gpu", "mfu", "peak_memory_gib")
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
    """

    def __init__(self, path: str | None, flops_per_sample: dict[str, float], settings: dict,
                 skip_batches: int = 2):
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
        self.record: dict | None = None

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def fit_start(self, state: State, logger: Logger) -> None:
        self._first = state.timestamp.batch.value  # nonzero when resuming from a checkpoint
        if self.skip_batches == 0:  # measure from the very start, first batch's loading included
            self._t0, self._s0 = self._now(), state.timestamp.sample.value

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = state.timestamp.batch.value - self._first
        if batch == self.skip_batches and batch > 0:
            self._t0, self._s0 = self._now(), state.timestamp.sample.value
        elif batch > self.skip_batches:
            self._t1, self._s1 = self._now(), state.timestamp.sample.value
            self._eval_seconds += self._eval_pending
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
            **self.settings,
            "versions": _versions(),
        }
        self.record = record
        logger.log_metrics({f"results/{k}": record[k] for k in SUMMARY if record[k] is not None})
        if dist.get_global_rank() == 0:
            print("results: " + json.dumps({k: record[k] for k in SUMMARY}), flush=True)
            if self.path:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
