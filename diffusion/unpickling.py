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

Low in the package (it imports only errors.py and file_checks.py): the trainer, the savers
(checkpoints.py, remote_checkpoints.py) and eval (eval/trained_model.py) all read checkpoints through it.
"""

from __future__ import annotations

import datetime
import os
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


@contextmanager
def safe_loading(trust: bool = False):
    """Within it, every ``torch.load`` (Composer's ``weights_only=False`` ones too) unpickles with
    ``weights_only=True`` and ``SAFE_GLOBALS`` allowed; ``trust``: leave loading as the caller asks. Nests
    (torch's safe_globals does not: leaving an inner one would drop the outer one's types)."""
    if trust or _active:
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
    Unloadable. The one core of ``load_checkpoint_file`` (one-line errors) and ``checkpoints.check_checkpoint``
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
            found = re.search(r"(?:GLOBAL|got <class) '?([\w.]+)", e.detail)
            raise UsageError(
                f"{what} {path} holds {found[1] if found else 'a type'}, which a checkpoint of this "
                f"project never does; unpickling it could run code from the file. Only if you made "
                f"the file yourself, trust it with {trust_flag}"
            ) from None
        raise UsageError(f"{what} {path} does not load, it is damaged ({e.detail}); pass a whole checkpoint") from None
