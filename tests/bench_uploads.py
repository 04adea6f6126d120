"""Not a test: what a checkpoint saved to object storage costs the training, uploaded in the background (now)
and synchronously (before: RemoteCheckpointSaver.background = False), against the SeaweedFS server the tests
use (conftest.S3Server, started here on loopback). Writes the figures as JSON; docs/reliability.md keeps them.

    PYTHONPATH=. python tests/bench_uploads.py OUT.json [--batches_per_save 3] [--saves 4]   # from the repo root

flux-small without EMA (its checkpoint: weights and AdamW's two moments, about 500 MiB), synthetic data at
64 px, one process; the same run twice in this process, saves uploaded synchronously, then in the background.
The cost of a save is the training it holds up: from the end of the save's batch to the start of the next
batch (the checkpoint callbacks run in between: the file written, and the upload, or the wait for the previous
one). Also the wall time of each save interval (the save and the batches up to the next one) and the
upload's own time. On a busy machine the intervals are noisy; the hold-ups are not (no batch in them)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from composer.core import Callback
from conftest import S3Server

import train
from diffusion import object_store
from diffusion.checkpointing import remote as remote_checkpoints


class _Clock(Callback):
    """The wall time at the start and the end of every batch."""

    def __init__(self):
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}

    def batch_start(self, state, logger):
        self.starts[state.timestamp.batch.value + 1] = time.perf_counter()

    def batch_end(self, state, logger):
        self.ends[state.timestamp.batch.value] = time.perf_counter()


def _run(args: list[str], background: bool | None, every: int, saves: int) -> dict:
    import diffusion.trainer

    clock, real = _Clock(), diffusion.trainer.callbacks
    diffusion.trainer.callbacks = lambda *a, **k: [clock, *real(*a, **k)]
    uploads, real_upload = [], object_store.upload

    def upload(local, url, budget=None):
        start = time.perf_counter()
        real_upload(local, url, budget)
        if url.endswith(".pt"):
            uploads.append((time.perf_counter() - start, Path(local).stat().st_size))

    remote_checkpoints.object_store.upload = upload
    remote_checkpoints.RemoteCheckpointSaver.background = bool(background)
    start = time.perf_counter()
    try:
        assert train.main([*args, f"max_duration={every * saves + 1}ba"]) == 0
    finally:
        diffusion.trainer.callbacks, remote_checkpoints.object_store.upload = real, real_upload
        remote_checkpoints.RemoteCheckpointSaver.background = True
    saved = [every * i for i in range(1, saves + 1)]  # each followed by a batch (the run's last save is not)
    held = [clock.starts[b + 1] - clock.ends[b] for b in saved]
    marks = [clock.ends[b] for b in saved]
    intervals = [b - a for a, b in zip(marks, marks[1:])]
    return {
        "held_s": [round(t, 2) for t in held],
        "median_held_s": round(statistics.median(held), 2),
        "intervals_s": [round(t, 2) for t in intervals],
        "median_interval_s": round(statistics.median(intervals), 2),
        "uploads_s": [round(t, 2) for t, _ in uploads],
        "checkpoint_mib": round(uploads[0][1] / 2**20, 1) if uploads else None,
        "run_s": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--batches_per_save", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--model_name", default="flux-small")
    opts = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-uploads-"))
    server = S3Server(root)
    server.start()
    try:
        os.environ.update(server.env())
        common = [f"model_name={opts.model_name}", "use_synth_data=true", "num_workers=0", "batch_size=2", "lr=1e-4"]
        common += ["image_size=64", "use_ema=false", "eval_interval=null", "progress=lines", "log_interval=1000ba"]
        common += [f"save_interval={opts.batches_per_save}ba", "save_num_checkpoints_to_keep=1", "autoresume=false"]
        figures = {"cpus": os.cpu_count(), "model_name": opts.model_name, "date": time.strftime("%Y-%m-%d")}
        figures["batches_per_save"] = opts.batches_per_save
        for name, background in (("synchronous", False), ("background", True)):
            server.client().create_bucket(Bucket=name)
            figures[name] = _run(
                [*common, f"save_folder=s3://{name}/run"], background, opts.batches_per_save, opts.saves
            )
            print(name, figures[name], flush=True)
        sync, back = figures["synchronous"]["median_held_s"], figures["background"]["median_held_s"]
        figures["ratio_background_to_synchronous"] = round(back / sync, 3)
        Path(opts.out).write_text(json.dumps(figures, indent=1) + "\n")
        print(
            "held up per save: synchronous",
            sync,
            "s, background",
            back,
            "s, ratio",
            figures["ratio_background_to_synchronous"],
        )
    finally:
        server.stop(grace=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
