"""Reading a checkpoint file without running code from it: the project's unpickling policy.

A checkpoint is a pickle, and unpickling can call any function the file names (``os.system`` included).
Every checkpoint this project reads is loaded with ``torch.load(weights_only=True)``, whose unpickler
builds only tensors, containers and the types allowed here: ``SAFE_GLOBALS``, the few a Composer
checkpoint of this project holds besides those (found by loading checkpoints of every family: the numpy
RNG state, a timedelta, the torch version). Composer 0.32.1 itself calls ``torch.load(...,
weights_only=False)`` for ``load_path`` and autoresume, on torch 2.7 and 2.11 alike (both default to
True only when the argument is left out), so ``safe_loading`` sets ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``,
which torch honours over an explicit ``weights_only=False``, while the Trainer is built. A file that
needs anything else is refused in one line naming the ``trust_checkpoint`` key, which turns this off for
files one made oneself.

A sharded (FSDP) checkpoint folder is also a pickle: torch.distributed.checkpoint's ``FileSystemReader`` reads
its ``.metadata`` with a plain ``pickle.load`` (torch 2.7), outside ``torch.load`` and so outside
``weights_only``: our checks, the converter and Composer's own sharded load (``load_path`` and autoresume with
FSDP, from a folder or a bucket) would all run a hostile one. ``guard_sharded_metadata``, done when this module
is imported (everything that reads a checkpoint imports it first), makes that reader unpickle with
``MetadataUnpickler``, which builds only the classes such metadata holds (``metadata_globals``); trust it with
the same key. Composer's unreleased fix of its own loads (composer#3937, after 0.32.1) leaves this one.

Low in the package (it imports only errors.py and file_checks.py): the trainer, the savers
(checkpointing/local.py, checkpointing/remote.py) and eval (eval/trained_model.py) all read checkpoints through it.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import pickle
import re
from contextlib import contextmanager

import numpy as np
import torch
from torch.torch_version import TorchVersion

from diffusion.errors import UsageError
from diffusion.file_checks import torch_file_problem

TRUST = "trust_checkpoint"  # the TrainConfig key (entry points: --trust_checkpoint)
# The function a pickled array is rebuilt by, taken from the array itself: numpy 1.x names it
# numpy.core.multiarray._reconstruct, numpy 2 numpy._core.multiarray._reconstruct (numpy 1.26 has only a stub
# numpy._core, without it; numpy 2 keeps numpy.core as a deprecated alias). A checkpoint names the one of the
# numpy that wrote it, so both names are allowed, whichever numpy reads it.
_RECONSTRUCT = np.empty(0).__reduce__()[0]
SAFE_GLOBALS = [
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,  # the numpy RNG state (Composer's 'rng')
    (_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),  # files written under numpy 2
    (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),  # files written under numpy 1
    datetime.timedelta,  # Composer's wall-clock timestamps
    TorchVersion,  # Composer's metadata
]

_active: list[bool] = []  # an enclosing safe_loading is in force
_trusted: list[bool] = []  # an enclosing safe_loading(trust=True), none restricting


@contextmanager
def safe_loading(trust: bool = False):
    """Within it, every ``torch.load`` (Composer's ``weights_only=False`` ones too) unpickles with
    ``weights_only=True`` and ``SAFE_GLOBALS`` allowed; ``trust``: leave loading as the caller asks. Nests
    (torch's safe_globals does not: leaving an inner one would drop the outer one's types). The same holds
    for sharded folders' ``.metadata`` (``guard_sharded_metadata``): restricted everywhere but within
    ``trust``."""
    if trust and not _active:
        _trusted.append(True)
        try:
            yield
        finally:
            _trusted.pop()
        return
    if _active:
        yield
        return
    key, before = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ[key] = "1"
    _active.append(True)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            yield
    finally:
        _active.pop()
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


class Unloadable(Exception):
    """Why a checkpoint file does not load: ``kind`` is "file" (zero bytes, cut short, not a torch file:
    ``detail`` says which), "type" (a type outside SAFE_GLOBALS, or with ``trust`` a pickle that fails:
    ``detail`` is the unpickler's whole message) or "damaged" (a damaged zip member, a cut pickle)."""

    def __init__(self, kind: str, detail: str, error: str = ""):
        super().__init__(detail)
        self.kind, self.detail, self.error = kind, detail, error  # error: the exception's type name


def _first_line(text: str, limit: int = 200) -> str:
    return text.splitlines()[0][:limit] if text else ""


def read_checkpoint_file(path: str, trust: bool = False, mmap: bool = False):
    """``torch.load`` of one checkpoint file the way every checkpoint here is read (``safe_loading``), or
    Unloadable. The one core of ``load_checkpoint_file`` (one-line errors) and ``checkpointing.local.check_checkpoint``
    (autoresume's reasons to skip a file)."""
    problem = torch_file_problem(path)
    if problem:
        raise Unloadable("file", problem)
    try:
        with safe_loading(trust):
            return torch.load(path, map_location="cpu", weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise Unloadable("type", str(e)) from None  # whole: the type's name is on a later line
    except (RuntimeError, EOFError, OSError) as e:  # a damaged zip member, a cut pickle
        raise Unloadable("damaged", _first_line(str(e)), type(e).__name__) from None


def load_checkpoint_file(
    path: str, what: str = "checkpoint", trust: bool = False, mmap: bool = False, trust_flag: str = f"{TRUST}=true"
):
    """``torch.load`` of one checkpoint file, or a one-line UsageError naming ``what``, the file and what is
    wrong: zero bytes, cut short, not a torch file, or a type outside ``SAFE_GLOBALS`` (code could run; the
    message names ``trust_flag``, the way the user's tool spells the trust_checkpoint key)."""
    try:
        return read_checkpoint_file(path, trust, mmap)
    except Unloadable as e:
        if e.kind == "file":
            raise UsageError(
                f"{what} {path} is {e.detail}; pass a whole checkpoint (e.g. SAVE_FOLDER/latest-rank0.pt)"
            ) from None
        if e.kind == "type" and trust:
            raise UsageError(f"{what} {path} does not unpickle ({_first_line(e.detail)})") from None
        if e.kind == "type":
            raise refused(what, path, e.detail, trust_flag) from None
        raise UsageError(f"{what} {path} does not load, it is damaged ({e.detail}); pass a whole checkpoint") from None


def foreign_name(detail: str) -> str | None:
    """The global an unpickler refused (``posix.system``), from its message ``detail``; None if it names none."""
    found = re.search(r"(?:GLOBAL|got <class) '?([\w.]+)", detail)
    return found[1] if found else None


def refused(what: str, path: str, detail: str, trust_flag: str = f"{TRUST}=true") -> UsageError:
    """The one line for a checkpoint file (or a sharded folder's ``.metadata``) at ``path`` that names a type
    outside the allowed ones; ``detail``: the unpickler's message, which names it."""
    return UsageError(
        f"{what} {path} holds {foreign_name(detail) or 'a type'}, which a checkpoint of this project never does; "
        f"unpickling it could run code from the file. Only if you made the file yourself, trust it with {trust_flag}"
    )


# --- sharded checkpoint folders: torch.distributed.checkpoint's .metadata ---------------------------------------


def metadata_globals() -> dict[tuple[str, str], object]:
    """(module, name) -> object: every global a ``.metadata`` that torch.distributed.checkpoint wrote names, and
    nothing else. Its dataclasses (the metadata, each entry's storage and tensor properties, the index of each
    shard's bytes), ``torch.Size``, torch's dtypes (pickled by name: ``torch.float32``), the function a layout
    is looked up by (``torch.serialization._get_layout``, a dict lookup) and the ``pathlib`` path its writer
    records (``pathlib._local`` on Python 3.13 and later). Found by reading the ``.metadata`` of a 2-rank FSDP
    checkpoint of this project with EMA (every global it names is here). The private ones are looked up by name
    and left out where a torch lacks them (its metadata then holds none)."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
             "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex"]  # fmt: skip
    classes = [getattr(metadata, n) for n in names if hasattr(metadata, n)] + [torch.Size]
    classes += [filesystem._StorageInfo] if hasattr(filesystem, "_StorageInfo") else []
    allowed: dict[tuple[str, str], object] = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("pathlib", "PosixPath")] = allowed[("pathlib._local", "PosixPath")] = pathlib.PosixPath
    if hasattr(torch.serialization, "_get_layout"):  # looks a layout up by its name
        allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


class RefusedGlobal(pickle.UnpicklingError):
    """A ``.metadata`` names a global outside ``metadata_globals``."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a sharded folder's ``.metadata``, building only ``metadata_globals``; any other global (a
    function such as ``os.system`` above all) is refused before it is looked up."""

    _allowed: dict[tuple[str, str], object] | None = None

    def find_class(self, module: str, name: str):
        if MetadataUnpickler._allowed is None:
            MetadataUnpickler._allowed = metadata_globals()
        found = MetadataUnpickler._allowed.get((module, name))
        if found is None:
            raise RefusedGlobal(
                f"Unsupported global: GLOBAL {module}.{name} (not a type a sharded checkpoint's .metadata holds)"
            )
        return found


class _MetadataPickle:
    """What torch.distributed.checkpoint.filesystem calls ``pickle`` once guarded: the module itself, but ``load``
    (which that module uses for ``.metadata`` alone) unpickles with ``MetadataUnpickler``, unless within
    ``safe_loading(trust=True)``."""

    def __getattr__(self, name: str):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        if _trusted and not _active:
            return pickle.load(file, **kwargs)
        return MetadataUnpickler(file, **kwargs).load()


def guard_sharded_metadata() -> None:
    """Make every read of a sharded folder's ``.metadata`` go through ``MetadataUnpickler``: torch's
    ``FileSystemReader.read_metadata`` (torch.distributed.checkpoint.filesystem, 2.7 and on) calls
    ``pickle.load``; Composer's readers (``FileSystemReaderWithValidation``, ``DistCPObjectStoreReader``) and
    ours (checkpointing/local.py, eval/trained_model.py) are that reader or its subclasses. So the one name that
    module looks ``pickle`` up by is replaced, not each reader. Idempotent; done at import."""
    from torch.distributed.checkpoint import filesystem

    if not isinstance(filesystem.pickle, _MetadataPickle):
        filesystem.pickle = _MetadataPickle()


def read_sharded_metadata(folder: str, trust: bool = False):
    """The ``.metadata`` of the sharded checkpoint ``folder`` (torch.distributed.checkpoint's ``Metadata``),
    unpickled the way every checkpoint here is; Unloadable("type") for a global outside ``metadata_globals``.
    A missing or damaged one raises what torch's reader raises."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with safe_loading(trust):
            return FileSystemReader(folder).read_metadata()
    except RefusedGlobal as e:
        raise Unloadable("type", str(e)) from None


def load_sharded_metadata(
    folder: str, what: str = "checkpoint", trust: bool = False, trust_flag: str = f"{TRUST}=true"
):
    """``read_sharded_metadata``, with a hostile ``.metadata`` a one-line UsageError naming the file and
    ``trust_flag`` (``load_checkpoint_file``'s)."""
    try:
        return read_sharded_metadata(folder, trust)
    except Unloadable as e:
        raise refused(what, os.path.join(folder, ".metadata"), e.detail, trust_flag) from None


guard_sharded_metadata()
