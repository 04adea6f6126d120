"""``data.py bench``: how many samples per second the training loader delivers from an MDS dataset.

It times the exact path training uses (``StreamingDataLoader`` over the same dataset classes, shuffled,
collated into batches) for each requested number of workers, after a warm-up that covers worker start
and first shard reads. Image datasets are decoded, cropped, resized and tokenized at ``image_size``;
latent datasets are read and converted to fp32 tensors.

Besides samples per wall-clock second it reports samples per CPU-second spent by the loader's processes
(main + workers): on a busy or small machine the wall-clock rate says how busy the machine was, the
CPU-second rate says what one dedicated core delivers, which is what sizes workers on a GPU node.

A remote dataset (s3://...) with a cold cache is first downloaded whole into the cache by Streaming's own
shard download (``prepare_shard``, ``DOWNLOAD_THREADS`` at a time), timed on its own: the download rate
(MiB/s, shards/s) is reported apart from the decoding rate, which is then timed on the local copy.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch
from streaming import StreamingDataLoader

from diffusion.batch import TEXT_EMBEDS
from diffusion.data import buckets, shards
from diffusion.data.loaders import loader_kwargs, size_conditioning, streaming_dataset, token_lengths
from diffusion.errors import UsageError
from diffusion.object_store import is_remote


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and its live children (the loader's workers)."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


DOWNLOAD_THREADS = 8


def _tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _download(dataset, src: str, local: str) -> dict | None:
    """Every shard of ``dataset`` not in its cache yet, downloaded and timed; None when the cache was warm."""
    before, start = _tree_bytes(local), time.perf_counter()
    with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        list(pool.map(dataset.prepare_shard, range(dataset.num_shards)))
    seconds, got = time.perf_counter() - start, _tree_bytes(local) - before
    if got <= 0:
        return None
    row = {
        "download_mib": round(got / 2**20, 2),
        "download_seconds": round(seconds, 2),
        "download_mib_per_sec": round(got / 2**20 / seconds, 1),
        "download_shards_per_sec": round(dataset.num_shards / seconds, 1),
    }
    print(
        f"bench: downloaded {dataset.num_shards} shards, {row['download_mib']:,} MiB, from {src} into {local} in "
        f"{row['download_seconds']} s: {row['download_mib_per_sec']:,} MiB/s, {row['download_shards_per_sec']:,} "
        f"shards/s ({DOWNLOAD_THREADS} at a time); the decoding rates below read that local copy"
    )
    return row


def _release(dataset) -> None:
    """Stop the background threads of the epoch a loader left unfinished in this process (Streaming stops
    them when the next epoch starts), so the dataset, and its claim on the local directory, can go before
    the next worker count builds its own."""
    iterator = getattr(dataset, "_iterator", None)  # Streaming 0.13's per-epoch state
    if iterator is not None:
        iterator.exit()


def _time_loader(loader, batches: int, warmup: int) -> tuple[int, float, float]:
    """(samples, wall seconds, CPU seconds of the loader processes) over ``batches`` batches after
    ``warmup``, running more epochs when needed."""
    seen, samples, start, cpu = 0, 0, None, None
    while True:
        got_any = False
        for batch in loader:
            got_any = True
            if seen == warmup:
                start, cpu = time.perf_counter(), _cpu_seconds()
            elif seen > warmup:
                samples += len(next(iter(batch.values())))
            seen += 1
            if seen > warmup + batches:
                return samples, time.perf_counter() - start, _cpu_seconds() - cpu
        if not got_any:
            raise UsageError("the dataset yields no full batch; lower --batch_size")


def bench(
    src: str,
    *,
    image_size: int = 256,
    num_workers=(1,),
    batch_size: int = 64,
    batches: int = 20,
    warmup: int = 3,
    model_name: str = "sd-tiny",
    cache: str | None = None,
    crop: str = "center",
    hflip: bool = False,
    results: str | None = None,
) -> list[dict]:
    # a bucketed dataset (data.py bucket) is read as training reads it: a stream per bucket, a bucket per batch,
    # each at its own size (a bucket smaller than the batch is refused there); its kind is its first bucket's
    bucketed = buckets.read_index(src, "DIR")
    if bucketed and not is_remote(src):
        remote, local = None, src
    else:
        remote, local = shards.source(src, cache, key="DIR")
    first = buckets.location_of(src, bucketed["buckets"][0]) if bucketed else src
    index = shards.read_index(first) or {}
    precomputed = TEXT_EMBEDS in shards.index_columns(index)
    if not bucketed:
        _check_batch_fits(src, index, batch_size)
    tokenizers, options = (None, {}) if precomputed else _model_inputs(model_name, image_size, crop, hflip)
    rows, downloaded = [], None
    for workers in num_workers:
        dataset = streaming_dataset(
            remote=remote,
            local=local,
            key="DIR",
            precomputed=precomputed,
            image_size=image_size,
            tokenizers=tokenizers,
            shuffle=True,
            batch_size=batch_size,
            **options,
        )
        if remote and downloaded is None:
            downloaded = _download(dataset, src, local) or {}
        loader = StreamingDataLoader(dataset, **loader_kwargs(workers, batch_size, drop_last=True))
        timed = _time_loader(loader, batches, warmup)
        rows.append(_row(src, None if precomputed else image_size, workers, batch_size, timed, downloaded))
        rows[-1]["buckets"] = len(bucketed["buckets"]) if bucketed else None
        _print_row(rows[-1])
        del loader  # and its workers
        _release(dataset)
        del dataset
        gc.collect()
    if results:
        with open(results, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows


def _check_batch_fits(src: str, index: dict, batch_size: int) -> None:
    """An error, not a smaller batch: the batch size is part of what is measured."""
    size = shards.index_samples(index)
    if index and batch_size > size:
        raise UsageError(
            f"--batch_size {batch_size} is larger than the dataset: {src} has {size:,} samples"
            + (f"; the largest batch that fits is {size}, pass --batch_size {size} or less" if size else "")
        )


def _model_inputs(model_name: str, image_size: int, crop: str, hflip: bool) -> tuple[dict, dict]:
    """The tokenizers an image-caption dataset is read with and the per-sample work training does for that
    model (its token lengths, SDXL's size keys), so the rate measured is the one training gets."""
    from diffusion.models.build import build_model

    built = build_model(model_name)
    return built.tokenizers, dict(
        crop=crop,
        hflip=hflip,
        token_lengths=token_lengths(built.model, image_size),
        size_conditioning=size_conditioning(built.model, image_size),
    )


def _row(
    src: str, image_size: int | None, workers: int, batch_size: int, timed: tuple, downloaded: dict | None
) -> dict:
    """One results row; ``image_size`` None for a latents dataset; ``timed``: (samples, seconds, CPU-seconds)."""
    samples, seconds, cpu = timed
    rate = samples / seconds
    return {
        "dataset": src,
        "kind": "latents" if image_size is None else "images",
        "image_size": image_size,
        "num_workers": workers,
        "batch_size": batch_size,
        "samples_per_sec": round(rate, 1),
        "samples_per_sec_per_worker": round(rate / max(workers, 1), 1),
        "ms_per_batch": round(1000 * seconds * batch_size / samples, 2),
        "samples_timed": samples,
        "samples_per_cpu_sec": round(samples / cpu, 1) if cpu > 0 else None,
        "load_average": round(os.getloadavg()[0], 2),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        **(downloaded or {}),
    }


def _print_row(row: dict) -> None:
    what = row["kind"] + (f" in {row['buckets']} buckets" if row.get("buckets") else "")
    what += "" if row["image_size"] is None else f" at {row['image_size']} px"
    workers = row["num_workers"]
    print(
        f"bench: {what}, {workers} worker{'' if workers == 1 else 's'}, batch {row['batch_size']}: "
        f"{row['samples_per_sec']:,.0f} samples/s ({row['samples_per_sec_per_worker']:,.0f} per worker), "
        f"{row['ms_per_batch']} ms per batch; {row['samples_per_cpu_sec'] or 0:,.0f} samples per CPU-second "
        f"of the loader processes; {row['samples_timed']:,} samples timed, load average {row['load_average']}"
    )
