"""torch.compile's caches carried between machines (``compile_cache=DIR``): the kernels a compiled run built,
read back by the next run on a machine of the same kind, so it does not compile them again.

A lent GPU gives 15 minutes, and a compiled SD2 run spent ~3 of them compiling (docs/performance.md, the H200 of
2026-11-27). torch (2.7+) serializes what Inductor and AOTAutograd cached during a process
(``torch.compiler.save_cache_artifacts``: the graphs' generated code, on CUDA with their Triton kernels) and loads
such bytes into its local caches (``load_cache_artifacts``), where compilation then finds them. The file is named
for what makes the kernels valid, the torch version and the device (``cache_file``): a cache from another torch or
another GPU kind is left alone, and that run compiles as it would have. ``load`` runs before the model is
compiled; ``CompileCache`` writes the file at the end of the run (one writer per node, atomically).
"""

from __future__ import annotations

import os
import re

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def cache_file(folder: str) -> str:
    """FOLDER/torch-VERSION-DEVICE.bin, e.g. torch-2.11.0+cu130-NVIDIA_H100_80GB_HBM3.bin."""
    return os.path.join(folder, re.sub(r"[^\w.+-]+", "_", f"torch-{torch.__version__}-{device_name()}") + ".bin")


def load(folder: str) -> str:
    """Reads this torch and device's cache from ``folder`` into torch's local caches; a line saying what it
    found."""
    path = cache_file(folder)
    if not os.path.isfile(path):
        return (
            f"compile cache: none for this torch and device in {folder} yet (this run writes {os.path.basename(path)})"
        )
    import torch._dynamo  # noqa: F401 - torch 2.7's load_cache_artifacts fails on a circular import without it

    with open(path, "rb") as f:
        info = torch.compiler.load_cache_artifacts(f.read())
    kernels = len(info.inductor_artifacts) if info is not None else 0
    return f"compile cache: {kernels} compiled graphs read from {path}"


class CompileCache(Callback):
    """At the end of fit, writes what this process compiled (and what it read) to ``cache_file(folder)``: local rank
    0 of each node, to a temporary file renamed over the old one."""

    def __init__(self, folder: str):
        self.folder = folder

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_local_rank() != 0:
            return
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        os.makedirs(self.folder, exist_ok=True)
        path = cache_file(self.folder)
        with open(path + ".tmp", "wb") as f:
            f.write(saved[0])
        os.replace(path + ".tmp", path)
        print(f"compile cache: {len(saved[1].inductor_artifacts)} compiled graphs written to {path}", flush=True)
