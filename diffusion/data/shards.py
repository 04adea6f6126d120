"""Where MDS datasets live: local directories or any URL Streaming reads and writes (s3://, gs://, oci://...).

A dataset that ``data.py`` writes is a set of parts, ``OUT/<part>/`` (one per input shard for convert,
one per range of samples for precompute), each written by one ``MDSWriter``, plus ``OUT/index.json``
merged from the parts' indexes by Streaming's ``merge_index``. A part is finished once its own
``index.json`` exists (``MDSWriter`` writes it last), which is what makes a re-run skip finished work.
A local part is written in a scratch folder of its own, ``OUT/.partial-<part>/``, and moved to
``OUT/<part>/`` when finished: a folder of OUT is replaced only when it holds nothing but the shards of an
unfinished part, so a folder of the user's that shares a part's name is never written into or deleted.
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
    return read_document(root, INDEX, "MDS index", REWRITE)


def read_document(root: str, name: str, what: str, fix: str) -> dict | None:
    """The parsed JSON file ``name`` under ``root`` (local or remote), or None when there is none."""
    path = join(root, name)
    if not is_remote(root):
        if not os.path.isfile(path):
            return None
        return read_json(path, what, fix)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            CloudDownloader.direct_download(path, os.path.join(tmp, name))
        except Exception as e:  # Streaming's S3 downloader raises botocore's 404, others FileNotFoundError
            if object_store.is_missing(e):
                return None
            raise UsageError(f"{path}: {object_store.problem(e, path)}") from None
        return read_json(os.path.join(tmp, name), what, fix, shown=path)


def write_document(root: str, name: str, document: dict) -> None:
    """``document`` as the JSON file ``name`` under ``root`` (local: written whole, then moved into place)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
        if is_remote(root):
            object_store.upload(path, join(root, name))
        else:
            os.makedirs(root, exist_ok=True)
            shutil.move(path, join(root, name))


def entries(root: str) -> list[str]:
    """The names directly under ``root``: a local folder's entries (none when it does not exist), an s3://
    folder's objects and subfolders; other stores cannot be listed here (none)."""
    if not is_remote(root):
        return sorted(os.listdir(root)) if os.path.isdir(root) else []
    if object_store.split(root)[0] != "s3":
        return []
    found = object_store.retrying(lambda: object_store.sizes(root), f"list {root}")
    return sorted({name.split("/")[0] for name in found})


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


SCRATCH = ".partial-"  # a local part is written in OUT/.partial-<part>/, then moved to OUT/<part>/
PART_FILE = re.compile(r"(shard\.\d+\.mds(\.\w+)?|index\.json)")  # what MDSWriter writes into a part


def check_in_the_way(out: str, names: list[str]) -> None:
    """A UsageError when a local ``OUT/<name>`` that a part would replace is not an unfinished part: anything
    but a folder of MDS shard files alone (as an interrupted run of an older version left them)."""
    for name in names if not is_remote(out) else ():
        path = join(out, name)
        if not os.path.lexists(path):
            continue
        if os.path.islink(path) or not os.path.isdir(path) or not all(map(PART_FILE.fullmatch, os.listdir(path))):
            raise UsageError(
                f"{path} is in the way of part {name!r} and is not one this tool wrote (it holds more than MDS "
                "shards); move it out of OUT, or write into another OUT"
            )


def _place_part(out: str, name: str, scratch: str) -> None:
    """Move a finished local part from its scratch folder to ``OUT/<name>``, replacing only an unfinished part."""
    path = join(out, name)
    try:
        check_in_the_way(out, [name])
    except UsageError:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.rename(scratch, path)


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
    scratch = None if is_remote(out) else join(out, SCRATCH + name)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)  # this tool's own scratch, left by an interrupted run
    writer = MDSWriter(
        out=scratch or join(out, name), columns=columns, compression=compression, size_limit=shard_size, exist_ok=True
    )
    n = 0
    try:
        for row in rows:
            writer.write(row)
            n += 1
    except BaseException:
        writer.cancel_future_jobs()  # MDSWriter's __exit__ would write the index of a partial part
        shutil.rmtree(writer.local, ignore_errors=True)  # the scratch, or the local copy of a remote part
        raise
    writer.finish()
    if scratch:
        _place_part(out, name, scratch)
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
