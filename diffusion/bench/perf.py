"""One command for the GPU throughput targets: runs each on this node's GPUs and prints a table.

    python -m diffusion.bench.perf --results perf.jsonl            # all targets, ~6-8 min on one H100
    python -m diffusion.bench.perf --only sd2-512-latents --dry_run  # print the commands
    python -m diffusion.bench.perf --only sd2-512-latents --extra="--compile --channels_last"  # a variant
    python -m diffusion.bench.perf --only sd2-512-latents --microbatch fit  # the largest that fits this card
    python -m diffusion.bench.perf --report_only                   # the lent GPUs' lines in docs/measured/

Each target is a microbatch sweep (diffusion.bench.sweep) of benchmark.py on synthetic data, bf16, EMA on.
The report has one table per GPU kind (an H200's figure never stands against an H100's goal): per target
and speed switches, the fastest microbatch beside the kind's own goal and the published anchors
(../shared/reference/anchors.md). Figures are per GPU, MFU from the traced FLOP count.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from diffusion.bench import fit, measured
from diffusion.cli import Parser, markdown_table, positive, run
from diffusion.errors import UsageError

LORA = ["--lora_rank", "16", "--lora_base_dtype", "bf16"]
# the new families' first CUDA runs: name, preset, flags beside --image_size 512, microbatches to try
FAMILY_RUNS = (
    ("flux2-klein-512-lora", "flux2-klein-4b", [*LORA, "--encoder_dtype", "bf16"], [8, 16]),
    ("sd35-medium-512", "sd35-medium", ["--encoder_dtype", "bf16"], [8, 16]),
    ("z-image-512-lora", "z-image", [*LORA, "--encoder_dtype", "bf16"], [4, 8]),
    ("qwen-image-512-lora", "qwen-image", [*LORA, "--encoder_dtype", "bf16"], [2, 4]),
)
# name -> benchmark.py flags, microbatches to try, per-GPU goal by GPU chip (in unit: img/s, or MFU in %; issue
# 54), published per-GPU anchor
TARGETS = {
    "sd2-512-latents": {
        "flags": ["--model_name", "sd2-base", "--image_size", "512", "--precomputed_latents"],
        "microbatch": [32, 64],
        "goal": {"H100": 150, "H200": 160},
        "unit": "img/s",
        "anchor": "126-137 img/s (MLPerf v4.x NVIDIA, H100)",
    },
    "sd2-256-latents": {
        "flags": ["--model_name", "sd2-base", "--image_size", "256", "--precomputed_latents"],
        "microbatch": [128, 256],
        "goal": {"H100": 600, "H200": 650},
        "unit": "img/s",
        "anchor": "137.5 img/s (MosaicML, A100)",
    },
    "sd2-512-online": {
        "flags": ["--model_name", "sd2-base", "--image_size", "512", "--encoder_dtype", "bf16"],
        "microbatch": [32, 48],
        "goal": {"H100": 75, "H200": 80},
        "unit": "img/s",
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
        "goal": {"H100": 40, "H200": 42},
        "unit": "% MFU",
        "anchor": "-",
    },
    # the new families' first CUDA runs (issue 54): no goal yet; img/s, MFU and peak memory at 512 px, sized by
    # their counted memory (fit.MEMORY: diffusion.bench.step_memory); LoRA on a bf16 base where a full fine-tune
    # does not fit one card (docs/flux2.md, qwen-image.md, z-image.md), SD3.5 Medium's full fine-tune
    **{
        name: {
            "flags": ["--model_name", model, "--image_size", "512", *flags],
            "microbatch": sizes,
            "goal": {},
            "unit": "img/s",
            "anchor": "-",
        }
        for name, model, flags, sizes in FAMILY_RUNS
    },
}
FAMILIES = tuple(name for name, *_ in FAMILY_RUNS)
COMMON = ["--use_synth_data", "--precision", "amp_bf16", "--num_workers", "4", "--measure_skip_batches", "5"]


def config(name: str):
    """The TrainConfig a target's runs train with (EMA on, as the sweep runs them)."""
    from diffusion.bench import step_memory

    return step_memory.config([*TARGETS[name]["flags"], *COMMON, "--use_ema"])


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


def report(lines: Sequence[dict]) -> str:
    """Markdown, one table per GPU kind: per target and speed switches (eager: none), the fastest ok run against
    that kind's goal; the failed runs (OOM, errors) beside it."""
    kinds: dict[str, dict[tuple[str, str], dict]] = {}
    for rec in lines:
        name = rec.get("perf_target") or _tag(rec.get("command") or [], "perf_target")  # failed runs: from the command
        if name not in TARGETS:
            continue
        row = kinds.setdefault(measured.kind(rec), {}).setdefault(
            (name, _settings(rec) or "eager"), {"best": None, "failed": [], "gpus": set()}
        )
        row["gpus"].add(rec.get("gpu_name") or "CPU")
        if rec.get("status") != "ok":
            when = f" ({rec['date'][:10]})" if rec.get("date") else ""
            row["failed"].append(f"mb {rec.get('device_train_microbatch_size')}: {rec.get('status')}{when}")
        elif rec["images_per_sec_per_gpu"] > ((row["best"] or {}).get("images_per_sec_per_gpu") or 0):
            row["best"] = rec
    out = []
    for gpu_kind in sorted(kinds):
        rows = kinds[gpu_kind]
        order = sorted(rows, key=lambda key: (list(TARGETS).index(key[0]), key[1] != "eager", key[1]))
        names = sorted(set().union(*(r["gpus"] for r in rows.values())))
        out += [f"**{gpu_kind}** ({', '.join(names)})", ""]
        out += markdown_table(
            HEADER, [_row(name, settings, rows[name, settings], gpu_kind) for name, settings in order]
        )
        out.append("")
    return "\n".join(out).rstrip("\n")


HEADER = (
    "target",
    "settings",
    "img/s/GPU",
    "MFU %",
    "peak GiB",
    "microbatch",
    "goal",
    "of goal",
    "published",
    "date",
    "failed",
)


def _row(name: str, settings: str, row: dict, gpu_kind: str) -> list[str]:
    t, r = TARGETS[name], row["best"] or {}
    goal = t["goal"].get(measured.family(gpu_kind))
    figure = (r.get("mfu") or 0) * 100 if t["unit"] == "% MFU" else r.get("images_per_sec_per_gpu")
    return [
        name,
        settings,
        _fmt(r.get("images_per_sec_per_gpu"), ".1f"),
        _fmt(r.get("mfu") and 100 * r["mfu"], ".1f"),
        _fmt(r.get("peak_memory_gib"), ".1f"),
        str(r.get("device_train_microbatch_size") or "-"),
        f">= {goal}{'' if t['unit'].startswith('%') else ' '}{t['unit']}" if goal else "- (none for this kind)",
        f"{figure / goal:.0%}" if goal and figure else "-",
        t["anchor"],
        (r.get("date") or "-")[:10],
        "; ".join(row["failed"]) or "-",
    ]


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _tag(command: list[str], key: str) -> str | None:
    tags = [command[i + 1] for i, a in enumerate(command[:-1]) if a == "--tag"]
    return next((t.split("=", 1)[1] for t in tags if t.startswith(key + "=")), None)


def _settings(rec: dict) -> str:
    """The speed switches a run had on ('compile, channels_last'), from its result line or command."""
    command = rec.get("command") or []
    return ", ".join(s for s in SWITCHES if rec.get(s) or f"--{s}" in command)


def _microbatch(text: str) -> int | str:
    return text if text == "fit" else positive(int)(text)


def microbatches(names: Sequence[str], given: Sequence[int | str], extra: Sequence[str], memory_gib: float | None):
    """Each target's microbatches: its own, the ones given, or (``fit``) the largest predicted to fit this card
    (diffusion.bench.fit; --compile runs keep fewer activations)."""
    if "fit" not in given:
        return {name: list(given) for name in names}
    if len(given) > 1:
        raise UsageError("--microbatch: fit stands alone (the largest that fits this card); drop the numbers")
    gib = memory_gib or fit.card_gib()
    compiled = "--compile" in extra
    chosen = {name: [fit.microbatch(name, gib, compiled)] for name in names}
    for name, (mb,) in chosen.items():
        print(
            f"perf: {name}{' compiled' if compiled else ''} on a {gib:.1f} GiB card: microbatch {mb} "
            f"(predicted peak {fit.predicted_gib(name, mb, compiled):.1f} GiB)",
            flush=True,
        )
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("diffusion.bench.perf", __doc__)
    p.add_argument(
        "--results",
        default=None,
        help="results file the runs append to (default perf.jsonl); for --report_only a file or a folder of "
        ".jsonl files (default: the lent GPUs' lines, docs/measured/)",
    )
    p.add_argument("--only", nargs="+", choices=list(TARGETS), help="run these targets only")
    p.add_argument("--batches", type=int, default=30, help="batches per run (first 5 not measured; default 30)")
    p.add_argument("--grad_accum", type=int, default=2, help="microbatches per optimizer step (default 2)")
    p.add_argument(
        "--microbatch",
        nargs="+",
        type=_microbatch,
        default=[],
        metavar="N",
        help="microbatch sizes to try instead of each target's own, or fit: the largest this card's memory holds",
    )
    p.add_argument(
        "--memory_gib",
        type=positive(float),
        default=None,
        help="the card's memory for --microbatch fit (default: read from the GPU; an 80 GB H100 has 79.6)",
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
    p.add_argument("--report_only", action="store_true", help="only print the tables from --results, by GPU kind")
    args = p.parse_args(argv)
    if not args.report_only:
        from diffusion.bench import sweep

        results = args.results or "perf.jsonl"
        extra = shlex.split(args.extra)
        names = args.only or list(TARGETS)
        for name, sizes in microbatches(names, args.microbatch, extra, args.memory_gib).items():
            for cmd in commands([name], results, args.batches, args.grad_accum, extra, sizes, args.timeout):
                print("python -m diffusion.bench.sweep " + " ".join(cmd), flush=True)
                if not args.dry_run:
                    sweep.main(cmd)
    if not args.dry_run:
        source = args.results or ("perf.jsonl" if not args.report_only else measured.MEASURED)
        print(report(measured.read(source)))
    return 0


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.perf", main))
