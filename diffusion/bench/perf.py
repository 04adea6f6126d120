"""One command for the GPU throughput targets: runs each on this node's GPUs and prints a table.

    python -m diffusion.bench.perf --results perf.jsonl            # all targets, ~6-8 min on one H100
    python -m diffusion.bench.perf --only sd2-512-latents --dry_run  # print the commands
    python -m diffusion.bench.perf --only sd2-512-latents --extra="--compile --channels_last"  # a variant

Each target is a microbatch sweep (diffusion.bench.sweep) of benchmark.py on synthetic data, bf16, EMA on;
the report keeps each target's fastest microbatch and sets it beside the target and the published
anchors (../shared/reference/anchors.md). Figures are per GPU, MFU from the traced FLOP count.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from diffusion.cli import Parser, markdown_table, positive, run
from diffusion.errors import UsageError

# name -> benchmark.py flags, microbatches to try, per-GPU target (img/s or MFU), published per-GPU anchor
TARGETS = {
    "sd2-512-latents": {
        "flags": ["--model_name", "sd2-base", "--image_size", "512", "--precomputed_latents"],
        "microbatch": [32, 64],
        "target": "150 img/s",
        "anchor": "126-137 img/s (MLPerf v4.x NVIDIA, H100)",
    },
    "sd2-256-latents": {
        "flags": ["--model_name", "sd2-base", "--image_size", "256", "--precomputed_latents"],
        "microbatch": [128, 256],
        "target": "600 img/s",
        "anchor": "137.5 img/s (MosaicML, A100)",
    },
    "sd2-512-online": {
        "flags": ["--model_name", "sd2-base", "--image_size", "512", "--encoder_dtype", "bf16"],
        "microbatch": [32, 48],
        "target": "75 img/s",
        "anchor": "48.2 img/s (AWS P5, H100)",
    },
    "flux-mid-256": {
        "flags": [
            "--model_name",
            "flux-mid",
            "--image_size",
            "256",
            "--precomputed_latents",
            "--encoder_dtype",
            "bf16",
        ],
        "microbatch": [8, 16],
        "target": "40% MFU",
        "anchor": "-",
    },
}
COMMON = ["--use_synth_data", "--precision", "amp_bf16", "--num_workers", "4", "--measure_skip_batches", "5"]


# benchmark.py switches that change speed, shown in the report's settings column when on
SWITCHES = ("compile", "channels_last", "cudnn_benchmark", "gradient_checkpointing")


def commands(
    names: Sequence[str],
    results: str,
    batches: int,
    grad_accum: int,
    extra: Sequence[str] = (),
    microbatches: Sequence[int] = (),
    timeout: float | None = None,
) -> list[list[str]]:
    """The diffusion.bench.sweep argument lists, one per target and microbatch (batch = microbatch x grad_accum
    per GPU); ``extra`` benchmark.py flags go to every run; ``timeout`` seconds stops a run (status error)."""
    out = []
    variant = "".join(f.strip("-").replace("_", "") for f in extra) or "default"
    for name in names:
        t = TARGETS[name]
        for mb in microbatches or t["microbatch"]:
            out.append(
                [
                    "--microbatch",
                    str(mb),
                    "--ema",
                    "on",
                    "--results",
                    results,
                    "--logs",
                    f"{results}-logs/{name}-{variant}",
                    *(["--timeout", f"{timeout:g}"] if timeout else []),
                    "--",
                    *t["flags"],
                    *COMMON,
                    *extra,
                    "--batch_size",
                    str(mb * grad_accum),
                    "--max_duration",
                    f"{batches}ba",
                    "--tag",
                    f"perf_target={name}",
                ]
            )
    return out


def report(results: str) -> str:
    """Markdown: per target, the best ok run (its speed switches in the settings column); OOMs and errors
    noted."""
    path = Path(results)
    if not path.is_file():
        raise UsageError(f"--results: {results} does not exist (run the targets first)")
    best: dict[str, dict] = {}
    failed: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        name = rec.get("perf_target") or _tag(rec.get("command") or [], "perf_target")  # failed runs: from the command
        if name not in TARGETS:
            continue
        if rec.get("status") != "ok":
            failed.setdefault(name, []).append(
                f"mb {rec.get('device_train_microbatch_size')}{_settings(rec, ' ')}: {rec.get('status')}"
            )
        elif rec["images_per_sec_per_gpu"] > best.get(name, {}).get("images_per_sec_per_gpu", 0):
            best[name] = rec
    rows = []
    for name, t in TARGETS.items():
        r = best.get(name)
        if r is None and name not in failed:
            continue
        fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
        rows.append(
            [
                name,
                fmt(r and r["images_per_sec_per_gpu"], ".1f"),
                fmt(r and r["mfu"] and 100 * r["mfu"], ".1f"),
                fmt(r and r["peak_memory_gib"], ".1f"),
                str(r and r["device_train_microbatch_size"] or "-"),
                (r and _settings(r)) or "-",
                t["target"],
                t["anchor"],
                (r and r["gpu_name"]) or "-",
                (r and r["date"][:10]) or "-",
                "; ".join(failed.get(name, [])) or "-",
            ]
        )
    header = [
        "target",
        "img/s/GPU",
        "MFU %",
        "peak GiB",
        "microbatch",
        "settings",
        "goal",
        "published",
        "device",
        "date",
        "failed",
    ]
    return "\n".join(markdown_table(header, rows))


def _tag(command: list[str], key: str) -> str | None:
    tags = [command[i + 1] for i, a in enumerate(command[:-1]) if a == "--tag"]
    return next((t.split("=", 1)[1] for t in tags if t.startswith(key + "=")), None)


def _settings(rec: dict, lead: str = "") -> str:
    """The speed switches a run had on ('compile, channels_last'), from its result line or command."""
    command = rec.get("command") or []
    on = [s for s in SWITCHES if rec.get(s) or f"--{s}" in command]
    return lead + ", ".join(on) if on else ""


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("diffusion.bench.perf", __doc__)
    p.add_argument("--results", default="perf.jsonl", help="results file (appended; default perf.jsonl)")
    p.add_argument("--only", nargs="+", choices=list(TARGETS), help="run these targets only")
    p.add_argument("--batches", type=int, default=30, help="batches per run (first 5 not measured; default 30)")
    p.add_argument("--grad_accum", type=int, default=2, help="microbatches per optimizer step (default 2)")
    p.add_argument(
        "--microbatch",
        nargs="+",
        type=int,
        default=[],
        metavar="N",
        help="microbatch sizes to try instead of each target's own",
    )
    p.add_argument(
        "--extra",
        default="",
        metavar="FLAGS",
        help='more benchmark.py flags for every run, one string: --extra="--compile --channels_last"',
    )
    p.add_argument(
        "--timeout", type=positive(float), default=None, help="seconds before one run is stopped (recorded as error)"
    )
    p.add_argument("--dry_run", action="store_true", help="print the sweep commands, run nothing")
    p.add_argument("--report_only", action="store_true", help="only print the table from --results")
    args = p.parse_args(argv)
    if not args.report_only:
        from diffusion.bench import sweep

        extra = shlex.split(args.extra)
        for cmd in commands(
            args.only or list(TARGETS),
            args.results,
            args.batches,
            args.grad_accum,
            extra,
            args.microbatch,
            args.timeout,
        ):
            print("python -m diffusion.bench.sweep " + " ".join(cmd), flush=True)
            if not args.dry_run:
                sweep.main(cmd)
    if not args.dry_run:
        print(report(args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.perf", main))
