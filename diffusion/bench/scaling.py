"""Predict per-GPU training throughput on N nodes from a measurement on fewer (usually one node).

    python -m diffusion.bench.scaling --validate docs/published/multinode_scaling.csv   # the docs' validation table

The model (every constant is a datasheet figure or comes from the measured configuration; nothing is
fitted to a multi-node result):

1. Time per optimizer step on n nodes = compute + exposed communication + optimizer/EMA update.
2. Compute: per-image compute time c is taken as constant across node counts (the per-GPU microbatch is
   assumed to stay as measured). It is solved from the measured step time t0 = b0 / x0 (b0 images per GPU
   per step, x0 measured images/s per GPU): t0 = b0 * c + exposed(c, n0) + update, by fixed-point iteration,
   so the part of the measured node's own (NVLink) communication that was not hidden is taken out.
3. Communication, hierarchical collectives (intra-node NVLink, then inter-node NICs, one after the other):
   all-reduce of S bytes: 2(G-1)/G * S / nvlink  +  2(n-1)/n * S / node_nic;
   reduce-scatter or all-gather: half of that. ``node_nic`` is the node's total NIC bandwidth (8 GPUs each
   driving their share), so beyond one node the inter-node link per GPU is the bottleneck. Bandwidths are
   datasheet line rates (no efficiency factor). Latency: alpha per collective per hop, tree-shaped, so
   ``alpha_nvlink + alpha_net * 2 * log2(n)`` per collective (log in nodes, NCCL's tree for latency-bound
   sizes), times the number of collectives (DDP buckets of 25 MB; FSDP: one per wrapped unit and pass).
4. What is communicated (S = parameters x bytes):
   ddp:            one all-reduce of the gradients per optimizer step (no_sync while accumulating), during
                   the backward of the last microbatch;
   fsdp:           full shard (FSDP2): per microbatch, an all-gather of parameters in forward, another in
                   backward, a reduce-scatter of gradients in backward;
   shard_grad_op:  gradient/optimizer sharding (FSDP SHARD_GRAD_OP, ZeRO-2, a distributed optimizer): per
                   microbatch, one all-gather of parameters in forward and one reduce-scatter in backward.
5. Overlap: communication in forward hides behind that microbatch's forward compute (1 - beta) * c * m,
   communication in backward behind its backward beta * c * m; only what exceeds the window is exposed.
   beta, the backward share of step compute, is 2/3 of the denoiser's share of FLOPs (backward = 2x forward;
   frozen encoders run forward only): 2/3 with precomputed latents.
6. Update: AdamW reads param, grad, m, v and writes param, m, v (28 bytes per fp32 parameter), EMA reads
   two and writes one (12 bytes); memory-bound at the GPU's HBM bandwidth; divided by the GPU count when
   the optimizer is sharded. A lower bound: an unfused optimizer is slower.
Not modelled: throughput changes when the per-GPU batch (and so the microbatch) shrinks below the measured
one, data loading, stragglers and network congestion; a warning is attached to such rows.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass

from diffusion.cli import Parser, markdown_table, run
from diffusion.errors import UsageError


@dataclass(frozen=True)
class Interconnect:
    node_gbps: float  # inter-node NIC line rate per node, Gb/s (all NICs together)
    nvlink_gbytes: float  # NVLink per GPU per direction, GB/s
    hbm_tbytes: float  # HBM bandwidth per GPU, TB/s (for the optimizer update)
    net_latency_us: float = 5.0
    nvlink_latency_us: float = 3.0


# Datasheet figures. NVLink: A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s, bidirectional -> half per direction.
INTERCONNECTS = {
    "p4de": Interconnect(400, 300, 2.039, net_latency_us=15.0),  # 8x A100 80GB, 4x100 Gb/s EFA
    "p5": Interconnect(3200, 450, 3.35, net_latency_us=15.0),  # 8x H100, 32x100 Gb/s EFA
    "dgx-a100": Interconnect(1600, 300, 2.039),  # 8x A100 80GB, 8x200 Gb/s HDR IB
    "dgx-a100-40gb": Interconnect(1600, 300, 1.555),  # 8x A100 40GB, 8x200 Gb/s HDR IB
    "dgx-h100": Interconnect(3200, 450, 3.35),  # 8x H100 SXM, 8x400 Gb/s NDR IB
    "hgx-h200": Interconnect(3200, 450, 4.8),  # 8x H200, 8x400 Gb/s NDR IB
    "dgx-b200": Interconnect(3200, 900, 8.0),  # 8x B200, 8x400 Gb/s NDR IB
}

# Trainable parameters and FSDP units (outermost repeated blocks, sharding.py's rule, + the root).
MODELS = {
    "sd2-base": (865.9e6, 9),
    "sdxl-base": (2567.5e6, 10),  # 3 down, 3 up and the mid block's 3 (attention, 2 resnets)
    "flux-schnell": (11.9e9, 58),
    "flux-mid": (2.5e9, 13),
}
SHARDING = ("ddp", "fsdp", "shard_grad_op")
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Workload:
    params: float
    sharding: str = "ddp"
    grad_bytes: int = 4  # fp32 gradients (AMP keeps fp32 parameters)
    param_bytes: int = 2  # parameters gathered in the compute dtype
    units: int = 9
    backward_share: float = 2 / 3
    ema: bool = False


def _collective(nbytes: float, nodes: int, gpus: int, net: Interconnect, allreduce: bool) -> float:
    """Seconds of one hierarchical all-reduce (or reduce-scatter / all-gather) of ``nbytes``, bandwidth only."""
    k = 2 if allreduce else 1
    intra = k * (gpus - 1) / gpus * nbytes / (net.nvlink_gbytes * 1e9) if gpus > 1 else 0.0
    inter = k * (nodes - 1) / nodes * nbytes / (net.node_gbps / 8 * 1e9)
    return intra + inter


def _latency(count: int, nodes: int, net: Interconnect) -> float:
    return count * (net.nvlink_latency_us + net.net_latency_us * 2 * math.log2(nodes)) * 1e-6


def communication(w: Workload, nodes: int, gpus: int, net: Interconnect) -> tuple[float, float]:
    """(seconds in forward, seconds in backward) of communication per microbatch that syncs."""
    grads, params = w.params * w.grad_bytes, w.params * w.param_bytes
    if w.sharding == "ddp":
        buckets = math.ceil(grads / BUCKET_BYTES)
        return 0.0, _collective(grads, nodes, gpus, net, True) + _latency(buckets, nodes, net)
    gather = _collective(params, nodes, gpus, net, False) + _latency(w.units, nodes, net)
    scatter = _collective(grads, nodes, gpus, net, False) + _latency(w.units, nodes, net)
    return gather, scatter + (gather if w.sharding == "fsdp" else 0.0)


def step_time(c: float, batch: int, micro: int, w: Workload, nodes: int, gpus: int, net: Interconnect) -> dict:
    """Seconds per optimizer step for ``batch`` images per GPU in microbatches of ``micro``, compute ``c`` s/image."""
    micro = min(micro, batch)
    n_micro = math.ceil(batch / micro)
    fwd, bwd = communication(w, nodes, gpus, net)
    cm = c * micro
    exposed = max(0.0, fwd - (1 - w.backward_share) * cm) + max(0.0, bwd - w.backward_share * cm)
    syncs = 1 if w.sharding == "ddp" else n_micro
    sharded = nodes * gpus if w.sharding != "ddp" else 1
    update = w.params * (28 + (12 if w.ema else 0)) / sharded / (net.hbm_tbytes * 1e12)
    return {
        "compute": c * batch,
        "exposed": exposed * syncs,
        "update": update,
        "comm": (fwd + bwd) * syncs,
        "total": c * batch + exposed * syncs + update,
    }


def compute_per_image(
    x0: float, batch0: int, micro0: int, w: Workload, nodes0: int, gpus: int, net: Interconnect
) -> float:
    """Per-image compute seconds behind a measured ``x0`` images/s per GPU (measured step minus overheads)."""
    t0 = batch0 / x0
    c = t0 / batch0
    for _ in range(200):  # contraction: d(exposed)/dc <= micro/batch
        s = step_time(c, batch0, micro0, w, nodes0, gpus, net)
        c = max(t0 - s["exposed"] - s["update"], 1e-3 * t0) / batch0
    return c


def predict(
    x0: float,
    global0: int,
    nodes0: int,
    global_batch: int,
    nodes: int,
    micro: int,
    w: Workload,
    net: Interconnect,
    gpus: int = 8,
) -> dict:
    """Predicted images/s per GPU on ``nodes`` nodes, with the step-time breakdown and warnings."""
    b0, b = global0 / (nodes0 * gpus), global_batch / (nodes * gpus)
    if b != int(b) or b0 != int(b0):
        raise UsageError(
            f"--global_batch {global_batch if b != int(b) else global0} does not divide over "
            f"{(nodes if b != int(b) else nodes0) * gpus} GPUs; give a multiple of the GPU count"
        )
    c = compute_per_image(x0, int(b0), micro, w, nodes0, gpus, net)
    s = step_time(c, int(b), micro, w, nodes, gpus, net)
    out = {**s, "images_per_sec_per_gpu": b / s["total"], "batch_per_gpu": int(b), "efficiency": b / s["total"] / x0}
    out["note"] = f"microbatch {min(micro, int(b0))} -> {int(b)}" if b < min(micro, b0) else ""
    return out


def workload(model: str | None, params: float | None, **kw) -> Workload:
    if params is None:
        if model not in MODELS:
            raise UsageError(
                f"--model {model!r} has no known parameter count; give --params (e.g. 865.9M) or one "
                f"of {', '.join(MODELS)}"
            )
        params, kw["units"] = MODELS[model][0], kw.get("units") or MODELS[model][1]
    kw = {k: v for k, v in kw.items() if v is not None}
    return Workload(params=params, **kw)


def interconnect(name: str) -> Interconnect:
    if name not in INTERCONNECTS:
        raise UsageError(
            f"--interconnect {name!r} is unknown; choose one of {', '.join(INTERCONNECTS)} or give "
            "--node_gbps/--nvlink_gbytes/--hbm_tbytes"
        )
    return INTERCONNECTS[name]


def validate(path: str) -> list[dict]:
    """Predict every row of a published-figures CSV from the smallest configuration of its series."""
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    out, series = [], {}
    for r in rows:
        series.setdefault(r["series"], []).append(r)
    for name, rs in series.items():
        rs.sort(key=lambda r: int(r["gpus"]))
        base = rs[0]
        g = int(base["gpus_per_node"])
        w = workload(
            base["model"],
            None,
            sharding=base["sharding"],
            grad_bytes=int(base["grad_bytes"]),
            param_bytes=int(base["param_bytes"]),
            backward_share=float(base["backward_share"]),
            ema=base["ema"] == "yes",
        )
        net = interconnect(base["interconnect"])
        x0 = float(base["images_per_sec"]) / int(base["gpus"])
        for r in rs[1:]:
            p = predict(
                x0,
                int(base["global_batch"]),
                int(base["gpus"]) // g,
                int(r["global_batch"]),
                int(r["gpus"]) // g,
                int(base["microbatch"]),
                w,
                net,
                g,
            )
            pred, pub = p["images_per_sec_per_gpu"] * int(r["gpus"]), float(r["images_per_sec"])
            out.append(
                {
                    "series": name,
                    "from_gpus": int(base["gpus"]),
                    "gpus": int(r["gpus"]),
                    "batch_per_gpu": p["batch_per_gpu"],
                    "base": float(base["images_per_sec"]),
                    "predicted": pred,
                    "published": pub,
                    "error": pred / pub - 1,
                    "note": p["note"],
                }
            )
    return out


def validation_markdown(rows: list[dict]) -> str:
    cells = [
        [
            r["series"],
            f"{r['from_gpus']} -> {r['gpus']}",
            str(r["batch_per_gpu"]),
            f"{r['base']:,.0f}",
            f"{r['published']:,.0f}",
            f"{r['predicted']:,.0f}",
            f"{r['error']:+.1%}",
            "yes" if abs(r["error"]) <= 0.2 else "no",
            r["note"],
        ]
        for r in rows
    ]
    header = [
        "series",
        "GPUs",
        "batch/GPU",
        "smallest, images/s",
        "published, images/s",
        "predicted",
        "error",
        "within 20%",
        "microbatch shrinks (not modelled)",
    ]
    return "\n".join(markdown_table(header, cells)) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser("diffusion.bench.scaling", __doc__)
    p.add_argument("--validate", required=True, metavar="CSV", help="published multi-node figures (docs/published/)")
    args = p.parse_args(argv)
    try:
        rows = validate(args.validate)
    except OSError as e:
        raise UsageError(f"--validate {args.validate}: {e.strerror}") from None
    print(validation_markdown(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(run("diffusion.bench.scaling", main))
