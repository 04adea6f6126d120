"""Readers of image-caption sources, one per format, all yielding the same ``Record``s.

* folder: images (jpg, jpeg, png, webp, gif, bmp, tif, tiff; any case) anywhere under a directory (symlinked
  folders followed, each once), each with a sidecar ``.txt`` caption and an optional ``.json`` of metadata
  (same stem); a caption with no image beside it is a sample too, counted as ``missing_image``;
* webdataset: tar shards as img2dataset writes them (``key.jpg``, ``key.txt``, ``key.json``): a
  directory of ``*.tar``, one tar, or a brace pattern such as ``/data/{00000..00099}.tar``;
* parquet: a directory of ``*.parquet`` or one file, with an image-bytes column (binary, or a struct with
  a ``bytes`` field as Hugging Face datasets write it), a caption column, and metadata columns.

The unit of work (and of resumption) is a ``Task``: one tar, one parquet file, or a chunk of a folder.
What a reader had to mend to use a sample is a note, counted and reported: a caption that is not UTF-8
(decoded as cp1252, else latin-1) and a file name that is not UTF-8 (its key spelt with U+FFFD).
"""

from __future__ import annotations

import json
import math
import os
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from diffusion.data.bad_samples import BadSample, describe_error, printable
from diffusion.data.columns import CAPTION_COLUMNS, IMAGE_COLUMNS, KEY, score_name, scores_present
from diffusion.errors import UsageError

FORMATS = ("folder", "webdataset", "parquet")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")  # what PIL reads; lower case
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
    notes: list[tuple[str, str]] = field(default_factory=list)  # (reason, detail): what was mended


@dataclass(frozen=True)
class Task:
    name: str  # the output part's directory name
    path: str  # tar / parquet file, or the folder
    files: tuple[tuple[str, str], ...] = field(default=())  # folder: this chunk's (path relative to path, key)


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


def walk(src: str) -> list[str]:
    """Every file under the folder ``src``, relative to it, sorted. Symlinked folders are followed, each real
    folder once (a symlink loop is walked once, not forever)."""
    seen, found = set(), []
    for root, dirs, files in os.walk(src, followlinks=True):
        st = os.stat(root)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        found += [os.path.relpath(os.path.join(root, f), src) for f in files]
    return sorted(found)


def _ext(path: str) -> str:
    return os.path.splitext(path)[1][1:].lower()


def _listing(src: str, *exts: str) -> list[str]:
    """The files under ``src`` whose extension (any case) is one of ``exts``, as paths under ``src``."""
    return [os.path.join(src, p) for p in walk(src) if _ext(p) in exts]


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
    files = walk(src)
    exts = {_ext(p) for p in files}
    if "tar" in exts:
        return "webdataset"  # img2dataset also writes a metadata-only .parquet beside each tar
    if "parquet" in exts:
        return "parquet"
    if exts & {*IMAGE_EXTS, "txt"}:
        return "folder"
    raise UsageError(
        f"SRC {src!r} holds no .tar, .parquet, image ({', '.join(IMAGE_EXTS)}) or .txt caption files; pass "
        "--format if they are named otherwise"
    )


def _unique_names(paths: list[str], root: str) -> list[str]:
    """Part names from input paths: the relative path without extension, '/' -> '_'."""
    stems = [re.sub(r"\.(tar|tar\.gz|tgz|parquet)$", "", os.path.relpath(p, root)) for p in paths]
    names = [re.sub(r"[^\w.-]", "_", stem) for stem in stems]
    if len(set(names)) < len(names):
        names = [f"{i:05d}-{n}" for i, n in enumerate(names)]
    return names


def folder_samples(src: str) -> list[tuple[str, str]]:
    """(path under ``src``, key) of each folder sample: every image, keyed by its path without extension (with
    it, when several images share a stem, so keys stay unique), and every caption without an image beside it
    (read as a sample without an image: counted, not lost from sight)."""
    files = walk(src)
    images: dict[str, list[str]] = {}
    for rel in files:
        if _ext(rel) in IMAGE_EXTS:
            images.setdefault(os.path.splitext(rel)[0], []).append(rel)
    samples = []
    for rel in files:
        stem = os.path.splitext(rel)[0]
        if _ext(rel) in IMAGE_EXTS:
            samples.append((rel, rel if len(images[stem]) > 1 else stem))
        elif _ext(rel) == "txt" and stem not in images:
            samples.append((rel, stem))
    return samples


def list_tasks(src: str, fmt: str) -> list[Task]:
    if fmt == "folder":
        if not os.path.isdir(src):
            raise UsageError(f"SRC {src!r} is not a directory (--format folder)")
        files = folder_samples(src)
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


def _text(data: bytes, notes: list) -> str:
    """A caption's bytes as text: UTF-8 (a byte-order mark dropped), else cp1252 or latin-1 with a note."""
    try:
        return data.decode("utf-8-sig").strip()
    except UnicodeDecodeError as e:
        encoding = "cp1252"
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError:
            encoding, text = "latin-1", data.decode("latin-1")
        notes.append(("caption_not_utf8", f"byte {data[e.start]:#04x} at {e.start}: decoded as {encoding}"))
        return text.strip()


def _caption_file(stem: str) -> str | None:
    return next((stem + ext for ext in (".txt", ".TXT", ".Txt") if os.path.isfile(stem + ext)), None)


def _read(path: str | None, optional: bool = True) -> bytes | None:
    """A file's bytes; None for an optional one that is not there."""
    if path is None or (optional and not os.path.isfile(path)):
        return None
    with open(path, "rb") as f:
        return f.read()


def _no_image(stem: str) -> tuple[str, str]:
    """Why a caption file without an image beside it is skipped, naming what else shares its stem."""
    folder, base = os.path.split(stem)
    beside = sorted(p for p in os.listdir(folder or ".") if p.startswith(base + "."))
    return "missing_image", f"no image ({', '.join(IMAGE_EXTS)}) beside the caption; files with its stem: " + (
        ", ".join(beside)
    )


def read_folder(task: Task) -> Iterator[Record]:
    for rel, key in task.files:
        stem = os.path.splitext(os.path.join(task.path, rel))[0]
        key, mended = printable(key)
        where = f"{task.path}/{rel}"  # the counters print it printable
        notes = [("name_not_utf8", f"the key is spelt {key!r}")] if mended else []
        if _ext(rel) == "txt":
            yield Record(key, None, None, {}, where, _no_image(stem))
            continue
        try:
            image = _read(os.path.join(task.path, rel), optional=False)
            caption, meta = _read(_caption_file(stem)), _read(stem + ".json")
        except OSError as e:
            yield Record(key, None, None, {}, where, ("unreadable_file", describe_error(e)))
            continue
        caption = None if caption is None else _text(caption, notes)
        yield Record(key, image, caption, _json(meta) if meta is not None else {}, where, notes=notes)


def read_webdataset(task: Task) -> Iterator[Record]:
    """Groups consecutive tar members by key (the member path up to the first dot of its file name)."""
    name = os.path.basename(task.path)
    current, parts = None, {}

    def record():
        key, mended = printable(current)
        notes = [("name_not_utf8", f"the key is spelt {key!r}")] if mended else []
        image = next((parts[e] for e in IMAGE_EXTS if e in parts), None)
        caption = _text(parts["txt"], notes) if "txt" in parts else None
        meta = _json(parts["json"]) if "json" in parts else {}
        problem = None
        if image is None:
            problem = ("missing_image", f"no image member ({', '.join(IMAGE_EXTS)}); it has {', '.join(sorted(parts))}")
        return Record(key, image, caption, meta, f"{name}:{key}", problem, notes)

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
                if key != current or ext.lower() in parts:  # a member seen twice starts another sample
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


def number(value) -> float | None:
    """A metadata value as a finite float, or None: not a number (a string, a bool, null), or not finite
    (JSON's 1e400 reads as inf, an integer of 400 digits does not fit a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def record_scores(meta: dict, scores: list[str], notes: list | None = None) -> dict[str, float]:
    """The score columns of one sample; NaN where the sample lacks a value or its value is not a finite
    number (a numeric one that is not finite adds a note)."""
    values = {score_name(k): v for k, v in meta.items()}
    out = {}
    for s in scores:
        raw = values.get(s)
        v = number(raw)
        if v is None and notes is not None and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            notes.append(("metadata_not_finite", f"{s}={raw!r:.40} stored as NaN"))
        out[s] = float("nan") if v is None else v
    return out
