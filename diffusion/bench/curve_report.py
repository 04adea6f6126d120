"""What diffusion.bench.curves reports from its points: where each curve crosses the target, the markdown table
and the chart.

A point is a dict with ``variant``, ``batch``, ``seconds`` (training wall time to that batch), ``tflop``
(training FLOPs to it, in units of 1e12; None where the run's FLOP count is not known yet) and ``quality``.
"""

from __future__ import annotations

from collections.abc import Sequence

from diffusion.cli import markdown_table

AXES = ("batch", "seconds", "tflop")  # what a curve is drawn against, and what a crossing is counted in


def reached(quality: float, target: float, higher_is_better: bool) -> bool:
    return quality >= target if higher_is_better else quality <= target


def crossing(points: Sequence[dict], target: float, higher_is_better: bool) -> dict | None:
    """Batches, seconds and TFLOP at which a curve (``points`` in batch order) first reaches ``target``, each
    interpolated linearly between the last point short of it and the first point that reaches it (a curve that
    reaches it at its first point: that point's); None when no point reaches it."""
    before = None
    for point in points:
        if reached(point["quality"], target, higher_is_better):
            if before is None or point["quality"] == before["quality"]:
                return {axis: point[axis] for axis in AXES}
            share = (target - before["quality"]) / (point["quality"] - before["quality"])
            return {axis: _between(before[axis], point[axis], share) for axis in AXES}
        before = point
    return None


def _between(a: float | None, b: float | None, share: float) -> float | None:
    return None if a is None or b is None else a + share * (b - a)


def curves_of(points: Sequence[dict], names: Sequence[str]) -> dict[str, list[dict]]:
    """Each variant's points in batch order (variants in ``names``' order, each present even with no point)."""
    return {name: sorted((p for p in points if p["variant"] == name), key=lambda p: p["batch"]) for name in names}


def _figure(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _ratio(value: float | None, first: float | None) -> str:
    return "–" if value is None or not first else f"{value / first:.2f}x"


def table(curves: dict[str, list[dict]], quality: str, target: float | None, higher_is_better: bool) -> list[str]:
    """The comparison as markdown lines: per variant its points, last quality and, with a ``target``, batches,
    seconds and TFLOP to it with each one's ratio to the first variant's."""
    better = "higher" if higher_is_better else "lower"
    header = ["variant", "points", "last batch", f"{quality} ({better} is better)"]
    if target is not None:
        header += ["batches to target", "ratio", "seconds to target", "ratio", "TFLOP to target", "ratio"]
    crossings = {
        name: crossing(c, target, higher_is_better) if target is not None else None for name, c in curves.items()
    }
    first = crossings[next(iter(curves))] or {}
    rows = []
    for name, curve in curves.items():
        last = curve[-1] if curve else None
        row = [name, str(len(curve)), str(last["batch"]) if last else "–", _figure(last and last["quality"])]
        if target is not None:
            at = crossings[name] or {}
            for axis, digits in (("batch", 5), ("seconds", 4), ("tflop", 4)):
                row += [_figure(at.get(axis), digits), _ratio(at.get(axis), first.get(axis))]
        rows.append(row)
    title = f"Learning curves: {quality} ({better} is better)"
    title += (
        f", target {target:g} (batches, seconds and TFLOP interpolated between points)" if target is not None else ""
    )
    return [title, "", *markdown_table(header, rows)]


def chart(curves: dict[str, list[dict]], quality: str, target: float | None, path: str) -> None:
    """A PNG of quality against batches, training seconds and training TFLOP, one line per variant, the target
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, panels = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for panel, axis, label in zip(panels, AXES, ("batches", "training seconds", "training TFLOP")):
        for name, curve in curves.items():
            shown = [p for p in curve if p[axis] is not None]
            panel.plot([p[axis] for p in shown], [p["quality"] for p in shown], marker="o", label=name)
        if target is not None:
            panel.axhline(target, color="gray", linestyle="--", linewidth=1)
        panel.set_xlabel(label)
        panel.grid(alpha=0.3)
    panels[0].set_ylabel(quality)
    panels[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
