"""``data.py inspect``: what an MDS dataset holds (count, columns, score ranges) and a PNG grid of samples."""

from __future__ import annotations

import math
import textwrap

import numpy as np
from PIL import Image, ImageDraw, ImageOps
from streaming import StreamingDataset

from diffusion.data import buckets, shards
from diffusion.data.bad_samples import BadSample
from diffusion.data.bucket_split import bucket_counts, histogram
from diffusion.data.columns import (
    CAPTION_COLUMNS,
    IMAGE_COLUMNS,
    ORIGINAL_HEIGHT,
    ORIGINAL_WIDTH,
    dataset_columns,
    find_column,
    fixed_shape,
)
from diffusion.data.filters import check_filter_columns, passes
from diffusion.data.transforms import decode

TILE, COLS, TEXT_LINES, WRAP = 224, 4, 4, 34


def _grid(samples: list[tuple[Image.Image | None, str]], path: str) -> None:
    rows = math.ceil(len(samples) / COLS)
    line = 12
    cell_h = TILE + TEXT_LINES * line + 8
    sheet = Image.new("RGB", (COLS * TILE, rows * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (image, caption) in enumerate(samples):
        x, y = (i % COLS) * TILE, (i // COLS) * cell_h
        if image is None:
            draw.text((x + 8, y + TILE // 2), "(does not decode)", fill="red")
        else:
            image = ImageOps.contain(image, (TILE, TILE))
            sheet.paste(image, (x + (TILE - image.width) // 2, y + (TILE - image.height) // 2))
        for j, text in enumerate(textwrap.wrap(caption, WRAP)[:TEXT_LINES]):
            draw.text((x + 4, y + TILE + 4 + j * line), text, fill="black")
    sheet.save(path)


def inspect(
    src: str, *, cache: str | None = None, grid: str | None = None, n: int = 16, filters=(), scan: int = 10_000
) -> dict:
    """Prints a summary; ``grid``: write a PNG of ``n`` samples spread over the dataset with captions.
    Score ranges and filter pass rates are over the first ``scan`` samples."""
    index = buckets.read_index(src)
    if index is not None:  # a bucketed dataset: its buckets, then each is an MDS dataset of its own
        counts = {buckets.parse_name(n): index["samples"][n] for n in index["buckets"]}
        print(f"{src}: aspect-ratio buckets (data.py bucket), {sum(counts.values()):,} samples in {len(counts)}:")
        print(histogram(counts))
        print(f"  inspect one with: python data.py inspect {src.rstrip('/')}/{index['buckets'][0]}")
        return {"samples": sum(counts.values()), "buckets": index["samples"]}
    remote, local = shards.source(src, cache)
    with shards.opening_dataset(src):
        ds = StreamingDataset(remote=remote, local=local)
    shards.check_shards(ds.shards, src)
    columns = dataset_columns(ds.shards, src)
    total = ds.num_samples
    size = _print_contents(src, ds, columns)
    report = {"samples": total, "shards": len(ds.shards), "bytes": size, "columns": columns}
    count = min(total, scan)
    numeric = [c for c, e in columns.items() if e.startswith(("int", "float"))]
    if count and (numeric or filters):
        check_filter_columns(list(filters), columns, src)
        kept = _print_ranges(ds, numeric, list(filters), count, total)
        if filters:
            report["pass_rate"] = kept / count
    if grid:
        image_col, caption_col = find_column(columns, IMAGE_COLUMNS), find_column(columns, CAPTION_COLUMNS)
        if image_col is None:
            print(f"  no grid: {src} holds no images (columns: {', '.join(columns)})")
        else:
            cells = _grid_cells(ds, image_col, caption_col, np.linspace(0, total - 1, min(n, total)).round())
            _grid(cells, grid)
            print(f"  grid of {len(cells)} samples with captions: {grid}")
            report["grid"] = grid
    return report


def _print_contents(src: str, ds: StreamingDataset, columns: dict[str, str]) -> int:
    """Prints the sample and shard counts, the size, and each column with its encoding; returns the bytes."""
    size = sum(s.raw_data.bytes for s in ds.shards)
    print(
        f"{src}: {ds.num_samples:,} samples in {len(ds.shards)} shards, {size / 2**20:,.1f} MiB"
        + (f" ({ds.shards[0].compression} compressed)" if ds.shards and ds.shards[0].compression else "")
    )
    for name, enc in columns.items():
        shape = fixed_shape(enc)
        each = f"  ({np.prod(shape) * np.dtype(enc.split(':')[1]).itemsize / 1024:.1f} KiB per sample)" if shape else ""
        print(f"  {name:<20} {enc}{each}")
    return size


def _print_ranges(ds: StreamingDataset, numeric: list[str], filters: list, count: int, total: int) -> int:
    """Over the first ``count`` samples: prints each numeric column's range and the filters' pass rate;
    returns how many samples pass the filters."""
    values = {c: [] for c in numeric}
    kept = 0
    for i in range(count):
        sample = ds.get_item(i)
        kept += passes(filters, sample)
        for c in numeric:
            values[c].append(float(sample[c]))
    scanned = f"the first {count:,}" if count < total else f"all {count:,}"
    if ORIGINAL_WIDTH in values and ORIGINAL_HEIGHT in values:
        print(f"  aspect-ratio buckets of {scanned} samples (data.py bucket writes them):")
        print(histogram(bucket_counts(values[ORIGINAL_WIDTH], values[ORIGINAL_HEIGHT])))
    for c, v in values.items():
        a = np.asarray(v)
        known = a[~np.isnan(a)]
        stats = f"min {known.min():g}, mean {known.mean():g}, max {known.max():g}" if known.size else "no values"
        print(
            f"  {c:<20} {stats}"
            + (f", {a.size - known.size:,} NaN (missing)" if known.size < a.size else "")
            + f"  ({scanned} samples)"
        )
    if filters:
        print(
            f"  filters {' '.join(map(str, filters))}: {kept:,} of {scanned} samples pass ({100 * kept / count:.1f}%)"
        )
    return kept


def _grid_cells(ds: StreamingDataset, image_col: str, caption_col: str | None, picks) -> list:
    """(image, or None when it does not decode; caption) of the samples at ``picks``."""
    cells = []
    for i in picks:
        sample = ds.get_item(int(i))
        try:
            image = decode(sample[image_col])
        except BadSample:
            image = None
        cells.append((image, str(sample.get(caption_col, ""))))
    return cells
