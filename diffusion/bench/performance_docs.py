"""docs/performance.md's GPU tables, generated from the lent GPUs' lines (docs/measured/), so a figure in the docs
is always one a line holds.

    python -m diffusion.bench.performance_docs          # rewrite the generated blocks of docs/performance.md
    python -m diffusion.bench.performance_docs --check  # exit 1 when they are out of date (tests/test_perf.py)

A block sits between ``<!-- measured: WHAT -->`` and ``<!-- end measured -->``; WHAT is ``report`` (the per
GPU kind report of every line, as ``python -m diffusion.bench.perf --report_only`` prints it), ``plan`` (the
microbatches .ci/gpu picks on each lent card) or a file of docs/measured/ (that machine's every line).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from diffusion.bench import fit, measured, perf
from diffusion.cli import markdown_table

DOC = measured.ROOT / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- measured: ([^>]*?) -->\n)(.*?)(<!-- end measured -->)", re.S)
# the cards lent so far, with the memory .ci/gpu sizes microbatches for (the device tool's own figures)
SESSION_HEADER = ("run", "settings", "microbatch", "img/s/GPU", "MFU %", "peak GiB", "batches", "status")


def session_table(lines: list[dict]) -> list[str]:
    """Every line of one machine, in the order it was written, and where the lines came from."""
    rows = []
    for r in lines:
        settings = perf._settings(r) or ("eager" if "compile" in r or "command" in r else "-")
        if r.get("sdpa_kernels"):
            settings += f"; attention {r['sdpa_kernels']}"
        status = r.get("status") or "-"
        if r.get("error") or r.get("note"):
            status += f": {r.get('error') or r.get('note')}"
        rows.append(
            [
                r.get("perf_target") or r.get("model") or "-",
                settings,
                str(r.get("device_train_microbatch_size") or "-"),
                perf._fmt(r.get("images_per_sec_per_gpu"), ".1f"),
                perf._fmt(r.get("mfu") and 100 * r["mfu"], ".1f"),
                perf._fmt(r.get("peak_memory_gib"), ".1f"),
                _batches(r),
                status,
            ]
        )
    out = markdown_table(SESSION_HEADER, rows)
    transcribed = [r for r in lines if r.get("transcribed")]
    sources = sorted({r.get("source") or "-" for r in transcribed})
    if transcribed:
        out += ["", f"Transcribed ({len(transcribed)} of {len(lines)} lines): from {'; '.join(sources)}."]
    return out


def _batches(r: dict) -> str:
    batches = (r.get("max_duration") or "").removesuffix("ba")
    if not batches.isdigit():
        return "-"
    skip = r.get("measure_skip_batches")
    return f"{batches} ({skip} not measured)" if skip else batches


def plan_table() -> list[str]:
    """Per target, the microbatch .ci/gpu's ``--microbatch fit`` picks on each lent card, eager and compiled."""
    rows = []
    for target in fit.MEMORY:
        row = [target]
        for gib in fit.CARDS.values():
            eager, compiled = fit.microbatch(target, gib), fit.microbatch(target, gib, compiled=True)
            row.append(
                f"{eager} ({fit.predicted_gib(target, eager):.0f} GiB) / "
                f"{compiled} ({fit.predicted_gib(target, compiled, True):.0f} GiB)"
            )
        rows.append(row + [fit.MEMORY[target].source])
    header = ["target", *(f"{card} ({gib:g} GiB): eager / compiled" for card, gib in fit.CARDS.items()), "line"]
    return markdown_table(header, rows)


def block(what: str, folder: Path) -> list[str]:
    if what == "report":
        return perf.report(measured.read(folder)).splitlines()
    if what == "plan":
        return plan_table()
    return session_table(measured.read(folder / what))


def render(text: str, folder: Path = measured.MEASURED) -> str:
    """``text`` with every generated block rewritten from the lines in ``folder``."""
    return BLOCK.sub(lambda m: m[1] + "\n".join(block(m[2].strip(), folder)) + "\n" + m[4], text)


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(
                "docs/performance.md's tables differ from docs/measured/: run python -m diffusion.bench.performance_docs",
                file=sys.stderr,
            )
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
        print("wrote docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
