"""Readers of image-caption sources, one per format, all yielding the same ``Record``s.

* folder: images (jpg, jpeg, png, webp) anywhere under a directory, each with a sidecar ``.txt`` caption
  and an optional ``.json`` of metadata (same stem);
* webdataset: tar shards as img2dataset writes them (``key.jpg``, ``key.txt``, ``key.json``): a
  directory of ``*.tar``, one tar, or a brace pattern such as ``/data/{00000..00099}.tar``;
* parquet: a directory of ``*.parquet`` or one file, with an image-bytes column (binary, or a struct with
  a ``bytes`` field as Hugging Face datasets write it), a caption column, and metadata columns.

The unit of work (and of resumption) is a ``Task``: one tar, one parquet file, or a chunk of a folder.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from diffusion.data.bad_samples import BadSample, describe_error
from diffusion.data.columns import CAPTION_COLUMNS, IMAGE_COLUMNS, KEY, score_name, scores_present
from diffusion.errors import UsageError

FORMATS = ("folder", "webdataset", "parquet")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
PARQUET_IMAGE_COLUMNS = (*IMAGE_COLUMNS, "img", "image_bytes")
PARQUET_CAPTION_COLUMNS = (*CAPTION_COLUMNS, "text", "prompt")
FOLDER_CHUNK = 10_000  # images per folder task


@dataclass
class Record:
    key: str
    image: bytes | None
    caption: str | None
    meta: dict
    where: str  # "<input shard>:<key>", for reports
    problem: tuple[str, str] | None = None  # (reason, detail) when the reader could not read the sample


@dataclass(frozen=True)
class Task:
    name: str  # the output part's directory name
    path: str  # tar / parquet file, or the folder
    files: tuple[str, ...] = field(default=())  # folder: this chunk's image paths, relative to path


class BadShard(BadSample):
    """An input shard that could not be read to its end (what was read before still counts)."""


# --- finding the input ---------------------------------------------------------------------------------
def expand_braces(pattern: str) -> list[str]:
    """``a{00..02}b`` -> a00b a01b a02b (zero padding kept); ``{x,y}`` alternatives; nested and repeated."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.groups()
        width = len(lo) if lo.startswith("0") else 0
        options = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        options = body.split(",")
    return [out for opt in options for out in expand_braces(head + opt + tail)]


def _listing(src: str, ext: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(src), "**", f"*.{ext}"), recursive=True))


def detect_format(src: str) -> str:
    if "{" in src or src.endswith((".tar", ".tar.gz", ".tgz")):
        return "webdataset"
    if src.endswith(".parquet"):
        return "parquet"
    if not os.path.isdir(src):
        raise UsageError(
            f"SRC {src!r} does not exist; pass a folder of images + captions, a folder of tar "
            "shards (img2dataset webdataset output), tar files as a brace pattern, or parquet"
        )
    if _listing(src, "tar"):
        return "webdataset"  # img2dataset also writes a metadata-only .parquet beside each tar
    if _listing(src, "parquet"):
        return "parquet"
    if any(_listing(src, ext) for ext in IMAGE_EXTS):
        return "folder"
    raise UsageError(
        f"SRC {src!r} holds no .tar, .parquet or image files ({', '.join(IMAGE_EXTS)}); pass "
        "--format if they are named otherwise"
    )


def _unique_names(paths: list[str], root: str) -> list[str]:
    """Part names from input paths: the relative path without extension, '/' -> '_'."""
    stems = [re.sub(r"\.(tar|tar\.gz|tgz|parquet)$", "", os.path.relpath(p, root)) for p in paths]
    names = [re.sub(r"[^\w.-]", "_", stem) for stem in stems]
    if len(set(names)) < len(names):
        names = [f"{i:05d}-{n}" for i, n in enumerate(names)]
    return names


def list_tasks(src: str, fmt: str) -> list[Task]:
    if fmt == "folder":
        if not os.path.isdir(src):
            raise UsageError(f"SRC {src!r} is not a directory (--format folder)")
        files = sorted(
            {os.path.relpath(p, src) for ext in IMAGE_EXTS for e in (ext, ext.upper()) for p in _listing(src, e)}
        )
        return [
            Task(f"folder-{i // FOLDER_CHUNK:05d}", src, tuple(files[i : i + FOLDER_CHUNK]))
            for i in range(0, len(files), FOLDER_CHUNK)
        ]
    ext = "tar" if fmt == "webdataset" else "parquet"
    if os.path.isdir(src):
        paths, root = _listing(src, ext), src
    else:
        paths = expand_braces(src)
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise UsageError(f"SRC {src!r}: {len(missing)} of {len(paths)} files do not exist, e.g. {missing[0]!r}")
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
        paths = [os.path.abspath(p) for p in paths]
    return [Task(name, path) for name, path in zip(_unique_names(paths, root), paths)]


# --- reading ------------------------------------------------------------------------------------------
def _json(data: bytes) -> dict:
    try:
        obj = json.loads(data)
        return obj if isinstance(obj, dict) else {}
    except (ValueError, UnicodeDecodeError):
        return {}  # unreadable metadata: the sample keeps its image and caption, scores become NaN


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").strip()


def read_folder(task: Task) -> Iterator[Record]:
    for rel in task.files:
        stem = os.path.splitext(os.path.join(task.path, rel))[0]
        key = os.path.splitext(rel)[0]
        where = f"{task.path}/{rel}"
        try:
            with open(os.path.join(task.path, rel), "rb") as f:
                image = f.read()
        except OSError as e:
            yield Record(key, None, None, {}, where, ("unreadable_file", describe_error(e)))
            continue
        caption = meta = None
        if os.path.isfile(stem + ".txt"):
            with open(stem + ".txt", "rb") as f:
                caption = _text(f.read())
        if os.path.isfile(stem + ".json"):
            with open(stem + ".json", "rb") as f:
                meta = _json(f.read())
        yield Record(key, image, caption, meta or {}, where)


def read_webdataset(task: Task) -> Iterator[Record]:
    """Groups consecutive tar members by key (the member path up to the first dot of its file name)."""
    name = os.path.basename(task.path)
    current, parts = None, {}

    def record():
        image = next((parts[e] for e in IMAGE_EXTS if e in parts), None)
        caption = _text(parts["txt"]) if "txt" in parts else None
        meta = _json(parts["json"]) if "json" in parts else {}
        return Record(current, image, caption, meta, f"{name}:{current}")

    try:
        with tarfile.open(task.path, "r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                directory, base = os.path.split(member.name)
                if "." not in base or base.startswith("."):
                    continue
                stem, ext = base.split(".", 1)
                key = os.path.join(directory, stem)
                if key != current:
                    if current is not None and parts:
                        yield record()
                    current, parts = key, {}
                parts[ext.lower()] = tar.extractfile(member).read()
            end = tar.offset
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise BadShard("truncated_shard", f"{describe_error(e)} after key {current!r}") from None
    if task.path.endswith(".tar") and os.path.getsize(task.path) < end + 1024:  # tarfile stops quietly there
        raise BadShard(
            "truncated_shard",
            f"ends inside a member header, without the end-of-archive blocks, "
            f"after key {current!r} (that last sample is dropped)",
        )
    if current is not None and parts:
        yield record()


def _parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise UsageError("parquet sources need pyarrow: pip install pyarrow") from None
    return pyarrow.parquet


def parquet_layout(path: str, image_column: str | None, caption_column: str | None) -> tuple[str, str, list[str]]:
    """(image column, caption column, all column names) of a parquet file, from its footer."""
    pq = _parquet()
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise BadShard("unreadable_shard", f"not a readable parquet file ({describe_error(e)})") from None
    found = []
    for given, candidates, flag in (
        (image_column, PARQUET_IMAGE_COLUMNS, "--image_column"),
        (caption_column, PARQUET_CAPTION_COLUMNS, "--caption_column"),
    ):
        column = given or next((c for c in candidates if c in names), None)
        if column not in names:
            what = f"column {given!r}" if given else f"column named {'/'.join(candidates)}"
            raise UsageError(f"{path}: no {what} (columns: {', '.join(names)}); pass {flag}")
        found.append(column)
    return found[0], found[1], names


def read_parquet(task: Task, image_column: str | None, caption_column: str | None) -> Iterator[Record]:
    name = os.path.basename(task.path)
    image_col, caption_col, _ = parquet_layout(task.path, image_column, caption_column)
    row = 0
    try:
        for batch in _parquet().ParquetFile(task.path).iter_batches(batch_size=256):
            for values in batch.to_pylist():
                image = values.pop(image_col)
                if isinstance(image, dict):
                    image = image.get("bytes")
                caption = values.pop(caption_col)
                key = str(values.get(KEY) if values.get(KEY) is not None else row)
                yield Record(key, image, caption.strip() if isinstance(caption, str) else None, values, f"{name}:{key}")
                row += 1
    except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid... for a damaged file
        raise BadShard("truncated_shard", f"{describe_error(e)} after row {row}") from None


def read(task: Task, fmt: str, image_column: str | None = None, caption_column: str | None = None) -> Iterator[Record]:
    if fmt == "folder":
        return read_folder(task)
    if fmt == "webdataset":
        return read_webdataset(task)
    return read_parquet(task, image_column, caption_column)


def find_scores(
    tasks: list[Task], fmt: str, wanted: tuple[str, ...], image_column=None, caption_column=None, peek: int = 100
) -> list[str]:
    """Which wanted score columns the source has: a parquet schema, or the metadata of the first
    ``peek`` samples. Fixed once for the whole dataset, so every part has the same columns."""
    if fmt == "parquet":
        names = set()
        for task in tasks:
            try:
                names.update(parquet_layout(task.path, image_column, caption_column)[2])
            except BadShard:
                continue  # counted when its part is converted
        return scores_present(names, wanted)
    names = set()
    seen = 0
    for task in tasks:
        try:
            for record in read(task, fmt):
                names.update(
                    k for k, v in record.meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                )
                seen += 1
                if seen >= peek:
                    return scores_present(names, wanted)
        except BadShard:
            continue
    return scores_present(names, wanted)


def record_scores(meta: dict, scores: list[str]) -> dict[str, float]:
    """The score columns of one sample; NaN where the sample lacks a value."""
    values = {score_name(k): v for k, v in meta.items()}
    out = {}
    for s in scores:
        v = values.get(s)
        out[s] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")
    return out
