"""Where a step's time goes, measured: torch.profiler over a window of batches (setting ``profile=FIRST-LAST``),
writing each rank's Chrome/Perfetto trace and a summary (trace_summary.py: the GPU's busy and idle share of the
window, its top kernels, the top ops by self time, the optimizer's and EMA's time) into ``profile_folder``.

torch.profiler directly rather than Composer's ``Profiler``: that one is a Trainer argument with a cyclic
wait/warmup/active schedule, brings a system-metrics thread and its own event traces, refuses
``device_train_microbatch_size=auto``, and its trace handler exports the trace without handing the profile on, so
the top ops by self time (``key_averages``) would only be logged at close. Here one callback starts the profiler
before the window's first batch loads, opens a host annotation spanning the window (what the idle share is a share
of) and, after the last batch, synchronizes the device (every kernel the window launched ends inside it), closes
the annotation, stops the profiler and writes ``trace-rank{R}.json.gz``, ``summary-rank{R}.json`` and
``summary-rank{R}.md``. Outside the window the callback does nothing; inside it the profiler's own cost
(a few microseconds per op on the host) makes the window's batches slower than the others, so its figures are a
breakdown, not a throughput (the results line's window is BatchTimer's, which the profiled batches are part of).
"""

from __future__ import annotations

import gzip
import json
import os
import sys

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.callbacks.trace_summary import WINDOW, markdown, summarize

CPU_NOTE = "a CPU run has no kernel timeline; the op times are the CPU's"


def top_ops(profile, n: int = 15) -> list[dict]:
    """The ops with the most self time (device time first on a GPU), from the profile's averages."""
    rows = [
        {
            "name": e.key,
            "self_ms": e.self_cpu_time_total / 1e3,
            "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3,
            "calls": e.count,
        }
        for e in profile.key_averages()
        if e.key != WINDOW
    ]
    return sorted(rows, key=lambda r: (-r["self_device_ms"], -r["self_ms"]))[:n]


class ProfileWindow(Callback):
    """Profile batches ``start`` .. ``start + count - 1`` (counted from 1, as the progress lines count them)."""

    def __init__(self, start: int, count: int, folder: str):
        self.start, self.count, self.folder = start, count, folder
        self._profile = self._window = None
        self._first = self._last = None
        self.summary: dict | None = None

    def before_dataloader(self, state: State, logger: Logger) -> None:
        batch = state.timestamp.batch.value + 1
        if self._profile is None and self.summary is None and self.start <= batch < self.start + self.count:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            else:  # kineto's "gpuGetDeviceCount failed" line on a machine without a GPU says nothing
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.start()
            self._window = torch.profiler.record_function(WINDOW)
            self._window.__enter__()
            self._first = batch

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._profile is not None:
            self._last = state.timestamp.batch.value
            if self._last >= self.start + self.count - 1:
                self._finish()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._profile is not None:  # the run ended inside the window: what was recorded
            self._finish()
        elif self.summary is None and dist.get_global_rank() == 0:
            print(
                f"profile: the run ended at batch {state.timestamp.batch.value}, before the profile window "
                f"{self.start}-{self.start + self.count - 1} began; nothing was profiled",
                file=sys.stderr,
                flush=True,
            )

    def close(self, state: State, logger: Logger) -> None:
        if self._profile is not None:  # an exception ended the run: stop the profiler, write nothing
            self._window.__exit__(None, None, None)
            self._profile.stop()
            self._profile = None

    def _finish(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._window.__exit__(None, None, None)
        self._profile.stop()
        profile, self._profile = self._profile, None
        rank = dist.get_global_rank()
        os.makedirs(self.folder, exist_ok=True)
        trace_path = os.path.join(self.folder, f"trace-rank{rank}.json.gz")
        profile.export_chrome_trace(trace_path)
        with gzip.open(trace_path, "rt") as f:
            summary = summarize(json.load(f))
        on_gpu = summary["device_measured"]
        summary = {
            "batches": f"{self._first}-{self._last}",
            "batch_count": (self._last or self._first) - self._first + 1,
            "rank": rank,
            "on": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            **summary,
            "top_ops": top_ops(profile),
            "trace": trace_path,
        }
        if not on_gpu:
            summary["device_note"] = CPU_NOTE
        base = os.path.join(self.folder, f"summary-rank{rank}")
        with open(base + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(markdown(summary))
        self.summary = summary
        if rank == 0:
            share = (
                f"GPU idle {summary['device']['idle_share']:.1%} of the window"
                if on_gpu
                else "GPU share not measurable on CPU"
            )
            print(
                f"profile: batches {summary['batches']} ({summary['window_s'] * 1e3:.0f} ms), {share}; "
                f"summary {base}.md, trace {trace_path} (ui.perfetto.dev)",
                file=sys.stderr,
                flush=True,
            )
