"""``data.py bucket``: an image-caption MDS dataset -> a bucketed one (one MDS dataset per aspect ratio).

Every sample is copied as it is (image bytes, caption, metadata) into the folder of the bucket nearest its
aspect ratio (data/buckets.py): from the ``original_width``/``original_height`` columns that convert writes,
else from the stored image's header. Nothing is decoded or re-encoded. ``buckets.json`` is written last, so a
split cut short is redone by the same command; a finished one is left as it is.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

from streaming import MDSWriter, StreamingDataset

from diffusion import object_store
from diffusion.data import buckets, shards
from diffusion.data.bad_samples import BadSample
from diffusion.data.columns import IMAGE_COLUMNS, ORIGINAL_HEIGHT, ORIGINAL_WIDTH, dataset_columns, find_column
from diffusion.data.transforms import probe
from diffusion.errors import UsageError


def _size(sample: dict, image_column: str, sized: bool) -> tuple[int, int] | None:
    """(width, height) of a sample: its stored original size, else its image header's; None when unreadable."""
    if sized and sample[ORIGINAL_WIDTH] > 0 and sample[ORIGINAL_HEIGHT] > 0:
        return int(sample[ORIGINAL_WIDTH]), int(sample[ORIGINAL_HEIGHT])
    try:
        w, h, _ = probe(sample[image_column])
    except BadSample:
        return None
    return w, h


def split_buckets(
    src: str,
    out: str,
    *,
    cache: str | None = None,
    compression: str | None = None,
    shard_size: str = "64mb",
    aspects=buckets.ASPECTS,
) -> dict:
    """Copy every sample of ``src`` into ``out/<bucket>/``; returns the samples per bucket (and unreadable)."""
    done = buckets.read_buckets(out, "OUT")
    if done is not None:
        print(f"{out}: already bucketed ({buckets.BUCKETS_FILE} is there); nothing to do")
        return {"buckets": {buckets.name(a): None for a in done}, "unreadable": 0}
    if buckets.read_buckets(src, "SRC") is not None:
        raise UsageError(f"{src} is bucketed already ({buckets.BUCKETS_FILE}); train on it as it is")
    remote, local = shards.source(src, cache)
    with shards.opening_dataset(src):
        ds = StreamingDataset(remote=remote, local=local)
    shards.check_shards(ds.shards, src)
    columns = dataset_columns(ds.shards, src)
    image_column = find_column(columns, IMAGE_COLUMNS)
    if image_column is None:
        raise UsageError(f"{src} holds no images (columns: {', '.join(columns)}); bucket an image-caption dataset")
    sized = ORIGINAL_WIDTH in columns and ORIGINAL_HEIGHT in columns
    if not object_store.is_remote(out):
        for aspect in aspects:  # parts of a split cut short
            shutil.rmtree(os.path.join(out, buckets.name(aspect)), ignore_errors=True)
    writers: dict[tuple[int, int], MDSWriter] = {}
    counts: Counter = Counter()
    unreadable = 0
    try:
        for i in range(ds.num_samples):
            sample = ds.get_item(i)
            size = _size(sample, image_column, sized)
            if size is None:
                unreadable += 1
                continue
            aspect = buckets.nearest_aspect(*size, aspects=aspects)
            if aspect not in writers:
                writers[aspect] = MDSWriter(
                    out=buckets.location_of(out, buckets.name(aspect)),
                    columns=columns,
                    compression=compression,
                    size_limit=shard_size,
                    exist_ok=True,
                )
            writers[aspect].write(sample)
            counts[aspect] += 1
    finally:
        for writer in writers.values():
            writer.finish()
    ordered = {a: counts[a] for a in aspects if counts[a]}
    buckets.write_buckets_file(out, ordered)
    _report(src, out, ordered, unreadable)
    return {"buckets": {buckets.name(a): n for a, n in ordered.items()}, "unreadable": unreadable}


def _report(src: str, out: str, counts: dict, unreadable: int) -> None:
    total = sum(counts.values())
    print(
        f"{src} -> {out}: {total:,} samples in {len(counts)} buckets"
        + (f", {unreadable:,} unreadable" if unreadable else "")
    )
    print(histogram(counts))


def bucket_counts(widths, heights) -> dict[tuple[int, int], int]:
    """Samples per bucket (in table order, empty ones left out) of these sizes; unknown sizes (0, NaN) skipped."""
    counts = Counter(
        buckets.nearest_aspect(w, h) for w, h in zip(widths, heights) if w > 0 and h > 0 and w == w and h == h
    )
    return {a: counts[a] for a in buckets.ASPECTS if counts[a]}


def histogram(counts: dict[tuple[int, int], int], width: int = 40) -> str:
    """One line per bucket: its ratio, its samples and a bar (data.py inspect and bucket print it)."""
    most = max(counts.values(), default=0) or 1
    total = sum(counts.values()) or 1
    return "\n".join(
        f"  {buckets.name(a):>5} {n:>9,} {100 * n / total:5.1f}% {'#' * max(1, round(width * n / most))}"
        for a, n in counts.items()
    )
