"""What is wrong with a damaged or foreign file, in a few words, checked where the file is opened.

A copy cut short by a full disk or a killed ``rsync``, a zero-byte placeholder, or the wrong file behind
a path otherwise surfaces as a library's traceback deep inside ``torch.load``, ``safetensors`` or
``json``, naming neither the file nor the fault. These checks read only headers and sizes (a safetensors
header, a zip's end record, a JSON document), so they cost microseconds even on multi-GB weights, and
each answer is what the one-line error says after the file's path: "zero bytes", "truncated: 1,000
bytes, not a zip archive", "not JSON (...)", "a safetensors file whose header is cut (...)".
"""

from __future__ import annotations

import errno
import json
import os
import struct
import tempfile
import zipfile
from typing import Optional

from diffusion.errors import UsageError

_MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit; a larger "length" is not a header


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise UsageError(f"{path}: cannot be read ({e.strerror})") from None


def torch_file_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a whole ``torch.save`` file (a zip archive since torch 1.6), or None. Reads the
    zip's end record only: a copy cut short has none."""
    size = _size(path)
    if size == 0:
        return "zero bytes"
    if not zipfile.is_zipfile(path):
        return f"truncated or not a torch file: {size:,} bytes, not a zip archive (torch.save's format)"
    return None


def safetensors_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a whole safetensors file, or None: its 8-byte length, its JSON header, and a
    size that covers every tensor the header lists."""
    size = _size(path)
    if size == 0:
        return "zero bytes"
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > _MAX_SAFETENSORS_HEADER:
            return f"not a safetensors file ({size:,} bytes, no header length)"
        if 8 + length > size:
            return f"a safetensors file whose header is cut ({size:,} bytes, the header alone needs {8 + length:,})"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "not a safetensors file (its header is not JSON)"
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    ]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"truncated: {size:,} bytes, its header lists tensors up to byte {needed:,}"
    return None


def _parse_json(path: str):
    """(the JSON document at ``path``, None), or (None, why it is not one)."""
    if _size(path) == 0:
        return None, "zero bytes"
    try:
        with open(path) as f:
            return json.load(f), None
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"not JSON ({str(e).splitlines()[0][:120]})"


def json_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a JSON document, or None."""
    return _parse_json(path)[1]


def read_json(
    path: str, what: str, fix: str = "copy it again (or re-export the model)", shown: Optional[str] = None
) -> dict:
    """The JSON document at ``path`` (read once); a UsageError naming ``what``, the file (``shown``: the name
    to give it, e.g. the URL a temporary copy came from) and the fault otherwise, then ``fix``."""
    document, problem = _parse_json(path)
    if problem:
        raise UsageError(f"{what}: {shown or path} is {problem}; {fix}")
    return document


def check_weights(folder: str, what: str) -> None:
    """Every weights file directly in ``folder`` (``*.safetensors``, ``*.bin``/``*.pt`` torch files) is
    whole, or a UsageError naming ``what``, the file and the fault. Run before ``from_pretrained``."""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            problem = safetensors_problem(path)
        elif name.endswith((".bin", ".pt", ".pth")):
            problem = torch_file_problem(path)
        else:
            continue
        if problem:
            raise UsageError(f"{what}: {path} is {problem}; copy it again (or re-export the model)")


def folder_problem(path: str) -> Optional[str]:
    """Why no folder can be written at ``path``, or None: a file there or above it, or a place where nothing can be
    made. Checked before a run starts, so an output that cannot be written is one line, not an error after the work
    (a save, or the samples). Asked of the file system itself (a folder made and removed again in ``path``, or in
    its nearest existing parent): ``os.access`` says yes to root anywhere, also under /proc or on a read-only mount,
    where the save later failed with a traceback."""
    if os.path.isdir(path):
        why = _cannot_make_in(path)
        return f"is a folder where {why}" if why else None
    if os.path.lexists(path):
        return "is a file, not a folder"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"is under {parent}, which is a file, not a folder"
    why = _cannot_make_in(parent)
    return f"cannot be made: in {parent} {why}" if why else None


def _cannot_make_in(folder: str) -> Optional[str]:
    """Why no folder can be made in the existing ``folder`` (tried: one is made and removed), or None."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "this user cannot write"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=folder))
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return "this user cannot write"
        if e.errno == errno.EROFS:
            return "nothing can be written (a read-only file system)"
        return f"no folder can be made ({e.strerror}: a virtual file system such as /proc or /sys?)"
    return None


def check_output_folder(path: str, what: str) -> None:
    """``folder_problem`` as a UsageError naming ``what`` (the key or flag) and ``path``."""
    problem = folder_problem(path)
    if problem:
        raise UsageError(f"{what} {path!r} {problem}; give a folder that can be written")
