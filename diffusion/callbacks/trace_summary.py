"""What a profiler trace says about a step: the device's busy and idle share of the window, its top kernels, and
the host and device time of the named phases (the optimizer step, the EMA update).

Pure functions over a Chrome trace as torch.profiler exports it (``traceEvents``; times in microseconds), so the
arithmetic is tested on a synthetic kernel timeline on a machine without a GPU (tests/test_profile_window.py),
and a trace written on a lent GPU can be summarized again here (``summarize``). The window is the span of one
host-side annotation (profile_window.py opens it before the first profiled batch's data loading and closes it
after the last batch's synchronize, so every kernel the window launched has ended inside it). Busy is the union
of the device's kernel, memcpy and memset intervals clipped to the window: overlapping kernels on two streams
count once, a kernel still running as the window opens counts from there, so ``busy + idle = window`` and the idle share is the time the GPU waited on the host (launch
overhead, Python, data loading, host syncs), the figure the host-overhead goal (idle <= 1% of a step) is about.
"""

from __future__ import annotations

from collections import defaultdict

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of time the device spends working
WINDOW = "diffusion/profile_window"  # the host annotation spanning the profiled batches
PHASES_NOTE = (
    "Annotated spans, inclusive of what runs inside them: Composer runs forward and backward inside "
    "`Optimizer.step`'s closure, so the optimizer's own cost is its ops' and kernels' time (e.g. "
    "`Optimizer.step#AdamW.step`'s self time above); `diffusion/ema_update` is the EMA update alone."
)


def busy_seconds(intervals, start: float, end: float) -> float:
    """The length of the union of ``(start, end)`` intervals (any unit) clipped to ``[start, end]``."""
    busy, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= reach:
            continue
        busy += b - max(a, reach)
        reach = b
    return busy


def device_share(intervals, start: float, end: float) -> dict:
    """Busy and idle seconds and shares of the window ``[start, end]`` (microseconds, as in a Chrome trace)."""
    wall = end - start
    busy = busy_seconds(intervals, start, end) if wall > 0 else 0.0
    return {
        "window_s": wall / 1e6,
        "busy_s": busy / 1e6,
        "idle_s": (wall - busy) / 1e6,
        "busy_share": busy / wall if wall > 0 else 0.0,
        "idle_share": 1 - busy / wall if wall > 0 else 0.0,
    }


def _window(events: list[dict]) -> tuple[float, float] | None:
    spans = [e for e in events if e.get("name") == WINDOW and e.get("cat") == "user_annotation" and "dur" in e]
    if not spans:
        return None
    return min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)


def _top(totals: dict[str, list], n: int, window_us: float) -> list[dict]:
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [
        {"name": name, "ms": us / 1e3, "calls": calls, "share_of_window": us / window_us if window_us else 0.0}
        for name, (us, calls) in ranked
    ]


def summarize(trace: dict, top: int = 15) -> dict:
    """The device's busy/idle share of the window, its top kernels, and each named phase's host (and device)
    time, from a Chrome trace; ``device_measured`` is False where the trace holds no device work (a CPU run)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    window = _window(events)
    if window is None:
        raise ValueError(f"the trace has no {WINDOW!r} annotation: it was not written by profile_window.py")
    start, end = window
    work = [e for e in events if e.get("cat") in DEVICE_WORK and e["ts"] < end and e["ts"] + e["dur"] > start]
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in work:
        kernels[e["name"]][0] += e["dur"]
        kernels[e["name"]][1] += 1
    phases: dict[str, dict] = {}
    for cat, side in (("user_annotation", "host_ms"), ("gpu_user_annotation", "device_ms")):
        for e in events:
            if e.get("cat") == cat and e["name"] != WINDOW and start <= e["ts"] < end:
                entry = phases.setdefault(e["name"], {"calls": 0, "host_ms": 0.0})
                entry[side] = entry.get(side, 0.0) + e["dur"] / 1e3
                entry["calls"] += side == "host_ms"
    out = {"window_s": (end - start) / 1e6, "device_measured": bool(work)}
    if work:
        out["device"] = device_share([(e["ts"], e["ts"] + e["dur"]) for e in work], start, end)
        out["top_kernels"] = _top(kernels, top, end - start)
    out["phases"] = dict(sorted(phases.items(), key=lambda kv: -kv[1]["host_ms"]))
    return out


def markdown(summary: dict) -> str:
    """The summary as a short markdown page (the JSON beside it holds the same figures)."""
    lines = [f"# Profile of batches {summary['batches']}", ""]
    lines.append(
        f"Window: {summary['window_s'] * 1e3:.1f} ms over {summary['batch_count']} batches on {summary['on']}."
    )
    if summary["device_measured"]:
        d = summary["device"]
        lines.append(
            f"GPU busy {d['busy_share']:.1%}, idle {d['idle_share']:.1%} of the window "
            f"({d['idle_s'] * 1e3:.1f} ms idle; the goal is idle <= 1% of a step)."
        )
    else:
        lines.append(f"GPU share: not measurable ({summary['device_note']}).")
    tables = [("Top kernels (device time)", summary.get("top_kernels", []), ("ms", "calls", "share_of_window"))]
    tables.append(("Top ops by self time", summary["top_ops"], ("self_ms", "self_device_ms", "calls")))
    for title, rows, cols in tables:
        if not rows:
            continue
        lines += ["", f"## {title}", "", "| name | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {r['name'][:90]} | " + " | ".join(_cell(r.get(c), c) for c in cols) + " |" for r in rows]
    if summary["phases"]:
        lines += [
            "",
            "## Named phases",
            "",
            PHASES_NOTE,
            "",
            "| name | calls | host ms | device ms |",
            "|---|---|---|---|",
        ]
        for name, p in summary["phases"].items():
            lines.append(f"| {name[:90]} | {p['calls']} | {p['host_ms']:.2f} | {_cell(p.get('device_ms'))} |")
    return "\n".join(lines) + "\n"


def _cell(value, column: str = "") -> str:
    if value is None:
        return ""
    if column.startswith("share"):
        return f"{value:.1%}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
