"""Per-rank statistics of a run's measured batches: each rank's images/s had it never waited, how much
it waited, the slowest ranks and the stragglers. Pure: the ranks' timings come in, gathered by the caller.

Sync is the same work on every rank except for waiting, so **wait** = a rank's sync time minus the least
sync time of any rank, and a rank's images/s is its images over its time less its wait: what it would do
if it never waited. A slow GPU, node or data loader shows as a low images/s and a short wait beside fast
ranks that wait long.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

SLOWEST = 3  # ranks listed by name in the record (all of them when there are this few)


@dataclass
class RankFigures:
    images_per_sec: dict[str, float]  # min / median / max over ranks
    wait_share: dict[str, float]
    wait_seconds: dict[str, float]
    slowest: list[dict]  # the SLOWEST slowest ranks, slowest first
    stragglers: list[dict]  # every rank more than the threshold below the median rank


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def rank_figures(ranks: list[dict], images: float, threshold: float) -> RankFigures | None:
    """``ranks``: one ``{"rank", "host", "compute_s", "sync_s"}`` per rank; ``images``: each rank's images
    over the measured batches. None when a rank measured nothing."""
    least_sync = min(r["sync_s"] for r in ranks)
    for r in ranks:
        r["wait_s"] = r["sync_s"] - least_sync
        busy = r["compute_s"] + least_sync
        r["images_per_sec"] = images / busy if busy > 0 and images else None
        r["wait_share"] = r["wait_s"] / (r["compute_s"] + r["sync_s"]) if r["compute_s"] + r["sync_s"] else None
    if any(r["images_per_sec"] is None for r in ranks):
        return None
    ranks.sort(key=lambda r: r["images_per_sec"])
    median = statistics.median(r["images_per_sec"] for r in ranks)
    figures = [
        {
            "rank": r["rank"],
            "host": r["host"],
            "images_per_sec": r["images_per_sec"],
            "slower_than_median": 1 - r["images_per_sec"] / median,
            "compute_s": r["compute_s"],
            "wait_s": r["wait_s"],
        }
        for r in ranks
    ]
    return RankFigures(
        images_per_sec=spread([r["images_per_sec"] for r in ranks]),
        wait_share=spread([r["wait_share"] for r in ranks]),
        wait_seconds=spread([r["wait_s"] for r in ranks]),
        slowest=figures[:SLOWEST],
        stragglers=[f for f in figures if f["slower_than_median"] > threshold],
    )
