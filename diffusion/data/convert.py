"""``data.py convert``: image-caption sources (folder, webdataset, parquet) -> MDS shards.

One reader per source format (sources.py) feeds one writer: every sample is decoded in full (so a
corrupt or truncated image is caught here, not hours into training), optionally shrunk to a maximum
shorter side and re-encoded as JPEG, and written with its caption and metadata (columns.py). Input
shards are converted in parallel, each into its own part of OUT; a re-run skips finished parts.
Problems are skipped and counted: samples (corrupt image, no caption, ...) and input shards (empty,
truncated); what was mended to keep a sample (a caption not in UTF-8...) is counted too; the counts and
first examples are printed at the end.

OUT belongs to one conversion: ``OUT/.convert.json`` records the source it is made from, written before
the first part. A re-run from the same source resumes; any other OUT that is not empty (another
conversion, another dataset, the user's files) is refused before anything is written, so one dataset
never swallows, hides or deletes another.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass

from tqdm import tqdm

from diffusion import object_store
from diffusion.data import shards
from diffusion.data.bad_samples import BadSample, SkipCounter, describe_error
from diffusion.data.columns import (
    CAPTION,
    IMAGE,
    KEY,
    KNOWN_SCORES,
    ORIGINAL_HEIGHT,
    ORIGINAL_WIDTH,
    image_caption_columns,
)
from diffusion.data.filters import passes
from diffusion.data.sources import (
    FORMATS,
    BadShard,
    Task,
    detect_format,
    find_scores,
    list_tasks,
    number,
    read,
    record_scores,
)
from diffusion.data.transforms import decode, probe, shrink
from diffusion.errors import UsageError

KEEP_FORMATS = ("JPEG", "PNG", "WEBP")  # stored as they came; anything else is re-encoded as JPEG
JPEG_QUALITY = 95
MANIFEST = ".convert.json"  # OUT's owner: the source this dataset is converted from
MAX_SIDE = 2**31 - 1  # an original_width/height past this is not a size


@dataclass(frozen=True)
class Options:
    fmt: str
    scores: tuple[str, ...]
    max_size: int | None = None
    filters: tuple = ()
    image_column: str | None = None
    caption_column: str | None = None
    compression: str | None = None
    shard_size: str = "64mb"


@dataclass
class PartResult:
    name: str
    written: int
    samples: SkipCounter  # skipped samples by reason
    shards: SkipCounter  # input-shard problems by reason
    notes: SkipCounter  # samples kept after a repair, by what was mended


def _size(meta: dict, key: str) -> int | None:
    value = number(meta.get(key))
    return int(value) if value is not None and 1 <= value <= MAX_SIDE else None


def _jpeg(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def convert_record(record, opts: Options) -> dict:
    """One source record -> one MDS row, or BadSample."""
    if record.problem:
        raise BadSample(*record.problem)
    if record.image is None:
        raise BadSample("missing_image", "no image file/bytes for this key")
    if not record.caption:
        raise BadSample("missing_caption", "no caption (.txt missing or empty, or a null caption)")
    width, height, fmt = probe(record.image)
    image = decode(record.image, min_side=opts.max_size)  # every pixel: truncation shows up here
    data = record.image
    if opts.max_size and min(width, height) > opts.max_size:
        data = _jpeg(shrink(image, opts.max_size))
    elif fmt not in KEEP_FORMATS:
        data = _jpeg(image)
    return {
        KEY: record.key,
        IMAGE: data,
        CAPTION: record.caption,
        ORIGINAL_WIDTH: _size(record.meta, ORIGINAL_WIDTH) or width,
        ORIGINAL_HEIGHT: _size(record.meta, ORIGINAL_HEIGHT) or height,
        **record_scores(record.meta, list(opts.scores), record.notes),
    }


_tick = None  # progress: called with a number of samples read (the bar, or a counter shared with the pool)


STORE_ENV = ("S3_", "AWS_", "GCS_", "GOOGLE_", "OCI_", "MOSAICML_")  # where the object store's clients look


def _init_worker(counter, store_env: dict) -> None:
    # A fork server's workers get the environment the server started with, which may predate the
    # credentials and endpoint set since (a notebook, a test): they get this process's, for writing to OUT.
    os.environ.update(store_env)

    def tick(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    global _tick
    _tick = tick


def _rows(task, opts: Options, result: PartResult):
    try:
        for i, record in enumerate(read(task, opts.fmt, opts.image_column, opts.caption_column)):
            if _tick is not None and i % 16 == 15:
                _tick(16)
            try:
                row = convert_record(record, opts)
            except BadSample as e:
                result.samples.add(e.reason, record.where, e.detail, log_it=False)
                continue
            for reason, detail in record.notes:
                result.notes.add(reason, record.where, detail, log_it=False)
            if not passes(opts.filters, row):
                result.samples.add("filtered", record.where, log_it=False)
                continue
            yield row
    except BadShard as e:
        result.shards.add(e.reason, task.path, e.detail, log_it=False)


def convert_part(task, out: str, opts: Options) -> PartResult:
    result = PartResult(task.name, 0, SkipCounter(), SkipCounter(), SkipCounter())
    result.written = shards.write_part(
        out,
        task.name,
        image_caption_columns(list(opts.scores)),
        _rows(task, opts, result),
        compression=opts.compression,
        shard_size=opts.shard_size,
    )
    if result.written == 0 and not result.samples.total and not result.shards.total:
        result.shards.add("empty_shard", task.path, "no samples in it", log_it=False)
    return result


def _run(todo, out: str, opts: Options, workers: int, bar: tqdm) -> list[PartResult]:
    global _tick
    if workers <= 1 or len(todo) <= 1:
        _tick = bar.update
        try:
            return [convert_part(task, out, opts) for task in todo]
        finally:
            _tick = None
    # Workers come from a fork server, not a fork of this process: a fork copies the locks of whatever
    # threads are running here (a logger's, a progress monitor's) and can deadlock in the child.
    # A worker that dies (out of memory, killed) fails the run with BrokenProcessPool instead of hanging.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    counter = ctx.Value("q", 0)
    with ProcessPoolExecutor(
        min(workers, len(todo)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(counter, {k: v for k, v in os.environ.items() if k.startswith(STORE_ENV)}),
    ) as pool:
        futures = [pool.submit(convert_part, task, out, opts) for task in todo]
        while wait(futures, timeout=0.5).not_done:
            bar.update(counter.value - bar.n)
        return [f.result() for f in futures]


def convert(
    src: str,
    out: str,
    *,
    fmt: str | None = None,
    workers: int = 1,
    max_size: int | None = None,
    filters=(),
    metadata=(),
    image_column: str | None = None,
    caption_column: str | None = None,
    compression: str | None = None,
    shard_size: str = "64mb",
    progress: bool = True,
) -> dict:
    """Convert ``src`` into the MDS dataset ``out``; prints a report and returns its figures."""
    start = time.time()
    object_store.check(out, "OUT")
    fmt, tasks = _tasks(src, fmt)
    _claim(out, src, fmt)
    wanted = tuple(KNOWN_SCORES) + tuple(m.lower() for m in metadata if m.lower() not in KNOWN_SCORES)
    scores = find_scores(tasks, fmt, wanted, image_column, caption_column)
    opts = Options(fmt, tuple(scores), max_size, tuple(filters), image_column, caption_column, compression, shard_size)
    columns = image_caption_columns(scores)
    done = shards.finished_parts(out, [t.name for t in tasks], columns)
    todo = [t for t in tasks if t.name not in done]
    shards.check_in_the_way(out, [t.name for t in todo])
    results = _run_with_bar(todo, out, opts, workers, progress)
    samples, bad_shards, notes = SkipCounter(), SkipCounter(), SkipCounter()
    for r in results:
        samples.update(r.samples)
        bad_shards.update(r.shards)
        notes.update(r.notes)
    index = shards.merge_parts(out, [t.name for t in tasks])
    report = {
        "format": fmt,
        "input_shards": len(tasks),
        "already_done": len(done),
        "converted": len(todo),
        "written": sum(r.written for r in results),
        "skipped": dict(samples.counts),
        "shard_problems": dict(bad_shards.counts),
        "mended": dict(notes.counts),
        "dataset_samples": shards.index_samples(index),
        "columns": columns,
        "seconds": round(time.time() - start, 1),
    }
    _print_report(report, out, samples, bad_shards, notes)
    if report["dataset_samples"] == 0:
        raise UsageError(
            f"no samples converted from {src!r} into {out!r}: skipped {samples.summary_counts() or 'none'}"
            f"; input shard problems: {bad_shards.summary_counts() or 'none'}"
        )
    return report


def _run_with_bar(todo: list[Task], out: str, opts: Options, workers: int, progress: bool) -> list:
    """Each task's result (_run), images counted on a progress bar on stderr (``progress``)."""
    bar = tqdm(
        total=None,
        unit="img",
        desc=f"convert {len(todo)} {opts.fmt} shards",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    results = _run(todo, out, opts, workers, bar)
    bar.update(max(0, sum(r.written + r.samples.total for r in results) - bar.n))
    bar.close()
    return results


def _tasks(src: str, fmt: str | None) -> tuple[str, list[Task]]:
    """The source's format (detected when not given) and its input files as tasks, or a UsageError."""
    fmt = fmt or detect_format(src)
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    tasks = list_tasks(src, fmt)
    if not tasks:
        raise UsageError(f"SRC {src!r} ({fmt}) holds no input files")
    return fmt, tasks


def _claim(out: str, src: str, fmt: str) -> None:
    """Make OUT this conversion's (a new or empty OUT) or find it is already (a re-run from the same source:
    resume), else a UsageError saying what OUT holds; before anything is written."""
    mine = {"source": src if "://" in src else os.path.abspath(src), "format": fmt}
    have = shards.read_document(out, MANIFEST, "convert's record", "convert into a new OUT")
    if have == mine:
        return
    index = shards.read_index(out)
    held = f"{shards.index_samples(index):,} samples in its index.json" if index else "not finished"
    if have is not None:
        raise UsageError(
            f"OUT {out!r} holds the conversion of {have.get('source')!r} ({have.get('format')}, {held}); convert "
            f"{src!r} into another OUT (a new or empty folder)"
        )
    if index is not None:
        raise UsageError(
            f"OUT {out!r} holds an MDS dataset ({held}) with no record of its source ({MANIFEST}: made by another "
            "tool or an older data.py); convert into another OUT (a new or empty folder)"
        )
    found = shards.entries(out)
    if found:
        listed = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise UsageError(f"OUT {out!r} is not empty (it holds {listed}); convert into a new or empty folder")
    try:
        shards.write_document(out, MANIFEST, mine)
    except OSError as e:  # OUT is a file, or under one, or in a folder this user may not write
        raise UsageError(f"OUT {out!r} cannot be written ({describe_error(e)}); choose another OUT") from None


def _print_report(report: dict, out: str, samples: SkipCounter, bad_shards: SkipCounter, notes: SkipCounter) -> None:
    """What was written, and what was skipped and why (samples, then input shards with problems)."""
    print(
        f"convert: {report['written']:,} samples from {report['converted']} {report['format']} input shards "
        f"written to {out} in {report['seconds']} s ({report['already_done']} shards already converted, "
        f"skipped); the dataset has {report['dataset_samples']:,} samples; columns: {', '.join(report['columns'])}"
    )
    print(
        f"convert: skipped {samples.total:,} sample{'' if samples.total == 1 else 's'}"
        + "".join(f"\n  {line}" for line in samples.report())
    )
    if notes.total:
        print(
            f"convert: mended and kept {notes.total:,} sample{'' if notes.total == 1 else 's'}"
            + "".join(f"\n  {line}" for line in notes.report())
        )
    if bad_shards.total:
        print(
            f"convert: {bad_shards.total} input shard{'' if bad_shards.total == 1 else 's'} with problems"
            + "".join(f"\n  {line}" for line in bad_shards.report())
        )
