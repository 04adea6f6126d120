"""The lent GPUs' results lines, kept: docs/measured/ holds one JSONL file per lent machine (its date and kind in
the name), every line a results line as benchmark.py or the sweep wrote it, so the tables in
docs/performance.md and ``python -m diffusion.bench.perf --report_only`` are made from the figures themselves.

The first three machines' lines were not kept: their files hold the figures of docs/performance.md's tables
transcribed, each line marked ``"transcribed": true`` with its ``source`` (the commit that recorded it).
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusion.bench.throughput import hardware_name
from diffusion.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent.parent
MEASURED = ROOT / "docs" / "measured"


def files(path: str | Path) -> list[Path]:
    """A results file, or every .jsonl in a folder (by name: the dated files in order)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.jsonl"))
        if not found:
            raise UsageError(f"--results: {path} holds no .jsonl results files")
        return found
    if not path.is_file():
        raise UsageError(f"--results: {path} does not exist (run the targets first, or name a results file)")
    return [path]


def read(path: str | Path) -> list[dict]:
    """Every line of a results file, or of every file in a folder; a line that is not JSON is one error naming
    its file and line."""
    out = []
    for file in files(path):
        for number, text in enumerate(file.read_text().splitlines(), 1):
            if not text.strip():
                continue
            try:
                out.append(json.loads(text))
            except json.JSONDecodeError as e:
                raise UsageError(f"{file}:{number}: not a results line ({e.msg}); fix or remove that line") from None
    return out


def kind(rec: dict) -> str:
    """The GPU kind a line was measured on ('H100-80GB', 'H200'; 'CPU'), from its gpu_name: figures of
    different kinds are never compared."""
    return hardware_name(rec.get("gpu_name"))


def family(gpu_kind: str) -> str:
    """The kind's chip, which the goals are set for: 'H100-80GB' and 'H100-PCIe' -> 'H100'."""
    return gpu_kind.split("-")[0]
