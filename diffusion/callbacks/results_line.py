"""The results line: every field of the JSON line a run appends to its results file (``results`` key), in
one place, and the writing of it.

A line holds the measurement (images/s, MFU, memory), the machine and world it ran on, the run's settings
(``run_settings``: the config keys a comparison needs, and ``tags``), the software versions, and the
per-rank figures (rank_stats.py). ``ThroughputRecorder`` fills it at the end of fit;
``python -m diffusion.bench.throughput`` and the sweep read it back.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import torch
from composer.utils import dist

from diffusion.callbacks.rank_stats import RankFigures
from diffusion.config import sdpa_kernels_of
from diffusion.techniques import TECHNIQUES
from diffusion.versions import installed

if TYPE_CHECKING:
    from diffusion.config import TrainConfig
    from diffusion.models.build import Built

SUMMARY = ("images_per_sec", "images_per_sec_per_gpu", "mfu", "peak_memory_gib")
PER_RANK = ("rank_images_per_sec", "rank_wait_share", "slowest_ranks")  # printed with SUMMARY
VERSIONED = ("torch", "mosaicml", "streaming-community", "diffusers", "transformers", "peft", "xformers", "diffusion")


FLOP_PARTS = ("total", "denoiser", "encoders")  # flops_per_sample's own keys (models/base.py)


def run_settings(cfg: TrainConfig, built: Built) -> dict:
    """The run's settings as the line holds them (``tags`` last, as given)."""
    return {
        "model": cfg.model_name,
        "family": built.family,
        "resolution": cfg.image_size,
        "global_batch_size": cfg.batch_size,
        "ema": cfg.use_ema,
        "fsdp": cfg.fsdp,
        "precomputed_latents": cfg.precomputed_latents,
        "synthetic": cfg.use_synth_data,
        "attention": cfg.attention,
        "sdpa_kernels": sdpa_kernels_of(cfg, built.model),
        "optimizer": cfg.optimizer,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "compile": cfg.compile,
        "compile_blocks": cfg.compile_blocks,
        "channels_last": cfg.channels_last,
        "cudnn_benchmark": cfg.cudnn_benchmark,
        "text_encoders_on_cpu": cfg.text_encoders_on_cpu,
        "num_workers": cfg.num_workers,
        "max_duration": cfg.max_duration,
        "prediction_type": getattr(built.model, "prediction_type", None),
        "objective": getattr(built.model, "objective", None),  # the family's loss options, defaults included
        # each training technique's entry (None when off), by its registry's name
        **{t.NAME: t.results(cfg, built.model) if t.on(cfg) else None for t in TECHNIQUES if t.RESULTS},
        **cfg.tags,
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        if (found := installed(name)) is not None:
            out[name] = found
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


def results_line(
    *,
    images: float,
    seconds: float,
    measured_batches: int,
    flops_per_sample: dict[str, float],
    peak_flops: float | None,
    peak_memory_gib: float,
    microbatch: int | None,
    precision: str,
    stopped_by: str | None,
    settings: dict,
    ranks: RankFigures | None,
    split: str,
    straggler_threshold: float,
    per_shape: dict | None = None,
    learned_nothing: str | None = None,
) -> dict:
    """The line of one run: ``images`` and ``seconds`` over the measured window, all ranks together;
    ``peak_flops``: one GPU's (None on CPU); ``stopped_by``: the signal that ended the run early, if any;
    ``learned_nothing``: why the run's figures are an untrained model's (callbacks/learned_nothing.py), if so."""
    world, on_gpu = dist.get_world_size(), torch.cuda.is_available()
    ips = images / seconds if seconds > 0 else None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "images_per_sec": ips,
        "images_per_sec_per_gpu": ips / world if ips else None,
        "measured_batches": measured_batches,
        "measured_seconds": seconds,
        "mfu": (ips * flops_per_sample["total"] / (world * peak_flops)) if ips and peak_flops else None,
        "tflop_per_image": flops_per_sample["total"] / 1e12,
        "tflop_per_image_denoiser": flops_per_sample["denoiser"] / 1e12,
        # what a technique adds beside the denoiser and the frozen encoders (REPA: its encoder and projector)
        **{f"tflop_per_image_{k}": v / 1e12 for k, v in flops_per_sample.items() if k not in FLOP_PARTS},
        "peak_memory_gib": peak_memory_gib,
        "peak_memory_kind": "cuda_max_allocated" if on_gpu else "cpu_max_rss_rank0",
        "device_train_microbatch_size": microbatch,
        "precision": precision,
        "gpu_name": torch.cuda.get_device_name() if on_gpu else None,
        "gpu_count": world if on_gpu else 0,
        "device": "gpu" if on_gpu else "cpu",
        "world_size": world,
        "num_nodes": world // max(dist.get_local_world_size(), 1),
        "stopped_by": stopped_by,  # a signal (Slurm's preemption, time limit or warning): what it measured so far
        "learned_nothing": learned_nothing,
        **settings,
        "versions": versions(),
        "rank_images_per_sec": ranks.images_per_sec if ranks else None,
        "rank_wait_share": ranks.wait_share if ranks else None,
        "rank_wait_seconds": ranks.wait_seconds if ranks else None,
        "rank_split": split if ranks else None,
        "slowest_ranks": ranks.slowest if ranks else [],
        "stragglers": ranks.stragglers if ranks else [],
        "straggler_threshold": straggler_threshold,
        "per_shape": shape_figures(per_shape),
    }


def shape_figures(per_shape: dict | None) -> dict | None:
    """With several batch shapes (aspect-ratio buckets; ``per_shape``: shape -> (batches, images, seconds, first
    batch's seconds)): each one's batches and images/s, width x height, and its first batch's seconds beside the
    mean of the others' (under --compile the first batch of a shape (re)compiles); None for one shape."""
    if not per_shape or len(per_shape) < 2:
        return None
    return {
        shape: {
            "batches": n,
            "images_per_sec": images / seconds if seconds > 0 else None,
            "first_batch_seconds": first,
            "other_batch_seconds": (seconds - first) / (n - 1) if n > 1 else None,
        }
        for shape, (n, images, seconds, first) in sorted(per_shape.items())
    }


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


def report(record: dict, path: str | None) -> None:
    """On rank 0: the summary on stdout (``results: {...}``), the straggler warning on stderr, and the line
    appended to ``path``."""
    print("results: " + json.dumps({k: record[k] for k in SUMMARY + PER_RANK}), flush=True)
    if record["stragglers"]:
        print(f"{os.path.basename(sys.argv[0])}: warning: {straggler_warning(record)}", file=sys.stderr, flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
