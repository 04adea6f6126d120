"""Time-to-train and GPU-hours per node count, from a measured (or published) per-GPU throughput.

    python -m diffusion.bench.planning --images_per_sec_per_gpu 137.5 36.3 --samples 1.1B 1.7B --global_batch 2048 \\
        --nodes 1 2 4 8 16 --model sd2-base --sharding shard_grad_op --microbatch 16 --interconnect dgx-a100
    python -m diffusion.bench.planning --results results.jsonl --model sd2-base --samples 1.7B --global_batch 2048 \\
        --interconnect p5

A run may have phases (e.g. 256 px then 512 px): give one throughput and one sample count per phase.

With ``--interconnect`` the per-GPU throughput on n nodes is predicted by diffusion/bench/scaling.py's model
(communication volume, bandwidth, latency and overlap from the model size, sharding, microbatch and global
batch; its docstring lists every assumption). ``--scaling_efficiency`` overrides it with a guess: with
``--scaling per_doubling`` (default) each doubling
of the node count keeps ``e`` of the per-GPU throughput: on n nodes the per-GPU figure is
``X * e ** log2(n)`` (n=1: X, 2: X*e, 4: X*e^2). With ``--scaling flat`` every multi-node run gets
``X * e`` and one node gets X. X should be measured on one full node, so intra-node scaling is already in it.
Then images/s = per-GPU figure x GPUs, time = samples / images/s per phase, GPU-hours = hours x GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Callable, Sequence

from diffusion.bench import scaling
from diffusion.cli import Parser, markdown_table, positive, run
from diffusion.errors import UsageError

SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def count(text: str) -> float:
    """argparse type for sample counts: 1100000000, 1.1e9 or 1.1B (K, M, B/G, T)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*", text, re.I)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive count like 1.1e9 or 1.1B, got {text!r}")
    return float(m.group(1)) * SUFFIX[m.group(2).upper()]


def efficiency(nodes: int, e: float, scaling: str = "per_doubling") -> float:
    """Fraction of the one-node per-GPU throughput kept on ``nodes`` nodes."""
    if scaling == "flat":
        return 1.0 if nodes == 1 else e
    return e ** math.log2(nodes)


def plan(
    images_per_sec_per_gpu: Sequence[float],
    samples: Sequence[float],
    global_batch: int,
    nodes: Sequence[int],
    gpus_per_node: int = 8,
    e: float = 1.0,
    scaling: str = "per_doubling",
    model: Callable[[float, int], float] | None = None,
) -> list[dict]:
    """One dict per node count: GPUs, per-GPU batch, efficiency, images/s and hours per phase, totals.
    ``model(x, n)``, when given, is the efficiency on n nodes of a phase measured at x images/s per GPU."""
    if len(images_per_sec_per_gpu) != len(samples):
        raise UsageError(
            f"--images_per_sec_per_gpu has {len(images_per_sec_per_gpu)} value(s) but --samples has "
            f"{len(samples)}; give one throughput per phase"
        )
    out = []
    for n in nodes:
        gpus = n * gpus_per_node
        effs = [model(x, n) if model else efficiency(n, e, scaling) for x in images_per_sec_per_gpu]
        eff = effs[0]
        ips = [x * f * gpus for x, f in zip(images_per_sec_per_gpu, effs)]
        hours = [s / r / 3600 for s, r in zip(samples, ips)]
        out.append(
            {
                "nodes": n,
                "gpus": gpus,
                "batch_per_gpu": global_batch / gpus,
                "efficiency": eff,
                "efficiencies": effs,
                "images_per_sec": ips,
                "hours": hours,
                "steps": [math.ceil(s / global_batch) for s in samples],
                "total_hours": sum(hours),
                "gpu_hours": sum(hours) * gpus,
            }
        )
    return out


def markdown(rows: list[dict]) -> str:
    """The plan as a table to paste into a proposal, with per-phase columns only when there are phases."""
    phases = len(rows[0]["hours"])
    tag = (lambda i: f" ({i + 1})") if phases > 1 else (lambda i: "")
    header = ["nodes", "GPUs", "batch/GPU"] + [f"efficiency{tag(i)}" for i in range(phases)]
    header += [f"images/s{tag(i)}" for i in range(phases)] + [f"hours{tag(i)}" for i in range(phases)]
    header += ["days", "GPU-hours"]
    cells = [
        [
            str(r["nodes"]),
            str(r["gpus"]),
            f"{r['batch_per_gpu']:g}",
            *(f"{f:.3f}" for f in r["efficiencies"]),
            *(f"{x:,.0f}" for x in r["images_per_sec"]),
            *(f"{h:,.1f}" for h in r["hours"]),
            f"{r['total_hours'] / 24:,.1f}",
            f"{r['gpu_hours']:,.0f}",
        ]
        for r in rows
    ]
    lines = markdown_table(header, cells)
    odd = [str(r["nodes"]) for r in rows if r["batch_per_gpu"] != int(r["batch_per_gpu"])]
    if odd:
        lines.append(f"\nThe global batch does not split evenly over the GPUs of {', '.join(odd)} node(s).")
    steps = ", ".join(f"{s:,}" for s in rows[0]["steps"])
    lines.append(f"\nOptimizer steps per phase: {steps}.")
    return "\n".join(lines) + "\n"


def measured(path: str, model: str | None) -> dict:
    """The one-node figure for ``model`` in a benchmark.py results file (median of its runs) and its settings."""
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise UsageError(f"--results {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--results {path}: not a JSON-lines results file ({e.msg}, line {e.lineno})") from None
    ok = [
        r
        for r in lines
        if r.get("images_per_sec_per_gpu")
        and r.get("status", "ok") == "ok"
        and (model is None or r.get("model") == model)
    ]
    if not ok:
        raise UsageError(
            f"--results {path} has no measured images_per_sec_per_gpu"
            + (f" for --model {model}" if model else "")
            + "; run benchmark.py --results on one node for that workload"
        )
    r = ok[0]
    share = (2 / 3 * r["tflop_per_image_denoiser"] / r["tflop_per_image"]) if r.get("tflop_per_image") else None
    return {
        "x": statistics.median(x["images_per_sec_per_gpu"] for x in ok),
        "model": r.get("model"),
        "nodes": r.get("num_nodes") or 1,
        "global_batch": r.get("global_batch_size"),
        "ema": r.get("ema"),
        "microbatch": r.get("device_train_microbatch_size"),
        "fsdp": r.get("fsdp"),
        "backward_share": share,
    }


def scaling_model(args, m: dict) -> Callable[[float, int], float]:
    """efficiency(x, nodes) from diffusion.bench.scaling for the workload the flags (or results line) describe."""
    custom = (args.node_gbps, args.nvlink_gbytes, args.hbm_tbytes)
    if all(custom):
        net = scaling.Interconnect(*custom)
    elif any(custom):
        raise UsageError("--node_gbps, --nvlink_gbytes and --hbm_tbytes go together; give all three or --interconnect")
    else:
        net = scaling.interconnect(args.interconnect)
    sharding = args.sharding or ("fsdp" if m.get("fsdp") else "ddp")
    w = scaling.workload(
        args.model or m.get("model"),
        args.params,
        sharding=sharding,
        backward_share=args.backward_share or m.get("backward_share"),
        ema=bool(args.ema or m.get("ema")),
    )
    g0 = args.measured_global_batch or m.get("global_batch") or args.global_batch
    n0 = args.measured_nodes or m.get("nodes") or 1
    micro = args.microbatch or m.get("microbatch") or g0 // (n0 * args.gpus_per_node)
    return lambda x, n: scaling.predict(x, g0, n0, args.global_batch, n, micro, w, net, args.gpus_per_node)[
        "efficiency"
    ]


def parse_args(argv: Sequence[str] | None = None):
    p = Parser("diffusion.bench.planning", __doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--images_per_sec_per_gpu",
        nargs="+",
        type=positive(float),
        metavar="X",
        help="per-GPU training throughput measured on one full node, one per phase",
    )
    src.add_argument("--results", metavar="FILE", help="benchmark.py --results file (JSONL) with the one-node figure")
    p.add_argument(
        "--samples",
        nargs="+",
        type=count,
        required=True,
        metavar="N",
        help="training samples (images seen) per phase: 1.1e9 or 1.1B",
    )
    p.add_argument(
        "--global_batch", type=positive(int), required=True, help="global batch size (sets steps, batch/GPU)"
    )
    p.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4, 8, 16], help="node counts to plan for")
    p.add_argument("--gpus_per_node", type=positive(int), default=8, help="GPUs per node (default 8)")
    _add_scaling_model_flags(p)
    p.add_argument(
        "--scaling_efficiency",
        type=positive(float),
        metavar="E",
        help="override the model: per-GPU throughput kept per doubling of nodes (or flat); 0 < E <= 1",
    )
    p.add_argument(
        "--scaling",
        choices=["per_doubling", "flat"],
        default="per_doubling",
        help="how --scaling_efficiency applies (default per_doubling)",
    )
    return p.parse_args(argv)


def _add_scaling_model_flags(p: Parser) -> None:
    m = p.add_argument_group("scaling model (diffusion/bench/scaling.py)")
    m.add_argument("--interconnect", help=f"node type: {', '.join(scaling.INTERCONNECTS)}")
    m.add_argument("--node_gbps", type=positive(float), help="custom: inter-node NIC line rate per node, Gb/s")
    m.add_argument("--nvlink_gbytes", type=positive(float), help="custom: NVLink GB/s per GPU per direction")
    m.add_argument("--hbm_tbytes", type=positive(float), help="custom: HBM TB/s per GPU")
    m.add_argument("--model", help=f"preset whose parameter count to use: {', '.join(scaling.MODELS)}")
    m.add_argument("--params", type=count, help="trainable parameters instead of --model: 865.9M, 11.9B")
    m.add_argument(
        "--sharding",
        choices=scaling.SHARDING,
        help="ddp, fsdp (full shard) or shard_grad_op "
        "(gradients + optimizer sharded); default ddp, or fsdp when the results line says so",
    )
    m.add_argument("--microbatch", type=positive(int), help="per-GPU microbatch (default: the measured one)")
    m.add_argument(
        "--measured_global_batch",
        type=positive(int),
        help="global batch of the measurement (default: the results line's, else --global_batch)",
    )
    m.add_argument("--measured_nodes", type=positive(int), help="nodes of the measurement (default 1)")
    m.add_argument(
        "--backward_share",
        type=positive(float),
        help="backward share of step compute (default 2/3, or from the results line's FLOPs)",
    )
    m.add_argument("--ema", action="store_true", help="an EMA update runs every step")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scaling_efficiency and args.scaling_efficiency > 1:
        raise UsageError(
            f"--scaling_efficiency {args.scaling_efficiency} is above 1; give the fraction of per-GPU "
            "throughput kept, e.g. 0.9"
        )
    if min(args.nodes) < 1:
        raise UsageError(f"--nodes {min(args.nodes)} is below 1; give node counts of 1 or more")
    m = measured(args.results, args.model) if args.results else {}
    xs = [m["x"]] if m else args.images_per_sec_per_gpu
    if len(xs) != len(args.samples):
        raise UsageError(
            f"--images_per_sec_per_gpu has {len(xs)} value(s) but --samples has "
            f"{len(args.samples)}; give one throughput per phase"
        )
    model = None
    if not args.scaling_efficiency:
        if not (args.interconnect or args.node_gbps or args.nvlink_gbytes or args.hbm_tbytes):
            raise UsageError(
                "give --interconnect (or --node_gbps/--nvlink_gbytes/--hbm_tbytes) for the scaling "
                "model, or --scaling_efficiency to set the efficiency yourself"
            )
        model = scaling_model(args, m)
    print(
        markdown(
            plan(
                xs,
                args.samples,
                args.global_batch,
                args.nodes,
                args.gpus_per_node,
                args.scaling_efficiency or 1.0,
                args.scaling,
                model,
            )
        ),
        end="",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.planning", main))
