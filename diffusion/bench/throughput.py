"""Throughput comparison tables (and a chart) from benchmark results.

    python -m diffusion.bench.throughput results.jsonl aws_p4de_p5_sd2_512.csv --markdown table.md --plot table.png
    python -m diffusion.bench.throughput results.jsonl --baseline A100-80GB --compare H200   # the pair, of several

Reads benchmark.py/diffusion.bench.sweep result lines (JSONL) and published-figure CSVs
(``microbatch,num_workers,ema,hardware,gpus,images_per_sec``, images/s for the whole machine, ``#`` comments),
and prints one markdown row per (microbatch, dataloader workers, EMA) with one column per hardware type,
and a ratio column: with exactly two hardware types by default (the faster over the slower; ``--no_ratio``
leaves it out), with more for the pair named by ``--baseline``/``--compare``.

Cells are images/s for a node of ``--gpus_per_node`` GPUs, computed as the per-GPU figure times that
count, so a 1-GPU measurement and a published 8-GPU node figure sit in one column system (the footnote
says how many GPUs each hardware was measured on). Repeated measurements of a cell are summarised by
their median. Runs a sweep recorded as ``oom``/``error`` show as such where nothing was measured.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diffusion.cli import Parser, markdown_table, positive, run
from diffusion.errors import UsageError

# Settings that define the workload: results that differ in one of them do not belong in one table.
WORKLOAD = ("model", "resolution", "precomputed_latents", "precision", "fsdp")
CSV_COLUMNS = ("microbatch", "hardware", "gpus", "images_per_sec")
_VENDOR = re.compile(r"^(nvidia|tesla|geforce|quadro)\s+", re.I)


def hardware_name(gpu_name: str | None) -> str:
    """Short, comparable hardware name: 'NVIDIA H100 80GB HBM3' -> 'H100-80GB',
    'NVIDIA A100-SXM4-80GB' -> 'A100-80GB', 'NVIDIA A100-PCIE-40GB' -> 'A100-40GB-PCIe', None -> 'CPU'.

    Names already in this form map to themselves, so CSV columns and command-line names go through it too.
    """
    if not gpu_name:
        return "CPU"
    name = gpu_name.strip()
    while m := _VENDOR.match(name):
        name = name[m.end() :]
    tokens = [t for t in re.split(r"[\s_-]+", name) if t]
    first_numbered = next((i for i, t in enumerate(tokens) if re.search(r"\d", t)), len(tokens) - 1)
    parts = [t.upper() for t in tokens[: first_numbered + 1]]
    parts += [t.upper() for t in tokens[first_numbered + 1 :] if re.fullmatch(r"\d+GB", t, re.I)]
    parts += ["PCIe" for t in tokens if t.upper() == "PCIE"] + ["NVL" for t in tokens if t.upper() == "NVL"]
    return "-".join(parts)


@dataclass
class Point:
    """One measurement (or failed run) reduced to what the table needs."""

    microbatch: int | str | None
    num_workers: int | None
    ema: bool | None
    hardware: str
    gpus: int
    per_gpu: float | None  # images/s per GPU (per rank on CPU); None when the run measured nothing
    status: str = "ok"  # ok, oom or error
    source: str = ""
    settings: dict = field(default_factory=dict)

    def get(self, key: str):
        return getattr(self, key) if key in self.__dataclass_fields__ else self.settings.get(key)


def _flag(text: str | bool | None) -> bool | None:
    if text is None or isinstance(text, bool):
        return text
    return text.strip().lower() in ("yes", "true", "1", "on")


def _number(text: str | int | None) -> int | str | None:
    return int(text) if isinstance(text, str) and text.strip().isdigit() else text


def read_csv(path: Path) -> list[Point]:
    """Published figures: images_per_sec is for ``gpus`` GPUs together (a whole node)."""
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    rows = list(csv.DictReader(lines))
    missing = [c for c in CSV_COLUMNS if rows and c not in rows[0]]
    if missing:
        raise UsageError(
            f"{path}: CSV lacks column(s) {', '.join(missing)}; it needs {', '.join(CSV_COLUMNS)} "
            "(optional: num_workers, ema, model, resolution)"
        )
    points = []
    for i, row in enumerate(rows, 1):
        try:
            gpus, ips = int(row["gpus"]), float(row["images_per_sec"])
        except (TypeError, ValueError):
            raise UsageError(
                f"{path}: data row {i}: gpus {row['gpus']!r} and images_per_sec "
                f"{row['images_per_sec']!r} must be numbers"
            ) from None
        settings = {k: _number(row[k]) for k in WORKLOAD if row.get(k)}
        points.append(
            Point(
                _number(row["microbatch"]),
                _number(row.get("num_workers")),
                _flag(row.get("ema")),
                hardware_name(row["hardware"]),
                gpus,
                ips / gpus,
                source=path.name,
                settings=settings,
            )
        )
    return points


def read_jsonl(path: Path) -> list[Point]:
    """benchmark.py --results lines (and diffusion.bench.sweep lines, which add status oom/error)."""
    points = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict):
            raise UsageError(
                f"{path}:{lineno}: not a JSON object; pass result files written by "
                "benchmark.py --results or diffusion.bench.sweep (one JSON object a line)"
            )
        gpus = rec.get("gpu_count") or rec.get("world_size") or 1
        points.append(
            Point(
                rec.get("device_train_microbatch_size"),
                rec.get("num_workers"),
                rec.get("ema"),
                hardware_name(rec.get("gpu_name")),
                gpus,
                rec.get("images_per_sec_per_gpu"),
                status=rec.get("status", "ok"),
                source=path.name,
                settings={k: rec[k] for k in WORKLOAD if rec.get(k) is not None},
            )
        )
    return points


def load(paths: Sequence[str], where: Sequence[str] = ()) -> list[Point]:
    """Read every file, keep the points matching each ``key=value`` in ``where`` (points that do not
    record the key are kept), and refuse a mix of workloads that one table would silently average."""
    points: list[Point] = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise UsageError(
                f"FILES: {name} does not exist; pass benchmark results (.jsonl) or published figures (.csv)"
            )
        points += read_csv(path) if path.suffix.lower() == ".csv" else read_jsonl(path)
    for cond in where:
        key, sep, value = cond.partition("=")
        if not sep:
            raise UsageError(f"--where {cond!r}: expected key=value, e.g. --where resolution=512")
        points = [p for p in points if p.get(key) is None or str(p.get(key)).lower() == value.lower()]
    if not points:
        raise UsageError(
            f"no results in {', '.join(paths)}{' matching --where' if where else ''}; "
            "run benchmark.py with --results FILE (or diffusion.bench.sweep) first"
        )
    for key in WORKLOAD:
        values = sorted({str(p.settings[key]) for p in points if key in p.settings})
        if len(values) > 1:
            raise UsageError(
                f"the results mix {' and '.join(f'{key}={v}' for v in values)}; one table compares one workload, "
                f"pick one with --where {key}={values[-1]}"
            )
    return points


def _sort_key(row: tuple) -> tuple:
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in row)


def table(
    points: list[Point], gpus_per_node: int = 8, baseline: str | None = None, compare: str | None = None
) -> tuple[list[str], list[list[str]], dict[tuple, dict[str, float]]]:
    """Header, formatted rows and the numeric cells {row key: {hardware: node images/s}}."""
    hardware = sorted({p.hardware for p in points}, key=lambda h: (h not in (baseline, compare), h != baseline, h))
    for flag, name in (("--baseline", baseline), ("--compare", compare)):
        if name is not None and name not in hardware:
            raise UsageError(
                f"{flag} {name}: no results for that hardware; the inputs have {', '.join(sorted(hardware))}"
            )
    cells: dict[tuple, dict[str, list[float]]] = {}
    failed: dict[tuple, dict[str, str]] = {}
    for p in points:
        key = (p.microbatch, p.num_workers, p.ema)
        cells.setdefault(key, {})
        if p.status == "ok" and p.per_gpu:
            cells[key].setdefault(p.hardware, []).append(p.per_gpu * gpus_per_node)
        elif p.status != "ok":
            failed.setdefault(key, {})[p.hardware] = p.status
    values = {k: {h: statistics.median(v) for h, v in row.items()} for k, row in cells.items()}
    header = ["microbatch", "workers", "EMA", *hardware] + ([f"{compare} / {baseline}"] if baseline else [])
    rows = []
    for key in sorted(values, key=_sort_key):
        mb, workers, ema = key
        row = [
            "-" if mb is None else str(mb),
            "-" if workers is None else str(workers),
            "-" if ema is None else ("yes" if ema else "no"),
        ]
        row += [f"{values[key][h]:.2f}" if h in values[key] else failed.get(key, {}).get(h, "-") for h in hardware]
        if baseline:
            both = baseline in values[key] and compare in values[key]
            row.append(f"{values[key][compare] / values[key][baseline]:.2f}x" if both else "")
        rows.append(row)
    return header, rows, values


def default_pair(
    points: list[Point], baseline: str | None = None, compare: str | None = None
) -> tuple[str | None, str | None]:
    """The ratio's (baseline, compare): with exactly two hardware types, the one not named, or with neither
    named the slower one (median per-GPU figure) as the baseline, so the ratio reads as a speed-up; with more
    types, only the pair named in full."""
    hardware = sorted({p.hardware for p in points})
    if len(hardware) != 2:
        if (baseline is None) != (compare is None):
            raise UsageError(
                f"--baseline and --compare go together when the inputs have {len(hardware)} hardware "
                f"types ({', '.join(hardware)}): name both, e.g. --baseline A100-80GB --compare H100-80GB"
            )
        return baseline, compare
    if baseline is None and compare is None:
        speed = {
            h: statistics.median([p.per_gpu for p in points if p.hardware == h and p.per_gpu] or [0.0])
            for h in hardware
        }
        baseline = min(hardware, key=lambda h: (speed[h], h))
    if baseline is None:
        baseline = next(h for h in hardware if h != compare)
    if compare is None:
        compare = next(h for h in hardware if h != baseline)
    return baseline, compare


def markdown(points: list[Point], header: list[str], rows: list[list[str]], gpus_per_node: int) -> str:
    """The table plus a footnote: what a cell means and where each hardware's figures came from."""
    lines = markdown_table(header, rows)
    measured = {}
    for p in points:
        measured.setdefault(p.hardware, set()).add(f"{p.gpus}x in {p.source}")
    lines.append("")
    lines.append(
        f"Images/s for a node of {gpus_per_node} GPUs (per-GPU figure x {gpus_per_node}; per rank on CPU), "
        "median of repeated runs; '-' nothing measured. Measured: "
        + "; ".join(f"{h}: {', '.join(sorted(s))}" for h, s in sorted(measured.items()))
        + "."
    )
    return "\n".join(lines) + "\n"


def plot(header: list[str], rows: list[list[str]], values: dict, out: str, gpus_per_node: int) -> None:
    """Grouped bars: one group per table row, one bar per hardware."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hardware = [h for h in header[3:] if " / " not in h]
    keys = sorted(values, key=_sort_key)
    width = 0.8 / max(len(hardware), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(keys) * max(len(hardware), 1)), 4))
    for i, h in enumerate(hardware):
        xs = [j + i * width for j, k in enumerate(keys) if h in values[k]]
        ax.bar(xs, [values[k][h] for k in keys if h in values[k]], width, label=h)
    if " / " in header[-1]:  # annotate each group with its ratio
        for j, r in enumerate(rows):
            ax.annotate(
                r[-1],
                (j + width * (len(hardware) - 1) / 2, max(values[keys[j]].values())),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks([j + width * (len(hardware) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"mb {r[0]}\nw {r[1]}, EMA {r[2]}" for r in rows], fontsize=8)
    ax.set_ylabel(f"images/s per {gpus_per_node}-GPU node")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("diffusion.bench.throughput", __doc__)
    p.add_argument("files", nargs="+", metavar="FILES", help="benchmark result lines (.jsonl) and/or figure CSVs")
    p.add_argument("--markdown", metavar="OUT.md", help="also write the table to this file")
    p.add_argument("--plot", metavar="OUT.png", help="write a bar chart (matplotlib, Agg)")
    p.add_argument("--baseline", help="hardware the ratio divides by, e.g. A100-80GB (or a full GPU name)")
    p.add_argument("--compare", help="hardware the ratio is for, e.g. H100-80GB")
    p.add_argument(
        "--no_ratio",
        action="store_true",
        help="no ratio column (by default there is one when the inputs have exactly two hardware types)",
    )
    p.add_argument(
        "--gpus_per_node", type=positive(int), default=8, help="node size the cells are scaled to (default 8)"
    )
    p.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keep results with this setting (model, resolution, precision, ...); repeatable",
    )
    args = p.parse_args(argv)
    if args.no_ratio and (args.baseline or args.compare):
        raise UsageError("--no_ratio leaves the ratio out; drop it, or drop --baseline/--compare")
    points = load(args.files, args.where)
    baseline, compare = (hardware_name(n) if n else None for n in (args.baseline, args.compare))
    if not args.no_ratio:
        baseline, compare = default_pair(points, baseline, compare)
    header, rows, values = table(points, args.gpus_per_node, baseline, compare)
    text = markdown(points, header, rows, args.gpus_per_node)
    print(text, end="")
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.plot:
        plot(header, rows, values, args.plot, args.gpus_per_node)
    return 0


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.throughput", main))
