"""Checkpoints unpickle on every numpy of the tested range (diffusion/checkpointing/unpickling.py; diffusion/versions.py says
numpy 1.26 to 2.5): the allowed names resolve on the installed numpy, and a checkpoint written under numpy 1.x
(arrays named numpy.core.multiarray._reconstruct) or numpy 2 (numpy._core.multiarray._reconstruct) loads under
either. tests/data/numpy-*.pt were written by ``write_checkpoint`` under numpy 1.26.4 and 2.1.3; CI also runs
this file with numpy 1.26.4, the floor (.ci/run)."""

import datetime
import importlib
import random
import warnings

import numpy as np
import pytest
import torch
from conftest import REPO

from diffusion.checkpointing.unpickling import SAFE_GLOBALS, read_checkpoint_file

WRITTEN = sorted((REPO / "tests" / "data").glob("numpy-*.pt"))


def write_checkpoint(path) -> None:
    """The types a Composer checkpoint of this project holds besides tensors: the numpy RNG state (an
    array of uint32), a timedelta and the torch version; the array's pickle names this numpy's module."""
    rng = np.random.RandomState(7).get_state()
    state = {"model": {"w": torch.arange(3.0)}, "rng": [{"numpy": rng, "python": random.Random(7).getstate()}]}
    state["timestamp"] = {"total_wct": datetime.timedelta(seconds=3)}
    torch.save({"state": state, "metadata": {"torch_version": torch.__version__}}, path)


def check(loaded) -> None:
    name, keys, pos, *_ = loaded["state"]["rng"][0]["numpy"]
    assert name == "MT19937" and keys.dtype == np.uint32 and keys.shape == (624,) and pos == 624
    assert (keys == np.random.RandomState(7).get_state()[1]).all()
    assert loaded["state"]["timestamp"]["total_wct"] == datetime.timedelta(seconds=3)
    assert torch.equal(loaded["state"]["model"]["w"], torch.arange(3.0))


def test_each_allowed_name_is_the_object_this_numpy_unpickles_by_that_name():
    for entry in SAFE_GLOBALS:
        if isinstance(entry, tuple):
            obj, name = entry
            module, _, attr = name.rpartition(".")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2's numpy.core alias
                assert getattr(importlib.import_module(module), attr) is obj, name
    module = np.empty(0).__reduce__()[0]
    assert (module, f"{module.__module__}.{module.__name__}") in SAFE_GLOBALS  # what this numpy writes


def test_a_checkpoint_written_here_loads(tmp_path):
    write_checkpoint(tmp_path / "c.pt")
    check(read_checkpoint_file(str(tmp_path / "c.pt"), mmap=True))


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.stem)
def test_a_checkpoint_written_under_another_numpy_loads(path):
    check(read_checkpoint_file(str(path), mmap=True))


def test_both_numpy_majors_are_among_the_written_checkpoints():
    assert {p.stem.split("-")[1].split(".")[0] for p in WRITTEN} == {"1", "2"}
