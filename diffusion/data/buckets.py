"""Aspect-ratio buckets: images trained at (about) their own shape instead of square crops.

A bucket is an aspect ratio from ``ASPECTS`` (diffusion/aspects.py: data, as SDXL, PixArt and SANA use: 1:4 to 4:1). At a target
resolution R and a model's size multiple f, the bucket's pixel size is the one of its ratio with about R x R
pixels, each side a multiple of f (``bucket_size``), so one bucketed dataset serves every resolution phase
(256 px, then 512 px). Each sample belongs to the bucket nearest its aspect ratio in log space
(``nearest_aspect``, from the stored ``original_width``/``original_height``, else the image's own size).

On disk a bucketed dataset is a folder of MDS datasets, one per bucket (``WxH`` ratio names such as ``4x3``),
with ``buckets.json`` listing them (``data.py bucket`` writes it from any image-caption MDS dataset). Training
reads each bucket as one Streaming stream with ``batching_method="per_stream"``: every global batch comes from
one bucket, so every rank holds the same shape, and Streaming's order and mid-epoch resumption are kept. At a
bucket's edge the samples that do not fill a whole global batch are left out of that epoch (Streaming drops
them and logs it), on every rank alike: every rank runs the same number of batches each epoch, on any number
of nodes (tests/test_slurm_buckets.py). On N nodes Streaming pads a bucket to a multiple of N with up to N - 1
of its own samples, so a few may be read twice in an epoch.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

from diffusion import object_store
from diffusion.aspects import ASPECTS, name, names_of, parse_name  # noqa: F401 - the table, used as buckets.*
from diffusion.errors import UsageError

BUCKETS_FILE = "buckets.json"


def nearest_aspect(width: int, height: int, aspects=ASPECTS) -> tuple[int, int]:
    """The bucket whose ratio is nearest width / height in log space (1:2 and 2:1 are as far from 1:1)."""
    ratio = math.log(width / height)
    return min(aspects, key=lambda a: abs(math.log(a[0] / a[1]) - ratio))


def bucket_size(aspect: tuple[int, int], resolution: int, factor: int) -> tuple[int, int]:
    """(height, width) in pixels of a bucket at a resolution: about resolution^2 pixels, each side a
    positive multiple of ``factor`` (the model's VAE factor x its own downsampling or patching)."""
    ratio = aspect[0] / aspect[1]
    width = max(factor, round(resolution * math.sqrt(ratio) / factor) * factor)
    height = max(factor, round(resolution / math.sqrt(ratio) / factor) * factor)
    return height, width


def _remote_file(location: str) -> str:
    return f"{location.rstrip('/')}/{BUCKETS_FILE}"


def read_index(location: str | None, key: str = "SRC") -> dict | None:
    """buckets.json of a bucketed dataset (local directory or remote URL): its bucket names and samples per
    bucket; None for a plain MDS dataset. ``key`` names the location in the one line a store that does not
    answer gives (checked first: a download would retry for minutes)."""
    if not location:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(location, BUCKETS_FILE)
        if object_store.is_remote(location):
            object_store.check(location, key)
            try:
                path = object_store.download(_remote_file(location), os.path.join(tmp, BUCKETS_FILE))
            except FileNotFoundError:
                return None
        elif not os.path.isfile(path):
            return None
        with open(path) as f:
            text = f.read()
    try:
        index = json.loads(text)
        [parse_name(n) for n in index["buckets"]]
        return index
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{location}: {BUCKETS_FILE} is damaged; write the buckets again (data.py bucket)") from None


def location_of(root: str, bucket: str) -> str:
    """A bucket's dataset inside a bucketed dataset (local directory or remote URL)."""
    return f"{root.rstrip('/')}/{bucket}" if object_store.is_remote(root) else os.path.join(root, bucket)


def read_buckets(location: str | None, key: str = "SRC") -> list[tuple[int, int]] | None:
    """The buckets of a bucketed dataset, None for a plain MDS dataset."""
    index = read_index(location, key)
    return None if index is None else [parse_name(n) for n in index["buckets"]]


def write_buckets_file(out: str, counts: dict[tuple[int, int], int]) -> None:
    """buckets.json: the bucket folders in ``out`` and their sample counts (written last: its presence says
    the split finished)."""
    text = json.dumps(
        {"buckets": [name(a) for a in counts], "samples": {name(a): n for a, n in counts.items()}}, indent=1
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(out if not object_store.is_remote(out) else tmp, BUCKETS_FILE)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        if object_store.is_remote(out):
            object_store.upload(path, _remote_file(out))


def whole_global_batches(
    samples: int, nodes: int, ranks_per_node: int, workers: int, batch: int, canonical: int
) -> int:
    """The whole global batches Streaming's ``per_stream`` batching makes of one bucket of ``samples`` in an epoch,
    computed as it does (its own partition of the bucket over the nodes, ranks and workers, then the global batches
    with no sample missing). A bucket that gives none is left out of the run (``usable``): Streaming 0.13 raised
    on it, a numpy broadcast error on 3 or more nodes ("could not broadcast input array from shape (1,0)") or its
    own "does not have an adequate number of samples" otherwise, for buckets that need not be smaller than one
    global batch (5 samples on 4 nodes of one rank, batch 1)."""
    import numpy as np
    from streaming.base.partition import get_partitions

    try:
        partition = get_partitions("relaxed", samples, canonical, nodes, ranks_per_node, workers, batch, 0, None)
    except ValueError:  # the same broadcast error, raised while partitioning
        return 0
    global_batches = partition.transpose(3, 2, 0, 1, 4).reshape(-1, batch * ranks_per_node * nodes)
    return int(np.count_nonzero(global_batches.min(axis=1) >= 0))


def usable(counts: dict[str, int], nodes: int, ranks_per_node: int, workers: int, batch: int, canonical: int):
    """(the buckets of ``counts`` {name: samples} that give whole global batches on this world, the others)."""
    import warnings

    with warnings.catch_warnings():  # Streaming's warnings on small partitions: the line the caller prints says it
        warnings.simplefilter("ignore")
        give = {n: whole_global_batches(c, nodes, ranks_per_node, workers, batch, canonical) for n, c in counts.items()}
    return [n for n in counts if give[n]], [n for n in counts if not give[n]]
