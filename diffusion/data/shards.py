"""Where MDS datasets live: local directories or any URL Streaming reads and writes (s3://, gs://, oci://...).

A dataset that ``data.py`` writes is a set of parts, ``OUT/<part>/`` (one per input shard for convert,
one per range of samples for precompute), each written by one ``MDSWriter``, plus ``OUT/index.json``
merged from the parts' indexes by Streaming's ``merge_index``. A part is finished once its own
``index.json`` exists (``MDSWriter`` writes it last), which is what makes a re-run skip finished work.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import tempfile
from contextlib import contextmanager

from streaming import MDSWriter
from streaming.base.storage.download import CloudDownloader
from streaming.base.util import merge_index

from diffusion import object_store
from diffusion.data import shared_memory
from diffusion.errors import UsageError, spell
from diffusion.file_checks import json_problem, read_json
from diffusion.object_store import is_remote

INDEX = "index.json"
REWRITE = "copy the dataset again, or convert it again (data.py convert)"


def join(root: str, *names: str) -> str:
    return "/".join([root.rstrip("/"), *names]) if is_remote(root) else os.path.join(root, *names)


def read_index(root: str) -> dict | None:
    """The parsed ``index.json`` under ``root`` (local or remote), or None when there is none."""
    path = join(root, INDEX)
    if not is_remote(root):
        if not os.path.isfile(path):
            return None
        return read_json(path, "MDS index", REWRITE)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            CloudDownloader.direct_download(path, os.path.join(tmp, INDEX))
        except Exception as e:  # Streaming's S3 downloader raises botocore's 404, others FileNotFoundError
            if object_store.is_missing(e):
                return None
            raise UsageError(f"{path}: {object_store.problem(e, path)}") from None
        return read_json(os.path.join(tmp, INDEX), "MDS index", REWRITE, shown=path)


def index_columns(index: dict) -> dict[str, str]:
    shards = index.get("shards") or []
    return dict(zip(shards[0]["column_names"], shards[0]["column_encodings"])) if shards else {}


def index_samples(index: dict) -> int:
    return sum(s["samples"] for s in index.get("shards") or [])


def finished_parts(out: str, names: list[str], columns: dict[str, str]) -> set[str]:
    """The parts of ``out`` already written, checked to hold the columns about to be written."""
    done = set()
    for name in names:
        index = read_index(join(out, name))
        if index is None:
            continue
        have = index_columns(index)
        if have and have != columns:
            raise UsageError(
                f"{join(out, name)} was written with columns {have}, this run writes {columns} "
                "(another source, model or --image_size?); use a new OUT directory"
            )
        done.add(name)
    return done


def clear_part(out: str, name: str) -> None:
    """Drop a local part left half-written by an interrupted run (a remote one is overwritten)."""
    if not is_remote(out):
        shutil.rmtree(join(out, name), ignore_errors=True)


def write_part(
    out: str,
    name: str,
    columns: dict[str, str],
    rows,
    *,
    compression: str | None = None,
    shard_size: int | str = "64mb",
) -> int:
    """Write the dicts of ``rows`` as part ``name`` of ``out``; returns how many. The part's index.json is
    written only when ``rows`` ends normally, so an interrupted part is redone by the next run."""
    clear_part(out, name)
    writer = MDSWriter(
        out=join(out, name), columns=columns, compression=compression, size_limit=shard_size, exist_ok=True
    )
    n = 0
    try:
        for row in rows:
            writer.write(row)
            n += 1
    except BaseException:
        writer.cancel_future_jobs()  # MDSWriter's __exit__ would write the index of a partial part
        if is_remote(out):  # its local copy of a part on its way up (finish() removes it when all went well)
            shutil.rmtree(writer.local, ignore_errors=True)
        raise
    writer.finish()
    return n


def merge_parts(out: str, names: list[str]) -> dict:
    """Write ``OUT/index.json`` over the finished parts among ``names``; returns the merged index."""
    finished = [name for name in names if read_index(join(out, name)) is not None]
    if not is_remote(out) and os.path.isfile(join(out, INDEX)):
        os.remove(join(out, INDEX))  # merge_index moves its result into place and will not overwrite
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)  # merge_index announces its temporary folder as a warning
    try:
        merge_index([join(out, name, INDEX) for name in finished], out, keep_local=True)
    finally:
        logging.disable(level)
    return read_index(out) or {"shards": []}


def source(src: str, cache: str | None, key: str = "SRC") -> tuple[str | None, str]:
    """(remote, local) for a StreamingDataset over ``src``: a local dataset is read in place, a remote
    one (its store checked first) through ``cache`` (default: a new temporary directory, removed at exit)."""
    if is_remote(src):
        object_store.check(src, key)
        if cache is None:  # removed at exit: a download cache nobody asked to keep
            cache = tempfile.mkdtemp(prefix="mds-cache-")
            atexit.register(shutil.rmtree, cache, True)
        return src, cache
    if not os.path.isfile(os.path.join(src, INDEX)):
        raise UsageError(f"{spell(key)} {src!r} is not an MDS dataset (no {INDEX}); make one with data.py convert")
    return None, src


@contextmanager
def opening_dataset(where: str):
    """Around ``StreamingDataset(...)``: a dataset without samples (Streaming's RuntimeError) and an
    index.json that is empty or not JSON (its JSONDecodeError, naming the local copy) become one-line
    UsageErrors. Call ``check_shards`` on the dataset next. Datasets are made one at a time on a node
    (shared_memory.registering)."""
    try:
        with shared_memory.registering():
            yield
    except RuntimeError as e:
        if "contains no samples" not in str(e):
            raise
        raise UsageError(
            f"{where}: the MDS dataset has no samples; convert some data into it first (data.py convert)"
        ) from None
    except json.JSONDecodeError as e:
        found = re.search(r"Index file at (.+?) is empty or corrupted", str(e))
        if not found:
            raise
        problem = json_problem(found[1]) if os.path.isfile(found[1]) else "not JSON"
        raise UsageError(f"{where}: {found[1]} is {problem}; {REWRITE}") from None


def check_remote_shards(shards, remote: str | None, where: str) -> None:
    """Every shard file of ``shards`` not in the local cache yet has, as an object under ``remote`` (s3://),
    the size its index.json gives, or a one-line UsageError naming the object: one listing, before any
    download (a cut object would otherwise be downloaded and read as garbage). A dataset on local disk (no
    remote, or a remote folder): every shard file is there, or one line naming the missing one."""
    if not is_remote(remote):
        _check_local_files(shards, remote, where)
        return
    if object_store.split(remote)[0] != "s3":
        return
    found = None
    for shard in shards:
        for raw, zipped in shard.file_pairs:  # the store holds the compressed form when there is one
            if any(i and os.path.isfile(os.path.join(shard.dirname, shard.split, i.basename)) for i in (raw, zipped)):
                continue
            info = zipped or raw
            if found is None:
                found = object_store.retrying(lambda: object_store.sizes(remote), f"list {remote}")
            name = "/".join(p for p in (shard.split, info.basename) if p)
            size = found.get(name)
            if size != info.bytes:
                what = "missing" if size is None else f"{size:,} bytes, its index.json says {info.bytes:,}"
                raise UsageError(f"{where}: shard object {join(remote, name)} is {what}; {REWRITE}")


def _check_local_files(shards, remote: str | None, where: str) -> None:
    for shard in shards:
        for raw, zipped in shard.file_pairs:
            names = [i.basename for i in (raw, zipped) if i]
            places = [shard.dirname] + ([remote] if remote else [])
            if not any(os.path.isfile(os.path.join(p, shard.split, n)) for p in places for n in names):
                path = os.path.join(remote or shard.dirname, shard.split, names[-1])
                raise UsageError(f"{where}: shard {path} is missing (its index.json lists it); {REWRITE}")


def check_shards(shards, where: str) -> None:
    """Every shard file of ``shards`` (a StreamingDataset's) that is on local disk has the size its
    index.json gives, or a one-line UsageError naming the file (a copy cut short reads as garbage or
    fails deep inside Streaming). Files not downloaded yet are checked as they are read (streaming.py)."""
    for shard in shards:
        for info in (info for pair in shard.file_pairs for info in pair if info):  # raw and compressed
            path = os.path.join(shard.dirname, shard.split, info.basename)
            size = os.path.getsize(path) if os.path.isfile(path) else info.bytes
            if size != info.bytes:
                what = (
                    "zero bytes"
                    if size == 0
                    else (
                        f"{'truncated' if size < info.bytes else 'the wrong size'}: "
                        f"{size:,} bytes, its index.json says {info.bytes:,}"
                    )
                )
                raise UsageError(f"{where}: shard {path} is {what}; {REWRITE}")
