"""Time-to-train and GPU-hours per node count, from a measured (or published) per-GPU throughput.

    python -m diffusion.planning --images_per_sec_per_gpu 137.5 36.3 --samples 1.1B 1.7B \\
        --global_batch 2048 --nodes 1 2 4 8 16 --gpus_per_node 8 --scaling_efficiency 0.9

A run may have phases (e.g. 256 px then 512 px): give one throughput and one sample count per phase.

Scaling efficiency is an input, not a prediction. With ``--scaling per_doubling`` (default) each doubling
of the node count keeps ``e`` of the per-GPU throughput: on n nodes the per-GPU figure is
``X * e ** log2(n)`` (n=1: X, 2: X*e, 4: X*e^2). With ``--scaling flat`` every multi-node run gets
``X * e`` and one node gets X. X should be measured on one full node, so intra-node scaling is already in it.
Then images/s = per-GPU figure x GPUs, time = samples / images/s per phase, GPU-hours = hours x GPUs.
"""
from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence

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


def plan(images_per_sec_per_gpu: Sequence[float], samples: Sequence[float], global_batch: int,
         nodes: Sequence[int], gpus_per_node: int = 8, e: float = 1.0, scaling: str = "per_doubling") -> list[dict]:
    """One dict per node count: GPUs, per-GPU batch, efficiency, images/s and hours per phase, totals."""
    if len(images_per_sec_per_gpu) != len(samples):
        raise UsageError(f"--images_per_sec_per_gpu has {len(images_per_sec_per_gpu)} value(s) but --samples has "
                         f"{len(samples)}; give one throughput per phase")
    out = []
    for n in nodes:
        gpus = n * gpus_per_node
        eff = efficiency(n, e, scaling)
        ips = [x * eff * gpus for x in images_per_sec_per_gpu]
        hours = [s / r / 3600 for s, r in zip(samples, ips)]
        out.append({"nodes": n, "gpus": gpus, "batch_per_gpu": global_batch / gpus, "efficiency": eff,
                    "images_per_sec": ips, "hours": hours, "steps": [math.ceil(s / global_batch) for s in samples],
                    "total_hours": sum(hours), "gpu_hours": sum(hours) * gpus})
    return out


def markdown(rows: list[dict]) -> str:
    """The plan as a table to paste into a proposal, with per-phase columns only when there are phases."""
    phases = len(rows[0]["hours"])
    tag = (lambda i: f" ({i + 1})") if phases > 1 else (lambda i: "")
    header = ["nodes", "GPUs", "batch/GPU", "efficiency"]
    header += [f"images/s{tag(i)}" for i in range(phases)] + [f"hours{tag(i)}" for i in range(phases)]
    header += ["days", "GPU-hours"]
    cells = [[str(r["nodes"]), str(r["gpus"]), f"{r['batch_per_gpu']:g}", f"{r['efficiency']:.3f}",
              *(f"{x:,.0f}" for x in r["images_per_sec"]), *(f"{h:,.1f}" for h in r["hours"]),
              f"{r['total_hours'] / 24:,.1f}", f"{r['gpu_hours']:,.0f}"] for r in rows]
    lines = markdown_table(header, cells)
    odd = [str(r["nodes"]) for r in rows if r["batch_per_gpu"] != int(r["batch_per_gpu"])]
    if odd:
        lines.append(f"\nThe global batch does not split evenly over the GPUs of {', '.join(odd)} node(s).")
    steps = ", ".join(f"{s:,}" for s in rows[0]["steps"])
    lines.append(f"\nOptimizer steps per phase: {steps}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("diffusion.planning", __doc__)
    p.add_argument("--images_per_sec_per_gpu", nargs="+", type=positive(float), required=True, metavar="X",
                   help="per-GPU training throughput measured on one full node, one per phase")
    p.add_argument("--samples", nargs="+", type=count, required=True, metavar="N",
                   help="training samples (images seen) per phase: 1.1e9 or 1.1B")
    p.add_argument("--global_batch", type=positive(int), required=True, help="global batch size (sets steps, batch/GPU)")
    p.add_argument("--nodes", nargs="+", type=positive(int), default=[1, 2, 4, 8, 16], help="node counts to plan for")
    p.add_argument("--gpus_per_node", type=positive(int), default=8, help="GPUs per node (default 8)")
    p.add_argument("--scaling_efficiency", type=positive(float), default=1.0, metavar="E",
                   help="per-GPU throughput kept per doubling of nodes (or flat, see --scaling); 0 < E <= 1")
    p.add_argument("--scaling", choices=["per_doubling", "flat"], default="per_doubling",
                   help="how --scaling_efficiency applies (default per_doubling)")
    args = p.parse_args(argv)
    if args.scaling_efficiency > 1:
        raise UsageError(f"--scaling_efficiency {args.scaling_efficiency} is above 1; give the fraction of per-GPU "
                         "throughput kept, e.g. 0.9")
    print(markdown(plan(args.images_per_sec_per_gpu, args.samples, args.global_batch, args.nodes,
                        args.gpus_per_node, args.scaling_efficiency, args.scaling)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(run("diffusion.planning", main))
